"""Context parallelism: each sequence split over `cp` ranks, attention computed as a ring.

Load balance. Causal attention does more work for later tokens, so a contiguous split would give
the last rank C times the first's. Each sequence is cut into 2C chunks and rank r holds chunks r and
2C-1-r (an early and a late one): every rank then does the same attention work. Positions for RoPE
are the tokens' global positions.

Ring attention. Every rank starts with its own K/V (both chunks, only the key/value heads under
grouped-query attention); at each of C steps it attends its queries to the K/V block it holds while
the block moves on to the next rank (non-blocking P2P posted before the block's attention, so the
transfer overlaps it). Per (query chunk, key chunk) pair: an earlier key chunk is attended in full,
the same chunk causally, a later one is skipped (fully masked); the fused kernels attend each ring
step's pairs in one call (`ring_calls`). Partial outputs merge by log-sum-exp:
  lse = logaddexp(lse_a, lse_b),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).
Backward runs the ring again: each rank recomputes each block's probabilities from its queries and
the final log-sum-exp, adds dQ locally, and adds the block's dK/dV to an accumulator that travels
with the block and ends at the block's owner.

Traffic per layer and micro-batch, in K/V-block bytes (a block = K and V of one rank's tokens,
kv_heads only): forward C-1; backward C-1 blocks and C accumulators (the last hop takes each home).
With document masking each block also carries its tokens' document indices (8 bytes a token).

Each block runs through `plait.parallel.block_attention`: the device's fused kernel (the CPU's
flash; cuDNN's, else flash, for 16-bit blocks on a GPU), or - with document masking - a math path in
fp32; partial results merge in fp32 either way. The tests check each against full attention.
"""

from __future__ import annotations

import torch

from plait.comm import resolve_key
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


def ring_calls(cp: int, rank: int, batched: bool = True) -> list[list[tuple[str, str, str]]]:
    """Per ring step, the attention calls a rank makes on the block it holds: (query part, key part,
    kind), a part being "both" chunks, the "early" one or the "late" one. Batched, a step is one
    call: the rank's own block causally over both chunks at once (they are in position order, so
    the square causal mask is the right one), an earlier rank's block with both query chunks against
    its early chunk, a later rank's with the late query chunk against both - 2C-1 fewer calls than
    one per chunk pair, the same work. Unbatched: `block_plan`'s chunk pairs, one call each (the
    math path, whose scores would otherwise be a (2c x 2c) square)."""
    if not batched:
        name = ("early", "late")
        return [[(name[qi], name[ki], kind) for qi, ki, kind in step] for step in block_plan(cp, rank)]
    plan = []
    for s in range(cp):
        held = (rank - s) % cp
        if s == 0:
            plan.append([("both", "both", "causal")])
        elif held < rank:
            plan.append([("both", "early", "full")])
        else:
            plan.append([("late", "both", "full")])
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
        return torch.ops.plait.ring_attention(q, k, v, docs, self.comm.key(self.dim))[0]


def _part(x: torch.Tensor | None, part: str, dim: int = 2) -> torch.Tensor | None:
    """Both of a rank's chunks of `x` along `dim`, or the early or late one (a view)."""
    if x is None or part == "both":
        return x
    c = x.shape[dim] // 2
    return x.narrow(dim, 0, c) if part == "early" else x.narrow(dim, c, c)


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _exchange(comm, dim, tensors, nxt, prv, async_op):
    """Send `tensors` to the next rank and receive the previous rank's in one batched call."""
    incoming = [torch.empty_like(t) for t in tensors]
    pending = comm.send_recv(dim, sends=[(t, nxt) for t in tensors], recvs=[(t, prv) for t in incoming],
                             async_op=async_op)
    return incoming, pending


def _ring_forward(q, k, v, docs, comm, dim) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries over every rank's keys, in the accumulation dtype."""
    C, r = comm.size(dim), comm.rank(dim)
    scale = q.shape[-1] ** -0.5
    how = blk.kernel(q, docs, k)
    groups = 1 if how in blk.NATIVE_GQA else q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # 16-bit inputs merge in fp32
    q = q.contiguous()
    out = lse = None
    block = [torch.stack([k, v]).contiguous()] + ([docs.contiguous()] if docs is not None else [])  # what travels
    nxt, prv = (r + 1) % C, (r - 1) % C
    for step, calls in enumerate(ring_calls(C, r, batched=how in blk.NATIVE_GQA)):
        pending = None
        if step < C - 1:  # the next block is on its way while this one is attended
            incoming, pending = _exchange(comm, dim, block, nxt, prv, async_op=True)
        kk, vv = _expand(block[0][0], groups), _expand(block[0][1], groups)
        kdocs = block[1] if docs is not None else None
        for qp, kp, kind in calls:
            b_out, b_lse = blk.forward(_part(q, qp).contiguous(), _part(kk, kp).contiguous(), _part(vv, kp).contiguous(),
                                       kind == "causal", scale, how, _part(docs, qp, 1), _part(kdocs, kp, 1))
            if out is None:  # the first call covers every query (batched or not, the own block's causal one)
                out, lse = _first(q, b_out, b_lse, qp, acc)
                continue
            o, l_ = _part(out, qp), _part(lse, qp)
            new = torch.logaddexp(l_, b_lse)
            safe = blk._no_inf(new)
            o.mul_(torch.exp(l_ - safe)[..., None]).add_(b_out * torch.exp(b_lse - safe)[..., None])
            l_.copy_(new)
        if pending is not None:
            pending.wait()
            block = incoming
    return out, lse


def _first(q, b_out, b_lse, part, acc):
    """The running (out, lse) after a rank's first call: that call's result where it attended, and
    nothing seen yet (out 0, lse -inf) elsewhere."""
    if part == "both":
        return b_out.to(acc), b_lse.to(acc)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    _part(out, part).copy_(b_out)
    _part(lse, part).copy_(b_lse)
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, docs, comm, dim):
    """(dq, dk, dv): the ring again, each block's dK/dV accumulated in a buffer that travels with it
    (sent on while the next block is attended) and reaches the block's owner after the last hop."""
    C, r = comm.size(dim), comm.rank(dim)
    scale = q.shape[-1] ** -0.5
    how = blk.kernel(q, docs, k)
    groups = 1 if how in blk.NATIVE_GQA else q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    q, dout, out, lse = q.contiguous(), dout.contiguous(), out.contiguous(), lse.contiguous()
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    block = [torch.stack([k, v]).contiguous()] + ([docs.contiguous()] if docs is not None else [])
    nxt, prv = (r + 1) % C, (r - 1) % C
    B, Hkv, T, d = k.shape
    arrived, moving = torch.zeros(block[0].shape, dtype=acc, device=k.device), None  # this block's dK/dV so far
    for step, calls in enumerate(ring_calls(C, r, batched=how in blk.NATIVE_GQA)):
        pending = None
        if step < C - 1:
            incoming, pending = _exchange(comm, dim, block, nxt, prv, async_op=True)
        kk, vv = _expand(block[0][0], groups), _expand(block[0][1], groups)
        kdocs = block[1] if docs is not None else None
        dk = torch.zeros(kk.shape, dtype=acc, device=k.device)
        dv = torch.zeros(vv.shape, dtype=acc, device=k.device)
        for qp, kp, kind in calls:
            g = blk.backward(_part(dout, qp).contiguous(), _part(q, qp).contiguous(), _part(kk, kp).contiguous(),
                             _part(vv, kp).contiguous(), _part(out, qp).contiguous(), _part(lse, qp).contiguous(),
                             kind == "causal", scale, how, _part(docs, qp, 1), _part(kdocs, kp, 1))
            _part(dq, qp).add_(g[0])
            _part(dk, kp).add_(g[1])
            _part(dv, kp).add_(g[2])
        # fold expanded query-head groups back onto the key/value heads they share
        mine = torch.stack([x.view(B, Hkv, groups, T, d).sum(2) for x in (dk, dv)])
        if moving is not None:  # the accumulator of the block now held, sent on by the previous rank
            moving[1].wait()
            arrived = moving[0][0]
        moving = _exchange(comm, dim, [arrived + mine], nxt, prv, async_op=True)  # on with the block
        if pending is not None:
            pending.wait()
            block = incoming
    moving[1].wait()  # the last hop brought this rank's own block's accumulator home
    home = moving[0][0]  # (2, ...): dK and dV, returned as tensors of their own (a registered op's outputs may not alias)
    return dq.to(q.dtype), home[0].to(k.dtype, copy=True), home[1].to(v.dtype, copy=True)


# The ring as registered ops: torch.compile keeps a block that calls it in one graph (the op is
# opaque to it), and selective recomputation keeps its output instead of re-running the ring -
# communication included - in backward. Output in the input dtype, log-sum-exp in fp32 or wider,
# both contiguous.

@torch.library.custom_op("plait::ring_attention", mutates_args=())
def _op_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None,
             key: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _ring_forward(q, k, v, docs, *resolve_key(key))
    return out.to(q.dtype).contiguous(), lse.contiguous()  # a kernel's output may be strided


@_op_ring.register_fake
def _(q, k, v, docs, key):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("plait::ring_attention_backward", mutates_args=())
def _op_ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, docs: torch.Tensor | None,
                      key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, docs, *resolve_key(key))


@_op_ring_backward.register_fake
def _(dout, q, k, v, out, lse, docs, key):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the ring returns them


def _ring_setup(ctx, inputs, output):
    q, k, v, docs, key = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], docs)
    ctx.key = key


def _ring_grad(ctx, dout, dlse):
    q, k, v, out, lse, docs = ctx.saved_tensors
    dq, dk, dv = torch.ops.plait.ring_attention_backward(dout.contiguous(), q, k, v, out, lse, docs, ctx.key)
    return dq, dk, dv, None, None


_op_ring.register_autograd(_ring_grad, setup_context=_ring_setup)


def apply_cp(model, comm, dim: str = "cp", impl: str = "ring") -> ContextParallel:
    """Split every sequence of `model`'s forward over `dim`: the model localises its tokens and
    targets, and each attention runs the ring (or the all-to-all, `impl` "ulysses")."""
    cp = ContextParallel(comm, dim, impl)
    model.cp = cp
    for block in model.layers.values():
        block.attn.cp = cp
    return cp
