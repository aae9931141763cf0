"""Each pipeline rank's memory at its peak as a step runs: the model state it holds (by ZeRO stage),
the activations its schedule keeps in flight, ZeRO-3's gathered units and gradient chunks, the
fused loss's chunk on the rank with the head, and the buffers around them; the fullest rank is
what a layout must fit. The bytes of each piece are `plait.planner.memory`'s formulas; this module
places them on the ranks as plait's runtime does (`predict` reports the fullest)."""

from __future__ import annotations

import functools
from dataclasses import replace

from plait.parallel.schedules import compute_order, peak_activation_units, place, stage_of, units_as_w_starts
from plait.planner import costs, memory
from plait.planner.costs import ModelDims
from plait.planner.hardware import GIB, Cluster
from plait.planner.layout import Layout
from plait.planner.memory import Precision
from plait.planner.stage_costs import BUCKET_BYTES, StageCosts


def saturated(name: str, pp: int, m: int, exact: bool = True) -> int:
    """The micro-batch count past which a rank's peak of held activations no longer grows: by 4 pp
    (a multiple of pp, as interleaving needs) 1F1B, interleaved 1F1B and ZB-H1 have begun their
    steady state, and more micro-batches only lengthen it (tests/test_planner_memory.py checks
    this). Building those schedules for no more keeps a search's memory screening cheap. GPipe
    holds all m (`peak_activation_units` says so without building it). ZB-V's cost-driven order can
    keep admitting micro-batches where its stages are uneven: it is built in full when `exact`; a
    search's screening (`exact=False`) takes its peak at 4 pp, and the layouts it keeps are priced
    again in full (at a global batch of thousands, building every candidate's ZB-V in full took
    minutes)."""
    if name == "gpipe" or (name == "zbv" and exact):
        return m
    return min(m, 4 * pp)


def _peak_units(name: str, pp: int, m: int, v: int, rank: int, wfrac: float, costs: tuple | None = None,
                chunk_layers: tuple | None = None, exact: bool = True) -> float:
    return _peak_units_at(name, pp, saturated(name, pp, m, exact), v, rank, wfrac, costs, chunk_layers)


@functools.lru_cache(maxsize=8192)
def _peak_units_at(name: str, pp: int, m: int, v: int, rank: int, wfrac: float, costs: tuple | None,
                   chunk_layers: tuple | None) -> float:
    return peak_activation_units(name, pp, m, v, rank, wfrac, costs, chunk_layers)


@functools.lru_cache(maxsize=4096)
def pending_head_w(name: str, pp: int, m: int, v: int, costs: tuple | None = None, exact: bool = True) -> int:
    """Most micro-batches whose last-stage W has not run yet, at once, on the rank holding the last
    stage: each keeps the fused loss's d(loss)/d(logits) for the output matrix's gradient. Counted on
    the compute order alone (cached, shared with the activation peaks): the messages `build_schedule`
    adds do not reorder a rank's compute, and placing them cost a search most of its ZB-V time."""
    order = compute_order(name, pp, saturated(name, pp, m, exact), v, costs)
    rank, chunk = place(name, pp, v, pp * v - 1)
    n = peak = 0
    for a in order[rank]:
        if a.chunk == chunk and a.kind in ("B", "W"):
            n += 1 if a.kind == "B" else -1
            peak = max(peak, n)
    return peak


def held_layers(sched_name: str, pp: int, m: int, v: int, rank: int, wfrac: float, sc: StageCosts,
                exact: bool = True) -> tuple[float, float]:
    """(micro-batches in flight, layers' activations held) at the rank's peak: in-flight chunks times
    the rank's largest chunk, or for ZB-V, whose two chunks differ in size, each chunk by its own.
    `exact=False`: ZB-V's peak as `saturated` screens it."""
    layers = tuple(sc.layers[stage_of(sched_name, pp, rank, ch)] for ch in range(v))
    units = _peak_units(sched_name, pp, m, v, rank, wfrac, sc.order_costs, exact=exact)
    if sched_name == "zbv":
        return units, _peak_units(sched_name, pp, m, v, rank, wfrac, sc.order_costs, layers, exact)
    return units, units * max(layers)


def rank_memory(d: ModelDims, lay: Layout, c: Cluster, prec: Precision, sc: StageCosts, sched_name: str,
                m: int, exact: bool = True) -> tuple[int, dict[str, float], dict[str, float]]:
    """Peak memory by component on every pipeline rank; return the fullest rank's (and its state)."""
    tp, pp, v, cp, b, e = lay.tp, lay.pp, lay.v, lay.cp, lay.micro_batch, prec.act_bytes
    sp, shard = lay.seq_parallel, lay.shard_group
    wfrac = memory.wgrad_fraction(d)
    # zero-bubble blocks compile whole, their deferring linears custom ops (plait/parallel/wgrad.py)
    uly = lay.cp_impl == "ulysses"
    per_layer = memory.layer_activation_bytes(d, d.seq // cp, b, tp, sp, lay.recompute, e, lay.compile, cp, uly,
                                              lay.fp8)
    layer_w = costs.tp_share(d, tp)[0]
    best: tuple[float, int, dict, dict] = (-1.0, 0, {}, {})
    first = place(sched_name, pp, v, 0)[0]  # the rank whose stage holds the embedding
    for r in range(pp):
        st = memory.state_bytes(sc.rank_params[r], lay.zero, shard, prec, shard_is_master=True)  # plait's ZeRO-3
        units, held = held_layers(sched_name, pp, m, v, r, wfrac, sc, exact)
        grads, gathered, kept = st.grads, 0.0, 0.0
        local = lay.n_gpus == 1 or (lay.grad_group == 1 and lay.zero == 0)  # the engine without dp peers
        if local and m == 1 and not lay.grads_whole:
            grads = 0.0  # its gradient pieces come with the backward, after the forward's peak (plait.flat)
        if local and r == first and _table_from_master(d, lay, prec):
            st = replace(st, params=st.params - d.vocab * d.hidden * prec.param_bytes)
        if lay.zero == 3 and shard > 1:
            grads, gathered = _zero3_peak(sc.rank_params[r], sc.root_params[r], layer_w, st.grads, prec, pp, m,
                                          1.0 if lay.zero3_fp8_gather else prec.param_bytes)
            if lay.zero3_cast_once and pp == 1:  # every unit's 16-bit (FP8-gathered: 8-bit) chunk, kept
                lin = d.layers * costs.block_linear_share(d, tp) if lay.zero3_fp8_gather else 0.0
                kept = (lin + (sc.rank_params[r] - lin) * prec.param_bytes) / shard
        comp = {
            "parameters": st.params + kept, "gradients": grads, "master_weights": st.master,
            "optimizer_states": st.optimizer,
            "activations": held * per_layer + _batched_wgrad(d, lay, sc, prec, sched_name, m, r, wfrac, exact,
                                                             per_layer, held),
            "zero3_gather": gathered,
            "comm_buckets": 2 * BUCKET_BYTES if (lay.grad_group > 1 and lay.zero < 3) else 0.0,
            # full recomputation rebuilds one layer's complete activations inside its backward
            "recompute_buffer": memory.layer_activation_bytes(d, d.seq // cp, b, tp, sp, "none", e, lay.compile, cp, uly,
                                                              lay.fp8)
            if lay.recompute == "full" else 0.0,
            "cp_ring": 2 * sc.kv_chunk_bytes if cp > 1 else 0.0,  # the block in use + the one arriving
            "loss_chunk": _loss_bytes(d, lay, sched_name, m, sc, e, exact) if r == place(sched_name, pp, v, pp * v - 1)[0] else 0.0,
            "reserved": c.reserved_gib * GIB,
        }
        state = {"parameters": st.params + kept, "gradients": st.grads, "master_weights": st.master,
                 "optimizer_states": st.optimizer}
        # the end of the backward: every gradient there (pieces, ZeRO-3's shards) and the activations
        # gone; with few activations (full recompute, short sequences) this moment is the fuller one
        update = {**state, "activations": 0.0, "comm_buckets": comp["comm_buckets"], "reserved": comp["reserved"]}
        if sum(update.values()) > sum(comp.values()):
            comp = {k: update.get(k, 0.0) for k in comp}
        total = sum(comp.values())
        if total > best[0]:
            best = (total, r, comp, state)
    return best[1], best[2], best[3]


def _table_from_master(d: ModelDims, lay: Layout, prec: Precision) -> bool:
    """An untied, unsplit embedding on an engine without data-parallel peers is looked up from its
    fp32 master: no 16-bit copy (`plait.parallel.embedding_master`)."""
    return (not d.tie_embeddings and lay.tp == 1 and not lay.embed_copy and prec.master_bytes > 0
            and prec.param_bytes < 4)


def _batched_wgrad(d: ModelDims, lay: Layout, sc: StageCosts, prec: Precision, sched_name: str, m: int, rank: int,
                   wfrac: float, exact: bool, per_layer: float, held: float) -> float:
    """Bytes that a recorded zero-bubble run's W added over the rank's held peak (`held` layers'
    activations of `per_layer` bytes): it formed its chunk's 16-bit weight gradients all before adding
    any (`Layout.wgrad_batched`), and they sat together on what the rank held as that W started
    (2 x H200, 8b with 16 layers: 3.9 GB over 1F1B's peak on the rank with 9 layers). Today's W adds
    each as formed. 0 when the W's level stays below the peak."""
    if not lay.wgrad_batched or sched_name not in ("zb", "zbv"):
        return 0.0
    layers = tuple(sc.layers[stage_of(sched_name, lay.pp, rank, ch)] for ch in range(lay.v))
    mm = saturated(sched_name, lay.pp, m, exact)
    if sched_name == "zbv":  # its chunks differ in size: each weighed by its layers
        at_w = units_as_w_starts(sched_name, lay.pp, mm, lay.v, rank, wfrac, sc.order_costs, layers)
    else:
        at_w = units_as_w_starts(sched_name, lay.pp, mm, lay.v, rank, wfrac, sc.order_costs) * max(layers)
    grads = max(layers) * costs.block_linear_share(d, lay.tp) * prec.param_bytes
    return max(0.0, (at_w - held) * per_layer + grads)


def _zero3_peak(params: float, root: float, block: float, grad_shard: float, prec: Precision, pp: int,
                m: int, block_bytes: float | None = None) -> tuple[float, float]:
    """(gradient bytes, gathered parameter bytes) of plait's ZeRO-3 at a rank's activation peak, the
    end of the last forward (plait/parallel/fsdp.py). Alone, gradient chunks exist only once a
    backward has reduced into them (so from the second micro-batch on), and at the peak only the
    root unit (embedding, norm gains) and the head unit (an untied output matrix, freed when the
    forward returns) are gathered, `root` together: every block was freed after its forward.
    As a pipeline stage (`keep`) every unit stays gathered through the step and gradients accumulate
    in full per-unit buffers, bound by the first backward. `block_bytes`: a gathered block's bytes a
    parameter (1 with the FP8 gather; else the precision's)."""
    block_bytes = prec.param_bytes if block_bytes is None else block_bytes
    if pp > 1:
        return params * prec.grad_bytes, root * prec.param_bytes + (params - root) * block_bytes
    return (grad_shard if m > 1 else 0.0), max(root * prec.param_bytes, block * block_bytes)


def _loss_bytes(d: ModelDims, lay: Layout, sched_name: str, m: int, sc: StageCosts, e: float,
                exact: bool = True) -> float:
    """The fused loss's chunk; in a zero-bubble pipeline also what it keeps for the output matrix's
    deferred gradient (plait/loss.py): every pending micro-batch's 16-bit d(loss)/d(logits) of this
    rank's vocabulary rows."""
    tokens = lay.micro_batch * d.seq // lay.cp
    out = memory.loss_chunk_bytes(d, tokens, lay.tp, lay.compile, e, lay.eager_head, lay.loss_logits_held)
    if lay.head_wgrad_in_w:
        out += pending_head_w(sched_name, lay.pp, m, lay.v, sc.order_costs, exact) * tokens * -(-d.vocab // lay.tp) * e
    return out
