"""ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the order of each rank's actions and
where its messages go. `plait.parallel.schedules` builds it; nothing else needs this file.

Two chunks per rank placed in a V (`schedules.stage_of`): chunk 0 of rank r is stage r, chunk 1
stage 2 pp - 1 - r. Rank 0 holds the first and the last stage, so the embedding and the output head
share a GPU, and the last rank turns a micro-batch from chunk 0 to chunk 1 without a message. The
backward is split as in ZB-H1: B the input gradient, W the weight gradient, deferred into idle time.

The order is found by list scheduling over the stages' relative costs (`costs`: per stage, its
(F, B, W) times; None = equal stages). A rank that becomes free runs a ready B (chunk 1 first: its
backward has the longer way still to go), else a ready F, else its oldest pending W - except
right after a B, when a ready F goes first (1F1B's alternation: a rank that drains several
backwards in a row lets the pipeline behind it run dry). Among forwards, chunk 1 first (it
finishes a micro-batch already inside the rank); a chunk-0 forward (a new micro-batch) only while
the activations the rank holds between F and W, plus room kept for the chunk-1 forward of it and of
each micro-batch still on its way back, stay within pp micro-batches of the heaviest rank's
chunks: the peak 1F1B has for the same split. A chunk-micro-batch counts its layers plus a tenth
for its input tensor (equal stages: 2 pp chunk-micro-batches a rank). So a rank whose chunks are
small, as rank 0's are when the head is heavy, admits more micro-batches, and none holds more than
the fullest GPU would. Keeping the room is what stops a rank from filling up with new
micro-batches while the ones it must finish cannot enter, which would deadlock.

The costs only *find* the order; the order is valid for any actual times (`schedules.check` proves
it). With equal stages on 4 ranks it idles 5.9% of the step at m = 8 (1F1B: 27.3%, ZB-H1: 11.1%).
Costs matter because the head makes the last stage several layers heavier than the others.
Measured on 4 x H200 (bench/README.md): 1.07x (1b) and 1.11x (8b) ZB-H1's tokens/s at m = 4, even
at m = 8, 0.96-0.97x at m = 32, where the activation bound holds new micro-batches back (with 1.5x
the bound the planner prices 1b at m = 32 even with ZB-H1). Where B takes twice F or more (full
recomputation, long sequences) the bound holds them back in the steady state too: at pp = 2,
m = 64, (F, B, W) = (1, 2, 1) this order idles 19.8% of the step, ZB-H1 0.8%. Not solved here:
the planner prices every schedule from its lists, so its search ranks ZB-H1 and interleaving
above it there.
"""

from __future__ import annotations

import functools

from plait.parallel.schedules import Action, place, stage_of


@functools.lru_cache(maxsize=512)
def zb_v_timed(pp: int, m: int, costs: tuple | None = None) -> tuple[tuple[tuple[float, float, Action], ...], ...]:
    """Per rank, its actions as (start, end, action) of the list-scheduling run."""
    S = 2 * pp
    stage = [[stage_of("zbv", pp, r, c) for c in (0, 1)] for r in range(pp)]
    # what a chunk-micro-batch between F and W holds, in layers' activations (+ its input tensor)
    weight = [[(costs[stage[r][c]][0] + 0.1) if costs else 1.0 for c in (0, 1)] for r in range(pp)]
    cap = pp * max(map(sum, weight))  # pp micro-batches of the heaviest rank's: 1F1B's peak for this split
    # zero-layer stages still take a moment, so the order stays causal
    took = [[{k: max(1e-9, costs[stage[r][c]]["FBW".index(k)] if costs else 1.0) for k in "FBW"} for c in (0, 1)]
            for r in range(pp)]

    f_end: dict[tuple[int, int], float] = {}  # (mb, stage) -> when its F ends
    b_end: dict[tuple[int, int], float] = {}  # ... its B
    never = float("inf")
    nxt_f, nxt_b = [[0, 0] for _ in range(pp)], [[0, 0] for _ in range(pp)]
    pend: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    live = [0.0] * pp  # activations between F and W, weighted
    free = [0.0] * pp
    orders: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    t, left = 0.0, 3 * m * S
    last_kind = [""] * pp

    def cand_b(r):
        for c in (1, 0):
            mb, s = nxt_b[r][c], stage[r][c]
            if mb < m and f_end.get((mb, s), never) <= t and (s == S - 1 or b_end.get((mb, s + 1), never) <= t):
                return Action("B", mb, c)

    def cand_f(r):
        w0, w1 = weight[r]
        for c in (1, 0):
            mb, s = nxt_f[r][c], stage[r][c]
            # this F, and room kept for the chunk-1 F of it and of every micro-batch on its way back
            room = c == 1 or live[r] + (nxt_f[r][0] - nxt_f[r][1] + 1) * w1 + w0 <= cap + 1e-9
            if mb < m and room and (s == 0 or f_end.get((mb, s - 1), never) <= t):
                return Action("F", mb, c)

    while left:
        for r in range(pp):
            if free[r] > t:
                continue
            act = (cand_f(r) or cand_b(r)) if last_kind[r] == "B" else (cand_b(r) or cand_f(r))
            if act is None and pend[r]:
                act = Action("W", *pend[r].pop(0))
            if act is None:
                continue
            last_kind[r] = act.kind
            if act.kind == "F":
                nxt_f[r][act.chunk] += 1
                live[r] += weight[r][act.chunk]
            elif act.kind == "B":
                nxt_b[r][act.chunk] += 1
                pend[r].append((act.microbatch, act.chunk))
            else:
                live[r] -= weight[r][act.chunk]
            end = t + took[r][act.chunk][act.kind]
            orders[r].append((t, end, act))
            if act.kind != "W":
                (f_end if act.kind == "F" else b_end)[(act.microbatch, stage[r][act.chunk])] = end
            free[r] = end
            left -= 1
        # the next event: a rank coming free (every action still running ends as its rank does)
        later = [x for x in free if x > t]
        if left and not later:
            raise AssertionError(f"ZB-V list scheduling stalled at pp={pp} m={m}")  # a bug, never input
        t = min(later) if later else t
    return tuple(tuple(o) for o in orders)


def zb_v_lists(pp: int, m: int, costs: tuple | None = None) -> list[list[Action]]:
    """Each rank's actions with their messages.

    Activations and gradients flow both ways between neighbours here, and 1F1B's placement (each
    receive just before its consumer, each send right after its producer) lets two neighbours each
    wait in a batch for a message the other posts only later (`schedules.check` finds it at pp = 2,
    m = 3). So every message is sent, and received, at the moment of the list-scheduling run that
    produced it, on both ranks: a rank posts it after the actions it started before then. A rank
    reaches a message's batch once its actions before that moment ran, whose inputs came in batches
    of earlier moments: by induction over the moments no batch waits on one that cannot come. In
    one moment: sends, then receives, each in message order, so NCCL pairs the same tensors."""
    timed = zb_v_timed(pp, m, costs)
    events: list[list[tuple]] = [[] for _ in range(pp)]  # (time, phase, order, action)
    for r, acts in enumerate(timed):
        for start, end, a in acts:
            events[r].append((start, 1, _order(a), a))
            s = stage_of("zbv", pp, r, a.chunk)
            dst = s + 1 if a.kind == "F" else s - 1 if a.kind == "B" else -1
            if not 0 <= dst < 2 * pp:
                continue
            peer, chunk = place("zbv", pp, 2, dst)
            if peer == r:
                continue  # the turn at the last rank: the executor hands the tensor over
            kind = "F" if a.kind == "F" else "B"
            snd = Action("SEND_" + kind, a.microbatch, a.chunk, peer)
            rcv = Action("RECV_" + kind, a.microbatch, chunk, r)
            events[r].append((end, 0, (0, *_order(snd)), snd))
            events[peer].append((end, 0, (1, *_order(rcv)), rcv))
    return [[e[3] for e in sorted(evs, key=lambda e: e[:3])] for evs in events]


def _order(a: Action) -> tuple:
    return a.kind, a.microbatch, a.chunk
