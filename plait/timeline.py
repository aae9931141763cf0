"""A pipeline timeline - simulated by the planner or measured by the executor - as numbers and a PNG.

A span is (rank, start s, end s, kind, micro-batch, chunk): one compute action. The bubble is the
ranks' idle share of the step: 1 - sum(busy) / (pp x makespan), the same definition as the
simulator's (`plait.planner.simulate.Timeline.bubble_fraction`), so a measured bubble and a
predicted one compare directly. Drawing needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import UserError

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def bubble(spans, pp: int) -> float:
    """Idle share of `pp` ranks' time over the spans' makespan."""
    if not spans:
        return 0.0
    start = min(s[1] for s in spans)
    makespan = max(s[2] for s in spans) - start
    busy = sum(s[2] - s[1] for s in spans)
    return 1.0 - busy / (pp * makespan) if makespan > 0 else 0.0


def replayed_bubble(spans, sched) -> float:
    """The bubble the schedule's dependencies alone force when every action takes the time it took
    (the simulator replaying the measured durations, messages instant). The measured bubble minus
    this one is what the executor and the links added: waits for transfers, launch gaps. Unequal
    stages raise both alike, so the difference isolates the pipeline's own overhead - as far as the
    ranks' clocks agree (they start together at a barrier: on GPUs to microseconds, on CPU ranks
    sharing cores to milliseconds, where the replay can even exceed the measurement)."""
    from statistics import median

    from plait.planner.simulate import simulate

    took = {(r, k, mb, c): b - a for r, a, b, k, mb, c in spans}
    typical: dict = {}
    for (r, k, _, c), d in took.items():
        typical.setdefault((r, k, c), []).append(d)
    typical = {key: median(ds) for key, ds in typical.items()}

    def dur(rank, act) -> float:
        return took.get((rank, act.kind, act.microbatch, act.chunk), typical.get((rank, act.kind, act.chunk), 0.0))

    return simulate(sched, dur).bubble_fraction


def stage_seconds(spans, pp: int, v: int, m: int, schedule: str = "1f1b") -> list[float]:
    """Compute seconds per micro-batch of each of the pp x v stages (stage = chunk x pp + rank, or
    ZB-V's V: `plait.parallel.schedules.stage_of`)."""
    from plait.parallel.schedules import stage_of

    out = [0.0] * (pp * v)
    for r, a, b, _, _, c in spans:
        out[stage_of(schedule, pp, r, c)] += (b - a) / m
    return out


def split_advice(spans, pp: int, v: int, m: int, counts: list[int], schedule: str = "1f1b") -> dict | None:
    """The measured stage times and, when a split of the same layers would shorten the slowest stage
    by more than 2%, that split (`plait.parallel.stages.measured_split`) and the stage times it gives.
    ZB-V's ranks each run two stages, so what its split evens out is their pairs: no advice there."""
    from plait.parallel.stages import measured_split

    now = stage_seconds(spans, pp, v, m, schedule)
    fit = measured_split(now, counts) if schedule != "zbv" else None
    out = {"stage_layers": ",".join(map(str, counts)), "stage_ms": [round(t * 1e3, 3) for t in now]}
    if fit is not None and fit[0] != counts and max(fit[1]) < 0.98 * max(now):
        out.update(suggested_stage_layers=",".join(map(str, fit[0])), suggested_stage_ms=[round(t * 1e3, 3) for t in fit[1]])
    return out


def report(spans, sched, counts: list[int]) -> dict:
    """A measured step of `sched` (spans of every pipeline rank; `counts` the layers of each of its
    pp x v stages): its bubble measured, replayed with its action times, simulated with equal stage
    costs and by the textbook formula, and the split advice. The executor's profile and the
    benchmark both report this."""
    from plait.parallel.schedules import build_schedule
    from plait.planner.simulate import simulate

    pp, v, m = sched.pp, sched.v, sched.microbatches
    # with equal stages, the order equal stages give (ZB-V's order follows the stages' costs:
    # the ordered-by-cost list simulated with equal costs matched neither `plait schedule` nor this run)
    equal = build_schedule(sched.name, pp, m, v)
    return {"measured_bubble": bubble(spans, pp), "replayed_bubble": replayed_bubble(spans, sched),
            "simulated_bubble": simulate(equal).bubble_fraction, "textbook_bubble": textbook(sched.name, pp, m, v),
            "split": split_advice(spans, pp, v, m, counts, sched.name)}


def host_share(actions_by_rank) -> list[float]:
    """Per rank: seconds the host spent issuing its compute actions over the seconds the device ran
    them (`Timeline` actions). Near or above 1 the rank is launch-bound: its GPU waits on its CPU.
    On a CPU run both clocks are the host's, so it reads 1."""
    out = []
    for acts in actions_by_rank:
        device = sum(a[4] - a[3] for a in acts)
        out.append(round(sum(a[5] for a in acts) / device, 3) if device > 0 and acts and len(acts[0]) > 5 else 0.0)
    return out


def held(actions_by_rank) -> list[dict | None]:
    """Per rank: the most bytes its allocator held once an action was issued, and that action (kind,
    micro-batch, chunk), from `Timeline`'s record; None where nothing was counted (a CPU run). The
    level between actions: a schedule's activations in flight and deferred W inputs, not the
    transient peak inside an action."""
    out = []
    for acts in actions_by_rank:
        top = max(acts, key=lambda a: a[6], default=None) if acts and len(acts[0]) > 6 else None
        out.append({"bytes": top[6], "action": list(top[:3])} if top is not None and top[6] else None)
    return out


def textbook(name: str, pp: int, m: int, v: int = 1) -> float | None:
    """The closed-form bubble of GPipe / 1F1B, (p - 1) / (m + p - 1), and of interleaving, with v m:
    idle over the whole step when F and B take the same time on every rank (ZB has none)."""
    if name in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if name == "interleaved":
        return (pp - 1) / (v * m + pp - 1)
    return None


def draw(spans, pp: int, v: int, path: str | Path, title: str, unit: str = "s") -> Path:
    """One row per rank, one box per compute action (F blue, B orange, W green, micro-batch inside)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("drawing a timeline needs matplotlib: pip install 'plait[plot]'") from None
    start = min(s[1] for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.6 * pp))
    for rank, a, b, kind, mb, chunk in spans:
        ax.barh(rank, b - a, left=a - start, height=0.8, color=COLOURS.get(kind, "grey"), edgecolor="white",
                linewidth=0.3)
        label = f"{kind}{mb}" + ("abcdefgh"[chunk] if v > 1 else "")
        ax.text(a - start + (b - a) / 2, rank, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    from matplotlib.patches import Patch

    names = {"F": "forward", "B": "backward", "W": "weight gradient"}
    kinds = [k for k in names if any(s[3] == k for s in spans)]
    # above the rows, right of the title (below, it ran into the time axis' label)
    ax.legend(handles=[Patch(color=COLOURS[k], label=f"{k}: {names[k]}") for k in kinds], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), fontsize=7, frameon=False, borderaxespad=0.2)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    path = Path(path)
    if path.is_dir():
        plt.close(fig)
        raise ValueError(f"{path} is a folder")
    if not path.suffix:  # matplotlib would write path.png: return the name it gets
        path = path.with_name(path.name + ".png")
    fig.savefig(path, dpi=120)  # into an existing folder: a mistyped one is the caller's to refuse, not to create
    plt.close(fig)
    return path
