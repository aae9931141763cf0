"""ZeRO-3: the gather / prefetch / free schedule (tied, and untied with its output matrix as the head
unit), bf16 compute from fp32 masters with fp32 or bf16 gradient reduction, an untied model against
the single-process run, and the same run under torch's FSDP2 (`fully_shard`). One spawn of 4 ranks:
the pair {0,1} runs the schedules and precisions, the pair {2,3} FSDP2 and the untied runs."""

from __future__ import annotations

import pytest
from dist import run_dist
from dp_runs import (MICRO, STEPS, UNEVEN, Groups, assert_equivalent, backwards_reversed, config, reference, rel,
                     train, train_torch_peer)

DEEP = dict(UNEVEN, n_layers=5)  # enough blocks that "at most two gathered" means something
UNTIED = dict(UNEVEN, tie_embeddings=False)


def _schedule(corpus, comm, model_cfg) -> dict:
    """One step of ZeRO-3 on a 5-block model with the event trace on; then a forward without
    gradients (evaluation)."""
    import torch

    from plait.data import TokenData
    from plait.parallel.build import parallelize

    cfg = config(corpus, zero=3, model=model_cfg)
    par = parallelize(cfg, comm, torch.device("cpu"), torch.float32, compile=False)
    model, engine = par.model, par.engine
    x, y = TokenData(cfg.data.path).batch(0, 0, micro_batch=MICRO, grad_accum=1, dp_rank=par.data_rank,
                                          dp_size=par.data_size, seq_len=32, seed=0)
    g = engine.gather
    g.trace = []
    loss = model(x, y)
    forward = list(g.trace)
    engine.before_backward(first=True, last=True)
    loss.backward()
    engine.step(1e-3, loss.detach())
    step = list(g.trace)
    g.trace = []
    with torch.no_grad():
        model(x, y)
    units = engine.layout.units
    largest = max(u.padded for u in units[:-1]) * 4  # a block (or the head)
    return {"forward": forward, "all": step, "eval": list(g.trace), "root": engine.root, "head": engine.head,
            "blocks": len(engine.blocks), "units": [[s.name for s in u.slots] for u in units],
            "peak": g.peak_gathered_bytes, "bound": units[-1].padded * 4 + 2 * largest,
            "all_blocks": sum(u.padded for u in units) * 4,
            "params_bytes_at_rest": sum(p.untyped_storage().nbytes() for p in model.parameters()),
            "grads_at_rest": sum(p.grad is not None for p in model.parameters())}


def _untied(corpus, comm, root) -> dict:
    """The untied model (a head unit) for 20 steps, and with 3 micro-batches whose backwards run
    after every forward, in reverse order: the head is gathered and freed by each forward, and
    backward never needs it back."""
    out = {}
    for name, accum, step_fn in (("z3", 1, None), ("z3-rev", 3, backwards_reversed)):
        facts = {}
        res = train(config(corpus, zero=3, grad_accum=accum, model=UNTIED), comm, root / name, step_fn=step_fn,
                    engine_hook=lambda e: facts.update(padded=e.layout.padded_numel, root=e.layout.units[-1].padded,
                                                       head=e.layout.units[e.head].padded))
        out[name] = {**res, "facts": facts}
    return out


def _precision(corpus, comm) -> dict:
    """bf16 parameters (and compute), fp32 masters; gradients reduced in fp32 and in bf16."""
    out = {}
    for reduce in ("fp32", "bf16"):
        seen = {}

        def look(e, seen=seen):
            seen.update(shards=e.shards.dtype, master_is_shard=e.opt.master.data_ptr() == e.shards.data_ptr(), gathered=e.gather.full[0].dtype,
                        acc=e.gshards[0].dtype, padded=e.layout.padded_numel, root=e.layout.units[-1].padded)

        res = train(config(corpus, zero=3, dtype="bf16", steps=5, reduce_dtype=reduce), comm, before_step=look)
        out[reduce] = {"losses": res["losses"], "ledger": res["ledger"][0], **{k: str(v) for k, v in seen.items()},
                       "padded_n": seen["padded"], "root_n": seen["root"]}
    return out


def _cast_once(corpus, comm) -> dict:
    """bf16, three micro-batches a step, 3 steps: each unit's chunk cast at every gather, or once a
    step and kept until the update (parallel.zero3_cast_once); the losses, the final shards and how
    many casts each made."""
    out = {}
    for once in (False, True):
        seen = {}

        def look(e, seen=seen):
            seen.update(casts=e.gather.n_casts, units=len(e.layout.units), blocks=len(e.blocks),
                        shards=e.shards.clone(), kept=len(e.gather.kept_casts()),
                        params_at_update=e.state_bytes()["params"], owned=e.layout.owned_numel)

        res = train(config(corpus, zero=3, dtype="bf16", steps=3, grad_accum=3, zero3_cast_once=once), comm,
                    engine_hook=look)
        out[once] = {"losses": res["losses"], **seen}
    return out


def _fsdp2(corpus, group) -> dict:
    """The same 20 steps with torch's FSDP2 on the same model, optimizer and tokens."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from plait.model import build_model

    cfg = config(corpus)
    mesh = DeviceMesh.from_group(group, "cpu")
    model = build_model(cfg.model, 0, "cpu")
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train_torch_peer(model, cfg, group)


def _body(dims, corpus, root):
    groups = Groups()
    comm = groups.comm("pair")
    if dims.rank < 2:
        return {"schedule": _schedule(corpus, comm, DEEP), "untied_schedule": _schedule(corpus, comm, dict(DEEP, tie_embeddings=False)),
                "precision": _precision(corpus, comm), "cast_once": _cast_once(corpus, comm)}
    return {"fsdp2": _fsdp2(corpus, groups.pair[1]), "untied": _untied(corpus, comm, root)}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    from plait.parallel.sharded_state import full_weights

    root = tmp_path_factory.mktemp("fsdp")
    per_rank = run_dist(_body, 4, corpus, root, timeout=300)
    ref, _ = reference(config(corpus, micro_batch=2 * MICRO), root / "ref")  # test_data_parallel's n2-z0 reference
    ref_bf16 = train(config(corpus, micro_batch=2 * MICRO, dtype="bf16", steps=5))
    untied = {}
    for name, accum in (("z3", 1), ("z3-rev", 3)):
        untied[name] = train(config(corpus, micro_batch=2 * MICRO, grad_accum=accum, model=UNTIED), None, root / f"ref-{name}")
        untied[name]["weights"] = full_weights(root / f"ref-{name}")
    return per_rank[0], per_rank[2], ref, ref_bf16, untied, root


def _first(events, what, i):
    return events.index((what, i))


def _assert_blocks_prefetched_used_and_freed(s):
    fwd, root, head, L = s["forward"], s["root"], s["head"], s["blocks"]
    assert fwd[:2] == [("gather", root), ("ready", root)]  # the root unit first, then block 0 prefetched
    for i in range(L - 1):  # block i+1's gather is issued before block i's compute ends (its free)
        assert _first(fwd, "gather", i + 1) < _first(fwd, "free", i)
    ends = [("free", head)] if head is not None else []
    assert [e for e in fwd if e[0] == "free"] == [("free", i) for i in range(L)] + ends  # all freed after forward
    back = s["all"][len(fwd):]
    for i in range(L - 1, 0, -1):  # backward: gathered again, block i-1 prefetched while block i runs
        assert _first(back, "gather", i) < _first(back, "gather", i - 1) < _first(back, "free", i)
    assert [e for e in back if e[0] == "reduce"][-1] == ("reduce", root)  # the root last ...
    assert back[-1] == ("free", root)  # ... then it is freed too
    assert sum(e == ("gather", i) for e in s["all"] for i in range(L)) == 2 * L  # each block twice a step
    assert s["peak"] <= s["bound"] < s["all_blocks"]  # never more than the root and two blocks (or block + head)
    assert s["params_bytes_at_rest"] == 0 and s["grads_at_rest"] == 0  # between steps: shards only


def test_blocks_are_prefetched_used_and_freed(runs):
    for kind in ("schedule", "untied_schedule"):
        _assert_blocks_prefetched_used_and_freed(runs[0][kind])


def test_a_tied_model_has_no_head_unit_and_an_untied_one_has_its_output_matrix_as_one(runs):
    tied, untied = runs[0]["schedule"], runs[0]["untied_schedule"]
    L = tied["blocks"]
    assert tied["head"] is None and len(tied["units"]) == L + 1
    assert tied["units"][-1][0] == "embed.weight" and "output.weight" not in sum(tied["units"], [])  # one matrix
    assert untied["head"] == L and len(untied["units"]) == L + 2  # blocks, head, root
    assert untied["units"][L] == ["output.weight"]
    root = untied["units"][-1]
    assert root[0] == "embed.weight" and "output.weight" not in root  # matrices first: decay stays a prefix
    assert all(n.endswith("norm.weight") for n in root[1:]) and len(root) == 1 + 2 * L + 1


def test_the_head_is_prefetched_during_the_last_block_freed_with_the_forward_and_reduced_first(runs):
    """Forward: the last block's pre-hook starts gathering the head, which is waited for just before
    the loss reads it and freed as the model's forward returns. Backward never gathers it again, and
    its gradient (formed by the fused loss in forward) is the first reduce-scatter, so it runs
    beside the whole backward. Evaluation (no gradients) frees head and root at the end."""
    s = runs[0]["untied_schedule"]
    fwd, head, root, L = s["forward"], s["head"], s["root"], s["blocks"]
    assert _first(fwd, "ready", L - 1) < _first(fwd, "gather", head) < _first(fwd, "free", L - 1)  # prefetched
    assert _first(fwd, "free", L - 1) < _first(fwd, "ready", head)  # waited for after the last block
    assert fwd[-1] == ("free", head)  # freed as the forward ends
    assert [e for e in fwd if e[1] == head] == [("gather", head), ("ready", head), ("free", head)]
    back = s["all"][len(fwd):]
    assert ("gather", head) not in back  # backward never reads the output matrix
    assert [e for e in back if e[0] == "reduce"] == [("reduce", i) for i in [head, *range(L - 1, -1, -1), root]]
    assert _first(back, "reduce", head) < _first(back, "ready", L - 1)  # before the last block's backward runs
    ev = s["eval"]
    assert _first(ev, "ready", L - 1) < _first(ev, "gather", head) < _first(ev, "free", L - 1)
    assert sorted(ev[-2:]) == [("free", head), ("free", root)]  # nothing stays gathered after evaluation


def test_bf16_compute_from_fp32_masters_with_fp32_or_bf16_reduction(runs):
    p, ref = runs[0]["precision"], runs[3]
    for reduce, bytes_per in (("fp32", 4), ("bf16", 2)):
        r = p[reduce]
        # the fp32 shard is the master; what is gathered for compute is bf16
        assert (r["shards"], r["master_is_shard"], r["gathered"]) == ("torch.float32", "True", "torch.bfloat16")
        assert r["acc"] == f"torch.{'float32' if reduce == 'fp32' else 'bfloat16'}"
        # bf16 rounds each sum differently from one device: close, not equal
        assert max(rel(a, b) for a, b in zip(r["losses"], ref["losses"])) < 2e-2
        shard = r["ledger"]["dp_shard"]
        assert shard["reduce_scatter"]["bytes"] == bytes_per * r["padded_n"]  # P in bytes of the reduced dtype
        assert shard["all_gather"]["bytes"] == 2 * (2 * r["padded_n"] - r["root_n"])  # params travel in bf16


def test_an_untied_model_trains_as_one_process(runs):
    """The head unit changes nothing a step computes: losses, grad norms and final weights match the
    single-process run, with one micro-batch and with three whose backwards run in reverse order.
    Traffic: the head is gathered once a micro-batch, like the root (3P less both second gathers)."""
    got, refs, root = runs[1]["untied"], runs[4], runs[5]
    for name, ref in refs.items():
        assert_equivalent(f"untied {name}", got[name], ref, root / name, ref["weights"])
    f = got["z3"]["facts"]
    for s in got["z3"]["ledger"]:
        assert s["dp_shard"]["all_gather"]["bytes"] == 4 * (2 * f["padded"] - f["root"] - f["head"])
        assert s["dp_shard"]["reduce_scatter"]["bytes"] == 4 * f["padded"]


def test_same_losses_as_torch_fsdp2(runs):
    fsdp2, ref = runs[1]["fsdp2"], runs[2]
    assert len(fsdp2["losses"]) == STEPS
    worst = max(rel(a, b) for a, b in zip(fsdp2["losses"], ref["losses"]))
    print(f"FSDP2 vs single process: max loss rel diff {worst:.2e}")
    assert worst <= 1e-5  # plait's ZeRO-3 matches the same reference (test_data_parallel)


def test_zero3_cast_once_keeps_each_chunks_cast_until_the_update(runs):
    """With parallel.zero3_cast_once a unit's bf16 chunk is cast once a step (at its first gather)
    and reused by every later gather until the update changes the shards: the same bits on the wire,
    so the same losses and weights, with one cast a unit a step where casting at each gather makes
    two a block a micro-batch. Never dropping the kept casts at the update trains on stale weights
    and fails this."""
    import torch

    runs_ = runs[0]["cast_once"]
    every, once = runs_[False], runs_[True]
    assert every["losses"] == once["losses"]
    assert torch.equal(every["shards"], once["shards"])
    steps, accum = 3, 3
    assert once["casts"] == steps * once["units"]
    assert every["casts"] >= steps * accum * 2 * every["blocks"]
    assert once["kept"] == 0  # dropped at the last update ...
    # ... which they were held through: 2 bytes (bf16) an owned element more at the update
    assert once["params_at_update"] - every["params_at_update"] == 2 * once["owned"]

