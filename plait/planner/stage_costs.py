"""What one micro-batch costs each pipeline stage of a layout: seconds of F, B and W, and what
those seconds are made of (math, tensor-parallel collectives, context-parallel ring, ZeRO-3
gathers), plus the parameters each pipeline rank holds and the links each mesh dim crosses.

Overlap rules (why some communication adds to a stage and some does not):
  TP collectives sit between dependent matmuls: on the critical path, added in full.
  CP's ring passes K/V blocks while the attention of the block already held runs: only what
    exceeds the attention compute is exposed.
  ZeRO-3 prefetches the next layer's parameters during this layer: only what exceeds the layer's
    compute is exposed (gather forward; gather + reduce-scatter backward). An untied output matrix
    (its own unit) is gathered during the last layer's forward and reduce-scattered beside the
    backward; the root unit's transfers at the micro-batch's ends have nothing beside them.
    ZeRO-3's own passes over the weights (the cast before each gather, the gradients' pack, the
    chunk's add) run on the compute stream: they add in full, and the transfers hide behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner import costs, roofline
from plait.planner.costs import ModelDims
from plait.planner.hardware import Cluster, Link
from plait.planner.layout import Layout, stage_layers
from plait.planner.memory import Precision
from plait.planner.placement import nodes_spanned
from plait.planner.traffic import Collective
from plait.parallel.schedules import SPLIT_BACKWARD, place, stage_of
from plait.parallel.stages import stage_work


BUCKET_BYTES = 25 * (1 << 20)  # plait's default gradient bucket (parallel.bucket_mb)


@dataclass(frozen=True)
class StageCosts:
    layers: tuple[int, ...]
    """Layers of each stage (pp * v of them)."""
    durations: tuple[tuple[float, float, float], ...]
    """(F, B, W) seconds per (rank, chunk), index rank * v + chunk; W = 0 unless split."""
    layer: dict
    """Seconds per layer per micro-batch by part: compute, tp, cp, zero3, recompute (F + B)."""
    rank_params: tuple[float, ...]
    """Parameters held by each pipeline rank (after TP)."""
    root_params: tuple[float, ...]
    """Of those, what is not in a block (ZeRO-3's root unit, and its head unit when the output is
    untied): embedding, output, norms."""
    tp_forward: tuple[Collective, ...]
    """TP collectives of one layer's forward."""
    tp_replay: tuple[Collective, ...]
    """TP collectives a full recomputation runs again in one layer's backward."""
    kv_chunk_bytes: float
    """K and V of one micro-batch's sequence slice on one GPU (what CP's ring passes)."""
    p2p_bytes: float
    p2p_s: float
    links: dict[str, tuple[Link, bool]]
    """Per group name: (link, crosses nodes)."""
    last_params: tuple[float, ...] = ()
    """Parameters of each pipeline rank whose gradients come last in its backward: the embedding on
    rank 0, one gradient bucket elsewhere. Their reduction cannot hide behind the backward."""
    root_zero3_s: float = 0.0
    """ZeRO-3's transfers exposed at a micro-batch's ends (the root unit's and the first and last
    blocks' gathers and reduce-scatters; what the head unit's leave), on rank 0, without a pipeline."""
    tp_ends_s: tuple[float, ...] = ()
    """Per pipeline rank, a micro-batch's TP collectives outside the layers (the vocab-parallel
    embedding's and loss's regions, the loss's logsumexp gather): exposed, in its durations."""
    lockstep: float = 1.0
    """How much longer the job's GPUs take for their work than one alone, each waiting for the
    slowest at every collective (measured: `HardwareProfile.lockstep_slowdown`); in the durations."""
    order_costs: tuple | None = None
    """ZB-V: the stages' relative costs its order is found with, as the executor finds it
    (`plait.parallel.stages.stage_work`); None for every other schedule."""

    def rank_busy_s(self, rank: int, v: int) -> float:
        return sum(sum(self.durations[rank * v + c]) for c in range(v))


def overlap_cost(c: Cluster, op: str, n: int = 2) -> float:
    """Extra compute seconds per second of `op` over `n` GPUs hidden behind compute (measured; 0
    without a profile)."""
    return c.profile.overlap_slowdown(op, n) if c.profile is not None else 0.0


def _stretch(c: Cluster, op: str, n: int = 2) -> float:
    """How many times slower `op` over `n` GPUs runs beside compute than alone (measured; 1 without
    a profile)."""
    return c.profile.overlap_stretch(op, n) if c.profile is not None else 1.0


def hide(parts: tuple[tuple[str, float], ...], window_s: float, c: Cluster, n: int = 2) -> tuple[float, float]:
    """Collectives (op, seconds alone) over a group of `n` GPUs issued beside `window_s` seconds of
    compute: (seconds left to run after the compute, extra compute seconds). Beside compute a
    collective runs its measured stretch times slower, so the window hides window / stretch of its
    time alone, and the compute beside it is slowed by the op's overlap cost for as long as it runs."""
    total = sum(t for _, t in parts)
    if total <= 0.0:
        return 0.0, 0.0
    stretch = {op: _stretch(c, op, n) for op, _ in parts}
    beside_s = sum(t * stretch[op] for op, t in parts)  # how long all of it would run beside compute
    share = min(1.0, window_s / beside_s)  # of each collective, what runs while the compute does
    slowdown = sum(overlap_cost(c, op, n) * t * stretch[op] for op, t in parts) * share
    return total * (1.0 - share), slowdown


def room_left(parts: tuple[tuple[str, float], ...], window_s: float, c: Cluster, n: int = 2) -> float:
    """Seconds of a `window_s` compute window during which the link is free once `parts` (as in
    `hide`) have run beside it: what another collective issued beside the same compute can use."""
    return max(0.0, window_s - sum(t * _stretch(c, op, n) for op, t in parts))


def split_layers(d: ModelDims, stages: int, split: str, schedule: str = "1f1b") -> list[int]:
    """Layers of each stage as the runtime splits them (plait/parallel/stages.py)."""
    from plait.parallel.stages import flops_balanced, parse_counts

    if split.strip() == "balance":
        return flops_balanced(d, stages, schedule)
    return parse_counts(split, d.layers, stages, "--stage-layers") or stage_layers(d.layers, stages)


def ulysses_all_to_alls(d: ModelDims, lay: Layout, e: float) -> tuple[Collective, ...]:
    """One layer's forward all-to-alls under Ulysses (plait/parallel/ulysses.py), per micro-batch on
    one rank: q, k and v out in one call (key/value heads repeated up to cp when fewer) and the
    output back; the backward runs the same two on the gradients."""
    from plait.parallel.ulysses import kv_repeats

    tokens = lay.micro_batch * d.seq // lay.cp
    q_heads, kv_heads = d.heads // lay.tp, max(1, d.kv_heads // lay.tp)
    kv_sent = kv_heads * kv_repeats(kv_heads, lay.cp)
    q = tokens * q_heads * d.head_dim * e
    kv = tokens * kv_sent * d.head_dim * e
    return (Collective("all_to_all", q + 2 * kv, lay.cp, 1, "Ulysses: queries, keys and values out"),
            Collective("all_to_all", q, lay.cp, 1, "Ulysses: output back"))


GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "shard": ("dp_shard", "cp"),
          "grad": ("dp_replicate", "dp_shard", "cp"), "replicate": ("dp_replicate",)}


def _zero3_ends(d: ModelDims, lay: Layout, c: Cluster, prec: Precision, link: Link, root: float, n_layers: int,
                lt: roofline.LayerTimes, block_ag: float, block_rs: float, m: int) -> tuple[float, float]:
    """Seconds ZeRO-3 without a pipeline adds to a micro-batch's forward and backward beyond its
    layers': the root unit's (`root` parameters, the head's among them) and the first and last
    blocks' transfers, exposed; an untied output matrix's, a unit of its own, beside compute: its
    gather is prefetched by the last layer, the only forward layer with no block transfer beside
    it, and its gradient is the backward's first, reduce-scattered beside what the layers' own
    transfers leave free of the link. Runs recorded while it was in the root (`zero3_whole_root`)
    gathered and reduced it with the root."""
    head = 0.0 if lay.zero3_whole_root else costs.output_share(d, lay.tp)

    def moved(op: str, params: float, per: float) -> float:
        return Collective(op, params * per, lay.shard_group, 1, "").time_s(link)

    f = moved("all_gather", root - head, prec.param_bytes) + block_ag
    b = block_ag + block_rs + moved("reduce_scatter", root - head, prec.wire_grad_bytes)
    # their passes (zero3_passes): the root is gathered once a micro-batch and kept through its
    # backward; the head's gradient is reduced as autograd made it, without a pack
    r_cast, r_pack, r_add = zero3_passes(root - head, lay.shard_group, prec, m, 1, lay.zero3_cast_once)
    h_cast, _, h_add = zero3_passes(head, lay.shard_group, prec, m, 1, lay.zero3_cast_once)
    f += roofline.kernel_time_s(0.0, r_cast + h_cast, c)
    b += roofline.kernel_time_s(0.0, r_pack + r_add + h_add, c)
    if head:
        n = lay.shard_group
        f += sum(hide((("all_gather", moved("all_gather", head, prec.param_bytes)),), lt.forward_s, c, n))
        room = n_layers * room_left((("all_gather", block_ag), ("reduce_scatter", block_rs)), lt.backward_s, c, n)
        b += sum(hide((("reduce_scatter", moved("reduce_scatter", head, prec.wire_grad_bytes)),), room, c, n))
    return f, b


def zero3_passes(params: float, shard: int, prec: Precision, m: int, gathers: int = 1,
                 cast_once: bool = False, fp8_gather: bool = False) -> tuple[float, float, float]:
    """HBM bytes plait's ZeRO-3 moves on the compute stream for a unit of `params` parameters
    (plait/parallel/gather.py, fsdp.py), per micro-batch of the `m` a GPU runs a step: (cast, pack,
    add). cast: each gather first casts this rank's fp32 master chunk to the wire's 16 bits (read 4,
    write 2 a parameter of the chunk), for the `gathers` a unit makes a micro-batch; kept from the
    step's first gather on (`cast_once`), once a step. pack: backward copies the unit's gradients
    into the reduce-scatter's buffer (read and write each). add: from the step's second micro-batch
    on, the reduced chunk is added into the step's (read two, write one), averaged over the m.
    `fp8_gather` (plait/parallel/fp8_gather.py): each gather quantizes the chunk to one byte instead
    (read 4, write 1), after one pass a step that finds its weights' maxima (read 4)."""
    chunk = params / shard
    per = 1 / m if cast_once else gathers
    if fp8_gather:
        cast = chunk * (prec.master_bytes + 1) * per + chunk * prec.master_bytes / m
    else:
        cast = chunk * (prec.master_bytes + prec.param_bytes) * per
    return cast, 2 * params * prec.wire_grad_bytes, 3 * chunk * prec.wire_grad_bytes * (m - 1) / m


def stage_costs(d: ModelDims, lay: Layout, c: Cluster, prec: Precision, m: int = 1) -> StageCosts:
    """`m`: micro-batches a GPU runs a step (what ZeRO-3's per-micro-batch passes average over)."""
    tp, pp, v, cp, b = lay.tp, lay.pp, lay.v, lay.cp, lay.micro_batch
    sp, e = lay.seq_parallel, prec.act_bytes
    S = pp * v
    layers = split_layers(d, S, lay.stage_split, lay.schedule)
    rank_of = [place(lay.schedule, pp, v, st)[0] for st in range(S)]
    tokens = b * d.seq // cp  # tokens of one micro-batch on one GPU
    sizes = lay.sizes()
    links = {}
    for name, dims in GROUPS.items():
        crosses = nodes_spanned(dims, sizes, c.gpus_per_node) > 1
        links[name] = (c.inter if crosses else c.intra, crosses)

    # parameters per pipeline rank: layers; the embedding on rank 0; the head on the last stage's
    # rank, which also keeps its own copy of a tied embedding matrix when the two ends are different
    # ranks (ZB-V holds both on rank 0: one matrix)
    block_t, embed_t, head_t = costs.tp_share(d, tp)  # per tensor-parallel rank
    head_rank = rank_of[S - 1]
    tied_copy = embed_t if (d.tie_embeddings and head_rank != 0) else 0
    rank_params, root_params, last_params = [], [], []
    for r in range(pp):
        root = (embed_t if r == 0 else 0) + ((head_t + tied_copy) if r == head_rank else 0)
        root_params.append(root)
        rank_params.append(sum(layers[stage_of(lay.schedule, pp, r, ch)] for ch in range(v)) * block_t + root)
        last_params.append(min(rank_params[-1], embed_t if r == 0 else BUCKET_BYTES / prec.wire_grad_bytes))

    fp8_gather = lay.zero3_fp8_gather and lay.zero == 3 and lay.shard_group > 1
    lt = roofline.layer_times(d, tokens, c, tp, lay.fp8, fp8_gather, sp)
    head_f, head_b = roofline.head_times(d, tokens, c, tp, sp, eager=lay.eager_head,
                                         eager_norm=not lay.compile)
    head_wgrad = roofline.linear_time_s("wgrad", tokens, d.hidden, -(-d.vocab // tp), c)  # within head_b
    act = tokens * d.hidden * e  # one (b, s/cp, h) activation, bytes
    tp_link = links["tp"][0]
    # A full recomputation replays a layer's forward only up to the last tensor backward needs
    # (plait's non-reentrant checkpoint stops early): everything but the MLP's exit collective.
    if tp == 1:
        tp_fwd: tuple[Collective, ...] = ()
        tp_replay: tuple[Collective, ...] = ()
    elif sp:
        tp_fwd = (Collective("all_gather", act, tp, 2, "SP all-gather before QKV and w1/w3"),
                  Collective("reduce_scatter", act, tp, 2, "SP reduce-scatter after wo and w2"))
        tp_replay = (Collective("all_gather", act, tp, 2, "recomputed SP all-gathers"),
                     Collective("reduce_scatter", act, tp, 1, "recomputed SP reduce-scatter after wo"))
    else:
        tp_fwd = (Collective("all_reduce", act, tp, 2, "all-reduce after wo and w2"),)
        tp_replay = (Collective("all_reduce", act, tp, 1, "recomputed all-reduce after wo"),)
    if lay.recompute_whole:  # a reentrant checkpoint runs the layer's forward to its end
        tp_replay = tp_fwd
    tp_s = sum(x.time_s(tp_link) for x in tp_fwd)  # forward; the backward mirrors it
    replay_s = sum(x.time_s(tp_link) for x in tp_replay) if lay.recompute == "full" else 0.0

    kv_chunk = 2 * tokens * d.kv_dim / tp * e
    cp_a2a = ulysses_all_to_alls(d, lay, e) if cp > 1 and lay.cp_impl == "ulysses" else ()
    if cp_a2a:  # the all-to-alls sit between the projections and attention: nothing hides them
        cp_f = cp_b = sum(x.time_s(links["cp"][0]) for x in cp_a2a)
    else:
        cp_s = Collective("send_recv", kv_chunk, cp, cp - 1, "").time_s(links["cp"][0]) if cp > 1 else 0.0
        cp_f = sum(hide((("send_recv", cp_s),), lt.attention_forward_s, c, cp))
        # backward: the K/V blocks again, and the dK/dV accumulators (fp32) beside them, which travel one
        # hop further, home (plait/parallel/context.py; the traffic table counts the same bytes)
        dkv_s = Collective("send_recv", kv_chunk * 4 / e, cp, cp, "").time_s(links["cp"][0]) if cp > 1 else 0.0
        cp_b = sum(hide((("send_recv", cp_s + dkv_s),), 2.5 * lt.attention_forward_s, c, cp))
        if cp > 1:  # the ring's own element-wise work: merges, accumulators, copies (plait/parallel/context.py)
            from plait.parallel.context import bookkeeping_bytes

            q_elems, kv_elems = (tokens * heads * d.head_dim for heads in (d.heads / tp, max(1, d.kv_heads // tp)))
            bk_f, bk_b = bookkeeping_bytes(q_elems, kv_elems, cp, e)
            cp_f += roofline.kernel_time_s(0.0, bk_f, c)
            cp_b += roofline.kernel_time_s(0.0, bk_b, c)

    shard = lay.shard_group
    z3_f = z3_b = 0.0
    if lay.zero == 3 and shard > 1:
        link = links["shard"][0]
        # the FP8 gather: a byte a parameter of the block's linears
        lin = costs.block_linear_share(d, tp) if fp8_gather else 0.0
        ag = Collective("all_gather", lin + (block_t - lin) * prec.param_bytes, shard, 1, "").time_s(link)
        rs = Collective("reduce_scatter", block_t * prec.wire_grad_bytes, shard, 1, "").time_s(link)
        # what does not hide, plus what hiding costs the compute beside it
        # the passes run on the compute stream: they add to it, and the transfers hide behind them too
        # (a pipeline stage keeps its units gathered over the step: no passes per micro-batch)
        # a block is gathered twice a micro-batch (forward, backward): its casts split between them
        cast, pack, add = zero3_passes(block_t, shard, prec, m, 2, lay.zero3_cast_once, fp8_gather) if pp == 1 \
            else (0.0,) * 3
        pf, pb = roofline.kernel_time_s(0.0, cast / 2, c), roofline.kernel_time_s(0.0, cast / 2 + pack + add, c)
        z3_f = pf + sum(hide((("all_gather", ag),), lt.forward_s + pf, c, shard))
        z3_b = pb + sum(hide((("all_gather", ag), ("reduce_scatter", rs)), lt.backward_s + pb, c, shard))
    # ZeRO-3 without a pipeline, at the ends of each micro-batch where no compute runs beside the
    # transfer (plait/parallel/fsdp.py): the forward begins by gathering the root unit (embedding,
    # norms) and then the first block; the backward begins by gathering the last block (the fused
    # loss left nothing to do before it); it ends with the first block's and the root's
    # reduce-scatters, which the next forward waits for. All exposed, once per micro-batch.
    root_f = root_b = 0.0
    if lay.zero == 3 and shard > 1 and pp == 1:
        root_f, root_b = _zero3_ends(d, lay, c, prec, links["shard"][0], root_params[0], layers[0], lt, ag, rs, m)

    # recomputation runs inside the backward: full = the forward again (with the TP collectives it
    # replays); selective = GPT's attention core (Korthikanti et al.), or for plait's Llama, whose
    # fused attention keeps no scores, the norms, RoPE and SwiGLU (plait/parallel/recompute.py):
    # memory-bound kernels, no matmul and no collective
    if lay.recompute == "full":
        rc = lt.forward_s + replay_s
    elif lay.recompute == "selective":
        rc = lt.attention_forward_s if d.arch == "gpt" else lt.pointwise_forward_s
    else:
        rc = 0.0
    # a checkpoint policy that also recomputes some matmuls (another system's: Layout.recompute_matmuls)
    rc += lay.recompute_matmuls * (lt.forward_s - lt.attention_forward_s - lt.pointwise_forward_s)
    # TP at the model's ends (plait/parallel/tensor.py; the traffic table's `_tp_ends`): the embedding
    # leaves its vocab-parallel region in the forward (an all-reduce; SP: a reduce-scatter, and an
    # all-gather in the backward), the loss enters one where the head runs (SP: an all-gather and a
    # reduce-scatter; else the backward's all-reduce) and gathers each rank's logsumexp and target
    # logit. Nothing runs beside them: they begin and end the micro-batch's work.
    if tp > 1:
        one = Collective("reduce_scatter" if sp else "all_reduce", act, tp, 1, "").time_s(tp_link)
        other = Collective("all_gather", act, tp, 1, "").time_s(tp_link) if sp else 0.0
        embed_f, embed_b = one, other  # SP: RS forward, AG backward; else the forward's all-reduce
        loss_in = one + other
        lse = Collective("all_gather", 2 * 4 * tokens * tp, tp, 1, "").time_s(tp_link)
    else:
        embed_f = embed_b = loss_in = lse = 0.0
    f1 = lt.forward_s + tp_s + cp_f + z3_f
    bi1 = lt.backward_input_s + tp_s + cp_b + z3_b + rc
    bw1 = lt.backward_weight_s
    split = lay.schedule in SPLIT_BACKWARD and pp > 1
    durs = []
    for r in range(pp):
        for ch in range(v):
            st = stage_of(lay.schedule, pp, r, ch)
            n, last = layers[st], st == S - 1
            # plait's fused loss (plait/loss.py) forms both of the head's gradients as it computes the
            # loss, so all three of the head's matmuls run where the loss does: in the last stage's B
            # slot (plait/parallel/pipeline.py), in its F for runs recorded before that
            head = head_f + head_b if last else 0.0
            # a zero-bubble schedule's fused loss defers the output matrix's gradient to W (plait/loss.py)
            head_w = head_wgrad if last and lay.head_wgrad_in_w else 0.0
            ends = (loss_in + lse) if last else 0.0  # in the slot the head runs in
            f = (n * f1 + (head + ends if lay.head_in_forward else 0.0) + (root_f if st == 0 else 0.0)
                 + (embed_f if st == 0 else 0.0))
            bi = (n * bi1 + (0.0 if lay.head_in_forward else head - head_w + ends) + (root_b if st == 0 else 0.0)
                  + (embed_b if st == 0 else 0.0))
            bw = n * bw1 + head_w
            durs.append((f, bi, bw) if split else (f, bi + bw, 0.0))
    # GPUs that meet at every collective each wait for the slowest (plait/benchmarks/lockstep.py):
    # everything a rank runs between two meetings takes the expected maximum of the job's GPUs
    slow = 1.0 + (c.profile.lockstep_slowdown(c.n_gpus) if c.profile is not None else 0.0)
    durs = [tuple(x * slow for x in t) for t in durs]

    pp_link = links["pp"][0]
    msg = act / (tp if sp else 1)  # SP keeps the hidden states sequence-split between stages
    # a stage boundary's message: the measured exchange between two GPUs where calibrated
    p2p_s = Collective("send_recv", msg, 2, 1, "").time_s(pp_link) if pp > 1 else 0.0
    parts = {"compute": lt.forward_s + lt.backward_s + rc - replay_s,
             "tp": 2 * tp_s + replay_s, "cp": cp_f + cp_b, "zero3": z3_f + z3_b}
    parts = {k: x * slow for k, x in parts.items()}
    ends_s = tuple(((embed_f + embed_b) * (rank_of[0] == r) + (loss_in + lse) * (rank_of[S - 1] == r)) * slow
                   for r in range(pp))
    return StageCosts(tuple(layers), tuple(durs), parts, tuple(rank_params), tuple(root_params), tp_fwd, tp_replay, kv_chunk, msg,
                      p2p_s, links, tuple(last_params), (root_f + root_b) * slow, ends_s, slow,
                      stage_work(d, layers, lay.head_wgrad_in_b) if lay.schedule == "zbv" and pp > 1 else None)
