"""Pipeline parallelism: every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) at 2 and 4
ranks with 1, pp and 3 pp micro-batches, and 3D layouts (PP 2 x TP 2 (+SP) x DP 2, ZeRO-1, 8
processes: 1F1B, ZB-H1, ZB-V), against the single-process run; point-to-point traffic to the byte against the formula and the
planner; micro-batches in flight against the schedule's bound.

The model has tied embeddings, so the first and last stages hold the two copies of the matrix and
add their gradients (ZB-V: both ends on rank 0, one matrix). One spawn of 4 ranks runs the 2-stage pipelines two at a time (ranks {0,1} and
{2,3}) and the 4-stage ones on all four; one spawn of 8 runs the 3D layout.
"""

from __future__ import annotations

import pytest
import torch
from dist import run_dist
from dp_runs import Groups, MICRO, assert_equivalent, config, reference, train
from plait.parallel.sharded_state import full_weights

PPM = {"preset": "custom", "vocab_size": 259, "dim": 32, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 64, "max_seq_len": 64}
SEQ, STEPS = 32, 20
# At lr 3e-3 (the other equivalence tests' rate) 12 micro-batches of this model train through
# grad-norm spikes (1.6 -> 2.5) that clipping turns into large steps, and a rounding difference of
# 1e-7 in one step's gradient grows to 3e-4 in a later one's norm; at 1e-3 training stays smooth.
LR = 1e-3


def _runs(pp: int) -> dict:
    out = {}
    for sched in ("gpipe", "1f1b", "zb"):
        for m in (1, pp, 3 * pp):
            out[f"pp{pp}-{sched}-m{m}"] = (pp, sched, m, 1)
    for m in (pp, 3 * pp):
        out[f"pp{pp}-interleaved-m{m}"] = (pp, "interleaved", m, 2)
    for m in (1, pp, 3 * pp):
        out[f"pp{pp}-zbv-m{m}"] = (pp, "zbv", m, 2)
    return out


RUNS = {**_runs(2), **_runs(4), "pp2-1f1b-m2-split": (2, "1f1b", 2, 1), "pp4-1f1b-m4-split": (4, "1f1b", 4, 1)}
# uneven stages (parallel.stage_layers), as `balance` makes them when the output head is heavy
SPLITS = {"pp2-1f1b-m2-split": "5,3", "pp4-1f1b-m4-split": "1,3,3,1"}
PAIRS = [n for n in RUNS if n.startswith("pp2")]
SCHEDULE = [tuple(PAIRS[i:i + 2]) if i + 1 < len(PAIRS) else PAIRS[i] for i in range(0, len(PAIRS), 2)]
SCHEDULE += [n for n in RUNS if n.startswith("pp4")]


def _config(corpus, name, **extra):
    pp, sched, m, v = RUNS[name]
    from plait.validate import validate_pipeline

    cfg = config(corpus, grad_accum=m, model=PPM, steps=STEPS, pp=pp, schedule=sched, v=v,
                 stage_layers=SPLITS.get(name, ""), **extra)
    cfg.train.lr, cfg.train.min_lr = LR, LR / 10
    validate_pipeline(cfg)
    return cfg


def _reference(corpus, m, out, micro_batch=MICRO, model=PPM):
    """The single-process run of `model` with m micro-batches a step: its result, with its final weights."""
    cfg = config(corpus, micro_batch=micro_batch, grad_accum=m, model=model, steps=STEPS)
    cfg.train.lr, cfg.train.min_lr = LR, LR / 10
    res, folder = reference(cfg, out)
    res["weights"] = full_weights(folder)
    return res


def _body(dims, corpus, root):
    groups = Groups()
    r = dims.rank
    results = {}
    for entry in SCHEDULE:
        if isinstance(entry, tuple):
            name = entry[min(r // 2, len(entry) - 1)]
            if len(entry) == 1 and r >= 2:
                continue
        else:
            name = entry
        pp = RUNS[name][0]
        comm = groups.comm("pp-pair" if pp == 2 else "pp-world")
        # the saved-bytes probe (a Python hook on every tensor autograd saves) only where its peak is read
        probe, facts = (SavedBytes() if _measures_saved_bytes(name) else None), {}
        res = train(_config(corpus, name), comm, root / name, step_fn=probe.step if probe else None,
                    par_hook=lambda par, facts=facts: facts.update(in_flight=par.runner.in_flight_peak,
                                                                     rank=par.runner.rank, costs=par.runner.costs))
        res.update(facts, saved_peak=probe.peak if probe else None)
        results.setdefault(name, res)
    return results


def _measures_saved_bytes(name: str) -> bool:
    """Whether test_micro_batches_in_flight_match_the_schedule reads this run's saved bytes: one chunk
    a stage, not ZB-H1 (its waiting W hold their inputs outside autograd), even stages."""
    _, sched, _, v = RUNS[name]
    return v == 1 and sched != "zb" and name not in SPLITS


class SavedBytes:
    """Bytes autograd keeps for backward, counted as tensors are saved and dropped as their graph is
    freed: its peak over a step is the activations of the micro-batches in flight."""

    def __init__(self):
        self.now = self.peak = 0

    def step(self, par, batches, lr):
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor):
            return par.runner.step(batches, lr)

    def _pack(self, t):
        return _Held(t, self)


class _Held:
    def __init__(self, t, probe):
        self.tensor, self.probe, self.n = t, probe, t.numel() * t.element_size()
        probe.now += self.n
        probe.peak = max(probe.peak, probe.now)

    def __del__(self):
        self.probe.now -= self.n


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    per_rank = run_dist(_body, 4, corpus, root, timeout=600)
    refs = {}
    for m in sorted({v[2] for v in RUNS.values()}):
        refs[m] = _reference(corpus, m, root / f"ref-{m}")
    return per_rank, refs, root


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_the_single_process_run(runs, name):
    """Loss per step within 1e-5 (relative), final weights within 1e-5 after gathering every stage's
    checkpoint files, the pre-clip grad norm within 1e-4."""
    per_rank, refs, root = runs
    ref = refs[RUNS[name][2]]
    got = next(r[name] for r in per_rank if name in r)
    assert_equivalent(name, got, ref, root / name, ref["weights"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.4


@pytest.mark.parametrize("pp", [2, 4])
def test_micro_batches_in_flight_match_the_schedule(runs, pp):
    """The executor holds what the schedule says: GPipe all m micro-batches on every stage, 1F1B at
    most pp - rank (stage 0: pp), interleaved its warm-up's worth - counted by the executor, and
    measured in bytes autograd keeps: a stage's peak is its micro-batches in flight times one
    micro-batch's activations, the same for every m and schedule, plus on the last stage only what
    the output head and loss save while one micro-batch's B runs them (once, however many wait)."""
    from plait.parallel.schedules import build_schedule, in_flight

    per_rank = runs[0]
    for rank in range(pp):
        points = set()  # (micro-batches in flight, peak saved bytes)
        for name, (p, sched, m, v) in RUNS.items():
            if p != pp:
                continue
            if name not in per_rank[rank]:  # of two 2-stage pipelines, ranks 0 and 1 ran the first
                continue
            got = per_rank[rank][name]
            want = in_flight(build_schedule(sched, pp, m, v, got["costs"]), got["rank"])[0]  # ZB-V's costed order
            assert got["in_flight"] == want, (name, rank)
            if sched == "gpipe":
                assert want == m
            if sched == "1f1b":
                assert want == min(m, pp - got["rank"])
            if _measures_saved_bytes(name):
                points.add((want, got["saved_peak"]))
        (w0, p0), (w1, p1) = min(points), max(points)
        assert w1 > w0, (rank, points)  # GPipe's m = 3 pp holds more than 1F1B's
        per_micro = (p1 - p0) / (w1 - w0)
        once = p0 - w0 * per_micro
        for w, peak in points:
            assert abs(peak - (w * per_micro + once)) <= 1e-6 * peak, (rank, points)
        if rank == pp - 1:
            assert once > 0, (rank, points)
        else:
            assert abs(once) <= 1e-6 * p1, (rank, points)


@pytest.mark.parametrize("name", ["pp2-1f1b-m2", "pp4-1f1b-m4", "pp4-gpipe-m12", "pp4-interleaved-m4", "pp4-zb-m12",
                                  "pp4-zbv-m12", "pp2-zbv-m6"])
def test_p2p_traffic_to_the_byte(runs, name):
    """Each micro-batch crosses every stage boundary once forward (its activation) and once backward
    (its gradient): 2 m (S - 1) activations of b s h fp32 a step over the pipeline (ZB-V: S - 2, its
    turn at the last rank stays on that rank); the planner prices the rank that sends most: a middle
    rank's 2 m v, at pp 2 (no middle rank) m for 1F1B and 2 m for ZB-V (was priced at 2 m v there)."""
    from plait.config import build_config
    from plait.planner.costs import ModelDims
    from plait.planner.hardware import cluster
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    pp, sched, m, v = RUNS[name]
    per_rank = runs[0]
    ranks = [r for r in range(4) if name in per_rank[r]]  # of two 2-stage pipelines, the ranks that ran it
    assert len(ranks) == pp
    A = MICRO * SEQ * PPM["dim"] * 4
    sends = [per_rank[r][name]["ledger"] for r in ranks]
    crossings = pp * v - 1 - (sched == "zbv")
    for step in range(STEPS):
        total = sum(led[step]["pp"]["send"]["bytes"] for led in sends)
        assert total == 2 * m * crossings * A
        received = sum(led[step]["pp"]["recv"]["bytes"] for led in sends)
        assert received == total
    d = ModelDims.from_config(build_config({"model": PPM}).model, seq=SEQ)
    lay = Layout(pp=pp, v=v, schedule=sched, micro_batch=MICRO)
    traffic = predict(d, lay, cluster("h100", 1, pp), MICRO * m, prec="fp32").traffic
    assert traffic["pp"].bytes_per_device == max(led[0]["pp"]["send"]["bytes"] for led in sends)
    if pp == 4:
        assert traffic["pp"].bytes_per_device == sends[1][0]["pp"]["send"]["bytes"]  # a middle rank
        # the tied embedding's two copies add their gradients once a step over the pipeline's two
        # ends, which the planner prices as rank 0's; ZB-V keeps both ends on rank 0: one matrix
        tied = sends[0][0].get("pp_ends")
        if sched == "zbv":
            assert tied is None and "pp_ends" not in traffic
        else:
            assert tied["all_reduce"]["calls"] == 1
            assert traffic["pp_ends"].bytes_per_device == tied["sent_bytes"] == d.vocab * d.hidden * 4


def test_a_wrongly_ordered_schedule_is_refused_before_it_runs(monkeypatch):
    """The executor proves a schedule before any rank runs it: a list whose receive comes after the
    compute that needs it raises here instead of hanging."""
    import dataclasses

    from plait.parallel import pipeline, schedules

    good = schedules.build_schedule("1f1b", 2, 2)
    acts = list(good.ranks[1])
    i = next(k for k, a in enumerate(acts) if a.kind == "RECV_F")
    acts.insert(i + 2, acts.pop(i))  # the receive after its forward
    bad = dataclasses.replace(good, ranks=(good.ranks[0], tuple(acts)))
    monkeypatch.setattr(pipeline, "build_schedule", lambda *a: bad)
    pipeline.checked_schedule.cache_clear()
    with pytest.raises(schedules.ScheduleError, match="has no RECV_F before it"):
        pipeline.checked_schedule("1f1b", 2, 2, 1)
    pipeline.checked_schedule.cache_clear()


# PP 2 x TP 2 (+SP) x DP 2 with ZeRO-1 on 8 processes: name -> (schedule, micro-batches)
THREE_D = {"3d-1f1b": ("1f1b", 2), "3d-zb": ("zb", 4), "3d-zbv": ("zbv", 4)}
# half of PPM's layers: two a stage, one a ZB-V chunk (the 4-rank runs have chunks of one and of two
# layers); tensor parallelism's collectives, per layer and micro-batch, are most of a step on 8
# processes sharing the cores
PPM_3D = {**PPM, "n_layers": 4}


def _body_3d(dims, corpus, root):
    from plait.comm import Comm, Ledger

    comm = Comm(dims, Ledger())
    out = {}
    for name, (sched, m) in THREE_D.items():
        cfg = config(corpus, grad_accum=m, model=PPM_3D, steps=STEPS, pp=2, tp=2, sp="on", zero=1, schedule=sched,
                     v=2 if sched == "zbv" else 1)
        cfg.train.lr, cfg.train.min_lr = LR, LR / 10
        out[name] = train(cfg, comm, root / name)
    return out


@pytest.mark.parametrize("name", list(THREE_D))
def test_3d_matches_the_single_process_run(corpus, tmp_path_factory, name, _three_d={}):
    if not _three_d:
        root = tmp_path_factory.mktemp("pp3d")
        _three_d["runs"] = run_dist(_body_3d, 8, corpus, root, pp=2, tp=2, timeout=600)
        _three_d["root"] = root
    root = _three_d["root"]
    m = THREE_D[name][1]
    ref = _reference(corpus, m, root / f"ref-{name}", micro_batch=2 * MICRO, model=PPM_3D)  # ZB-H1's = ZB-V's
    got = _three_d["runs"][-1][name]
    assert_equivalent(name, got, ref, root / name, ref["weights"])


@pytest.mark.parametrize("kv_rows", [None, slice(8, 16)], ids=["whole", "kv-rows"])
def test_zero_bubble_linears_defer_inside_compiled_blocks(kv_rows):
    """ZB-H1 with compiled blocks (inductor, as `apply_compile` sets it up for a served model): the
    deferring linears stay inside the graph, so all blocks share one graph and nothing breaks it.
    dx comes at once, dW waits for W, and both match the plain model's over two steps - the second
    replays the compiled graphs, whose buffers the store must still find intact. W fires every
    weight's post-accumulate hook once, as autograd would (DDP and ZeRO reduce from it). `kv-rows`:
    K and V use the rows of one head, as tensor parallelism does where it replicates KV heads; their
    dW reaches the parameter through the slice."""
    import copy

    import torch
    from torch._dynamo.utils import counters

    from plait.config import build_config
    from plait.model import Transformer, rope_table
    from plait.parallel.build import apply_compile
    from plait.parallel.wgrad import WeightGradStore

    cfg = build_config({"model": {"preset": "custom", "vocab_size": 64, "dim": 32, "n_layers": 3, "n_heads": 4,
                                  "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32}}).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.layers.values():
        block.attn.kv_rows = kv_rows
    ref = copy.deepcopy(model)
    store = WeightGradStore()
    for lin in model.block_linears():
        store.serve(lin)
    cos, sin = (t[:16] for t in rope_table(cfg))
    x0 = torch.randn(2, 16, cfg.dim)
    weights = torch.randn(2, 16, cfg.dim)  # a loss whose gradient differs everywhere
    torch._dynamo.reset()
    counters.clear()
    apply_compile(model)
    fired = []  # the engines' reductions start from these hooks: W must fire each once
    for lin in model.block_linears():
        lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))

    def run(m, defer):
        x = x0.clone().requires_grad_()
        h = x
        for block in m.layers.values():
            h = block(h, cos, sin)
        if defer:
            with store.input_grads_only("m"):
                (h * weights).sum().backward()
        else:
            (h * weights).sum().backward()
        return x.grad

    for step in range(2):
        dx = run(model, True)
        assert counters["stats"]["unique_graphs"] == 1  # one graph for every block, no breaks
        assert len(store.pending["m"]) == 3 * 7
        if step == 0:
            assert all(lin.weight.grad is None for lin in model.block_linears())  # deferred ...
        torch.testing.assert_close(dx, run(ref, False))  # ... while dx is complete
        fired.clear()
        store.run("m")
        assert sorted(map(id, fired)) == sorted(id(lin.weight) for lin in model.block_linears())
        for a, b in zip(model.block_linears(), ref.block_linears()):
            torch.testing.assert_close(a.weight.grad, b.weight.grad)
    with pytest.raises(RuntimeError, match="outside WeightGradStore.input_grads_only"):
        model.layers["0"](x0.clone().requires_grad_(), cos, sin).sum().backward()
    torch._dynamo.reset()


@pytest.mark.parametrize("name,pp,v", [("gpipe", 4, 1), ("1f1b", 2, 1), ("zb", 4, 1), ("interleaved", 4, 2),
                                       ("interleaved", 2, 2)])
def test_every_link_a_schedule_uses_is_opened_before_it_runs(name, pp, v):
    """NCCL connects two ranks at their first message and the CPU waits there for the peer, so a
    schedule's first exchange with a new peer can deadlock against a third rank (GPipe and
    interleaved 1F1B hung so on 4 H100/H200s). The executor's opening exchange, which every rank
    makes at once, must cover every (sender, receiver) link the schedule's messages use, the
    interleaved wrap-around from the last rank to the first included, and stay out of the ledger."""
    from plait.parallel import pipeline, schedules

    sched = schedules.build_schedule(name, pp, 3 * pp, v)
    used = {(r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
            for r, acts in enumerate(sched.ranks) for a in acts if not a.is_compute}
    opened, calls = set(), []

    class Recorder:
        def send_recv(self, dim, sends=(), recvs=(), record=True):
            calls.append(record)
            opened.update((rank, p) for _, p in sends)
            opened.update((p, rank) for _, p in recvs)

    for rank in range(pp):
        runner = pipeline.PipelineRunner(None, None, Recorder(), name, pp, v, rank, [], None, None, torch.float32)
        runner._connect((2, 4), torch.device("cpu"))
        runner._connect((2, 4), torch.device("cpu"))  # once per activation shape
    assert used <= opened, sorted(used - opened)
    assert len(calls) == pp and not any(calls)


def test_w_forms_one_weight_gradient_at_a_time_and_lets_its_inputs_go():
    """A deferred W formed every dW of the micro-batch before adding any: a chunk's weight
    gradients sat together beside the activations in flight (9 layers of 8b: 3.9 GB over 1F1B's
    peak, measured on 2 x H200). Each dW is now added as it is formed, and its (x, dy) dropped."""
    import weakref

    import torch

    import plait.parallel.wgrad as wgrad
    from plait.config import build_config
    from plait.model import Transformer, rope_table

    cfg = build_config({"model": {"preset": "custom", "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4,
                                  "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32}}).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    store = wgrad.WeightGradStore()
    for lin in model.block_linears():
        store.serve(lin)
        lin.weight.grad = torch.zeros_like(lin.weight)  # an engine's flat buffer: dW is added into it
    cos, sin = (t[:16] for t in rope_table(cfg))
    h = torch.randn(2, 16, cfg.dim)
    for block in model.layers.values():
        h = block(h, cos, sin)
    with store.input_grads_only("m"):
        h.square().sum().backward()
    kept = [weakref.ref(t) for _, x, dy, *_ in store.pending["m"] for t in (x, dy)]
    formed, most_alive, inputs_alive = [], [0], []
    real = wgrad._weight_grad

    def spy(dy, x, w, fmt, shards=()):
        most_alive[0] = max(most_alive[0], sum(r() is not None for r in formed))
        inputs_alive.append(sum(r() is not None for r in kept))
        g = real(dy, x, w, fmt, shards)
        formed.append(weakref.ref(g))
        return g

    wgrad._weight_grad = spy
    try:
        store.run("m")
    finally:
        wgrad._weight_grad = real
    assert len(formed) == 2 * 7 and most_alive[0] == 0  # no earlier dW alive when the next is formed
    # the store lets each (x, dy) go once used (x may be shared by q, k and v: it goes with the last)
    assert inputs_alive[-1] < inputs_alive[0] and not any(r() is not None for r in kept)
