"""`parallelize`: the one place that turns a config and a mesh into what a rank trains.

The order is fixed, and each step depends on the ones before it:
  1. build on the meta device     no memory, no time, whatever the model's size
  2. tensor parallelism (+ SP)    swaps full weights for this rank's shards while they are still
                                  shapes only, so no rank ever holds a full copy
  3. recomputation                wraps each block's inner forward: hooks added later (ZeRO-3's
                                  gather and free) stay outside the recomputed region
  4. materialise + init by name   each weight is drawn in full from (seed, name) and this rank keeps
                                  its box: every layout starts from the single-device model
  5. compute dtype                bf16 weights on GPU; the engine keeps fp32 masters
  6. compile                      per block, after every structural change and before the engine's
                                  hooks, so ZeRO-3's hooks run eagerly around the compiled code
  7. data parallelism / ZeRO      the engine over this rank's (local) parameters, told how tensor
                                  parallelism cut them
Pipeline stages (between 1 and 2) and context parallelism (after 2) slot into this order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from plait.config import Config
from plait.model import Transformer
from plait.parallel.data_parallel import apply_data_parallel
from plait.parallel.engine import Engine, Groups, TensorSplit
from plait.parallel.runner import Runner


@dataclass
class Parallelized:
    """What a rank trains: its model part, the engine over its parameters, the step runner, and the
    slice of each global batch it reads (its data-parallel coordinate)."""

    model: Transformer
    engine: Engine
    runner: Runner
    data_rank: int
    data_size: int


def autocast_for(dtype: torch.dtype, device: torch.device):
    if dtype == torch.bfloat16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def apply_compile(model: Transformer, hooks_outside: bool = False) -> None:
    """Compile each block on its own: identical blocks share one compiled graph, so compile time
    does not grow with depth, and the fused loss gets its softmax/one-hot arithmetic fused.
    `hooks_outside`: compile only `forward`, so module hooks (ZeRO-3's gather/free) run eagerly."""
    from plait.loss import ce_chunk

    for block in model.layers.values():
        if hooks_outside:
            block.forward = torch.compile(block.forward)
        else:
            block.compile()
    model.ce_chunk_fn = torch.compile(ce_chunk)
    model.tp.compile_kernels()


def parallelize(cfg: Config, comm, device: torch.device, dtype: torch.dtype, compile: bool,
                groups: Groups = Groups()) -> Parallelized:
    """Build this rank's part of the model and its engine (comm=None: one device, no process group)."""
    t, p = cfg.train, cfg.parallel
    with torch.device("meta"):  # 1
        model = Transformer(cfg.model)
    split = TensorSplit()
    if comm is not None and comm.size(groups.tp) > 1:  # 2
        from plait.parallel.tensor import apply_tp

        split = apply_tp(model, comm, groups.tp, sequence_parallel(cfg))
    if t.recompute != "none":  # 3
        from plait.parallel.recompute import apply_recompute

        apply_recompute(model, t.recompute)
    model.to_empty(device=device)  # 4
    model.tie()
    model.init_weights(t.seed)
    model.to(dtype)  # 5
    if compile:  # 6
        apply_compile(model, hooks_outside=comm is not None and p.zero == 3)
    engine = apply_data_parallel(model, cfg, comm, groups, compile=compile, split=split)  # 7
    data_rank, data_size = (comm.rank("dp"), comm.size("dp")) if comm is not None else (0, 1)
    return Parallelized(model, engine, Runner(model, engine, autocast_for(dtype, device)), data_rank, data_size)


def sequence_parallel(cfg: Config) -> bool:
    from plait.parallel.rules import sequence_parallel as sp

    return sp(cfg.parallel.sp, cfg.parallel.tp)
