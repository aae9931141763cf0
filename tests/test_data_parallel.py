"""DDP, ZeRO-1/2/3 and HSDP against the single-process run, their traffic to the byte, DDP's buckets.

One spawn of 4 ranks runs every layout (pairs of ranks run two N = 2 layouts side by side) for 20
steps of the trainer's own step on the same tokens; the single-process references run here. Each
run saves its state as the trainer does, so final weights are compared through the checkpoint files.
"""

from __future__ import annotations

import torch
import pytest

from dist import run_dist
from dp_runs import Groups, MICRO, STEPS, UNEVEN, assert_equivalent, backwards_reversed, config, reference, train
from plait.parallel.sharded_state import full_weights

# name: (layout, zero, grad_accum[, options]); "pair" runs go two at a time, one on ranks {0,1}, one
# on {2,3}. "-rev" runs accumulate 3 micro-batches whose backwards run after every forward, in
# reverse order (as a pipeline schedule may): the engines must reduce by backward order, not forward
# order. DDP's embedding goes as rows (parallel.embedding_rows) where ON says so, and in the UNTIED
# runs (which train the model with its own output matrix) on auto, unless OFF says otherwise.
ON, OFF = {"parallel": {"embedding_rows": "on"}}, {"parallel": {"embedding_rows": "off"}}
UNTIED = {"model": {"tie_embeddings": False}}
RUNS = {
    "n2-z0": ("pair", 0, 1), "n2-z1": ("pair", 1, 1), "n2-z2": ("pair", 2, 1), "n2-z3": ("pair", 3, 1),
    "n2-z0-accum": ("pair", 0, 2, ON), "n2-z2-accum": ("pair", 2, 2), "n2-z1-accum": ("pair", 1, 2), "n2-z3-accum": ("pair", 3, 2),
    "n2-z0-rev": ("pair", 0, 3, ON), "n2-z2-rev": ("pair", 2, 3), "n2-z3-rev": ("pair", 3, 3), "n2-z1-rev": ("pair", 1, 3),
    "n2-z0-untied": ("pair", 0, 2, UNTIED), "n2-z0-untied-off": ("pair", 0, 2, {**UNTIED, **OFF}),
    "n4-z0": ("world", 0, 1), "n4-z1": ("world", 1, 1), "n4-z2": ("world", 2, 1), "n4-z3": ("world", 3, 1),
    "hsdp-z1": ("hsdp", 1, 1), "hsdp-z3": ("hsdp", 3, 1),
}
SCHEDULE = [("n2-z0", "n2-z1"), ("n2-z2", "n2-z3"), ("n2-z0-accum", "n2-z2-accum"), ("n2-z1-accum", "n2-z3-accum"),
            ("n2-z0-rev", "n2-z2-rev"), ("n2-z3-rev", "n2-z1-rev"), ("n2-z0-untied", "n2-z0-untied-off"),
            "n4-z0", "n4-z1", "n4-z2", "n4-z3", "hsdp-z1", "hsdp-z3"]


def _run_config(corpus, name, micro_batch=MICRO, **kw):
    """The config of run `name` (its options applied), or of its single-process reference."""
    layout, zero, accum, *options = RUNS[name]
    opts = options[0] if options else {}
    model = {**UNEVEN, **opts.get("model", {})}
    return config(corpus, micro_batch=micro_batch, zero=zero, grad_accum=accum, model=model,
                  **{**opts.get("parallel", {}), **kw})


def _layout_facts(engine) -> dict:
    """What the traffic formulas need from an engine: element counts and unit paddings."""
    lay = getattr(engine, "layout", None)
    facts = {"P": sum(p.numel() for p in engine.model.parameters()), "buckets": len(getattr(engine, "ranges", []))}
    if lay is not None:
        facts.update(padded=lay.padded_numel, units=len(lay.units), owned=lay.owned_numel,
                     root_padded=lay.units[-1].padded)
    elif hasattr(engine, "flat"):
        facts.update(padded=engine.flat.padded, owned=engine.opt.hi - engine.opt.lo)
    return facts


def _mechanisms(corpus, comm) -> dict:
    """DDP: no traffic on a backward before the last; buckets launched from backward hooks, not
    from step(). ZeRO-2: no gradient kept on any parameter, staging bounded by a few buckets."""
    import torch.distributed as dist

    from plait.data import TokenData
    from plait.parallel.build import parallelize

    out = {}
    for zero in (0, 2):
        cfg = config(corpus, zero=zero, grad_accum=2, overlap_ctas=8 if zero == 0 else 0,
                     **({"embedding_rows": "on"} if zero == 0 else {}))
        par = parallelize(cfg, comm, torch.device("cpu"), torch.float32, compile=False)
        model, engine = par.model, par.engine
        lean = []  # DDP: which all-reduces asked for the few-SM communicator (parallel.overlap_ctas)
        starts = []  # and where each one's tensor starts
        if zero == 0:
            plain = comm.all_reduce
            comm.all_reduce = lambda *a, **k: (lean.append(k.get("lean", False)), starts.append(a[0].data_ptr()),
                                               plain(*a, **k))[2]
        data = TokenData(cfg.data.path)
        x, y = data.batch(0, 0, micro_batch=MICRO, grad_accum=2, dp_rank=par.data_rank, dp_size=par.data_size,
                          seq_len=32, seed=0)
        comm.ledger.reset()
        engine.before_backward(first=True, last=False)
        (model(x, y) / 2).backward()
        first = sum(d["sent_bytes"] for d in comm.ledger.summary().values())
        engine.before_backward(first=False, last=True)
        (model(x, y) / 2).backward()
        s = comm.ledger.summary()
        if zero == 0:
            embedding = engine.flat.view(engine.flat.grad, engine.rows_slot).data_ptr()
            out["ddp"] = {"first_micro_bytes": first, "buckets": len(engine.ranges),
                          "launched_in_backward": s.get("dp", {}).get("all_reduce", {}).get("calls", 0),
                          "lean": list(lean), "first_is_embedding": starts[0] == embedding,
                          "embedding_launched": starts.count(embedding)}
            comm.all_reduce = plain
        else:
            biggest = max(u.padded for u in engine.layout.units)
            out["zero2"] = {"grads_left": sum(p.grad is not None for p in model.parameters()),
                            "peak_staged": engine.peak_staged, "biggest": biggest, "P": engine.layout.numel,
                            "first_micro_rs": first > 0}
        engine.step(1e-3, torch.tensor(0.0))
        for h in getattr(engine, "hooks", []):
            h.remove()
    dist.barrier()
    return out


def _body(dims, corpus, root):
    groups = Groups()
    r = dims.rank
    results = {}
    for entry in SCHEDULE:
        name = entry[r // 2] if isinstance(entry, tuple) else entry
        comm = groups.comm(RUNS[name][0])
        facts = {}
        res = train(_run_config(corpus, name), comm, root / name,
                    engine_hook=lambda e: facts.update(_layout_facts(e)),
                    step_fn=backwards_reversed if name.endswith("-rev") else None)
        res["facts"] = facts
        res["ranks"] = [r]
        results.setdefault(name, res)
    results["mechanisms"] = _mechanisms(corpus, groups.comm("pair"))
    return results


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    per_rank = run_dist(_body, 4, corpus, root, timeout=300)
    merged = {}
    for res in per_rank:
        for name, v in res.items():
            merged.setdefault(name, v)
    refs = {}
    for name in ("n2-z0", "n4-z0", "n2-z0-accum", "n2-z0-rev", "n2-z0-untied"):
        key = _ref_key(name)
        out = root / f"ref-{'-'.join(map(str, key))}"
        refs[key], folder = reference(_run_config(corpus, name, micro_batch=MICRO * key[0]), out)
        refs[key]["weights"] = full_weights(folder)
    return merged, refs, root


def _ref_key(name):
    """What a run's single-process reference depends on: ranks, micro-batches, tied or not."""
    layout, _, accum, *options = RUNS[name]
    return 2 if layout == "pair" else 4, accum, "model" not in (options[0] if options else {})


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_the_single_process_run(runs, name):
    """Loss per step within 1e-5 (relative), final weights within 1e-5 (absolute).

    The pre-clip grad norm is checked too (1e-4), since Adam would forgive a gradient scaled by N
    (a missing average) almost entirely: only the norm and clipping see it. Its bound is looser
    because by step 20 the weights differ by rounding (~1e-7) and a sharp step can amplify that into
    the norm (seen: 8e-6 at the last step, with the same step's reduction itself exact to 1e-7)."""
    merged, refs, root = runs
    ref = refs[_ref_key(name)]
    got = merged[name]
    assert len(got["losses"]) == STEPS
    assert_equivalent(name, got, ref, root / name, ref["weights"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # and it did learn something


def _sent(s, dim):
    return s.get(dim, {}).get("sent_bytes", 0.0)


@pytest.mark.parametrize("name", ["n4-z0", "n4-z1", "n4-z2", "n4-z3", "n2-z0-accum", "n2-z0-untied", "n2-z2-accum",
                                  "hsdp-z1", "hsdp-z3"])
def test_traffic_to_the_byte(runs, name):
    """Ledger per step (bytes sent per device, ring): DDP / ZeRO-1 / ZeRO-2 2P(N-1)/N, ZeRO-3 3P(N-1)/N
    less the root unit's second gather; P in bytes (fp32, 4 per element) of the padded units. DDP
    with the embedding as rows: an untied embedding's V x dim leave the all-reduce, and every rank
    gathers all ranks' T token ids (int64) and T x dim gradients, T its tokens a step."""
    merged, _, _ = runs
    layout, zero, accum, *options = RUNS[name]
    got = merged[name]
    f = got["facts"]
    N = {"pair": 2, "world": 4, "hsdp": 2}[layout]
    opts = options[0] if options else {}
    untied = "model" in opts
    mode = opts.get("parallel", {}).get("embedding_rows", "auto")
    rows = zero == 0 and (mode == "on" or (mode == "auto" and untied))  # the runs whose embedding goes as rows
    reduced = 4 * (f["P"] - (UNEVEN["vocab_size"] * UNEVEN["dim"] if untied and rows else 0))
    T = MICRO * 32 * accum
    gathered = N * T * (8 + 4 * UNEVEN["dim"]) if rows else 0
    for s in got["ledger"]:
        stats = s["world"]["all_reduce"]  # one message a step: squared grad norm, loss, loss count (3 fp32)
        assert stats["bytes"] == 12 and stats["calls"] == 1
        if zero == 0:
            assert s["dp"]["all_reduce"]["bytes"] == reduced
            assert s["dp"].get("all_gather", {}).get("bytes", 0) == gathered
            assert s["dp"]["sent_bytes"] == (2 * reduced + gathered) * (N - 1) / N
            assert s["dp"]["all_reduce"]["calls"] == f["buckets"] and f["buckets"] > 3
            continue
        Pb = 4 * f["padded"]
        assert f["P"] <= f["padded"] < f["P"] + N * f.get("units", 1)  # padding: < N elements per unit
        assert "dp" not in s and "dp_shard" in s
        rs, ag = s["dp_shard"]["reduce_scatter"], s["dp_shard"]["all_gather"]
        assert rs["bytes"] == Pb * (accum if zero >= 2 else 1)  # ZeRO-2/3 reduce every micro-batch
        if zero < 3:
            assert ag["bytes"] == Pb
            assert _sent(s, "dp_shard") == (accum + 1 if zero == 2 else 2) * Pb * (N - 1) / N
        else:
            root_b = 4 * f["root_padded"]
            assert ag["bytes"] == 2 * Pb - root_b
            assert _sent(s, "dp_shard") == (3 * Pb - root_b) * (N - 1) / N
        if layout == "hsdp":  # the shard is then averaged over the 2 replicas
            assert s["dp_replicate"]["all_reduce"]["bytes"] == 4 * f["owned"]
            assert _sent(s, "dp_replicate") == 2 * 4 * f["owned"] * (2 - 1) / 2


def test_ddp_buckets_launch_during_backward_and_not_on_early_micro_batches(runs):
    m = runs[0]["mechanisms"]["ddp"]
    assert m["first_micro_bytes"] == 0  # accumulation micro-batch: no communication
    assert m["launched_in_backward"] == m["buckets"] > 3  # every bucket already on its way when backward returns
    # parallel.overlap_ctas: the buckets the backward overlaps go to the few-SM communicator, the
    # last one (nothing left to overlap it) does not
    assert m["lean"] == [True] * (m["buckets"] - 1) + [False]
    # the embedding as rows (on): the tied matrix's dense part (the output layer's gradient) is the
    # first bucket out, as the backward starts, not the last
    assert m["first_is_embedding"] and m["embedding_launched"] == 1


def test_zero2_never_holds_a_full_gradient(runs):
    m = runs[0]["mechanisms"]["zero2"]
    assert m["grads_left"] == 0  # every .grad was dropped once its bucket was staged
    assert m["peak_staged"] <= 3 * m["biggest"] < m["P"]
    assert m["first_micro_rs"]  # ZeRO-2 reduces every micro-batch into its shard
