"""`parallelize`: the one place that turns a config and a mesh into what a rank trains.

The order is fixed, and each step depends on the ones before it:
  1. build on the meta device     no memory, no time, whatever the model's size; with a pipeline
                                  only this rank's stages (`plait.parallel.stages`)
  2. tensor parallelism (+ SP)    swaps full weights for this rank's shards while they are still
                                  shapes only, so no rank ever holds a full copy
  3. context parallelism          each sequence split over the cp ranks (load-balanced chunks),
                                  attention as a ring (`plait.parallel.context`)
  4. recomputation                wraps each block's inner forward: hooks added later (ZeRO-3's
                                  gather and free) stay outside the recomputed region
  5. materialise + init by name   each weight is drawn in full from (seed, name) and this rank keeps
                                  its box: every layout starts from the single-device model
  6. compute dtype                bf16 weights on GPU; the engine keeps fp32 masters; with FP8 the
                                  blocks' linears quantize those weights at each matmul
  7. compile                      per block, after every structural change and before the engine's
                                  hooks, so ZeRO-3's hooks run eagerly around the compiled code (a
                                  zero-bubble pipeline defers weight gradients from inside backward,
                                  which a compiled graph cannot: its linears run between the
                                  compiled pieces of each block)
  8. data parallelism / ZeRO      the engine over this rank's (local) parameters, told how tensor
                                  parallelism cut them and which matrix is a tied copy
and the step runner: the plain micro-batch loop, or the pipeline executor over the schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from plait.config import Config
from plait.model import Transformer
from plait.parallel.data_parallel import apply_data_parallel
from plait.parallel.engine import Engine, Groups, TensorSplit
from plait.parallel.runner import Runner
from plait.parallel.schedules import SPLIT_BACKWARD


@dataclass
class Parallelized:
    """What a rank trains: its model part, the engine over its parameters, the step runner, and the
    slice of each global batch it reads (its data-parallel coordinate)."""

    model: Transformer
    engine: Engine
    runner: Runner
    data_rank: int
    data_size: int

    def close(self) -> None:
        """Let this rank's model, engine and optimizer state be freed once unreferenced (Engine.close)."""
        self.engine.close()


def autocast_for(dtype: torch.dtype, device: torch.device):
    if dtype == torch.bfloat16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def apply_compile(model: Transformer, hooks_outside: bool = False) -> None:
    """Compile each block on its own: identical blocks share one compiled graph, so compile time
    does not grow with depth, and the fused loss gets its softmax/one-hot arithmetic fused.
    `hooks_outside`: compile only `forward`, so module hooks (ZeRO-3's gather/free) run eagerly."""
    from plait.parallel.wgrad import COMPILE_OPTIONS, DeferrableLinear

    for block in model.layers.values():
        # a zero-bubble block's linears hand buffers to the weight-gradient store: no reuse of them
        served = any(isinstance(m, DeferrableLinear) for m in block.modules())
        options = COMPILE_OPTIONS if served else None
        if hooks_outside:
            block.forward = torch.compile(block.forward, options=options)
        else:
            block.compile(options=options)
    if model.norm is not None:  # the final norm too: eager, its fp32 arithmetic is ~15 passes over (tokens, dim)
        if hooks_outside:
            model.norm.forward = torch.compile(model.norm.forward)
        else:
            model.norm.compile()
    compile_loss(model)


def parallelize(cfg: Config, comm, device: torch.device, dtype: torch.dtype, compile: bool,
                groups: Groups = Groups()) -> Parallelized:
    """Build this rank's part of the model and its engine (comm=None: one device, no process group)."""
    t, p = cfg.train, cfg.parallel
    pp = comm.size(groups.pp) if comm is not None else 1
    stage = _stage(cfg, comm.rank(groups.pp), pp) if pp > 1 else None
    with torch.device("meta"):  # 1 (and the pipeline's split: only this rank's stages are built)
        model = Transformer(cfg.model) if stage is None else Transformer(cfg.model, **stage["build"])
    split = TensorSplit()
    if comm is not None and comm.size(groups.tp) > 1:  # 2
        from plait.parallel.tensor import apply_tp

        split = apply_tp(model, comm, groups.tp, sequence_parallel(cfg))
    if stage is not None:
        split = dataclasses.replace(split, **stage["tied"])
    if comm is not None and comm.size(groups.cp) > 1:  # 3: context parallelism (the ring attention)
        from plait.parallel.context import apply_cp

        apply_cp(model, comm, groups.cp, cfg.parallel.cp_impl)
        # the cp ranks hold the same parameters and see different tokens of the same sequences:
        # gradients average, and ZeRO shards, over dp x cp (the data split stays over dp)
        groups = dataclasses.replace(groups, grad="dp_cp", shard="dp_shard_cp")
    if t.recompute != "none":  # 4
        from plait.parallel.recompute import apply_recompute

        apply_recompute(model, t.recompute)
    model.to_empty(device=device)  # 5
    model.tie()
    model.init_weights(t.seed)
    model.to(dtype)  # 6
    if t.fp8 != "off":  # the blocks' matmuls in FP8, reading the weights TP and the engine leave in place
        from plait.fp8 import apply_fp8

        apply_fp8(model, t.fp8, device)
        if comm is not None:  # operands split over tp or cp are scaled as the whole tensor (plait.fp8)
            from plait.fp8 import shard_linears

            tp_key = comm.key(groups.tp) if comm.size(groups.tp) > 1 else None
            cp_key = comm.key(groups.cp) if comm.size(groups.cp) > 1 else None
            shard_linears(model, tp_key, cp_key)
    store = None
    if stage is not None and p.schedule in SPLIT_BACKWARD:  # weight gradients deferred by the blocks' linears
        from plait.parallel.wgrad import WeightGradStore

        store = WeightGradStore()
        for lin in model.block_linears():
            store.serve(lin)
        if model.norm is not None:  # the last stage: the output matrix's gradient goes to W too
            model.head_defer = store
    if compile:  # 7
        apply_compile(model, hooks_outside=comm is not None and p.zero == 3)
    engine = apply_data_parallel(model, cfg, comm, groups, compile=compile, split=split,  # 8
                                 pipeline=stage is not None)
    data_rank, data_size = (comm.rank("dp"), comm.size("dp")) if comm is not None else (0, 1)
    autocast = autocast_for(dtype, device)
    if stage is None:
        runner = Runner(model, engine, autocast)
    else:
        from plait.parallel.pipeline import PipelineRunner

        tp, cp, dim, sp = comm.size(groups.tp), comm.size(groups.cp), cfg.model.dim, sequence_parallel(cfg)
        # what crosses a stage boundary: this rank's tokens (1/cp of each sequence, 1/tp of them with SP)
        act_shape = (lambda b, s: (b * s // cp // tp, dim)) if sp else (lambda b, s: (b, s // cp, dim))
        runner = PipelineRunner(model, engine, comm, p.schedule, pp, p.v, comm.rank(groups.pp), stage["chunks"],
                                autocast, act_shape, dtype, store, groups.pp, stage["costs"])
    return Parallelized(model, engine, runner, data_rank, data_size)


def _stage(cfg: Config, rank: int, pp: int) -> dict:
    """What pipeline rank `rank` builds: its layers (by global id), whether it holds the embedding
    (stage 0) and the head (the last stage), its chunks' layer keys, and the tied-copy bookkeeping."""
    from plait.parallel.schedules import place
    from plait.parallel.stages import rank_chunks, resolve_counts, stage_layer_ids

    p, L = cfg.parallel, cfg.model.n_layers
    S = pp * p.v
    per_stage = stage_layer_ids(L, S, resolve_counts(p.stage_layers, cfg.model, cfg.train.seq_len, S, p.schedule))
    chunks = rank_chunks(pp, p.v, rank, per_stage, p.schedule)
    first, last = rank == place(p.schedule, pp, p.v, 0)[0], rank == place(p.schedule, pp, p.v, S - 1)[0]
    tied: dict = {}
    # two copies when the ends are on two ranks: stage 0's embedding, the last stage's output matrix
    # (ZB-V puts both ends on rank 0, whose model ties them as one device's does)
    if cfg.model.tie_embeddings and not (first and last):
        tied = {"tied": frozenset({"embed.weight"})} if first else {}
        if last:
            tied = {"tied": frozenset({"output.weight"}), "aliases": {"output.weight": "embed.weight"}}
    costs = None
    if p.schedule == "zbv":  # ZB-V's order is found with the stages' relative costs
        from plait.parallel.stages import stage_work
        from plait.planner.costs import ModelDims

        costs = stage_work(ModelDims.from_config(cfg.model, cfg.train.seq_len), [len(ids) for ids in per_stage])
    return {"build": {"layer_ids": sorted(i for c in chunks for i in c), "first": first, "last": last},
            "chunks": [[str(i) for i in c] for c in chunks], "tied": tied, "costs": costs}


def compile_loss(model: Transformer) -> None:
    from plait.loss import ce_chunk

    model.ce_chunk_fn = torch.compile(ce_chunk)
    model.tp.compile_kernels()


def sequence_parallel(cfg: Config) -> bool:
    from plait.parallel.rules import sequence_parallel as sp

    return sp(cfg.parallel.sp, cfg.parallel.tp)
