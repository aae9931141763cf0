"""Tensor parallelism (with and without sequence parallelism, every recomputation mode, composed
with DDP and ZeRO-1/2/3) against the single-process run; its traffic to the byte against the seed
formulas and the planner; per-rank memory against the formula.

One spawn of 4 ranks runs every layout: TP=2 layouts two at a time (ranks {0,1} and {2,3}), TP=4
on all four, TP=2 x DP=2 on all four. The model splits unevenly on purpose: a vocabulary of 259
(padded to 260 for tp 2 and 4) and 2 key/value heads, which TP=4 must replicate (one per rank pair).
"""

from __future__ import annotations

import pytest
from dist import run_dist
from dp_runs import Groups, MICRO, STEPS, assert_equivalent, config, measure_memory, memory_formula, reference, train
from plait.parallel.sharded_state import full_weights

TPM = {"preset": "custom", "vocab_size": 259, "dim": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 96, "max_seq_len": 64}
MODELS = {"tied": TPM, "untied": dict(TPM, tie_embeddings=False)}
SEQ = 32

# name: (layout, tp, sp, zero, recompute, grad_accum, model)
RUNS = {
    "tp2": ("tp-pair", 2, "off", 0, "none", 1, "tied"),
    "tp2-sp": ("tp-pair", 2, "on", 0, "none", 1, "tied"),
    "tp2-sel": ("tp-pair", 2, "off", 0, "selective", 1, "tied"),
    "tp2-sp-sel": ("tp-pair", 2, "on", 0, "selective", 1, "tied"),
    "tp2-full": ("tp-pair", 2, "off", 0, "full", 1, "tied"),
    "tp2-sp-full": ("tp-pair", 2, "on", 0, "full", 1, "tied"),
    "tp2-sp-untied": ("tp-pair", 2, "on", 0, "none", 1, "untied"),
    "tp2-sp-accum": ("tp-pair", 2, "on", 0, "none", 2, "tied"),
    "tp4": ("tp-world", 4, "off", 0, "none", 1, "tied"),
    "tp4-sp": ("tp-world", 4, "on", 0, "none", 1, "tied"),
    "tp4-sp-sel": ("tp-world", 4, "on", 0, "selective", 1, "tied"),
    "tp4-full": ("tp-world", 4, "off", 0, "full", 1, "untied"),
    "tp2-dp2-z0": ("tp-dp", 2, "off", 0, "none", 1, "tied"),
    "tp2-dp2-z1": ("tp-dp", 2, "on", 1, "none", 1, "tied"),
    "tp2-dp2-z2": ("tp-dp", 2, "on", 2, "none", 2, "tied"),
    "tp2-dp2-z3": ("tp-dp", 2, "on", 3, "selective", 1, "untied"),  # ZeRO-3's head unit: the vocabulary-split output
}
SCHEDULE = [("tp2", "tp2-sp"), ("tp2-sel", "tp2-sp-sel"), ("tp2-full", "tp2-sp-full"), ("tp2-sp-untied", "tp2-sp-accum"),
            "tp4", "tp4-sp", "tp4-sp-sel", "tp4-full", "tp2-dp2-z0", "tp2-dp2-z1", "tp2-dp2-z2", "tp2-dp2-z3"]


def _dp(layout: str) -> int:
    return 2 if layout == "tp-dp" else 1


def _config(corpus, name, steps=STEPS):
    layout, tp, sp, zero, rc, accum, model = RUNS[name]
    return config(corpus, zero=zero, grad_accum=accum, model=MODELS[model], recompute=rc, tp=tp, sp=sp, steps=steps)


def _activations(corpus, comm, tp, sp) -> dict:
    """Bytes layer 0 keeps for backward on this rank, per recompute mode (plait.parallel.activations)."""
    import torch

    from plait.parallel.activations import compiled_kept_bytes, kept_bytes
    from plait.parallel.build import parallelize

    out = {}
    for mode in ("none", "selective", "full"):
        cfg = config(corpus, model=TPM, recompute=mode, tp=tp, sp=sp)
        model = parallelize(cfg, comm, torch.device("cpu"), torch.float32, compile=False).model
        cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
        shape = (MICRO * SEQ // tp, TPM["dim"]) if sp == "on" else (MICRO, SEQ, TPM["dim"])
        x = torch.randn(shape, requires_grad=True)
        for compiled, measure in ((False, kept_bytes), (True, compiled_kept_bytes)):
            if compiled and mode == "full":
                continue  # a compiled full recomputation keeps the block's input, as eager
            out[(mode, compiled)], y = measure(lambda x: model.layers["0"](x, cos, sin), x)
            y.sum().backward()  # every rank runs the same collectives in backward
    return out


def _body(dims, corpus, root):
    groups = Groups()
    r = dims.rank
    results = {}
    sp = "off" if r < 2 else "on"
    results["activations"] = {(2, sp): _activations(corpus, groups.comm("tp-pair"), 2, sp)}
    for sp in ("off", "on"):
        results["activations"][(4, sp)] = _activations(corpus, groups.comm("tp-world"), 4, sp)
    for entry in SCHEDULE:
        name = entry[r // 2] if isinstance(entry, tuple) else entry
        comm = groups.comm(RUNS[name][0])
        mem, after = {}, {}
        res = train(_config(corpus, name), comm, root / name,
                    before_step=lambda e, mem=mem: mem or mem.update(measure_memory(e)),
                    engine_hook=lambda e, after=after: after.update(
                        engine=type(e).__name__, held=len(e.opt.flat.grad_buffers())
                        if getattr(getattr(e.opt, "flat", None), "pieces", None) is not None else -1))
        res["memory"], res["after_step"] = mem, after
        results.setdefault(name, res)
    return results


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    per_rank = run_dist(_body, 4, corpus, root, timeout=600)
    refs = {}
    for dp, accum, model in {(_dp(v[0]), v[5], v[6]) for v in RUNS.values()}:
        cfg = config(corpus, micro_batch=MICRO * dp, grad_accum=accum, model=MODELS[model])
        refs[(dp, accum, model)], folder = reference(cfg, root / f"ref-{dp}-{accum}-{model}")
        refs[(dp, accum, model)]["weights"] = full_weights(folder)
    return per_rank, refs, root


def _ref(refs, name):
    layout, _, _, _, _, accum, model = RUNS[name]
    return refs[(_dp(layout), accum, model)]


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_the_single_process_run(runs, name):
    """Loss per step within 1e-5 (relative), final weights within 1e-5 after gathering the shards
    from the checkpoint files, the pre-clip grad norm within 1e-4 (see test_data_parallel)."""
    per_rank, refs, root = runs
    ref = _ref(refs, name)
    got = next(r for r in per_rank if name in r)[name]
    assert_equivalent(name, got, ref, root / name, ref["weights"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.5


def _tp_traffic(name) -> tuple[dict, dict]:
    """Calls and bytes per step on the tp group by op, from the formulas (fp32, 4 bytes a number):
    (the transformer layers' part, the rest).

    Per layer and micro-batch, with A = b*s*h*4 bytes of one activation: without SP 2 all-reduces of
    A forward and 2 backward; with SP 2 all-gathers + 2 reduce-scatters each way. Full recomputation
    replays the forward up to the last tensor backward needs (the input of w2): every collective but
    the MLP's exit, i.e. 1 all-reduce, or 2 all-gathers and 1 reduce-scatter. The rest: the embedding leaves its region once (all-reduce
    forward / with SP reduce-scatter forward, all-gather backward), the loss enters once (all-reduce
    backward / all-gather forward, reduce-scatter backward) and all-gathers (logsumexp, target logit)
    per token from each rank; once a step, one all-reduce of the replicated parameters whose
    gradients are partial sums over tp (norm gains with SP, K/V heads shared by tp ranks)."""
    layout, tp, sp, zero, rc, accum, model = RUNS[name]
    m = MODELS[model]
    A = MICRO * SEQ * m["dim"] * 4
    replay = ({"all_gather": 2, "reduce_scatter": 1} if sp == "on" else {"all_reduce": 1}) if rc == "full" else {}
    layers, rest = {}, {}

    def add(ops, op, calls, size):
        c = ops.setdefault(op, {"calls": 0, "bytes": 0})
        c["calls"] += calls
        c["bytes"] += calls * size

    for op in (("all_gather", "reduce_scatter") if sp == "on" else ("all_reduce",)):
        # 2 regions a layer (attention, MLP), forward and backward, and what recomputation replays
        add(layers, op, (4 + replay.get(op, 0)) * accum * m["n_layers"], A)
        add(rest, op, 2 * accum, A)  # the embedding's exit and the loss's entry
    add(rest, "all_gather", accum, 2 * MICRO * SEQ * 4 * tp)
    partial = (2 * m["n_layers"] + 1) * m["dim"] if sp == "on" else 0
    if m["n_kv_heads"] < tp:
        partial += 2 * m["n_layers"] * m["n_kv_heads"] * (m["dim"] // m["n_heads"]) * m["dim"]
    if partial:  # under ZeRO each rank sums the part its shard holds (see the test)
        add(rest, "all_reduce", 1, 4 * partial)
    return layers, rest


def _merged(*parts) -> dict:
    out: dict = {}
    for ops in parts:
        for op, v in ops.items():
            c = out.setdefault(op, {"calls": 0, "bytes": 0})
            c["calls"] += v["calls"]
            c["bytes"] += v["bytes"]
    return out


@pytest.mark.parametrize("name", [n for n, v in RUNS.items() if v[3] in (0, 1, 3)])
def test_tp_traffic_to_the_byte(runs, name):
    per_rank, _, _ = runs
    zero, tp = RUNS[name][3], RUNS[name][1]
    want = _merged(*_tp_traffic(name))
    got = next(r for r in per_rank if name in r)[name]
    ring = {"all_reduce": 2 * (tp - 1) / tp, "all_gather": (tp - 1) / tp, "reduce_scatter": (tp - 1) / tp}
    if zero:  # the partial gradients are summed on the ZeRO shards: ranks 0 and 2 (one dp group) share them
        partial = want.pop("all_reduce")
        summed = sum(per_rank[r][name]["ledger"][0]["tp"].get("all_reduce", {}).get("bytes", 0) for r in (0, 2))
        assert summed == partial["bytes"]
    for step in got["ledger"]:
        t = step["tp"]
        assert set(t) - {"sent_bytes", "all_reduce" if zero else ""} == set(want)
        assert {op: {"calls": t[op]["calls"], "bytes": t[op]["bytes"]} for op in want} == want
        sent = t["sent_bytes"] - (ring["all_reduce"] * t["all_reduce"]["bytes"] if zero and "all_reduce" in t else 0)
        assert sent == pytest.approx(sum(ring[op] * v["bytes"] for op, v in want.items()))


@pytest.mark.parametrize("name", ["tp2", "tp2-sp", "tp2-full", "tp2-sp-full", "tp4-sp", "tp4-full", "tp2-sp-accum",
                                  "tp2-dp2-z0"])
def test_tp_traffic_equals_the_planner(runs, name):
    """The planner's tp traffic for the layout (`plait plan`: per layer and micro-batch as seeds
    000/001 count it, plus the vocabulary's and the partial gradients') is what the ledger counted,
    call for call and byte for byte."""
    from plait.config import build_config
    from plait.planner.costs import ModelDims
    from plait.planner.hardware import cluster
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    layout, tp, sp, zero, rc, accum, model = RUNS[name]
    dp = _dp(layout)
    d = ModelDims.from_config(build_config({"model": MODELS[model]}).model, seq=SEQ)
    lay = Layout(tp=tp, sp=sp == "on", recompute=rc, micro_batch=MICRO, dp_shard=dp, zero=zero)
    pred = predict(d, lay, cluster("h100", 1, tp * dp), MICRO * accum * dp, prec="fp32").traffic["tp"]
    got = next(r for r in runs[0] if name in r)[name]["ledger"][0]["tp"]
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        planned = [c for c in pred.collectives if c.op == op]
        assert sum(c.count for c in planned) == got.get(op, {}).get("calls", 0), op
        assert sum(c.count * c.size_bytes for c in planned) == got.get(op, {}).get("bytes", 0), op
    assert pred.bytes_per_device == pytest.approx(got["sent_bytes"])


@pytest.mark.parametrize("name", ["tp2", "tp4-sp", "tp2-dp2-z0", "tp2-dp2-z1", "tp2-dp2-z3"])
def test_memory_equals_the_formula(runs, name):
    """Model-state bytes per rank: the data-parallel formulas (test_dp_memory) over this rank's
    tensor-parallel share P_tp of the parameters, which is itself a formula: per layer the
    attention's Q and output and the MLP's three matrices divided by tp, K and V divided by tp when
    there are at least tp KV heads (else whole), the norm gains whole; the vocabulary matrix padded
    to a multiple of tp and divided by it."""
    layout, tp, sp, zero, rc, accum, model = RUNS[name]
    m = MODELS[model]
    d, L, H, kv, f = m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["ffn_dim"]
    hd = d // H
    kv_local = kv // tp if kv >= tp else kv
    vocab_rows = -(-m["vocab_size"] // tp) * tp // tp
    p_tp = L * (2 * d * H * hd // tp + 2 * d * kv_local * hd + 3 * d * f // tp + 2 * d) + d + vocab_rows * d
    p_tp += 0 if m.get("tie_embeddings", True) else vocab_rows * d
    per_rank, _, _ = runs
    for res in per_rank:
        if name not in res:
            continue
        mem = res[name]["memory"]
        assert mem["P"] == p_tp
        want = memory_formula(zero, mem, _dp(layout), 4, 4)
        assert {k: mem[k] for k in want} == want
        assert mem["reachable"] == mem["listed"] == sum(want.values())


def test_a_tensor_parallel_part_without_data_parallel_peers_keeps_its_gradients_in_pieces(runs):
    """With dp 1 there is nothing to all-reduce: the engine is the one-device one with its gradient
    pieces (plait/flat.py), which the update drops (2 bytes a parameter over tp away from the next
    forward's peak); with data-parallel peers the engines keep their whole buffers."""
    per_rank, _, _ = runs
    for res in per_rank:
        for name, (layout, *_rest) in RUNS.items():
            if name in res:
                got = res[name]["after_step"]
                if layout == "tp-dp":
                    assert got["engine"] != "Local", name
                else:
                    assert got == {"engine": "Local", "held": 0}, (name, got)


@pytest.mark.parametrize("tp, sp", [(2, "off"), (2, "on"), (4, "off"), (4, "on")])
def test_activation_bytes_equal_the_formula(runs, tp, sp):
    """What a block keeps per rank under TP (and SP), each recompute mode, measured == formula;
    TP=4 replicates the 2 KV heads (one per rank)."""
    from plait.parallel.activations import layer_bytes

    for res in runs[0]:
        got = res["activations"].get((tp, sp))
        if got is None:
            continue
        for (mode, compiled), n in got.items():
            want = layer_bytes(MICRO, SEQ, TPM["dim"], TPM["n_heads"], TPM["n_kv_heads"], TPM["ffn_dim"], tp,
                               sp == "on", mode, 4, compiled)
            assert n == want, (tp, sp, mode, compiled, n, want)
