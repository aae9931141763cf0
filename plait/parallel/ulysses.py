"""Context parallelism by all-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split
around attention, so each rank runs ordinary causal attention - the fused flash/cuDNN kernel on a
GPU - over the whole sequence for 1/C of the heads.

  q (B, H, T/C, d), k and v (B, Hkv, T/C, d) on each rank, tokens in the load-balanced layout of
  `plait.parallel.context` (rank r holds chunks r and 2C-1-r)
  -> all-to-all: split the heads into C groups, gather the sequence: (B, H/C, T, d), the chunks in
     rank order, then put back in sequence order
  -> causal attention (with document masking: a mask from every token's document, all-gathered)
  -> the inverse: chunks back to rank order, all-to-all heads home: (B, H, T/C, d).

Key/value heads: with Hkv a multiple of C each rank receives the Hkv/C that its query heads use
(grouped-query heads are contiguous); with fewer than C, each is repeated C/Hkv times first so every
rank gets the one it needs (more bytes than the ring, which never sends a repeated head). Head
counts that fit neither way are refused before launch (`plait.parallel.rules.check_split`).

Traffic per layer and micro-batch, forward and again backward: two all-to-alls (q, k and v in one
send buffer; the output), each moving (C-1)/C of the local tensors - independent of C in total bytes per rank, where the ring's
grows with C; but it cannot overlap attention, and it needs heads divisible by C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.parallel.context import chunk_ids


def chunk_order(cp: int) -> list[int]:
    """Chunk ids along a sequence gathered in rank order: rank 0's two chunks, then rank 1's, ..."""
    return [c for r in range(cp) for c in chunk_ids(cp, r)]


def _take(x: torch.Tensor, pieces: list[int], axis: int) -> torch.Tensor:
    """The 2C equal pieces of `x` along `axis`, concatenated in the order `pieces` names them."""
    parts = x.chunk(len(pieces), dim=axis)
    return torch.cat([parts[i] for i in pieces], dim=axis)


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How often each key/value head is sent so that every rank gets the ones its queries use."""
    return 1 if kv_heads % cp == 0 else cp // kv_heads


def attend(cp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence by all-to-all; `cp` is the
    model's `ContextParallel` (see `ContextParallel.attend` for the shapes)."""
    C, comm, dim = cp.cp, cp.comm, cp.dim
    order = chunk_order(C)  # gathered position i holds chunk order[i]
    natural = [order.index(c) for c in range(2 * C)]  # chunk c sits at gathered position natural[c]
    rep = kv_repeats(k.shape[1], C)
    if rep > 1:
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))

    # q, k and v leave in one all-to-all: one send buffer, slot j holding the heads rank j gets of
    # each, (C, B, hq/C + 2 hkv/C, T/C, d). One call instead of three moves the same bytes with
    # larger messages and a third of the launches, and its backward is one all-to-all too.
    hq, hkv = q.shape[1] // C, k.shape[1] // C
    send = torch.cat([t.unflatten(1, (C, -1)).movedim(1, 0) for t in (q, k, v)], dim=2)
    got = comm.all_to_all_chunks(send, dim)  # slot i: rank i's tokens of this rank's heads
    gathered = _take(got.movedim(0, 2).flatten(2, 3), natural, axis=2)  # (B, hs, T, d), sequence order
    q, k, v = gathered.split([hq, hkv, hkv], dim=1)
    gqa = q.shape[1] != k.shape[1]
    if docs is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        every = _take(comm.all_gather_along(docs, dim, axis=1, grad="split"), natural, axis=1)  # (B, T)
        T = every.shape[1]
        same = (every[:, :, None] == every[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=same[:, None], enable_gqa=gqa)
    out = _take(out, order, axis=2)  # back to rank order: position i <- chunk order[i]
    return comm.all_to_all_along(out, dim, scatter_axis=2, gather_axis=1)
