"""ZeRO-3: the gather / prefetch / free schedule, bf16 compute from fp32 masters with fp32 or bf16
gradient reduction, and the same run under torch's FSDP2 (`fully_shard`). One spawn of 4 ranks: the
pair {0,1} runs plait, the pair {2,3} runs FSDP2, side by side."""

from __future__ import annotations

import pytest
from dist import run_dist
from dp_runs import MICRO, STEPS, UNEVEN, Groups, config, rel, train, train_torch_peer

DEEP = dict(UNEVEN, n_layers=5)  # enough blocks that "at most two gathered" means something


def _schedule(corpus, comm) -> dict:
    """One step of ZeRO-3 on a 5-block model with the event trace on."""
    import torch

    from plait.data import TokenData
    from plait.parallel.build import parallelize

    cfg = config(corpus, zero=3, model=DEEP)
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
    units = engine.layout.units
    block_bytes = max(u.padded for u in units[:-1]) * 4
    return {"forward": forward, "all": g.trace, "root": engine.root, "blocks": len(units) - 1,
            "peak": g.peak_gathered_bytes, "bound": units[-1].padded * 4 + 2 * block_bytes,
            "all_blocks": sum(u.padded for u in units) * 4,
            "params_bytes_at_rest": sum(p.untyped_storage().nbytes() for p in model.parameters()),
            "grads_at_rest": sum(p.grad is not None for p in model.parameters())}


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


def _body(dims, corpus):
    groups = Groups()
    if dims.rank < 2:
        comm = groups.comm("pair")
        return {"schedule": _schedule(corpus, comm), "precision": _precision(corpus, comm)}
    return {"fsdp2": _fsdp2(corpus, groups.pair[1])}


@pytest.fixture(scope="module")
def runs(corpus):
    per_rank = run_dist(_body, 4, corpus, timeout=300)
    ref = train(config(corpus, micro_batch=2 * MICRO))
    ref_bf16 = train(config(corpus, micro_batch=2 * MICRO, dtype="bf16", steps=5))
    return per_rank[0], per_rank[2], ref, ref_bf16


def test_blocks_are_prefetched_used_and_freed(runs):
    s = runs[0]["schedule"]
    fwd, root, L = s["forward"], s["root"], s["blocks"]

    def first(events, what, i):
        return events.index((what, i))

    assert fwd[:2] == [("gather", root), ("ready", root)]  # the root unit first, then block 0 prefetched
    for i in range(L - 1):  # block i+1's gather is issued before block i's compute ends (its free)
        assert first(fwd, "gather", i + 1) < first(fwd, "free", i)
    assert [e for e in fwd if e[0] == "free"] == [("free", i) for i in range(L)]  # every block freed after forward
    back = s["all"][len(fwd):]
    for i in range(L - 1, 0, -1):  # backward: gathered again, block i-1 prefetched while block i runs
        assert first(back, "gather", i) < first(back, "gather", i - 1) < first(back, "free", i)
    assert [e for e in back if e[0] == "reduce"][-1] == ("reduce", root)  # the root last ...
    assert back[-1] == ("free", root)  # ... then it is freed too
    assert sum(e == ("gather", i) for e in s["all"] for i in range(L)) == 2 * L  # each block twice a step
    assert s["peak"] <= s["bound"] < s["all_blocks"]  # never more than the root and two blocks
    assert s["params_bytes_at_rest"] == 0 and s["grads_at_rest"] == 0  # between steps: shards only


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


def test_same_losses_as_torch_fsdp2(runs):
    fsdp2, ref = runs[1]["fsdp2"], runs[2]
    assert len(fsdp2["losses"]) == STEPS
    worst = max(rel(a, b) for a, b in zip(fsdp2["losses"], ref["losses"]))
    print(f"FSDP2 vs single process: max loss rel diff {worst:.2e}")
    assert worst <= 1e-5  # plait's ZeRO-3 matches the same reference (test_data_parallel)
