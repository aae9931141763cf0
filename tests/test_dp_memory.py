"""Per-rank memory of every data-parallel stage against the ZeRO formulas, to the byte, and the same
run under torch's DistributedDataParallel. One spawn of 4 ranks.

Bytes per element (P parameters, N shards, S = this rank's share of the padded units = padded / N):
  parameters: the compute dtype, 2 (bf16) or 4 (fp32); gradients: the same, or the reduce dtype
  under ZeRO-2/3; optimizer: K = 12 with bf16 parameters (fp32 master 4 + two fp32 moments 8),
  K = 8 with fp32 parameters, which are their own masters - except ZeRO-2, whose master shard is kept
  apart from the full parameters (its chunks are not contiguous there), so K = 12 for it always.
  DDP     params 2P      grads 2P         optimizer K P
  ZeRO-1  params 2P'     grads 2P'        optimizer K P'/N       P' = P rounded up to a multiple of N
  ZeRO-2  params 2P''    grads 2 P''/N    optimizer K P''/N      P'' = every bucket padded to N
  ZeRO-3  params 4P''/N  grads 2 P''/N    optimizer 8 P''/N      P'' = every block (and the root) padded
ZeRO-3's shard is the fp32 master itself (gathered as bf16), so its (2 + 2 + K) P''/N is
(K + 2) P''/N: the paper's bf16 parameter copy is not kept. Its gradient chunks exist only from
backward to the update, so everything is measured where model-state memory peaks: after backward,
before the update. Padding is named and bounded: fewer than N elements per unit.
"""

from __future__ import annotations

import pytest
from dist import run_dist
from dp_runs import MICRO, STEPS, Groups, config, memory_formula, measure_memory, nbytes, rel, train, train_torch_peer

CASES = [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32")]


def _torch_ddp(corpus, group) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from plait.model import build_model

    cfg = config(corpus)
    model = DistributedDataParallel(build_model(cfg.model, 0, "cpu"), process_group=group, bucket_cap_mb=0.02)
    return train_torch_peer(model, cfg, group)


def _body(dims, corpus):
    groups = Groups()
    out = {}
    for zero, dtype in CASES:
        got = {}
        train(config(corpus, zero=zero, dtype=dtype, steps=1), groups.comm("world"), before_step=lambda e: got.update(measure_memory(e)),
              engine_hook=lambda e: got.update(grads_after_step=nbytes(e.memory()["grads"])))
        out[(zero, dtype, "world")] = got
    for zero in (2, 3):
        got = {}
        train(config(corpus, zero=zero, dtype="bf16", steps=1, reduce_dtype="fp32"), groups.comm("world"),
              before_step=lambda e: got.update(measure_memory(e)))
        out[(zero, "bf16-reduce-fp32", "world")] = got
    got = {}
    train(config(corpus, zero=3, dtype="bf16", steps=1), groups.comm("hsdp"), before_step=lambda e: got.update(measure_memory(e)))
    out[(3, "bf16", "hsdp")] = got
    # ZeRO-3 over two micro-batches: what the in-flight reductions keep alive as each forward begins
    # (2 steps x 2 micro-batches = 4 forwards: this helper runs no validation)
    kept = []

    def step_fn(par, batches, lr):
        if not kept:  # after the engine's own hook, which finishes them
            e = par.engine
            par.model.register_forward_pre_hook(lambda *_: kept.append(nbytes(t for _, _, k in e.inflight.items for t in k)))
        return par.runner.step(batches, lr)

    train(config(corpus, zero=3, dtype="bf16", steps=2, grad_accum=2), groups.comm("world"), step_fn=step_fn)
    out["zero3_kept_at_forward"] = kept
    out["torch_ddp"] = _torch_ddp(corpus, groups.pair[dims.rank // 2])
    return out


@pytest.fixture(scope="module")
def runs(corpus):
    per_rank = run_dist(_body, 4, corpus, timeout=300)
    return per_rank, train(config(corpus, micro_batch=2 * MICRO))


@pytest.mark.parametrize("case", CASES + [(2, "bf16-reduce-fp32"), (3, "bf16-reduce-fp32")])
def test_memory_equals_thememory_formula(runs, case):
    zero, prec = case
    for rank, res in enumerate(runs[0]):
        m = res[(zero, prec, "world")]
        param_b = 4 if prec == "fp32" else 2
        grad_b = 4 if prec != "bf16" else 2
        want = memory_formula(zero, m, 4, param_b, grad_b)
        got = {k: m[k] for k in want}
        if rank == 0:
            print(f"zero {zero} {prec}: P={m['P']} padded={m['padded']} {got}")
        assert got == want, (rank, got, want)
        assert m["reachable"] == m["listed"] == sum(want.values())  # nothing else held
        assert m["P"] <= m["padded"] < m["P"] + 4 * m["units"]  # padding: < N elements per unit
        if zero >= 1:
            assert m["owned"] * 4 == m["padded"]
        if zero == 3 and "grads_after_step" in m:  # the update consumed the gradient chunks and dropped them
            assert m["grads_after_step"] == 0


def test_hsdp_shards_over_dp_shard_only(runs):
    for res in runs[0]:
        m = res[(3, "bf16", "hsdp")]
        assert m["owned"] * 2 == m["padded"]  # 2 shards (the replicas hold copies)
        assert {k: m[k] for k in ("params", "grads", "optimizer")} == memory_formula(3, m, 2, 2, 2)


def test_same_losses_as_torch_ddp(runs):
    per_rank, ref = runs
    for r in (0, 2):
        losses = per_rank[r]["torch_ddp"]["losses"]
        assert len(losses) == STEPS
        worst = max(rel(a, b) for a, b in zip(losses, ref["losses"]))
        print(f"torch DDP vs single process: max loss rel diff {worst:.2e}")
        assert worst <= 1e-5


def test_zero3_frees_reduction_buffers_before_the_next_forward(runs):
    """With several micro-batches, the last reductions of one backward (the root's full packed
    gradient among them) are finished as the next forward begins, not carried through its
    activation peak."""
    for res in runs[0]:
        kept = res["zero3_kept_at_forward"]
        assert len(kept) == 4 and kept == [0, 0, 0, 0], kept
