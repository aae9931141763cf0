"""Shared by the data-parallel tests: an unevenly sized micro model, the training loop, sub-groups.

UNEVEN: every parameter count is a multiple of `dim` (RoPE needs even head sizes, so `dim` is even):
nothing can be odd, and N = 2 always divides. dim = 42 makes the counts 2 mod 4, so with N = 4 the
flat space, the blocks and the buckets need padding, and shard boundaries cut through parameters
for N = 2 and 4 alike. 3 layers, vocab 259 (the byte data uses 256 of it), ~68K parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from plait.comm import Comm, Ledger
from plait.config import build_config
from plait.data import TokenData
from plait.optim import lr_at
from plait.parallel.build import parallelize
from plait.train import micro_batch

UNEVEN = {"preset": "custom", "vocab_size": 259, "dim": 42, "n_layers": 3, "n_heads": 3, "n_kv_heads": 1,
          "ffn_dim": 113, "max_seq_len": 64}
STEPS = 20
MICRO = 2  # sequences per rank per micro-batch


def config(corpus, micro_batch=MICRO, zero=0, grad_accum=1, dtype="fp32", steps=STEPS, model=None, recompute="none",
           **parallel):
    # lr 3e-3 with warmup, clipping at 1.0 and weight decay 0.1: the trainer's defaults at micro scale.
    # Adam divides by sqrt(v) + eps, so where a gradient is ~eps (rare tokens' output rows) the
    # rounding of a different summation order moves the update by a large fraction of lr: with
    # eps 1e-8 the final weights of a correct layout differed by up to 2e-5 on an AVX-512 CPU. With
    # eps 1e-6 such elements no longer amplify rounding, and correct layouts stay below 1e-6 over
    # 20 steps while a missing average or reduction still shows in the loss and the grad norm.
    return build_config({"model": dict(model or UNEVEN), "data": {"path": str(corpus)},
                         "train": {"steps": steps, "micro_batch": micro_batch, "grad_accum": grad_accum,
                                   "seq_len": 32, "lr": 3e-3, "warmup_steps": 2, "dtype": dtype, "eps": 1e-6,
                                   "recompute": recompute},
                         "parallel": {"zero": zero, "bucket_mb": 0.02, **parallel}})  # ~5K fp32 elements a bucket


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def train(cfg, comm=None, out: Path | None = None, engine_hook=None, before_step=None, step_fn=None,
          par_hook=None) -> dict:
    """The trainer's model, engine and step (`plait.parallel.build.parallelize`) for cfg.train.steps
    steps on cfg's data; returns losses, grad norms and the ledger of every step. Saves the final
    state into `out`. engine_hook(engine) runs after the last step; before_step(engine) before every
    update, when backward has reduced the gradients and the optimizer has not consumed them yet (the
    peak of model-state memory: ZeRO-3 frees its gradient chunks in the update). step_fn(par,
    batches, lr) replaces the runner's step (e.g. to run backwards in another order); par_hook(par)
    sees the model, engine and runner after the last step."""
    t = cfg.train
    data = TokenData(cfg.data.path)
    par = parallelize(cfg, comm, torch.device("cpu"), DTYPES[t.dtype], compile=False)
    engine = par.engine
    if before_step is not None:
        update = engine.step
        engine.step = lambda lr, loss_sum: (before_step(engine), update(lr, loss_sum))[1]
    if comm is not None:
        comm.ledger.reset()  # count this run only
    losses, norms = [], []
    for step in range(t.steps):
        batches = [micro_batch(data, cfg, par, step, m) for m in range(t.grad_accum)]
        loss, norm = (step_fn or (lambda p, b, lr: p.runner.step(b, lr)))(par, batches, lr_at(step, t))
        losses.append(loss.item())
        norms.append(norm.item())
        if comm is not None:
            comm.ledger.step()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        engine.save(out)
    if engine_hook is not None:
        engine_hook(engine)
    if par_hook is not None:
        par_hook(par)
    ledger = [comm.ledger.summary(i) for i in range(len(comm.ledger.steps))] if comm is not None else None
    return {"losses": losses, "norms": norms, "ledger": ledger}


_REFERENCES: dict = {}


def reference(cfg, out: Path) -> tuple[dict, Path]:
    """`train(cfg, None, out)`, the single-process reference of a layout, run once a session: modules
    compare with the same references (tensor and context parallelism's models are the same, two 3D
    pipelines accumulate alike). Returns a copy of its result and the folder its final state is
    saved in (`out`, or the folder of the first run of the same config)."""
    import copy

    key = cfg.to_toml()
    if key not in _REFERENCES:
        _REFERENCES[key] = (train(cfg, None, out), out)
    res, folder = _REFERENCES[key]
    return copy.deepcopy(res), folder


def backwards_reversed(par, batches, lr):
    """Every micro-batch's forward first, then their backwards in reverse order - the order a
    pipeline schedule may run them in. The engine is told which backward is first and last."""
    n = len(batches)
    losses = [par.model(x, y) / n for x, y in batches]
    for k, i in enumerate(reversed(range(n))):
        par.engine.before_backward(first=k == 0, last=k == n - 1)
        losses[i].backward()
    return par.engine.step(lr, sum(loss.detach() for loss in losses))


class Groups:
    """Sub-groups of a 4-rank world (every rank must create every group, in the same order)."""

    def __init__(self):
        world = dist.get_world_size()
        self.single = [dist.new_group([r]) for r in range(world)]
        self.pair = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
        self.cross = [dist.new_group([0, 2]), dist.new_group([1, 3])] if world == 4 else []
        self.ends = dist.new_group([0, 3]) if world == 4 else None  # a 4-stage pipeline's first and last

    def comm(self, layout: str) -> Comm:
        """'pair': two DP groups of 2 ({0,1} and {2,3}); 'world': one of 4; 'hsdp': shard {0,1}/{2,3},
        replicate {0,2}/{1,3}. Tensor-parallel: 'tp-pair': two TP groups of 2; 'tp-world': TP over 4;
        'tp-dp': TP {0,1}/{2,3} x DP {0,2}/{1,3}. Pipelines: 'pp-pair': two of 2 stages; 'pp-world': one
        of 4 (its tied-embedding ends {0, 3})."""
        r = dist.get_rank()
        one = {"tp": self.single[r], "pp": self.single[r], "cp": self.single[r]}
        alone = {"dp": self.single[r], "dp_shard": self.single[r], "dp_replicate": self.single[r], "pp": self.single[r],
                 "cp": self.single[r]}
        if layout == "pp-pair":  # two 2-stage pipelines
            g = self.pair[r // 2]
            return Comm(None, Ledger(), groups={**alone, "tp": self.single[r], "pp": g, "pp_ends": g, "world": g})
        if layout == "pp-world":  # one 4-stage pipeline
            ends = {"pp_ends": self.ends} if r in (0, 3) else {}
            return Comm(None, Ledger(), groups={**alone, "tp": self.single[r], "pp": dist.group.WORLD, **ends})
        if layout == "tp-pair":
            return Comm(None, Ledger(), groups={**alone, "tp": self.pair[r // 2], "world": self.pair[r // 2]})
        if layout == "tp-world":
            return Comm(None, Ledger(), groups={**alone, "tp": dist.group.WORLD})
        if layout == "tp-dp":
            dp = self.cross[r % 2]
            return Comm(None, Ledger(), groups={"tp": self.pair[r // 2], "dp": dp, "dp_shard": dp,
                                                "dp_replicate": self.single[r], "pp": self.single[r],
                                                "cp": self.single[r]})
        if layout == "pair":
            g = self.pair[r // 2]
            groups = {"dp": g, "dp_shard": g, "dp_replicate": self.single[r], "world": g}
        elif layout == "world":
            groups = {"dp": dist.group.WORLD, "dp_shard": dist.group.WORLD, "dp_replicate": self.single[r]}
        else:
            groups = {"dp": dist.group.WORLD, "dp_shard": self.pair[r // 2], "dp_replicate": self.cross[r % 2]}
        return Comm(None, Ledger(), groups={**one, **groups})


def cli_train(corpus, out, model: dict, steps: int = 6, extra=(), sample_tokens: int = 0) -> list[str]:
    """`plait train` arguments for a small CPU run of `model` that evaluates and saves every 3 steps
    (the end-to-end tests' common part; `extra` adds or overrides)."""
    args = ["train", "--out", str(out), "--steps", str(steps), "--data.path", str(corpus),
            "--train.seq_len", "32", "--train.eval_batches", "1", "--train.eval_every", "3",
            "--train.progress", "false", "--train.sample_tokens", str(sample_tokens), "--train.compile", "off",
            "--train.tensorboard", "false", "--train.device", "cpu", "--checkpoint.every", "3"]
    for k, v in model.items():
        args += [f"--model.{k}", str(v)]
    return args + list(extra)


def metrics_rows(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def assert_same_cli_run(run: Path, ref: Path, steps: int, loss_tol: float = 1e-5, weights: bool = True) -> None:
    """A `plait train` run logged steps 1..steps with the reference run's losses (relative `loss_tol`)
    and, with `weights`, ended with its weights (1e-5, every rank's checkpoint files gathered)."""
    from plait.parallel.sharded_state import full_weights

    rows, want = metrics_rows(run), metrics_rows(ref)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), Path(run).name
    for a, b in zip(rows, want):
        assert rel(a["loss"], b["loss"]) <= loss_tol, (Path(run).name, a["step"], a["loss"], b["loss"])
    if weights:
        last = f"step_{steps:08d}"
        w, wref = full_weights(Path(run) / "checkpoints" / last), full_weights(Path(ref) / "checkpoints" / last)
        assert w.keys() == wref.keys() and max_weight_diff(w, wref) <= 1e-5, Path(run).name


def assert_equivalent(name: str, got: dict, ref: dict, got_dir, ref_weights: dict) -> None:
    """The equivalence every layout test asserts: loss per step within 1e-5 (relative), final
    weights within 1e-5 after gathering the run's checkpoint files, the pre-clip grad norm within
    1e-4 (see test_data_parallel for why its bound is looser); the worst of each is printed."""
    from plait.parallel.sharded_state import full_weights

    worst_loss = max(rel(a, b) for a, b in zip(got["losses"], ref["losses"]))
    worst_norm = max(rel(a, b) for a, b in zip(got["norms"], ref["norms"]))
    worst_w = max_weight_diff(full_weights(got_dir), ref_weights)
    print(f"{name}: max loss rel diff {worst_loss:.2e}, grad norm {worst_norm:.2e}, weights {worst_w:.2e}")
    assert len(got["losses"]) == len(ref["losses"])
    assert worst_loss <= 1e-5 and worst_w <= 1e-5 and worst_norm <= 1e-4


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def train_torch_peer(model, cfg, group) -> dict:
    """The reference loop for a torch-wrapped peer (DDP or FSDP2): the same batches, AdamW groups,
    clipping and LR schedule as plait's trainer, with torch doing the communication."""
    t = cfg.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    data, r, n = TokenData(cfg.data.path), dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for step in range(t.steps):
        x, y = data.batch(step, 0, micro_batch=MICRO, grad_accum=1, dp_rank=r, dp_size=n, seq_len=32, seed=0)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / n)
    return {"losses": losses}


def nbytes(tensors) -> int:
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def measure_memory(engine) -> dict:
    m = engine.memory()
    out = {k: nbytes(v) for k, v in m.items()}
    # independently: every storage reachable from the model's parameters, their grads and the optimizer
    params = list(engine.model.parameters())
    o = engine.opt
    reach = params + [p.grad for p in params if p.grad is not None] + [o.master, o.exp_avg, o.exp_avg_sq]
    out["reachable"] = nbytes(reach + [t for v in m.values() for t in v])
    out["listed"] = nbytes([t for v in m.values() for t in v])
    out["P"] = sum(p.numel() for p in params)
    lay = getattr(engine, "layout", None)
    out["padded"] = lay.padded_numel if lay else engine.opt.flat.padded
    out["units"] = len(lay.units) if lay else 1
    out["owned"] = engine.opt.hi - engine.opt.lo
    out["dtype"] = str(params[0].dtype)
    return out


def memory_formula(zero, m, shards, param_b, grad_b) -> dict:
    """Model-state bytes per rank (test_dp_memory's docstring), from the measured element counts."""
    P, Pp = m["P"], m["padded"]
    K = 8 if param_b == 4 and zero != 2 else 12
    return {0: {"params": param_b * P, "grads": param_b * P, "optimizer": K * P},
            1: {"params": param_b * Pp, "grads": param_b * Pp, "optimizer": K * Pp // shards},
            2: {"params": param_b * Pp, "grads": grad_b * Pp // shards, "optimizer": K * Pp // shards},
            3: {"params": 4 * Pp // shards, "grads": grad_b * Pp // shards, "optimizer": 8 * Pp // shards}}[zero]
