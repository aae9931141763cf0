"""`predict`: one layout on one cluster -> memory per GPU by component, traffic per mesh dimension,
step time, bubble and MFU. The search calls it for every candidate, `plait plan` prints it, and a
run can be compared with it (predicted vs measured peak memory and step time).

How a step is timed
  1. Each pipeline stage's F, B (and W for zb) per micro-batch: `stage_costs` (roofline math plus
     the TP, CP and ZeRO-3 communication that does not hide, and ZeRO-3's own casts and packs).
  2. The schedule's action lists -- the lists the executor runs -- are simulated with those
     durations and the pipeline link's point-to-point time: makespan and bubble.
  3. Gradient synchronisation as the engines run it (`_sync_s`): DDP's all-reduce and ZeRO-2's
     reduce-scatter overlap each rank's last backward, slowing its compute by the measured overlap
     cost; what sticks out, ZeRO-1's reduce-scatter, ZeRO-1/2's all-gather of the updated
     parameters and HSDP's all-reduce across replicas add to the step.
  4. The optimizer update is memory-bound: its bytes over HBM bandwidth.
Memory per GPU is the fullest pipeline rank's peak (`plait.planner.rank_memory`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from plait.parallel.rules import embedding_rows
from plait.parallel.schedules import SPLIT_BACKWARD, Action, build_schedule, place, stage_of
from plait.planner import costs, memory
from plait.planner.costs import ModelDims
from plait.planner.hardware import GIB, Cluster
from plait.planner.layout import Layout, check_layout
from plait.planner.memory import Precision
from plait.planner.rank_memory import held_layers, rank_memory
from plait.planner.simulate import simulate
from plait.planner.stage_costs import StageCosts, hide, stage_costs
from plait.planner.traffic import Collective, DimTraffic

MEMORY_PARTS = ("parameters", "gradients", "master_weights", "optimizer_states", "activations",
                "zero3_gather", "comm_buckets", "recompute_buffer", "cp_ring", "loss_chunk", "reserved")
TIME_PARTS = ("compute", "tp", "cp", "zero3", "bubble", "dp_sync", "optimizer", "host")


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    n_gpus: int
    microbatches: int
    tokens_per_step: int
    memory_bytes: dict[str, float]
    """Peak memory of the fullest GPU, by component (keys: MEMORY_PARTS)."""
    memory_rank: int
    """Pipeline rank of that GPU."""
    state_bytes: dict[str, float]
    """That GPU's model state at the optimizer step (parameters, gradients, master weights, optimizer
    states): what `plait plan --validate` counts in the run. At the peak ZeRO-3 may hold fewer
    gradients."""
    capacity_bytes: float
    """The GPU's memory as the driver reports it."""
    traffic: dict[str, DimTraffic]
    time_s: dict[str, float]
    """Step time by part (keys: TIME_PARTS), adding up to step_time_s: the busiest rank's work by
    kind, its idle time within the pipeline (bubble), then gradient sync and optimizer after it."""
    makespan_s: float
    bubble: float
    """Idle share of the pipeline ranks' time during the makespan (simulated)."""
    step_time_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    mfu: float
    hfu: float
    exact: bool = True
    """False when the pipeline was estimated in closed form instead of simulated (search screening)."""
    explain: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    masked_share: float = 0.0
    """Share of the model FLOPs a causal attention kernel does not run: the masked half of the
    T x T square that the MFU convention (PaLM's, torchtitan's) counts."""

    @property
    def memory_total_bytes(self) -> float:
        return sum(self.memory_bytes.values())

    @property
    def fits(self) -> bool:
        return self.memory_total_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> float:
        """Capacity minus use: negative when the layout does not fit."""
        return self.capacity_bytes - self.memory_total_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s


@functools.lru_cache(maxsize=256)
def schedule(name: str, pp: int, m: int, v: int, costs: tuple | None = None):
    """Schedules are immutable: build each shape once (`costs`: ZB-V's, `StageCosts.order_costs`)."""
    return build_schedule(name, pp, m, v, costs)


def estimate_makespan(name: str, pp: int, m: int, v: int, durs: tuple, p2p_s: float, costs: tuple | None = None):
    """Closed-form makespan for screening many layouts (the search then simulates the best).

    The slowest rank works m times its per-micro-batch time T; fill and drain add the other ranks'
    share once: sum(T) - max(T) for 1F1B and GPipe ((p - 1) T when even), 1/v of that when
    interleaved, and for ZB-H1 only F + B - W per rank (W fills the rest)."""
    per_rank = [sum(sum(durs[r * v + c]) for c in range(v)) for r in range(pp)]
    if name in SPLIT_BACKWARD:  # W fills the rest
        fills = [sum(durs[r * v + c][0] + durs[r * v + c][1] - durs[r * v + c][2] for c in range(v)) for r in range(pp)]
    else:
        fills = per_rank
    fill = (sum(fills) - max(fills)) / (v if name in ("interleaved", "zbv") else 1)
    makespan = m * max(per_rank) + fill + 2 * (pp - 1) * p2p_s
    return makespan, 1 - sum(per_rank) * m / (pp * makespan), tuple(makespan for _ in range(pp))


# Micro-batches per pipeline rank past which the simulation extrapolates (`simulate_makespan`)
SIMULATED_PER_RANK = 16


@functools.lru_cache(maxsize=4096)
def simulate_makespan(name: str, pp: int, m: int, v: int, durs: tuple, p2p_s: float, costs: tuple | None = None):
    """Simulate the schedule with per-(rank, chunk) durations: (makespan, bubble, end per rank).

    Past 2 x 16 pp micro-batches the schedule is in its steady state, where every further
    micro-batch adds the same time (the slowest rank's F + B + W): the makespan and each rank's end
    are simulated at 16 pp and 32 pp and extended along that line, since simulating every action
    of a global batch of tens of thousands of sequences took a search minutes per layout
    (tests/test_planner_predict.py checks the line against the full simulation)."""
    m1 = SIMULATED_PER_RANK * pp
    if m <= 2 * m1:
        return _simulated(name, pp, m, v, durs, p2p_s, costs)
    t1, _, e1 = _simulated(name, pp, m1, v, durs, p2p_s, costs)
    t2, _, e2 = _simulated(name, pp, 2 * m1, v, durs, p2p_s, costs)
    k = (m - 2 * m1) / m1
    makespan = t2 + k * (t2 - t1)
    busy = m * sum(sum(d) for d in durs)  # every rank's F, B and W of every micro-batch and chunk
    return makespan, 1 - busy / (pp * makespan), tuple(b + k * (b - a) for a, b in zip(e1, e2))


def _simulated(name: str, pp: int, m: int, v: int, durs: tuple, p2p_s: float, costs: tuple | None = None):
    table = {(r, c): durs[r * v + c] for r in range(pp) for c in range(v)}

    def dur(rank: int, a: Action) -> float:
        f, b, w = table[(rank, a.chunk)]
        return {"F": f, "B": b, "W": w}[a.kind]

    tl = simulate(schedule(name, pp, m, v, costs), dur, p2p_s)
    ends = [0.0] * pp
    for s in tl.spans:
        ends[s.rank] = max(ends[s.rank], s.end_s)
    return tl.makespan_s, tl.bubble_fraction, tuple(ends)


def _rows(d: ModelDims, lay: Layout, m: int, prec: Precision) -> tuple[float, Collective] | None:
    """DDP with the embedding as rows (`Layout.embedding_rows`, decided as the engine decides):
    (the dense parameters that leave the all-reduce - an untied embedding's -, the rows'
    all-gather: every rank's T token ids, int64, and T x dim gradients); None without."""
    tokens = lay.micro_batch * d.seq * m
    if lay.zero != 0 or max(lay.tp, lay.pp, lay.cp) > 1 or not embedding_rows(lay.embedding_rows, lay.grad_group,
                                                                              tokens, d.vocab, d.tie_embeddings):
        return None
    n = lay.grad_group
    gather = Collective("all_gather", n * tokens * (d.hidden * prec.wire_grad_bytes + 8), n, 1,
                        "embedding rows: token ids and their gradients")
    return (0.0 if d.tie_embeddings else d.vocab * d.hidden), gather


def _sync_s(lay: Layout, psi: float, last: float, m: int, prec: Precision,
            sc: StageCosts, rows: tuple[float, Collective] | None = None) -> tuple[tuple[tuple[str, float], ...], float]:
    """Gradient synchronisation of a rank holding `psi` parameters, as the engines run it: ((op,
    seconds alone) that can hide behind the backward, seconds after the backward). DDP all-reduces
    buckets as the backward frees them; ZeRO-2 reduce-scatters them so; ZeRO-1 reduce-scatters its
    whole buffer at the step; ZeRO-1/2 all-gather the updated parameters after it; HSDP all-reduces
    the shard across replicas at the step.

    `last` of the `psi` parameters get their gradients when the backward ends (the first stage's
    embedding, else one bucket): nothing is left to hide their reduction behind (4 x H100, 1b DDP:
    3.0 ms of all-reduce ran after the backward, the embedding's bucket). `rows` (`_rows`): the
    embedding goes as rows, all-gathered after the backward; the rest all hides behind it."""
    shard, hidden, after = lay.shard_group, (), 0.0
    last = min(last, psi)
    if rows is not None:
        dense_out, gather = rows
        psi, last = psi - dense_out, 0.0
        after += gather.time_s(sc.links["grad"][0])
    if lay.zero == 0 and lay.grad_group > 1 and not lay.grad_overlap:  # one all-reduce after the backward
        after += Collective("all_reduce", psi * prec.wire_grad_bytes, lay.grad_group, 1, "").time_s(sc.links["grad"][0])
    elif lay.zero == 0 and lay.grad_group > 1:
        link = sc.links["grad"][0]
        hidden = (("all_reduce", Collective("all_reduce", (psi - last) * prec.wire_grad_bytes, lay.grad_group, 1,
                                            "").time_s(link)),)
        after += Collective("all_reduce", last * prec.wire_grad_bytes, lay.grad_group, 1, "").time_s(link)
    elif lay.zero in (1, 2) and shard > 1:
        link = sc.links["shard"][0]
        if lay.zero == 2:
            # every micro-batch's buckets reduce-scatter; the last one's tail after its backward
            rs = Collective("reduce_scatter", psi * prec.wire_grad_bytes, shard, m, "").time_s(link)
            tail = Collective("reduce_scatter", last * prec.wire_grad_bytes, shard, 1, "").time_s(link)
            hidden, after = (("reduce_scatter", rs - tail),), after + tail
        else:
            after += Collective("reduce_scatter", psi * prec.wire_grad_bytes, shard, 1, "").time_s(link)
        after += Collective("all_gather", psi * prec.param_bytes, shard, 1, "").time_s(link)
    if lay.zero >= 1 and lay.dp_replicate > 1:
        after += Collective("all_reduce", psi / shard * prec.wire_grad_bytes, lay.dp_replicate, 1, "").time_s(
            sc.links["replicate"][0])
    return hidden, after


def _tied_sum(d: ModelDims, lay: Layout, prec: Precision) -> Collective | None:
    """The step's sum of a tied embedding's two copies, the first stage's embedding and the last
    stage's output matrix, over the `pp_ends` group (plait/parallel/engine.py): DDP and ZeRO-1 add
    the whole local gradient (`_sum_tied`), ZeRO-2/3 the data-parallel rank's reduced chunk of it
    (`_sum_tied_chunks`); after the backward, with nothing beside it. None where there is one
    copy: no pipeline, untied, or ZB-V, whose two ends are both on rank 0."""
    if lay.pp == 1 or not d.tie_embeddings or place(lay.schedule, lay.pp, lay.v, lay.pp * lay.v - 1)[0] == 0:
        return None
    _, embed_t, _ = costs.tp_share(d, lay.tp)
    if d.arch == "gpt":  # the word embedding alone is shared; the position table lives on the first stage only
        embed_t -= d.seq * d.hidden / lay.tp
    size = -(-embed_t // lay.shard_group) * prec.wire_grad_bytes if lay.zero >= 2 else embed_t * prec.grad_bytes
    return Collective("all_reduce", size, 2, 1, "tied embedding: the first and last stage's gradients added")


def _tp_ends(d: ModelDims, lay: Layout, prec: Precision, m: int) -> tuple[Collective, ...]:
    """TP traffic outside the layers (plait/parallel/tensor.py), on a pipeline's first rank:
    per micro-batch the vocab-parallel embedding leaves its region and the loss enters one (an
    all-reduce each, or with SP a reduce-scatter and an all-gather each), and the loss all-gathers
    every rank's logsumexp and target logit (2 fp32 per token); per step the gradients of
    replicated weights that are partial sums over tp (SP's norm gains, shared K/V heads) are
    all-reduced, on this rank's ZeRO shard of them."""
    tp, tokens = lay.tp, lay.micro_batch * d.seq // lay.cp
    act = tokens * d.hidden * prec.act_bytes
    n = 2 if lay.pp == 1 else 1  # a pipeline's first rank holds the embedding only
    ends = ((Collective("reduce_scatter", act, tp, n * m, "vocab-parallel embedding out, loss in (SP)"),
             Collective("all_gather", act, tp, n * m, "vocab-parallel embedding out, loss in (SP)"))
            if lay.seq_parallel else
            (Collective("all_reduce", act, tp, n * m, "vocab-parallel embedding out, loss in"),))
    if lay.pp == 1:
        ends += (Collective("all_gather", 2 * 4 * tokens * tp, tp, m, "vocab-parallel loss: logsumexp, target logit"),)
    partial = (2 * d.layers + 1) * d.hidden if lay.seq_parallel else 0
    if d.kv_heads < tp:
        partial += 2 * d.layers * d.head_dim * d.hidden * d.kv_heads
    if partial:
        shards = lay.shard_group if lay.zero >= 1 else 1
        ends += (Collective("all_reduce", partial * prec.grad_bytes / shards, tp, 1,
                            "partial gradients of replicated weights"),)
    return ends


_TP_BACKWARD = {  # the backward's collective for each forward one: the same bytes, the transposed op
    "all_gather": ("reduce_scatter", "SP backward: reduce-scatter of QKV's and w1/w3's input gradients"),
    "reduce_scatter": ("all_gather", "SP backward: all-gather of wo's and w2's output gradients"),
    "all_reduce": ("all_reduce", "backward: all-reduce of QKV's and w1/w3's input gradients")}


def _tp_backward(x: Collective) -> Collective:
    op, what = _TP_BACKWARD[x.op]
    return Collective(op, x.size_bytes, x.n, x.count, what)


def _traffic(d: ModelDims, lay: Layout, prec: Precision, sc: StageCosts, m: int) -> dict[str, DimTraffic]:
    """Per mesh dim, per step, what rank 0 of the pipeline sends (a middle stage for PP)."""
    out: dict[str, DimTraffic] = {}
    nl = sum(sc.layers[stage_of(lay.schedule, lay.pp, 0, ch)] for ch in range(lay.v))  # layers on pipeline rank 0
    shard, g, p = lay.shard_group, prec.wire_grad_bytes, prec.param_bytes
    if lay.tp > 1:
        replay = sc.tp_replay if lay.recompute == "full" else ()  # what a recomputed forward runs again
        out["tp"] = DimTraffic("tp", lay.tp, *sc.links["tp"], tuple(
            Collective(x.op, x.size_bytes, lay.tp, x.count * nl * m, x.what)
            for x in sc.tp_forward + tuple(map(_tp_backward, sc.tp_forward)) + replay) + _tp_ends(d, lay, prec, m))
    if lay.cp > 1 and lay.cp_impl == "ulysses":  # plait/parallel/ulysses.py: forward and backward
        from plait.planner.stage_costs import ulysses_all_to_alls

        out["cp"] = DimTraffic("cp", lay.cp, *sc.links["cp"], tuple(
            Collective(x.op, x.size_bytes, lay.cp, 2 * x.count * nl * m, x.what)
            for x in ulysses_all_to_alls(d, lay, prec.act_bytes)))
    elif lay.cp > 1:  # plait/parallel/context.py: the ring's K/V blocks and their fp32 dK/dV accumulators
        out["cp"] = DimTraffic("cp", lay.cp, *sc.links["cp"], (
            Collective("send_recv", sc.kv_chunk_bytes, lay.cp, 2 * (lay.cp - 1) * nl * m,
                       "ring: K/V blocks, forward and backward"),
            Collective("send_recv", sc.kv_chunk_bytes * 4 / prec.act_bytes, lay.cp, lay.cp * nl * m,
                       "ring: dK/dV accumulators (fp32), the last hop home")))
    if lay.pp > 1:
        out["pp"] = DimTraffic("pp", lay.pp, *sc.links["pp"], (Collective(
            "send_recv", sc.p2p_bytes, lay.pp, _stage_messages(lay) * m,
            "activation forward + gradient backward per micro-batch and chunk (the busiest rank)"),))
    tied = _tied_sum(d, lay, prec)
    if tied is not None:  # rank 0 is one of the two ends
        out["pp_ends"] = DimTraffic("pp_ends", 2, *sc.links["pp"], (tied,))
    psi = sc.rank_params[0]
    if lay.zero == 0 and lay.grad_group > 1:
        rows = _rows(d, lay, m, prec)
        dense_out, extra = (rows[0], (rows[1],)) if rows is not None else (0.0, ())
        # with cp the group is the mesh's flattened dp x cp (plait.parallel.dims): named so, keyed "dp"
        out["dp"] = DimTraffic("dp_cp" if lay.cp > 1 else "dp", lay.grad_group, *sc.links["grad"], (
            Collective("all_reduce", (psi - dense_out) * g, lay.grad_group, 1, "gradient all-reduce"),) + extra)
    if lay.zero >= 1 and shard > 1:
        if lay.zero == 3 and lay.pp > 1:
            # a pipeline stage gathers its units once a step and reduces their accumulated gradients
            # once (plait/parallel/fsdp.py, `keep`), not per micro-batch
            colls = (Collective("all_gather", psi * p, shard, 1, "parameter all-gather, once a step"),
                     Collective("reduce_scatter", psi * g, shard, 1, "gradient reduce-scatter, once a step"))
        elif lay.zero == 3:
            # every micro-batch: the blocks' linears gathered in forward and again in backward; the root
            # unit (embedding, norm gains) and the output matrix once, kept into backward or never read
            # there (plait/parallel/fsdp.py) - the textbook's 3P less their second gathers
            # one collective per block and pass, as they run (the count is what a reader sees, and
            # what latency is paid for)
            block = costs.block_linear_share(d, lay.tp)
            # an untied output matrix is a unit of its own, gathered (and reduced) apart from the root
            # (runs recorded while it lay in the root unit: `Layout.zero3_whole_root`)
            out_w = 0.0 if d.tie_embeddings or lay.zero3_whole_root else (
                -(-d.vocab // lay.tp) * d.hidden if d.arch == "llama" else d.vocab * d.hidden / lay.tp)
            root = psi - nl * block - out_w
            once = (Collective("all_gather", root * p, shard, m,
                               "all-gather of the root unit (embedding, norm gains), once a micro-batch"),)
            if out_w:
                once += (Collective("all_gather", out_w * p, shard, m, "all-gather of the output matrix, once a "
                                    "micro-batch"),)
            if lay.zero3_fp8_gather:  # the blocks' weights in FP8: a byte a parameter
                colls = (Collective("all_gather", block, shard, 2 * m * nl,
                                    "FP8 block all-gather, forward and backward"),) + once
            else:
                colls = (Collective("all_gather", block * p, shard, 2 * m * nl,
                                    "block all-gather, forward and backward"),) + once
            colls += (Collective("reduce_scatter", block * g, shard, m * nl, "blocks' gradient reduce-scatter"),
                      Collective("reduce_scatter", root * g, shard, m, "gradient reduce-scatter of the root unit"))
            if out_w:
                colls += (Collective("reduce_scatter", out_w * g, shard, m, "gradient reduce-scatter of the output "
                                     "matrix"),)
        else:
            colls = (Collective("reduce_scatter", psi * g, shard, m if lay.zero == 2 else 1, "gradient reduce-scatter"),
                     Collective("all_gather", psi * p, shard, 1, "updated-parameter all-gather"))
        out["dp_shard"] = DimTraffic("dp_shard_cp" if lay.cp > 1 else "dp_shard", shard, *sc.links["shard"], colls)
    if lay.zero >= 1 and lay.dp_replicate > 1:
        out["dp_replicate"] = DimTraffic("dp_replicate", lay.dp_replicate, *sc.links["replicate"], (
            Collective("all_reduce", psi / shard * g, lay.dp_replicate, 1, "all-reduce of the gradient shard"),))
    return out


def _stage_messages(lay: Layout) -> int:
    """Messages a pipeline rank sends per micro-batch, for the rank that sends most: each of its
    stages sends its activation on and its input's gradient back unless that neighbour stage is
    its own (ZB-V's turn) or there is none. A middle rank: 2v; at pp = 2 no rank is a middle one."""
    S = lay.pp * lay.v
    rank = [place(lay.schedule, lay.pp, lay.v, s)[0] for s in range(S)]
    return max(sum((s + 1 < S and rank[s + 1] != r) + (s > 0 and rank[s - 1] != r) for s in range(S) if rank[s] == r)
               for r in range(lay.pp))


def predict(d: ModelDims, lay: Layout, c: Cluster, global_batch: int,
            prec: Precision | str = "mixed", exact: bool = True) -> Prediction:
    """Memory, traffic and time of `lay` training `d` on `c` with `global_batch` sequences a step.

    `exact=False` replaces the schedule simulation by `estimate_makespan` (for screening)."""
    prec = memory.precision(prec) if isinstance(prec, str) else prec
    m = check_layout(d, lay, c, global_batch)
    pp, v = lay.pp, lay.v
    sched_name = lay.schedule if pp > 1 else "1f1b"
    sc = stage_costs(d, lay, c, prec, m)
    # one stage has no fill, drain or P2P: the closed form is exact there, and simulating every
    # micro-batch of a huge global batch took minutes (a million: 28 s, 1e8: hours)
    run = simulate_makespan if exact and pp > 1 else estimate_makespan
    makespan, bubble, ends = run(sched_name, pp, m, v, sc.durations, sc.p2p_s, sc.order_costs)

    # the step ends when the last rank has synchronised its gradients and updated its weights
    # the optimizer's update streams its state once: measured on a calibrated cluster
    hbm_s = c.profile.optimizer_gbps * 1e9 if c.profile is not None else c.gpu.hbm_gbps * 1e9 * c.hbm_efficiency
    step, dp_exposed, opt_s = 0.0, 0.0, 0.0
    tied = _tied_sum(d, lay, prec)
    tied_s = tied.time_s(sc.links["pp"][0]) if tied is not None else 0.0
    # the step's all-reduce of TP's partial gradients (SP's norm gains, shared K/V heads) after the
    # backward, each pipeline rank its layers' share
    partial = [x for x in (_tp_ends(d, lay, prec, m) if lay.tp > 1 else ()) if x.what.startswith("partial")]
    partial_s = sum(x.time_s(sc.links["tp"][0]) for x in partial)
    for r in range(pp):
        psi = sc.rank_params[r]
        last_bwd = sum(sc.durations[r * v + ch][1] + sc.durations[r * v + ch][2] for ch in range(v))
        hidden, after = _sync_s(lay, psi, sc.last_params[r], m, prec, sc, _rows(d, lay, m, prec) if r == 0 else None)
        after += tied_s if r in (0, pp - 1) else 0.0
        after += partial_s * sum(sc.layers[stage_of(lay.schedule, pp, r, ch)] for ch in range(v)) / d.layers
        room = last_bwd * (m if lay.zero == 2 else 1)
        exposed = sum(hide(hidden, room, c, lay.grad_group if lay.zero == 0 else lay.shard_group)) + after
        local = psi / (lay.shard_group if lay.zero >= 1 else 1)
        # read grad + param, read and write master and moments, write param
        opt = local * (prec.grad_bytes + 2 * prec.k + 2 * prec.param_bytes) / hbm_s
        if ends[r] + exposed + opt > step:
            step, dp_exposed, opt_s = ends[r] + exposed + opt, exposed, opt

    # time by part, on the busiest rank (the pipeline's bottleneck): its work split by kind, its idle
    # time until the pipeline ends = bubble (fill, drain, imbalance), then the tail after the pipeline
    b_rank = max(range(pp), key=lambda r: sc.rank_busy_s(r, v))
    busy = sc.rank_busy_s(b_rank, v) * m
    nl = sum(sc.layers[stage_of(lay.schedule, pp, b_rank, ch)] for ch in range(v))
    parts = {k: sc.layer[k] * nl * m for k in ("compute", "tp", "cp", "zero3")}
    parts["zero3"] += sc.root_zero3_s * m if b_rank == 0 else 0.0
    parts["tp"] += sc.tp_ends_s[b_rank] * m if sc.tp_ends_s else 0.0
    parts["compute"] += busy - sum(parts.values())  # the output head, the embedding's share
    tail = max(0.0, step - makespan)
    # what the host leaves idle once a step (its syncs at the step's ends, its launches): measured
    # on this card's plait step by `plait bench calibrate` (plait/benchmarks/step_gaps.py)
    gap = c.profile.step_gap_s if c.profile is not None else 0.0
    step += gap
    time_s = {**parts, "bubble": max(0.0, makespan - busy), "dp_sync": tail - min(opt_s, tail),
              "optimizer": min(opt_s, tail), "host": gap}

    mem_rank, mem, state = rank_memory(d, lay, c, prec, sc, sched_name, m, exact)
    traffic = _traffic(d, lay, prec, sc, m)

    tokens_step = global_batch * d.seq
    model_flops = costs.model_flops_per_token(d) * tokens_step
    # plait's fused attention already recomputes its scores: "selective" adds no work to Llama
    hw_rc = "none" if (d.arch == "llama" and lay.recompute == "selective") else lay.recompute
    hw_flops = (costs.hardware_flops_per_token(d, hw_rc)
                + 2 * lay.recompute_matmuls * d.layers * costs.layer_params(d)) * tokens_step
    peak = c.peak_flops
    mfu = model_flops / (step * c.n_gpus * peak)
    hfu = hw_flops / (step * c.n_gpus * peak)
    explain = _explain(d, lay, c, prec, global_batch, m, sc, mem_rank, sched_name, makespan, bubble,
                       dp_exposed, opt_s, step, model_flops, mfu, traffic, mem) if exact else ()
    masked = d.layers * costs.attention_flops_per_token(d, causal=True) * 3 / costs.model_flops_per_token(d)
    return Prediction(lay, c.n_gpus, m, tokens_step, mem, mem_rank, state, c.gpu.hbm_gib * GIB, traffic, time_s,
                      makespan, bubble, step, model_flops, hw_flops, mfu, hfu, exact, explain, masked)


def _peak_state(mem: dict, params: float) -> float:
    """Model state bytes a parameter at the fullest rank's activation peak (the memory table's)."""
    return sum(mem.get(k, 0.0) for k in ("parameters", "gradients", "master_weights", "optimizer_states")) / params


def _peak_grads(lay: Layout, m: int) -> str:
    """Why the peak's gradients differ from the update's (`rank_memory`)."""
    if lay.zero == 3 and lay.shard_group > 1 and lay.pp == 1:
        return "ZeRO-3's gradient shards exist from the second micro-batch's backward" if m == 1 else \
            "ZeRO-3's gradient shards from the first micro-batch's backward on"
    if lay.n_gpus == 1 or (lay.grad_group == 1 and lay.zero == 0):
        return "one device's gradient pieces come with the backward" if m == 1 and not lay.grads_whole else \
            "the gradient pieces stay from the first backward to the update"
    return "the gradient buffer is held through the step"


def _explain(d, lay, c, prec, gb, m, sc, mem_rank, sched_name, makespan, bubble, dp_exposed, opt_s,
             step, model_flops, mfu, traffic, mem) -> tuple[tuple[str, str], ...]:
    """Each quantity with the formula and the numbers that produced it (`plait plan --explain`)."""
    pp, v, cp, b, tp = lay.pp, lay.v, lay.cp, lay.micro_batch, lay.tp
    per_layer = memory.layer_activation_bytes(d, d.seq // cp, b, tp, lay.seq_parallel, lay.recompute,
                                              prec.act_bytes, lay.compile, cp, lay.cp_impl == "ulysses", lay.fp8)
    units, held = held_layers(sched_name, pp, m, v, mem_rank, memory.wgrad_fraction(d), sc)
    ex = [
        ("parameters", f"N = {costs.param_count(d):,}; in matmuls N' = {costs.matmul_params(d):,}"),
        ("model FLOPs/token", f"6N' + 12LHQT = 6 x {costs.matmul_params(d):.4g} + 12 x {d.layers} x {d.heads} x "
                              f"{d.head_dim} x {d.seq} = {costs.model_flops_per_token(d):.4g}"),
        ("micro-batches", f"M = B / (dp x b) = {gb} / ({lay.dp} x {b}) = {m}"),
        ("state bytes/param", f"{prec.name}: param {prec.param_bytes:g} + grad {prec.grad_bytes:g} + K {prec.k:g} "
                              f"(master {prec.master_bytes:g} + moments {prec.optim_bytes:g}); ZeRO-{lay.zero} over "
                              f"N_d = {lay.shard_group} -> {memory.bytes_per_param(lay.zero, lay.shard_group, prec, True):.4g}"
                              f" B/param x {sc.rank_params[mem_rank]:.4g} params on pipeline rank {mem_rank} at the "
                              f"update; " + (
                                  "the table's moment is the update's (its state outweighs the activation peak)"
                                  if mem.get("activations") == 0.0 else
                                  f"at the activation peak {_peak_state(mem, sc.rank_params[mem_rank]):.4g} B/param"
                                  f" (the table's: {_peak_grads(lay, m)})")),
        ("activations", f"{d.arch} per layer (s = {d.seq // cp}, b = {b}, t = {tp}, sp = {lay.seq_parallel}, "
                        f"recompute = {lay.recompute}) = {per_layer / 2**20:.1f} MiB x {held:.3g} layers' worth: "
                        f"{units:.3g} micro-batch chunks in flight of up to "
                        f"{max(sc.layers[stage_of(sched_name, pp, mem_rank, ch)] for ch in range(v))} layers "
                        f"({sched_name} schedule, rank {mem_rank})"),
        ("layer time", f"per micro-batch: math {sc.layer['compute'] * 1e3:.3f} ms + TP "
                       f"{sc.layer['tp'] * 1e3:.3f} ms + CP {sc.layer['cp'] * 1e3:.3f} ms + ZeRO-3 "
                       f"{sc.layer['zero3'] * 1e3:.3f} ms (F + B; ZeRO-3: its transfers' exposed part and cost to the compute beside "
                       f"them, and its casts and gradient packs; " + (
                           f"matmuls and attention as measured on {c.profile.card}, memory-bound kernels at "
                           f"{c.profile.pointwise_gbps:.0f} GB/s)" if c.profile is not None else
                           f"roofline: peak {c.peak_flops / 1e12:.0f} TFLOP/s x {c.matmul_efficiency:g}, HBM "
                           f"{c.gpu.hbm_gbps:g} GB/s x {c.hbm_efficiency:g})") + (
                           f"; x {sc.lockstep:.3f}: {c.n_gpus} GPUs in lockstep, each waiting for the "
                           f"slowest at every collective (" + (
                               "measured" if str(c.n_gpus) in c.profile.lockstep.get("groups", {}) else
                               "the measured spread times the expected maximum of that many") + ")"
                           if sc.lockstep != 1.0 else "")),
        ("pipeline", f"{sched_name} pp = {pp}, m = {m}, v = {v}: makespan {makespan * 1e3:.2f} ms, bubble "
                     f"{bubble:.2%} of all ranks' time as simulated (these stages and P2P times); " + (
                         f"the textbook (p-1)/(v m + p-1) for even stages and free P2P would be "
                         f"{(pp - 1) / (v * m + pp - 1):.2%}" if sched_name not in SPLIT_BACKWARD else
                         "a zero-bubble schedule has no closed form: W fills what the stages leave")),
        ("step time", f"makespan + exposed gradient sync {dp_exposed * 1e3:.2f} ms + optimizer "
                      f"{opt_s * 1e3:.2f} ms + host gaps {(c.profile.step_gap_s if c.profile else 0.0) * 1e3:.2f} ms"
                      f" = {step * 1e3:.2f} ms"),
        ("MFU", f"{model_flops:.4g} FLOP / ({step:.4g} s x {c.n_gpus} GPUs x {c.peak_flops:.4g} FLOP/s) "
                f"= {mfu:.2%}"),
    ]
    for t in traffic.values():
        ex.append((f"traffic {t.dim}", "; ".join(
            f"{x.count:g} x {x.op}({x.size_bytes / 2**20:.1f} MiB over {x.n}) = {x.bytes_per_device / 1e9:.3f} GB"
            for x in t.collectives) + f" per device on {t.link.name} ({t.link.bytes_per_s / 1e9:g} GB/s): "
            f"{t.time_s * 1e3:.2f} ms if nothing overlapped"))
    return tuple(ex)
