"""Search layouts: enumerate (tp, pp, v, cp, dp_replicate x dp_shard, zero, micro-batch, recompute,
schedule) for a model on a cluster, keep those that fit in memory, rank them by predicted step time,
and say why the winners win.

Two passes keep it fast: every candidate is costed with the closed-form pipeline estimate
(`predict(exact=False)`), then the best `refine` are re-costed by simulating their schedules, and
the final order is by simulated step time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from plait.errors import UserError
from plait.planner.costs import ModelDims
from plait.planner.hardware import GIB, Cluster
from plait.planner.layout import Layout, check_layout
from plait.planner.memory import Precision
from plait.planner.predict import Prediction, predict
from plait.planner.stage_costs import split_layers


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class Space:
    """What to try. None = every sensible value; a tuple pins the choices (e.g. tp=(8,))."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    """Data-parallel degree(s) to keep; None: whatever the other degrees leave of the GPUs."""
    dp_replicate: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    v: tuple[int, ...] = (2, 4)
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedule: tuple[str, ...] = ("1f1b", "interleaved", "zb", "zbv")
    sp: bool = True
    compile: bool = True
    fp8: str = "off"
    """The linears' FP8 scaling every candidate runs with (`train.fp8`): a given, not searched."""
    cp_impl: tuple[str, ...] = ("ring", "ulysses")
    """Context parallelism's two ways, tried where cp > 1 (Ulysses only where the heads split)."""
    stage_split: tuple[str, ...] = ("", "balance")
    """Pipeline splits to try (pp > 1): as even as possible, and lighter last stage."""
    max_cp: int = 8
    pipeline_only: bool = False
    """A schedule or virtual stages were asked for: only layouts with a pipeline (pp > 1) have them."""


@dataclass
class SearchResult:
    ranked: list[Prediction]
    considered: int
    rejected: Counter = field(default_factory=Counter)
    """Reason -> count, for layouts that are impossible or do not fit."""
    example_oom: Prediction | None = None
    """The fastest-looking layout that did not fit (to show what memory costs)."""
    leanest_oom: Prediction | None = None
    """The layout that did not fit with the least memory per GPU: how far the cluster is from any."""

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def candidates(d: ModelDims, c: Cluster, global_batch: int, space: Space = Space()):
    """Every layout of `space` whose degrees multiply to the cluster's GPU count. A `balance` split
    that comes out as the even one is the even layout again: it is not tried twice."""
    n = c.n_gpus
    splits: dict[tuple[int, str], tuple[str, ...]] = {}

    def distinct_splits(stages: int, sched: str) -> tuple[str, ...]:
        if (stages, sched) not in splits:
            seen, keep = set(), []
            for split in space.stage_split:
                counts = tuple(split_layers(d, stages, split, sched))
                if counts not in seen:
                    seen.add(counts)
                    keep.append(split)
            splits[(stages, sched)] = tuple(keep)
        return splits[(stages, sched)]

    tps = space.tp or tuple(t for t in _divisors(c.gpus_per_node) if d.heads % t == 0 and d.kv_heads % t == 0)
    cps = space.cp or tuple(k for k in (1, 2, 4, 8, 16, 32) if k <= space.max_cp and d.seq % (2 * k) == 0 or k == 1)
    for tp in tps:
        for cp in cps:
            if n % (tp * cp):
                continue
            for pp in space.pp or tuple(p for p in _divisors(n // (tp * cp)) if p <= d.layers):
                if n % (tp * cp * pp) or (pp == 1 and space.pipeline_only):
                    continue
                dp = n // (tp * cp * pp)
                if space.dp and dp not in space.dp:
                    continue
                for zero in space.zero:
                    if zero > 0 and dp * cp == 1:
                        continue  # nothing to shard over
                    reps = space.dp_replicate or ((1,) if zero < 3 else tuple(r for r in _divisors(dp) if r < dp or dp == 1))
                    for rep in reps:
                        if dp % rep:
                            continue
                        for mb in space.micro_batch:
                            if global_batch % (dp * mb):
                                continue
                            m = global_batch // (dp * mb)
                            for rc in space.recompute:
                                scheds = ("1f1b",) if pp == 1 else space.schedule
                                for sched in scheds:
                                    vs = space.v if sched == "interleaved" else (2,) if sched == "zbv" else (1,)
                                    for v in vs:
                                        if sched == "interleaved" and (m % pp or pp * v > d.layers):
                                            continue
                                        if sched == "zbv" and 2 * pp > d.layers:
                                            continue
                                        for split in distinct_splits(pp * v, sched) if pp > 1 else ("",):
                                            for impl in space.cp_impl if cp > 1 else space.cp_impl[:1]:
                                                yield Layout(tp=tp, pp=pp, dp_replicate=rep, dp_shard=dp // rep,
                                                             cp=cp, zero=zero, v=v, schedule=sched, micro_batch=mb,
                                                             recompute=rc, sp=space.sp, compile=space.compile,
                                                             cp_impl=impl, stage_split=split, fp8=space.fp8)


def search(d: ModelDims, c: Cluster, global_batch: int, prec: Precision | str = "mixed",
           space: Space = Space(), top: int = 10, refine: int = 40,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Rank the layouts that fit by predicted step time (simulated for the best `refine`).
    `progress(done, total)` is called every 1,000 layouts screened (a 405b search over 1,024 GPUs
    screens 116,000 of them, minutes on a laptop)."""
    screened: list[Prediction] = []
    rejected: Counter = Counter()
    oom: Prediction | None = None
    lean: Prediction | None = None
    considered = 0
    layouts = list(candidates(d, c, global_batch, space))
    for lay in layouts:
        considered += 1
        if progress is not None and considered % 1000 == 0:
            progress(considered, len(layouts))
        try:
            check_layout(d, lay, c, global_batch)
        except UserError as e:
            rejected[str(e).split(" = ")[0] + " constraint"] += 1
            continue
        p = predict(d, lay, c, global_batch, prec, exact=False)
        if not p.fits:
            rejected["does not fit in memory"] += 1
            if oom is None or p.step_time_s < oom.step_time_s:
                oom = p
            if lean is None or p.memory_total_bytes < lean.memory_total_bytes:
                lean = p
            continue
        screened.append(p)
    if not screened:
        return SearchResult([], considered, rejected, oom, lean)
    screened.sort(key=lambda p: p.step_time_s)
    exact = [predict(d, p.layout, c, global_batch, prec, exact=True) for p in screened[:refine]]
    exact = [p for p in exact if p.fits]
    fastest = min(p.step_time_s for p in exact) if exact else 1.0
    # within 0.01% of each other, prefer the simpler layout: fewer mechanisms to run and debug
    exact.sort(key=lambda p: (round(p.step_time_s / fastest, 4), _complexity(p.layout), -p.headroom_bytes))
    return SearchResult(exact[:top], considered, rejected, oom, lean)


def _complexity(lay: Layout) -> tuple:
    return (lay.cp > 1, lay.pp > 1, lay.v > 1, lay.dp_replicate > 1, lay.zero, lay.recompute != "none",
            lay.schedule != "1f1b", lay.micro_batch)


def _share(p: Prediction) -> str:
    t = p.step_time_s
    parts = [(k, v) for k, v in p.time_s.items() if v / t >= 0.005]
    return ", ".join(f"{k} {v / t:.0%}" for k, v in sorted(parts, key=lambda kv: -kv[1]))


def explain_ranking(res: SearchResult, n: int = 5) -> list[str]:
    """Why the winners win: each one's time budget, and for each runner-up the parts that cost it
    the most relative to the winner."""
    if not res.considered:
        return ["no layout to consider: the choices given leave none on this cluster (the degrees must multiply "
                "to its GPU count, and the global batch must split into the data-parallel ranks' micro-batches)"]
    if not res.ranked:
        lines = [f"no layout fits: of {res.considered} considered, "
                 + ", ".join(f"{v} rejected: {k}" for k, v in res.rejected.items())]
        # the leanest, not the fastest: how far off the cluster is (the fastest of a 405b search on one
        # node needed 4593 GiB a GPU, its leanest a seventh of that)
        o = res.leanest_oom or res.example_oom
        if o is not None:
            lines.append(f"the leanest of them, {o.layout.describe()}, needs {o.memory_total_bytes / GIB:.1f} GiB per "
                         f"GPU of {o.capacity_bytes / GIB:.0f} ({o.memory_total_bytes / o.capacity_bytes:.1f}x): more "
                         "GPUs (--nodes, --gpus-per-node) or a larger card")
        return lines
    best = res.ranked[0]
    lines = [f"#1 {best.layout.describe()}: {seconds(best.step_time_s)}/step, MFU {best.mfu:.1%}; time = "
             f"{_share(best)}; {best.headroom_bytes / GIB:.1f} GiB free of {best.capacity_bytes / GIB:.0f}"]
    for i, p in enumerate(res.ranked[1:n], start=2):
        noise = 5e-4 * best.step_time_s  # differences below this are rounding, not reasons
        deltas = {k: p.time_s[k] - best.time_s[k] for k in best.time_s
                  if abs(p.time_s[k] - best.time_s[k]) > noise}
        worse = sorted(((k, v) for k, v in deltas.items() if v > 0), key=lambda kv: -kv[1])[:2]
        better = sorted(((k, v) for k, v in deltas.items() if v < 0), key=lambda kv: kv[1])[:1]
        why = ", ".join(f"+{seconds(v)} {k}" for k, v in worse) or "same time"
        gain = f" (saves {seconds(-better[0][1])} {better[0][0]})" if better else ""
        lines.append(f"#{i} {p.layout.describe()}: +{p.step_time_s / best.step_time_s - 1:.1%}: {why}{gain}")
    if res.example_oom is not None:
        o = res.example_oom
        lines.append(f"fastest layout that does not fit: {o.layout.describe()} ({seconds(o.step_time_s)}/step) needs "
                     f"{o.memory_total_bytes / GIB:.1f} GiB per GPU, over by {-o.headroom_bytes / GIB:.1f} GiB")
    rejected = ", ".join(f"{v} rejected: {k}" for k, v in res.rejected.items())
    lines.append(f"considered {res.considered} layouts" + (f"; {rejected}" if rejected else ", none rejected"))
    return lines


def seconds(x: float) -> str:
    """A time (or a difference of two) with digits that say something: a small model's parts differ by a
    fraction of a millisecond, which three decimals of a second print as 0.000."""
    return f"{x:.3f} s" if abs(x) >= 0.1 else f"{x * 1e3:.3g} ms"


def pin(space: Space, **fixed) -> Space:
    """`space` with the given dims pinned to one value each (None values ignored)."""
    kw = {k: (v,) for k, v in fixed.items() if v is not None}
    return replace(space, **kw)
