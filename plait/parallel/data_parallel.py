"""The factory of data-parallel engines: one per layout, all with the interface of
`plait.parallel.engine.Engine`.

  engine  gradients                                        optimizer state   parameters after the step
  Local   flat space in pieces, allocated by backward and  all               updated in place
          dropped after the update (`plait.flat`): one
          device, or no data-parallel peer (tp / pp only)
  DDP     flat buffer, all-reduced in buckets while the    all               updated in place, equal on
          last backward runs (`plait.parallel.ddp`)                          every rank
  ZeRO-1  flat buffer, reduce-scattered after backward     1/N, contiguous   all-gathered
  ZeRO-2  1/N shard; buckets reduce-scattered during       1/N per bucket    all-gathered per bucket
          backward, then freed (`plait.parallel.zero`)
  ZeRO-3  1/N shard per block (`plait.parallel.fsdp`)      1/N per block     stay sharded; gathered per
                                                                             block before use

Gradients are averaged over the grad group: each rank's loss is the mean over its tokens, so the
mean of the ranks' gradients is the gradient of the global mean loss - the single-device gradient.
"""

from __future__ import annotations

import torch

from plait.flat import FlatParams
from plait.optim import FlatAdamW
from plait.parallel.buckets import bucket_cap
from plait.parallel.engine import Engine, Groups, Local, TensorSplit, reduce_dtype_of


def apply_data_parallel(model, cfg, comm=None, groups: Groups = Groups(), compile: bool = False,
                        split: TensorSplit = TensorSplit(), pipeline: bool = False) -> Engine:
    """Wrap `model` (parameters already in the compute dtype) in the engine its layout needs.

    comm=None is one device. Otherwise `cfg.parallel.zero` picks DDP or a ZeRO stage over
    `groups.shard`, replicated over `groups.replicate` (HSDP) when that group has more than one rank.
    `split`: how tensor parallelism cut the parameters (none by default). `pipeline`: the model is
    a pipeline stage (ZeRO-3 keeps it gathered through a step: `plait.parallel.fsdp.Zero3`).
    """
    t, p = cfg.train, cfg.parallel
    named = list(model.named_parameters())
    if comm is None or (p.zero == 0 and comm.size(groups.grad) == 1):
        # one device, or a tensor / pipeline part with no data-parallel peer: nothing to all-reduce, and
        # the gradient pieces keep 2 bytes a parameter away from the forward's peak (at tp 8, a 70B's
        # 17 GB a GPU); the tp sums and the mesh-wide statistics still run over comm
        from plait.parallel import embedding_master

        table = embedding_master.master_only_name(model, split, p.tp)  # read from its master: no 16-bit copy
        flat = FlatParams(named, lazy_grads=True, master_only=table)
        engine = Local(model, FlatAdamW(flat, t, compile=compile), comm, groups, split=split)
        if table is not None:
            embedding_master.install(model, flat)
        return engine
    dtype = named[0][1].dtype
    if p.zero == 0:
        from plait.parallel.ddp import DDP

        flat = FlatParams(named)
        cap = bucket_cap(p.bucket_mb, flat.grad.element_size())
        return DDP(model, FlatAdamW(flat, t, compile=compile), comm, groups, cap, split, p.overlap_ctas,
                   rows=_embedding_rows(cfg, model, comm.size(groups.grad), pipeline))
    from plait.parallel import zero

    if p.zero == 1:
        return zero.Zero1(model, named, t, comm, groups, compile, split)
    reduce_dtype = reduce_dtype_of(p.reduce_dtype, dtype)
    if p.zero == 2:
        cap = bucket_cap(p.bucket_mb, torch.empty((), dtype=reduce_dtype).element_size())
        return zero.Zero2(model, named, t, comm, groups, cap, reduce_dtype, compile, split)
    from plait.parallel.fsdp import Zero3

    return Zero3(model, t, comm, groups, reduce_dtype, compile, split, keep=pipeline, cast_once=p.zero3_cast_once,
                 fp8_gather=p.zero3_fp8_gather)


def _embedding_rows(cfg, model, ranks: int, pipeline: bool) -> bool:
    """Whether DDP sends the embedding's gradient as rows (`parallel.embedding_rows`): only for a
    whole model (no tp/pp/cp split); on `auto` for an untied embedding whose rows are fewer bytes
    than its matrix (`plait.parallel.rules.embedding_rows`)."""
    from plait.model import DENSE
    from plait.parallel.rules import embedding_rows

    p, t = cfg.parallel, cfg.train
    if pipeline or model.tp is not DENSE or model.cp is not None or model.embed is None:
        return False
    tied = model.output is not None and model.output.weight is model.embed.weight
    return embedding_rows(p.embedding_rows, ranks, t.micro_batch * t.seq_len * t.grad_accum, model.cfg.vocab_size, tied)
