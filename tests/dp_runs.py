"""Shared by the data-parallel tests: an unevenly sized micro model, the training loop, sub-groups.

UNEVEN: every parameter count is a multiple of `dim` (RoPE needs even head sizes, so `dim` is even):
nothing can be odd, and N = 2 always divides. dim = 42 makes the counts 2 mod 4, so with N = 4 the
flat space, the blocks and the buckets need padding, and shard boundaries cut through parameters
for N = 2 and 4 alike. 3 layers, vocab 259 (the byte data uses 256 of it), ~68K parameters.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from plait.comm import Comm, Ledger
from plait.config import build_config
from plait.data import TokenData
from plait.model import build_model
from plait.optim import lr_at
from plait.parallel.data_parallel import apply_data_parallel
from plait.train import train_step

UNEVEN = {"preset": "custom", "vocab_size": 259, "dim": 42, "n_layers": 3, "n_heads": 3, "n_kv_heads": 1,
          "ffn_dim": 113, "max_seq_len": 64}
STEPS = 20
MICRO = 2  # sequences per rank per micro-batch


def config(corpus, micro_batch=MICRO, zero=0, grad_accum=1, dtype="fp32", steps=STEPS, model=None, **parallel):
    # lr 3e-3 with warmup, clipping at 1.0 and weight decay 0.1: the trainer's defaults at micro scale.
    # Adam divides by sqrt(v) + eps, so where a gradient is ~eps (rare tokens' output rows) the
    # rounding of a different summation order moves the update by a large fraction of lr: with
    # eps 1e-8 the final weights of a correct layout differed by up to 2e-5 on an AVX-512 CPU. With
    # eps 1e-6 such elements no longer amplify rounding, and correct layouts stay below 1e-6 over
    # 20 steps while a missing average or reduction still shows in the loss and the grad norm.
    return build_config({"model": dict(model or UNEVEN), "data": {"path": str(corpus)},
                         "train": {"steps": steps, "micro_batch": micro_batch, "grad_accum": grad_accum,
                                   "seq_len": 32, "lr": 3e-3, "warmup_steps": 2, "dtype": dtype, "eps": 1e-6},
                         "parallel": {"zero": zero, "bucket_mb": 0.02, **parallel}})  # ~5K fp32 elements a bucket


def train(cfg, comm=None, out: Path | None = None, engine_hook=None, before_step=None) -> dict:
    """The trainer's step (`plait.train.train_step`) for cfg.train.steps steps on cfg's data; returns
    losses, grad norms and the ledger of every step. Saves the final state into `out`.
    engine_hook(engine) runs after the last step; before_step(engine) before every update, when
    backward has reduced the gradients and the optimizer has not consumed them yet (the peak of
    model-state memory: ZeRO-3 frees its gradient chunks in the update)."""
    t = cfg.train
    data = TokenData(cfg.data.path)
    model = build_model(cfg.model, t.seed, "cpu").to({"fp32": torch.float32, "bf16": torch.bfloat16}[t.dtype])
    engine = apply_data_parallel(model, cfg, comm)
    if before_step is not None:
        update = engine.step
        engine.step = lambda lr, loss_sum: (before_step(engine), update(lr, loss_sum))[1]
    if comm is not None:
        comm.ledger.reset()  # count this run only
    losses, norms = [], []
    for step in range(t.steps):
        batches = [data.batch(step, m, micro_batch=t.micro_batch, grad_accum=t.grad_accum, dp_rank=engine.rank,
                              dp_size=engine.size, seq_len=t.seq_len, seed=t.seed) for m in range(t.grad_accum)]
        loss, norm = train_step(model, engine, batches, lr_at(step, t), contextlib.nullcontext)
        losses.append(loss.item())
        norms.append(norm.item())
        if comm is not None:
            comm.ledger.step()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        engine.save(out)
    if engine_hook is not None:
        engine_hook(engine)
    ledger = [comm.ledger.summary(i) for i in range(len(comm.ledger.steps))] if comm is not None else None
    return {"losses": losses, "norms": norms, "ledger": ledger}


class Groups:
    """Sub-groups of a 4-rank world (every rank must create every group, in the same order)."""

    def __init__(self):
        world = dist.get_world_size()
        self.single = [dist.new_group([r]) for r in range(world)]
        self.pair = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
        self.cross = [dist.new_group([0, 2]), dist.new_group([1, 3])] if world == 4 else []

    def comm(self, layout: str) -> Comm:
        """'pair': two DP groups of 2 ({0,1} and {2,3}); 'world': one of 4; 'hsdp': shard {0,1}/{2,3},
        replicate {0,2}/{1,3}."""
        r = dist.get_rank()
        if layout == "pair":
            g = self.pair[r // 2]
            groups = {"dp": g, "dp_shard": g, "dp_replicate": self.single[r]}
        elif layout == "world":
            groups = {"dp": dist.group.WORLD, "dp_shard": dist.group.WORLD, "dp_replicate": self.single[r]}
        else:
            groups = {"dp": dist.group.WORLD, "dp_shard": self.pair[r // 2], "dp_replicate": self.cross[r % 2]}
        return Comm(None, Ledger(), groups=groups)


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
