"""Context parallelism: each sequence split over `cp` ranks, attention computed as a ring.

Load balance. Causal attention does more work for later tokens, so a contiguous split would give
the last rank C times the first's. Each sequence is cut into 2C chunks and rank r holds chunks r and
2C-1-r (an early and a late one): every rank then does the same attention work. Positions for RoPE
are the tokens' global positions.

Ring attention. Every rank starts with its own K/V (both chunks, only the key/value heads under
grouped-query attention); at each of C steps it attends its queries to the K/V block it holds while
the block moves on to the next rank (non-blocking P2P posted before the block's attention, so the
transfer overlaps it). Per (query chunk, key chunk) pair: an earlier key chunk is attended in full,
the same chunk causally, a later one is skipped (fully masked). Partial outputs merge by log-sum-exp:
  lse = logaddexp(lse_a, lse_b),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).
Backward runs the ring again: each rank recomputes each block's probabilities from its queries and
the final log-sum-exp, adds dQ locally, and adds the block's dK/dV to an accumulator that travels
with the block and ends at the block's owner.

Traffic per layer and micro-batch, in K/V-block bytes (a block = K and V of one rank's tokens,
kv_heads only): forward C-1; backward C-1 blocks and C accumulators (the last hop takes each home).
With document masking each block also carries its tokens' document indices (8 bytes a token).

Each block runs through `plait.parallel.block_attention`: the CPU's flash kernel, or - on GPUs for
now, and always with document masking - a math path in fp32; partial results merge in fp32 either
way. The CPU tests check both against full attention.
"""

from __future__ import annotations

import torch

from plait.parallel import block_attention as blk


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) rank `rank` holds: an early one and its mirror."""
    return rank, 2 * cp - 1 - rank


def block_plan(cp: int, rank: int) -> list[list[tuple[int, int, str]]]:
    """Per ring step, the (local query chunk, key chunk of the block held, kind) pairs computed:
    kind "full" or "causal"; pairs whose key chunk comes after the query chunk are skipped. At step s
    a rank holds the block of rank (rank - s) mod cp."""
    mine = chunk_ids(cp, rank)
    plan = []
    for s in range(cp):
        theirs = chunk_ids(cp, (rank - s) % cp)
        pairs = []
        for qi, qc in enumerate(mine):
            for ki, kc in enumerate(theirs):
                if kc < qc:
                    pairs.append((qi, ki, "full"))
                elif kc == qc:
                    pairs.append((qi, ki, "causal"))
        plan.append(pairs)
    return plan


def work(cp: int, rank: int) -> float:
    """Attention work of a rank in units of one full chunk-by-chunk block (a causal one is half)."""
    return sum(1.0 if kind == "full" else 0.5 for step in block_plan(cp, rank) for _, _, kind in step)


class ContextParallel:
    """A model's context-parallel state over mesh dim `dim` of `comm`."""

    def __init__(self, comm, dim: str = "cp", impl: str = "ring"):
        self.comm, self.dim, self.impl = comm, dim, impl
        self.cp, self.rank = comm.size(dim), comm.rank(dim)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of every sequence: (B, T, ...) -> (B, T/cp, ...)."""
        c = x.shape[1] // (2 * self.cp)
        a, b = chunk_ids(self.cp, self.rank)
        return torch.cat([x[:, a * c:(a + 1) * c], x[:, b * c:(b + 1) * c]], dim=1)

    def positions(self, seq: int, device) -> torch.Tensor:
        """Global positions of this rank's tokens (for RoPE)."""
        return self.local(torch.arange(seq, device=device)[None])[0]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys; q (B, H, T/cp, d),
        k and v (B, Hkv, T/cp, d) in the layout of `local`; returns (B, H, T/cp, d). docs (B, T/cp):
        this rank's tokens' document indices; then a query sees only keys of its document (the
        keys' indices travel around the ring with their block). `impl` "ulysses" exchanges heads
        for sequence by all-to-all instead (`plait.parallel.ulysses`)."""
        if self.impl == "ulysses":
            from plait.parallel import ulysses

            return ulysses.attend(self, q, k, v, docs)
        return _RingAttention.apply(q, k, v, docs, self)


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    c = x.shape[2] // 2
    return [x[:, :, :c], x[:, :, c:]]


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _exchange(comm, dim, tensors, nxt, prv, async_op):
    """Send `tensors` to the next rank and receive the previous rank's in one batched call."""
    incoming = [torch.empty_like(t) for t in tensors]
    pending = comm.send_recv(dim, sends=[(t, nxt) for t in tensors], recvs=[(t, prv) for t in incoming],
                             async_op=async_op)
    return incoming, pending


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, cp: ContextParallel):
        comm, dim, C, r = cp.comm, cp.dim, cp.cp, cp.rank
        groups, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        how = blk.kernel(q, docs)
        acc = torch.promote_types(q.dtype, torch.float32)  # 16-bit inputs merge in fp32
        qs = _blocks(q)
        qdocs = _doc_blocks(docs)
        out = [torch.zeros(x.shape, dtype=acc, device=q.device) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=acc, device=q.device) for x in qs]
        block = [torch.stack([k, v]).contiguous()] + ([docs.contiguous()] if docs is not None else [])  # what travels
        nxt, prv = (r + 1) % C, (r - 1) % C
        for step, pairs in enumerate(block_plan(C, r)):
            pending = None
            if step < C - 1:  # the next block is on its way while this one is attended
                incoming, pending = _exchange(comm, dim, block, nxt, prv, async_op=True)
            kv = block[0]
            ks, vs = _blocks(_expand(kv[0], groups)), _blocks(_expand(kv[1], groups))
            kdocs = _doc_blocks(block[1] if docs is not None else None)
            for qi, ki, kind in pairs:
                b_out, b_lse = blk.forward(qs[qi].contiguous(), ks[ki].contiguous(), vs[ki].contiguous(),
                                           kind == "causal", scale, how, qdocs[qi], kdocs[ki])
                new = torch.logaddexp(lse[qi], b_lse)
                safe = blk._no_inf(new)
                out[qi] = out[qi] * torch.exp(lse[qi] - safe)[..., None] + b_out * torch.exp(b_lse - safe)[..., None]
                lse[qi] = new
            if pending is not None:
                pending.wait()
                block = incoming
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.cp, ctx.how = cp, how
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        cp, how = ctx.cp, ctx.how
        comm, dim, C, r = cp.comm, cp.dim, cp.cp, cp.rank
        groups, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        acc = out.dtype
        qs, dos, outs, lses = _blocks(q), _blocks(dout.contiguous()), _blocks(out), _blocks(lse[..., None])
        qdocs = _doc_blocks(docs)
        dq = [torch.zeros(x.shape, dtype=acc, device=q.device) for x in qs]
        block = [torch.stack([k, v]).contiguous()] + ([docs.contiguous()] if docs is not None else [])
        dkv = torch.zeros(block[0].shape, dtype=acc, device=k.device)  # travels with its block
        nxt, prv = (r + 1) % C, (r - 1) % C
        B, Hkv, T, d = k.shape
        for step, pairs in enumerate(block_plan(C, r)):
            pending = None
            if step < C - 1:
                incoming, pending = _exchange(comm, dim, block, nxt, prv, async_op=True)
            kv = block[0]
            ks, vs = _blocks(_expand(kv[0], groups)), _blocks(_expand(kv[1], groups))
            kdocs = _doc_blocks(block[1] if docs is not None else None)
            dk = [torch.zeros(x.shape, dtype=acc, device=k.device) for x in ks]
            dv = [torch.zeros(x.shape, dtype=acc, device=k.device) for x in vs]
            for qi, ki, kind in pairs:
                g = blk.backward(dos[qi], qs[qi].contiguous(), ks[ki].contiguous(), vs[ki].contiguous(),
                                 outs[qi].contiguous(), lses[qi][..., 0].contiguous(), kind == "causal", scale, how,
                                 qdocs[qi], kdocs[ki])
                dq[qi] += g[0]
                dk[ki] += g[1]
                dv[ki] += g[2]
            # fold the query-head groups back onto the key/value heads they share
            fold = [torch.cat(x, dim=2).view(B, Hkv, groups, T, d).sum(2) for x in (dk, dv)]
            dkv += torch.stack(fold)
            if pending is not None:  # pass the block's accumulator on with the block
                (moved,), _ = _exchange(comm, dim, [dkv], nxt, prv, async_op=False)
                pending.wait()
                block, dkv = incoming, moved
        (home,), _ = _exchange(comm, dim, [dkv], nxt, prv, async_op=False)  # the accumulator held: one hop home
        return torch.cat(dq, dim=2).to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None


def _doc_blocks(docs):
    if docs is None:
        return [None, None]
    c = docs.shape[1] // 2
    return [docs[:, :c], docs[:, c:]]


def apply_cp(model, comm, dim: str = "cp", impl: str = "ring") -> ContextParallel:
    """Split every sequence of `model`'s forward over `dim`: the model localises its tokens and
    targets, and each attention runs the ring (or the all-to-all, `impl` "ulysses")."""
    cp = ContextParallel(comm, dim, impl)
    model.cp = cp
    for block in model.layers.values():
        block.attn.cp = cp
    return cp
