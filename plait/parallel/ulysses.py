"""Context parallelism by all-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split
around attention, so each rank runs ordinary causal attention - the fused flash/cuDNN kernel on a
GPU - over the whole sequence for 1/C of the heads.

  q (B, H, T/C, d), k and v (B, Hkv, T/C, d) on each rank, tokens in the load-balanced layout of
  `plait.parallel.context` (rank r holds chunks r and 2C-1-r)
  -> all-to-all: split the heads into C groups, gather the sequence: (B, H/C, T, d), the chunks in
     rank order, then put back in sequence order
  -> causal attention
  -> the inverse: chunks back to rank order, all-to-all heads home: (B, H, T/C, d).

Overlap. The exchanges sit between the projections and attention, so done whole nothing could hide
them. Each rank therefore splits its heads into `head_groups` groups and pipelines them: the next
group's q/k/v travel while this group is attended, and this group's output travels home while the
next is attended. Forward, only the first group's q/k/v and the last group's output are exposed;
backward mirrors it (the output gradient of the next group arrives while this group's attention
backward runs, and this group's dq/dk/dv leave while the next one's runs). With two groups half the
exchanged bytes hide. It is one registered op (`plait::ulysses_attention`): torch.compile keeps a
block that calls it in one graph, and selective recomputation keeps its outputs instead of
exchanging again in backward. Document masking keeps the unpipelined form below (`_attend_masked`):
its math kernel needs every token's document, and it is the slow path anyway.

Key/value heads: with Hkv a multiple of C each rank receives the Hkv/C that its query heads use
(grouped-query heads are contiguous, and so are a group's: query head j*H/C + g*H/(CG) + i uses key/
value head j*Hkv/C + g*Hkv/(CG) + i*Hkv/H); with fewer than C, each is repeated C/Hkv times first so
every rank gets the one it needs (more bytes than the ring, which never sends a repeated head). Head
counts that fit neither way are refused before launch (`plait.parallel.rules.check_split`).

Traffic per layer and micro-batch, forward and again backward: the q/k/v exchange and the output's,
each moving (C-1)/C of the local tensors (in `head_groups` calls each) - independent of C in total
bytes per rank, where the ring's grows with C; it needs heads divisible by C.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.comm import resolve_key
from plait.parallel import block_attention as blk
from plait.parallel.context import chunk_ids


def chunk_order(cp: int) -> list[int]:
    """Chunk ids along a sequence gathered in rank order: rank 0's two chunks, then rank 1's, ..."""
    return [c for r in range(cp) for c in chunk_ids(cp, r)]


def _natural(cp: int) -> list[int]:
    """Where chunk c sits in the rank-ordered gathered sequence, for c in sequence order."""
    order = chunk_order(cp)
    return [order.index(c) for c in range(2 * cp)]


def _take(x: torch.Tensor, pieces: list[int], axis: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 2C equal pieces of `x` along `axis`, concatenated in the order `pieces` names them."""
    parts = x.chunk(len(pieces), dim=axis)
    return torch.cat([parts[i] for i in pieces], dim=axis, out=out)


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How often each key/value head is sent so that every rank gets the ones its queries use."""
    return 1 if kv_heads % cp == 0 else cp // kv_heads


def head_groups(heads: int, kv_heads: int, cp: int) -> int:
    """How many groups a rank's heads are attended in, each group's exchanges overlapping its
    neighbours' attention: two where its query and (sent) key/value heads both halve, else one."""
    hq, hkv = heads // cp, kv_heads * kv_repeats(kv_heads, cp) // cp
    return 2 if hq % 2 == 0 and hkv % 2 == 0 else 1


def _out_of(x: torch.Tensor, C: int, G: int, g: int) -> torch.Tensor:
    """(C, B, h, T/C, d) send slots of head group g of x (B, H, T/C, d): slot j, rank j's heads."""
    return x.unflatten(1, (C, G, -1))[:, :, g].movedim(1, 0)


def _into(x: torch.Tensor, C: int, G: int, g: int, got: torch.Tensor) -> None:
    """Write received slots `got` (C, B, h, T/C, d) - slot i from rank i - as head group g of x."""
    x.unflatten(1, (C, G, -1))[:, :, g].copy_(got.movedim(0, 1))


def _home(x: torch.Tensor, C: int) -> torch.Tensor:
    """(B, h, T, d) in sequence order -> (C, B, h, T/C, d): slot j, the two chunks rank j holds."""
    return _take(x, chunk_order(C), 2).unflatten(2, (C, -1)).movedim(2, 0).contiguous()


def _gathered(got: torch.Tensor, C: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Received slots (C, B, h, T/C, d), slot i rank i's tokens -> (B, h, T, d) in sequence order."""
    return _take(got.movedim(0, 2).flatten(2, 3), _natural(C), 2, out)


def _shapes(q, k, C: int, G: int) -> tuple[int, int, int]:
    """(query heads, key/value heads, all heads) of one rank's group, key/value heads as sent."""
    hq, hkv = q.shape[1] // (C * G), k.shape[1] * kv_repeats(k.shape[1], C) // (C * G)
    return hq, hkv, hq + 2 * hkv


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for a kernel that takes as many as there are query heads."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _kernel(qg: torch.Tensor, kg: torch.Tensor) -> tuple[str, int]:
    """The attention kernel for one group's (B, hq, T, d) queries and key/value heads, and how often
    it needs each key/value head repeated."""
    how = blk.kernel(qg, None, kg)
    return how, 1 if how in blk.NATIVE_GQA else qg.shape[1] // kg.shape[1]


def _forward(q, k, v, key: str, G: int):
    comm, dim = resolve_key(key)
    C = comm.size(dim)
    hq, hkv, hs = _shapes(q, k, C, G)
    B, _, Tc, d = q.shape
    rep = kv_repeats(k.shape[1], C)
    if rep > 1:
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    # every group's q/k/v go out at once, queued in order on the communication stream: each arrives
    # while the one before it is attended
    sends = [torch.cat([_out_of(t, C, G, g) for t in (q, k, v)], dim=2) for g in range(G)]
    inbound = [comm.all_to_all(s, dim, async_op=True) for s in sends]
    qkv = q.new_empty((G, B, hs, Tc * C, d))
    outs = q.new_empty((G, B, hq, Tc * C, d))
    lse = torch.empty((G, B, hq, Tc * C), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    out = q.new_empty(q.shape)  # contiguous, as the fake promises (q is a transposed view)
    homeward, outbound = [], []
    for g in range(G):
        _gathered(inbound[g].wait(), C, out=qkv[g])
        qg, kg, vg = (t.contiguous() for t in qkv[g].split([hq, hkv, hkv], dim=1))
        how, x = _kernel(qg, kg)
        o, lse[g] = blk.forward(qg, _expand(kg, x), _expand(vg, x), True, d ** -0.5, how, cast=False)
        outs[g].copy_(o)
        homeward.append(_home(outs[g], C))  # kept until its exchange is done
        outbound.append(comm.all_to_all(homeward[-1], dim, async_op=True))  # beside the next group's attention
    for g in range(G):
        _into(out, C, G, g, outbound[g].wait())
    return out, qkv, outs, lse


def _backward(dout, qkv, outs, lse, key: str, kv_heads: int):
    comm, dim = resolve_key(key)
    C = comm.size(dim)
    G, B, hs, T, d = qkv.shape
    hq = outs.shape[2]
    hkv = (hs - hq) // 2
    # every group's output gradient goes out at once: each arrives while the one before it is
    # differentiated, and each group's dq/dk/dv leave while the next one's are formed
    sends = [_out_of(dout, C, G, g).contiguous() for g in range(G)]
    inbound = [comm.all_to_all(s, dim, async_op=True) for s in sends]
    Tc = T // C
    dq = dout.new_empty(dout.shape)
    dk, dv = (dout.new_empty((B, hkv * C * G, Tc, d)) for _ in range(2))  # key/value heads as sent
    homeward, outbound = [], []
    for g in range(G):
        do = _gathered(inbound[g].wait(), C)
        qg, kg, vg = (t.contiguous() for t in qkv[g].split([hq, hkv, hkv], dim=1))
        how, x = _kernel(qg, kg)
        grads = blk.backward(do, qg, _expand(kg, x), _expand(vg, x), outs[g], lse[g], True, d ** -0.5, how, cast=False)
        # fold a kernel's repeated key/value heads back onto the heads they copy
        grads = (grads[0], *(y if x == 1 else y.unflatten(1, (-1, x)).sum(2) for y in grads[1:]))
        homeward.append(_home(torch.cat([y.to(dout.dtype) for y in grads], dim=1), C))
        outbound.append(comm.all_to_all(homeward[-1], dim, async_op=True))
    for g in range(G):
        got = outbound[g].wait()
        _into(dq, C, G, g, got[:, :, :hq])
        _into(dk, C, G, g, got[:, :, hq:hq + hkv])
        _into(dv, C, G, g, got[:, :, hq + hkv:])
    rep = dk.shape[1] // kv_heads
    if rep > 1:  # a repeated head's copies each received a share of its gradient
        dk, dv = (x.unflatten(1, (kv_heads, rep)).sum(2) for x in (dk, dv))
    return dq, dk, dv


@torch.library.custom_op("plait::ulysses_attention", mutates_args=())
def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str,
        groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's output (B, H, T/C, d); for backward: each group's gathered q/k/v, output and
    log-sum-exp over the whole sequence)."""
    return _forward(q, k, v, key, groups)


@_op.register_fake
def _(q, k, v, key, groups):
    comm, dim = resolve_key(key)
    C = comm.size(dim)
    hq, hkv, hs = _shapes(q, k, C, groups)
    B, _, Tc, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    return (q.new_empty(q.shape), q.new_empty((groups, B, hs, Tc * C, d)), q.new_empty((groups, B, hq, Tc * C, d)),
            q.new_empty((groups, B, hq, Tc * C), dtype=acc))


@torch.library.custom_op("plait::ulysses_attention_backward", mutates_args=())
def _op_backward(dout: torch.Tensor, qkv: torch.Tensor, outs: torch.Tensor, lse: torch.Tensor, key: str,
                 kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, qkv, outs, lse, key, kv_heads)


@_op_backward.register_fake
def _(dout, qkv, outs, lse, key, kv_heads):
    B, _, Tc, d = dout.shape
    return dout.new_empty(dout.shape), dout.new_empty((B, kv_heads, Tc, d)), dout.new_empty((B, kv_heads, Tc, d))


def _setup(ctx, inputs, output):
    q, k, v, key, groups = inputs
    ctx.save_for_backward(*output[1:])
    ctx.key, ctx.kv_heads = key, k.shape[1]


def _grad(ctx, dout, *_):
    qkv, outs, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.plait.ulysses_attention_backward(dout.contiguous(), qkv, outs, lse, ctx.key, ctx.kv_heads)
    return dq, dk, dv, None, None


_op.register_autograd(_grad, setup_context=_setup)


def attend(cp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence by all-to-all; `cp` is the
    model's `ContextParallel` (see `ContextParallel.attend` for the shapes)."""
    if docs is not None:
        return _attend_masked(cp, q, k, v, docs)
    groups = head_groups(q.shape[1], k.shape[1], cp.cp)
    return torch.ops.plait.ulysses_attention(q, k, v, cp.comm.key(cp.dim), groups)[0]


def _attend_masked(cp, q, k, v, docs: torch.Tensor) -> torch.Tensor:
    """With document masking: one exchange each way (autograd's all-to-alls), a mask from every
    token's document, all-gathered, and the masked attention between them."""
    C, comm, dim = cp.cp, cp.comm, cp.dim
    order, natural = chunk_order(C), _natural(C)
    rep = kv_repeats(k.shape[1], C)
    if rep > 1:
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    # q, k and v leave in one all-to-all: one send buffer, slot j holding the heads rank j gets of
    # each, (C, B, hq/C + 2 hkv/C, T/C, d)
    hq, hkv = q.shape[1] // C, k.shape[1] // C
    send = torch.cat([t.unflatten(1, (C, -1)).movedim(1, 0) for t in (q, k, v)], dim=2)
    got = comm.all_to_all_chunks(send, dim)  # slot i: rank i's tokens of this rank's heads
    gathered = _take(got.movedim(0, 2).flatten(2, 3), natural, axis=2)  # (B, hs, T, d), sequence order
    q, k, v = gathered.split([hq, hkv, hkv], dim=1)
    every = _take(comm.all_gather_along(docs, dim, axis=1, grad="split"), natural, axis=1)  # (B, T)
    T = every.shape[1]
    same = (every[:, :, None] == every[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=same[:, None], enable_gqa=q.shape[1] != k.shape[1])
    out = _take(out, order, axis=2)  # back to rank order: position i <- chunk order[i]
    return comm.all_to_all_along(out, dim, scatter_axis=2, gather_axis=1)
