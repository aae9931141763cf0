"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs.

A schedule is built once from (name, pp, microbatches, v) and then *read* by three consumers: the
executor runs it, the planner's simulator times it (`plait.planner.simulate`), and the timeline chart
draws it. Nothing else in plait knows what "1F1B" means.

Vocabulary
  stage        one of S = pp * v consecutive slices of the model's layers. Rank r holds the v chunks
               (virtual stages) r, r + pp, r + 2 pp, ... (Megatron's interleaving); chunk c of rank r
               is stage c * pp + r. ZB-V places its two chunks in a V instead (`stage_of`): chunk 0
               of rank r is stage r, chunk 1 stage 2 pp - 1 - r, so rank 0 holds both the first and
               the last stage and the last rank hands stage pp - 1's output to stage pp locally.
  F / B / W    forward; backward; weight-gradient. In a schedule with `split_backward` (ZB-H1) B
               computes only the input gradient and W the weight gradient; otherwise B does both and
               there is no W.
  SEND_F/RECV_F, SEND_B/RECV_B
               the activation (forward) and gradient (backward) messages between adjacent stages.
               A RECV comes right before the action that consumes it and a SEND right after the
               action that produced it; the executor may post a run of consecutive SEND/RECV actions
               as one batch (batch_isend_irecv), and `check` proves that even this rendezvous
               execution cannot deadlock.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from plait.errors import bad_value
from plait.parallel.rules import flag_field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
SPLIT_BACKWARD = ("zb", "zbv")  # schedules whose B computes input gradients only, W the rest
COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank. `chunk` is the local model chunk (0..v-1); `peer` the other rank of a
    send/recv (-1 for compute)."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int = -1

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def label(self, v: int = 1) -> str:
        """Short name for charts: F3, B3, W3; with v > 1 the chunk as a letter (F3a, F3b)."""
        suffix = "abcdefghijklmnopqrstuvwxyz"[self.chunk] if v > 1 else ""
        return f"{self.kind}{self.microbatch}{suffix}"

    def __str__(self) -> str:
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.kind}{self.microbatch}.{self.chunk}{peer}"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    v: int
    split_backward: bool
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    def stage(self, rank: int, chunk: int) -> int:
        return stage_of(self.name, self.pp, rank, chunk)

    def place(self, stage: int) -> tuple[int, int]:
        return place(self.name, self.pp, self.v, stage)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.is_compute]


def stage_of(name: str, pp: int, rank: int, chunk: int) -> int:
    """The stage that chunk `chunk` of pipeline rank `rank` runs: looped (chunk * pp + rank) for every
    schedule but ZB-V, whose second chunk comes back up the ranks (2 pp - 1 - rank)."""
    if name == "zbv" and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


def place(name: str, pp: int, v: int, stage: int) -> tuple[int, int]:
    """(rank, chunk) of `stage`: the inverse of `stage_of`."""
    if name == "zbv" and stage >= pp:
        return 2 * pp - 1 - stage, 1
    return stage % pp, stage // pp


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------

def canonical(name: str, field: Callable[[str], str] = flag_field) -> str:
    """The schedule's name as SCHEDULES spells it (aliases accepted); an unknown one is one line."""
    name = str(name).lower()
    aliases = {"zb-h1": "zb", "zbh1": "zb", "zb-v": "zbv", "interleaved-1f1b": "interleaved", "fill-drain": "gpipe"}
    name = aliases.get(name, name)
    if name not in SCHEDULES:
        raise bad_value(field("schedule"), name, f"choose one of {', '.join(SCHEDULES)}")
    return name


def default_v(name) -> int:
    """Model chunks per rank a schedule runs when v is not given: two for interleaved and ZB-V (ZB-V
    knows no other), one for the rest; an unknown name is left to `canonical`'s error."""
    aliases = {"zb-v": "zbv", "interleaved-1f1b": "interleaved"}
    return 2 if aliases.get(str(name).lower(), str(name).lower()) in ("interleaved", "zbv") else 1


# Largest pp x v x micro-batches a schedule is built for: 128 stages x 8192 micro-batches, about a
# minute and 2 GB to build and check; beyond it a request is refused rather than left to run for hours.
MAX_STAGE_MICROBATCHES = 2**20


def check_args(name: str, pp: int, microbatches: int, v: int = 1,
               field: Callable[[str], str] = flag_field) -> str:
    """Validate a schedule request without building it; return the canonical name.

    Every bad input is one UserError line naming the knob, the value and the fix, as the caller's
    command line names it: `field(knob)` (`plait.parallel.rules`' convention) gives --pp, --v, ... for
    `plait plan` and `plait schedule`, `rules.run_field` parallel.pp, parallel.v, ... for `plait
    train`."""
    name = canonical(name, field)
    for knob, value in (("pp", pp), ("microbatches", microbatches), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_value(field(knob), value, "must be a positive integer")
    if pp * v * microbatches > MAX_STAGE_MICROBATCHES:  # lists, checks and simulations grow with it
        most = max(1, MAX_STAGE_MICROBATCHES // (pp * v))
        raise bad_value(field("microbatches"), microbatches, f"pp x v x micro-batches = {pp * v * microbatches:,} "
                        f"stage passes a step, more than plait schedules ({MAX_STAGE_MICROBATCHES:,}): use at most "
                        f"{most:,} micro-batches at pp x v = {pp * v} (the bubble depends on their ratio, not their size)")
    if name == "interleaved":
        if v < 2:
            raise bad_value(field("v"), v, "the interleaved schedule needs v >= 2 model chunks per rank "
                            "(v = 1 is plain 1f1b)")
        if pp < 2:
            raise bad_value(field("pp"), pp, "the interleaved schedule needs pp >= 2 (with one rank there is "
                            "no bubble to shrink)")
        if microbatches % pp:
            near = max(pp, round(microbatches / pp) * pp)
            raise bad_value(field("microbatches"), microbatches, f"the interleaved schedule runs micro-batches "
                            f"in groups of pp = {pp}: use a multiple of {pp} (e.g. {near})")
    elif name == "zbv":
        if v != 2:
            flag = field("v") if field("v").startswith("--") else "--" + field("v")
            raise bad_value(field("v"), v, f"ZB-V runs two model chunks per rank, placed in a V: give {flag} 2")
        if pp < 2:
            raise bad_value(field("pp"), pp, "ZB-V needs pp >= 2 (with one rank there is no bubble to fill)")
    elif v != 1:
        other = "zbv (v = 2)" if name == "zb" else "interleaved"  # ZB-V is zero-bubble's two-chunk variant
        raise bad_value(field("v"), v, f"only the interleaved and zbv schedules have virtual stages; use v = 1 "
                        f"with {name} or {field('schedule')} {other}")
    return name


def check_no_pipeline(name: str, v: int, field: Callable[[str], str] = flag_field) -> None:
    """pp = 1: a schedule or virtual stages were meant for a pipeline, so say so rather than ignore
    them. The knob named is the one the caller's user gave (`field`, as in `check_args`): v first,
    since a default schedule (1f1b) with v > 1 was never asked for."""
    if v != 1 and v != default_v(name):  # a v the schedule would not take by itself was given
        raise bad_value(field("v"), v, f"virtual stages are chunks of a pipeline's stages: v > 1 needs "
                        f"{field('pp')} > 1 and {field('schedule')} interleaved (zbv: v = 2); without a "
                        f"pipeline drop {field('v')}")
    if canonical(name, field) != "1f1b":
        raise bad_value(field("schedule"), name, f"orders a pipeline's stages: it needs {field('pp')} > 1 "
                        f"(without a pipeline, drop {field('schedule')})")


@functools.lru_cache(maxsize=512)
def _compute_slots(name: str, pp: int, m: int, v: int, costs: tuple | None = None) -> tuple:
    """Per rank, the compute actions grouped into slots (see `_with_p2p`); cached, immutable."""
    if name == "interleaved":
        slots = _interleaved(pp, m, v)
    elif name == "zbv":
        from plait.parallel.schedule_zbv import zb_v_timed

        slots = [[[a] for _, _, a in timed] for timed in zb_v_timed(pp, m, costs)]
    else:
        orders = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb": _zb_h1}[name](pp, m, v)
        slots = [[[a] for a in order] for order in orders]
    return tuple(tuple(tuple(slot) for slot in rank_slots) for rank_slots in slots)


def build_schedule(name: str, pp: int, microbatches: int, v: int = 1, costs: tuple | None = None) -> Schedule:
    """Per-rank action lists of schedule `name` (compute plus the sends and receives).

    `costs` (ZB-V only; the others ignore it): per stage, the relative (F, B, W) times its order is
    found with (`plait.parallel.schedule_zbv`); None = equal stages."""
    name = check_args(name, pp, microbatches, v)
    if name == "zbv":
        from plait.parallel.schedule_zbv import zb_v_lists

        ranks = tuple(tuple(acts) for acts in zb_v_lists(pp, microbatches, costs))
    else:
        slots = _compute_slots(name, pp, microbatches, v)
        ranks = tuple(tuple(_with_p2p(rank_slots, r, pp, v, name)) for r, rank_slots in enumerate(slots))
    return Schedule(name, pp, microbatches, v, name in SPLIT_BACKWARD, ranks)


@functools.lru_cache(maxsize=512)
def compute_order(name: str, pp: int, microbatches: int, v: int = 1,
                  costs: tuple | None = None) -> tuple[tuple[Action, ...], ...]:
    """Per rank, only the F/B/W actions in order: cheaper than `build_schedule` when the messages
    do not matter (memory estimates)."""
    name = check_args(name, pp, microbatches, v)
    costs = costs if name == "zbv" else None
    return tuple(tuple(a for slot in rank for a in slot) for rank in _compute_slots(name, pp, microbatches, v, costs))


def _gpipe(pp: int, m: int, v: int) -> list[list[Action]]:
    # fill then drain: every micro-batch's activations stay alive until the backward phase
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)]


def _one_f_one_b(pp: int, m: int, v: int) -> list[list[Action]]:
    # rank r runs pp - r - 1 forwards ahead, then alternates: at most pp - r micro-batches in flight
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action("F", warm + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warm, m)]
        out.append(order)
    return out


def _interleaved(pp: int, m: int, v: int) -> list[list[list[Action]]]:
    # Megatron's interleaved 1F1B: forwards go through the chunks in groups of pp micro-batches;
    # backwards walk the chunks in reverse. The longer warm-up fills v chunks' worth of pipeline.
    total = m * v

    def fwd(k: int) -> Action:
        group, within = divmod(k, pp * v)
        return Action("F", group * pp + within % pp, within // pp)

    def bwd(k: int) -> Action:
        group, within = divmod(k, pp * v)
        return Action("B", group * pp + within % pp, v - 1 - within // pp)

    out = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        # steady-state F and B form one slot: see _with_p2p
        slots = [[fwd(k)] for k in range(warm)]
        slots += [[fwd(warm + k), bwd(k)] for k in range(total - warm)]
        slots += [[bwd(k)] for k in range(total - warm, total)]
        out.append(slots)
    return out


def _zb_h1(pp: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order of F and B (B now the input gradient only), with the
    weight-gradient passes W moved into what would otherwise be bubbles.

    Where the W go is found by list scheduling with unit costs (T_F = T_B = T_W): a rank runs its
    next 1F1B action as soon as the input has arrived, and a pending W whenever that action is not
    ready yet. Before an F, a rank holding r + 1 pending W runs one first: r + 1 is exactly what
    rank r needs to fill its drain (the last micro-batch's backward still has r stages to cross),
    and each pending W keeps its layers' inputs and output gradients alive, so no more are allowed.
    With m >= pp this reaches the ZB-H1 optimum (p-1)(T_F + T_B - T_W) of idle time per rank. The
    unit-cost run only *finds* the order; the order is valid for any costs (`check` proves it).
    """
    seqs = _one_f_one_b(pp, m, 1)
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, rank) -> finish time
    idx, pend = [0] * pp, [[] for _ in range(pp)]
    orders: list[list[Action]] = [[] for _ in range(pp)]
    t = 0
    while any(idx[r] < len(seqs[r]) or pend[r] for r in range(pp)):
        started = []
        for r in range(pp):
            act = None
            if idx[r] < len(seqs[r]):
                a = seqs[r][idx[r]]
                src = ("F", a.microbatch, r - 1) if a.kind == "F" else ("B", a.microbatch, r + 1)
                edge = r == 0 if a.kind == "F" else r == pp - 1
                if edge or done.get(src, t + 1) <= t:
                    if a.kind == "F" and len(pend[r]) >= r + 1:
                        act = Action("W", pend[r].pop(0))
                    else:
                        act = a
                        idx[r] += 1
                        if a.kind == "B":
                            pend[r].append(a.microbatch)
            if act is None and pend[r]:
                act = Action("W", pend[r].pop(0))
            if act is not None:
                orders[r].append(act)
                started.append((act.kind, act.microbatch, r))
        for key in started:
            done[key] = t + 1
        t += 1
    return orders


def _with_p2p(slots: list[list[Action]], rank: int, pp: int, v: int, name: str = "1f1b") -> list[Action]:
    """Between two slots (runs of compute with no message in between), one batch: the sends of the
    slot before and the receives of the slot after. A handoff between two stages of the same rank
    (ZB-V's turn at the last rank) is no message: the executor passes the tensor on.

    Every schedule but one makes each compute action its own slot. Interleaved 1F1B pairs each
    steady-state F with the B after it, as Megatron does: both outputs are sent, and both next
    inputs received, in one batch. Without the pairing, the wrap-around from the last rank to rank 0
    closes a cycle of ranks each waiting on the next (`check` finds it)."""
    last = pp * v - 1

    def peer(s: int) -> int:  # the rank of stage s, or -1 when it is this rank or no stage
        r = place(name, pp, v, s)[0] if 0 <= s <= last else rank
        return -1 if r == rank else r

    out: list[Action] = []
    sends: list[Action] = []
    for slot in slots:
        recvs = []
        for a in slot:
            s = stage_of(name, pp, rank, a.chunk)
            src = peer(s - 1) if a.kind == "F" else peer(s + 1) if a.kind == "B" else -1
            if src >= 0:
                recvs.append(Action("RECV_F" if a.kind == "F" else "RECV_B", a.microbatch, a.chunk, src))
        out += sends + recvs + list(slot)
        sends = []
        for a in slot:
            s = stage_of(name, pp, rank, a.chunk)
            dst = peer(s + 1) if a.kind == "F" else peer(s - 1) if a.kind == "B" else -1
            if dst >= 0:
                sends.append(Action("SEND_F" if a.kind == "F" else "SEND_B", a.microbatch, a.chunk, dst))
    return out + sends


# ---------------------------------------------------------------------------------------------
# Checking
# ---------------------------------------------------------------------------------------------

class ScheduleError(AssertionError):
    """A schedule that breaks an invariant: a bug in the builder, never a user mistake."""


def message_key(sched: Schedule, rank: int, a: Action) -> tuple[str, int, int]:
    """Identify the tensor a SEND/RECV carries: (direction, micro-batch, producing stage)."""
    s = sched.stage(rank, a.chunk)
    return {"SEND_F": ("act", a.microbatch, s), "RECV_F": ("act", a.microbatch, s - 1),
            "SEND_B": ("grad", a.microbatch, s), "RECV_B": ("grad", a.microbatch, s + 1)}[a.kind]


def check(sched: Schedule) -> int:
    """Prove the schedule is well formed and cannot deadlock; return the number of rendezvous rounds.

    Checks: each (micro-batch, stage) has exactly one F and one B (and one W when split); on its
    rank F comes before B before W; every receive sits before the compute that consumes it and
    every send after the compute that produced it; sends and receives pair up one to one with the
    right peer; and executing the lists with *rendezvous* point-to-point semantics -- a batch of
    consecutive SEND/RECV actions completes only once every one of them has met its partner posted
    on the peer -- runs every rank to its end.
    """
    S, m = sched.n_stages, sched.microbatches
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "B")
    seen: dict[tuple[str, int, int], int] = {}
    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    for r, acts in enumerate(sched.ranks):
        pos: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(acts):
            if a.kind not in COMPUTE + COMM:
                raise ScheduleError(f"rank {r}: unknown action {a}")
            if not (0 <= a.microbatch < m and 0 <= a.chunk < sched.v):
                raise ScheduleError(f"rank {r}: action {a} out of range")
            s = sched.stage(r, a.chunk)
            if a.is_compute:
                if a.kind == "W" and not sched.split_backward:
                    raise ScheduleError(f"rank {r}: W in a schedule whose B computes weight gradients")
                key = (a.kind, a.microbatch, s)
                if key in seen:
                    raise ScheduleError(f"rank {r}: {a} appears twice")
                seen[key] = r
                pos[key] = i
                before = {"B": "F", "W": "B"}.get(a.kind)
                if before and (before, a.microbatch, s) not in pos:
                    raise ScheduleError(f"rank {r}: {a} before its {before}")
            else:
                k = message_key(sched, r, a)
                other = s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1
                expected_peer = sched.place(other)[0] if 0 <= other < S else -1
                if a.peer != expected_peer or a.peer == r:
                    raise ScheduleError(f"rank {r}: {a} talks to rank {a.peer}, expected {expected_peer}")
                book = sends if a.kind.startswith("SEND") else recvs
                if k in book:
                    raise ScheduleError(f"rank {r}: message {k} posted twice")
                book[k] = r
                if a.kind.startswith("SEND") and (("F" if a.kind == "SEND_F" else "B"), a.microbatch, s) not in pos:
                    raise ScheduleError(f"rank {r}: {a} before the compute that produces it")
        # every consumer has its input earlier in the same list: a receive, or where the producing
        # stage is on this rank too (ZB-V's turn), that stage's compute. Each receive's first place,
        # looked up: scanning the list before every compute was quadratic (pp 8 x 2000 micro-batches:
        # 100 s of a `plait schedule` that simulates in 2)
        first_recv: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(acts):
            if a.kind in ("RECV_F", "RECV_B"):
                first_recv.setdefault((a.kind, a.microbatch, a.chunk), i)
        for i, a in enumerate(acts):
            if a.kind in ("F", "B"):
                s = sched.stage(r, a.chunk)
                src = s - 1 if a.kind == "F" else s + 1
                if not 0 <= src < S:
                    continue
                if sched.place(src)[0] == r:
                    if pos.get((a.kind, a.microbatch, src), i) >= i:
                        raise ScheduleError(f"rank {r}: {a} before the {a.kind} of stage {src} it takes from")
                    continue
                need = ("RECV_F" if a.kind == "F" else "RECV_B")
                if first_recv.get((need, a.microbatch, a.chunk), i) >= i:
                    raise ScheduleError(f"rank {r}: {a} has no {need} before it")
    for kind in kinds:
        for mb in range(m):
            for s in range(S):
                if (kind, mb, s) not in seen:
                    raise ScheduleError(f"{kind}{mb} of stage {s} is missing")
                if seen[(kind, mb, s)] != sched.place(s)[0]:
                    raise ScheduleError(f"{kind}{mb} of stage {s} runs on the wrong rank")
    if set(sends) != set(recvs):
        raise ScheduleError(f"unpaired messages: {sorted(set(sends) ^ set(recvs))[:4]}")
    # NCCL pairs a rank's sends to a peer with that peer's receives from it in the order posted,
    # whatever they carry: both sides must list each link's messages in the same order
    links: dict[tuple[int, int, bool], list] = {}
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if not a.is_compute:
                out = a.kind.startswith("SEND")
                link = (r, a.peer) if out else (a.peer, r)
                links.setdefault((*link, out), []).append(message_key(sched, r, a))
    for (src, dst, out), keys in links.items():
        if out and links.get((src, dst, False)) != keys:
            raise ScheduleError(f"rank {src} sends to rank {dst} in another order than rank {dst} receives")
    return _rendezvous_rounds(sched)


def _items(sched: Schedule, rank: int) -> list[list[Action]]:
    """A rank's list cut into compute actions and batches of consecutive communication actions."""
    items: list[list[Action]] = []
    for a in sched.ranks[rank]:
        if not a.is_compute and items and not items[-1][0].is_compute:
            items[-1].append(a)
        else:
            items.append([a])
    return items


def _rendezvous_rounds(sched: Schedule) -> int:
    items = [_items(sched, r) for r in range(sched.pp)]
    ptr = [0] * sched.pp
    open_ops: list[dict] = [dict() for _ in range(sched.pp)]  # rank -> {message key: kind} still waiting
    rounds = 0
    while True:
        progressed = False
        # compute actions never wait: their inputs arrived through an earlier, completed batch
        for r in range(sched.pp):
            while ptr[r] < len(items[r]) and items[r][ptr[r]][0].is_compute:
                ptr[r] += 1
                progressed = True
            if ptr[r] < len(items[r]) and not open_ops[r]:
                open_ops[r] = {message_key(sched, r, a): a.kind for a in items[r][ptr[r]]}
        posted = {}
        for r in range(sched.pp):
            for k, kind in open_ops[r].items():
                posted[(k, kind.startswith("SEND"))] = r
        matched = [(r, k) for r in range(sched.pp) for k, kind in open_ops[r].items()
                   if (k, not kind.startswith("SEND")) in posted]
        for r, k in matched:
            del open_ops[r][k]
            progressed = True
        for r in range(sched.pp):
            if ptr[r] < len(items[r]) and not items[r][ptr[r]][0].is_compute and not open_ops[r]:
                ptr[r] += 1
        rounds += 1
        if all(ptr[r] == len(items[r]) for r in range(sched.pp)):
            return rounds
        if not progressed:
            stuck = "; ".join(f"rank {r} waits on {[str(a) for a in items[r][ptr[r]]]}"
                              for r in range(sched.pp) if ptr[r] < len(items[r]))
            raise ScheduleError(f"{sched.name} pp={sched.pp} m={sched.microbatches} v={sched.v} "
                                f"deadlocks: {stuck}")


def _running_peaks(acts, split: bool, w_fraction: float, chunk_weights=None) -> tuple[int, int, float, float]:
    """(peak held F->B, peak waiting B->W, peak of held + w_fraction * waiting, that level's peak as a
    W starts, its own inputs still held), counts in chunk-micro-batches; the last two weighted by
    `chunk_weights[chunk]` when given."""
    fb = bw = peak_fb = peak_bw = 0
    held = waiting = peak = at_w = 0.0
    for a in acts:
        w = chunk_weights[a.chunk] if chunk_weights is not None else 1.0
        if a.kind == "F":
            fb, held = fb + 1, held + w
        elif a.kind == "B":
            fb, held = fb - 1, held - w
            if split:
                bw, waiting = bw + 1, waiting + w
        else:
            at_w = max(at_w, held + w_fraction * waiting)
            bw, waiting = bw - 1, waiting - w
        peak_fb, peak_bw = max(peak_fb, fb), max(peak_bw, bw)
        peak = max(peak, held + w_fraction * waiting)
    return peak_fb, peak_bw, peak, at_w


def in_flight(sched: Schedule, rank: int) -> tuple[int, int]:
    """Peak, over the rank's list, of (chunk-micro-batches between F and B, between B and W).

    The first number is what 1F1B bounds (pp - rank) and GPipe does not (m): the activations a
    rank must hold. The second counts weight-gradient passes waiting (zero unless split)."""
    fb, bw, _, _ = _running_peaks(sched.compute_actions(rank), sched.split_backward, 0.0)
    return fb, bw


def peak_activation_units(name: str, pp: int, microbatches: int, v: int, rank: int,
                          w_fraction: float, costs: tuple | None = None, chunk_layers=None) -> float:
    """Peak of (held F->B) + w_fraction * (waiting B->W), in chunk-micro-batches of activations,
    or with `chunk_layers` (the rank's layers per chunk) in layer-micro-batches: ZB-V's chunks
    differ in size and it admits micro-batches by what they hold.

    A waiting W keeps its layers' inputs and output gradients, `w_fraction` of a full set."""
    return _units(name, pp, microbatches, v, rank, w_fraction, costs, chunk_layers)[0]


def units_as_w_starts(name: str, pp: int, microbatches: int, v: int, rank: int,
                      w_fraction: float, costs: tuple | None = None, chunk_layers=None) -> float:
    """`peak_activation_units`' level at its fullest as a W starts (0 where no W runs): what a W's
    own transient memory lands on."""
    return _units(name, pp, microbatches, v, rank, w_fraction, costs, chunk_layers)[1]


def _units(name, pp, microbatches, v, rank, w_fraction, costs, chunk_layers) -> tuple[float, float]:
    if check_args(name, pp, microbatches, v) == "gpipe":  # every forward before any backward, no W
        return float(microbatches), 0.0
    acts = compute_order(name, pp, microbatches, v, costs)[rank]
    peaks = _running_peaks(acts, check_args(name, pp, microbatches, v) in SPLIT_BACKWARD, w_fraction, chunk_layers)
    return peaks[2], peaks[3]
