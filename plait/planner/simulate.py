"""Time a pipeline schedule by executing its action lists, and draw the result as a timeline.

The simulator walks exactly the per-rank lists `plait.parallel.schedules` builds (the lists the
executor runs), so the bubble the planner predicts is the bubble of the code that trains, not of a
textbook formula. Each compute action lasts what `durations` says; a send makes its tensor available
`p2p_s` later; a receive waits for it. Sends are asynchronous (isend), so a sender does not idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from plait.parallel.schedules import Action, Schedule, ScheduleError, message_key


@dataclass(frozen=True)
class Span:
    rank: int
    start_s: float
    end_s: float
    action: Action


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    spans: tuple[Span, ...]
    makespan_s: float
    busy_s: tuple[float, ...]  # compute time per rank

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: 1 - sum(busy) / (pp * makespan)."""
        total = self.schedule.pp * self.makespan_s
        return 1.0 - sum(self.busy_s) / total if total > 0 else 0.0

    @property
    def bubble_over_compute(self) -> float:
        """Idle time per unit of useful compute (Megatron's (p-1)/m form): bubble / busy."""
        busy = sum(self.busy_s)
        return (self.schedule.pp * self.makespan_s - busy) / busy if busy > 0 else 0.0


Durations = Callable[[int, Action], float]


def unit_durations(f: float = 1.0, b: float = 2.0, w: float = 1.0) -> Durations:
    """Every chunk costs f / b / w (divided by v: a chunk is 1/v of the rank's layers).

    Default: B = 2 F for a full backward. In a split schedule B is the input gradient only, and the
    caller passes b = w = f (the two halves of a backward of cost 2 F)."""

    costs = {"F": f, "B": b, "W": w}

    def dur(rank: int, a: Action) -> float:
        return costs[a.kind]

    return dur


def default_durations(sched: Schedule) -> Durations:
    """F = 1 per rank's share of layers; backward 2 (split as B = 1, W = 1 for zb); chunks 1/v."""
    v = sched.v
    if sched.split_backward:
        return unit_durations(1.0 / v, 1.0 / v, 1.0 / v)
    return unit_durations(1.0 / v, 2.0 / v, 0.0)


def simulate(sched: Schedule, durations: Durations | None = None, p2p_s: float = 0.0) -> Timeline:
    """Run the action lists as soon as dependencies allow; return every compute span and the makespan.

    Ranks advance in turn; one waiting on a message whose send has not run yet yields to the others.
    If no rank can move, the lists deadlock (impossible for lists that passed `schedules.check`)."""
    dur = durations or default_durations(sched)
    pp = sched.pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    ptr = [0] * pp
    ready_at: dict[tuple, float] = {}
    spans: list[Span] = []
    lists = sched.ranks
    while True:
        moved = False
        for r in range(pp):
            acts = lists[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.is_compute:
                    d = dur(r, a)
                    spans.append(Span(r, clock[r], clock[r] + d, a))
                    clock[r] += d
                    busy[r] += d
                elif a.kind.startswith("SEND"):
                    ready_at[message_key(sched, r, a)] = clock[r] + p2p_s
                else:
                    k = message_key(sched, r, a)
                    if k not in ready_at:
                        break
                    clock[r] = max(clock[r], ready_at[k])
                ptr[r] += 1
                moved = True
        if all(ptr[r] == len(lists[r]) for r in range(pp)):
            break
        if not moved:
            raise ScheduleError(f"{sched.name}: simulation cannot progress (deadlock)")
    return Timeline(sched, tuple(spans), max(clock) if clock else 0.0, tuple(busy))


def render(tl: Timeline, unit_s: float | None = None, max_width: int = 160) -> str:
    """A text chart: one row per rank, one cell per `unit_s` of time (default: the shortest action).

    Each action shows its label (F3, B3, W3; chunk letter a, b, ... when v > 1) followed by '=' for
    the rest of its length; idle time is '.'. A chart wider than `max_width` characters switches to
    one character per cell: the kind in capitals where an action starts, in lower case after."""
    sched = tl.schedule
    if not tl.spans:
        return ""
    unit = unit_s or min(s.end_s - s.start_s for s in tl.spans if s.end_s > s.start_s)
    n_cells = int(round(tl.makespan_s / unit))
    width = max(len(s.action.label(sched.v)) for s in tl.spans) + 1
    compact = n_cells * width > max_width
    idle = "." if compact else "." * (width - 1) + " "
    rows = []
    for r in range(sched.pp):
        cells = [idle] * n_cells
        for s in (s for s in tl.spans if s.rank == r):
            a, b = int(round(s.start_s / unit)), int(round(s.end_s / unit))
            if compact:
                for i in range(a, b):
                    cells[i] = s.action.kind if i == a else s.action.kind.lower()
                continue
            span_chars = (b - a) * width
            body = (s.action.label(sched.v) + "=" * span_chars)[: span_chars - 1] + " "
            for i in range(a, b):
                cells[i] = body[(i - a) * width:(i - a + 1) * width]
        rows.append(f"rank {r:>2} | " + "".join(cells).rstrip())
    return "\n".join(rows)
