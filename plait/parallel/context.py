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


def bookkeeping_bytes(q_elems: float, kv_elems: float, cp: int, e: float = 2.0) -> tuple[float, float]:
    """(forward, backward) bytes the ring's own element-wise work reads and writes per layer and
    micro-batch, beside the attention kernels, on the rank where they add up to most (`ring_calls`
    gives each rank its plan): `q_elems` elements of a rank's queries (b x T/cp x heads x head
    dim), `kv_elems` of its keys, `e` the inputs' bytes per element; the running output, dQ and the
    dK/dV accumulators in fp32. Forward: K/V stacked to travel; a chunk of the queries or of a held
    block made contiguous where a step attends one chunk (the queries' once); the first output
    widened to fp32; each later block merged in place (mul_ + addcmul_) over the queries it met;
    the output narrowed back. Backward: dQ and the accumulators zeroed, added into at every step
    over what each step met, narrowed at the end; K/V stacked and chunked again; the queries, their
    gradient and output chunked once. The log-sum-exp's, 1/head-dim of these, are left out."""
    a, frac = 4.0, {"both": 1.0, "early": 0.5, "late": 0.5}
    best = (0.0, 0.0)
    for r in range(cp):
        fwd = 4 * e * kv_elems + (a + e) * q_elems  # the stack; the output narrowed back
        bwd = 4 * e * kv_elems + (a + a + e) * q_elems + (2 * a + 2 * (a + e)) * kv_elems  # zeroed, narrowed
        q_parts = set()
        for step, ((qp, kp, _),) in enumerate(ring_calls(cp, r)):
            fq, fk = frac[qp], frac[kp]
            if kp != "both":
                fwd += 2 * e * kv_elems
                bwd += 2 * e * kv_elems
            if qp != "both" and qp not in q_parts:
                q_parts.add(qp)
                fwd += e * q_elems  # the query chunk, read and written once
                bwd += 3 * e * q_elems  # the queries, their gradient and the output, once each
            fwd += (e + a) * q_elems if step == 0 else (4 * a + e) * q_elems * fq
            bwd += (2 * a + e) * (q_elems * fq + 2 * kv_elems * fk)
        if fwd + bwd > sum(best):
            best = (fwd, bwd)
    return best


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


class _Parts:
    """A tensor's early / late / both chunks along `dim` as contiguous tensors, each copied once
    however many ring steps ask for it (the kernels take contiguous inputs)."""

    def __init__(self, x: torch.Tensor | None, dim: int = 2):
        self.x, self.dim, self.made = x, dim, {}

    def __getitem__(self, part: str) -> torch.Tensor | None:
        if self.x is None or part == "both":
            return self.x
        if part not in self.made:
            self.made[part] = _part(self.x, part, self.dim).contiguous()
        return self.made[part]


def _ring_forward(q, k, v, docs, comm, dim) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries over every rank's keys, in the accumulation dtype. Each
    block's output is merged into the fp32 running output in place, in the kernel's own dtype."""
    C, r = comm.size(dim), comm.rank(dim)
    scale = q.shape[-1] ** -0.5
    how = blk.kernel(q, docs, k)
    groups = 1 if how in blk.NATIVE_GQA else q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # 16-bit inputs merge in fp32
    q = q.contiguous()
    qs, qdocs = _Parts(q), _Parts(docs, 1)
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
            b_out, b_lse = blk.forward(qs[qp], _part(kk, kp).contiguous(), _part(vv, kp).contiguous(),
                                       kind == "causal", scale, how, qdocs[qp], _part(kdocs, kp, 1), cast=False)
            if out is None:  # the first call covers every query (batched or not, the own block's causal one)
                out, lse = _first(q, b_out, b_lse, qp, acc)
                continue
            o, l_ = _part(out, qp), _part(lse, qp)
            new = torch.logaddexp(l_, b_lse)
            safe = blk._no_inf(new)
            o.mul_(torch.exp(l_ - safe).unsqueeze(-1)).addcmul_(b_out, torch.exp(b_lse - safe).unsqueeze(-1))
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
    """(dq, dk, dv): the ring again. Each block's dK/dV accumulates in an fp32 buffer that travels
    with it: a rank adds its share into the buffer it received, in place, and sends it on while it
    attends the next block; the last hop brings each block's buffer home to its owner."""
    C, r = comm.size(dim), comm.rank(dim)
    scale = q.shape[-1] ** -0.5
    how = blk.kernel(q, docs, k)
    groups = 1 if how in blk.NATIVE_GQA else q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    q, dout, out, lse = q.contiguous(), dout.contiguous(), out.contiguous(), lse.contiguous()
    qs, douts, outs, lses, qdocs = _Parts(q), _Parts(dout), _Parts(out), _Parts(lse), _Parts(docs, 1)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    block = [torch.stack([k, v]).contiguous()] + ([docs.contiguous()] if docs is not None else [])
    nxt, prv = (r + 1) % C, (r - 1) % C
    moving = None  # (received buffers, pending exchange) of the accumulator on its way
    for step, calls in enumerate(ring_calls(C, r, batched=how in blk.NATIVE_GQA)):
        pending = None
        if step < C - 1:
            incoming, pending = _exchange(comm, dim, block, nxt, prv, async_op=True)
        kk, vv = _expand(block[0][0], groups), _expand(block[0][1], groups)
        kdocs = block[1] if docs is not None else None
        shares = []
        for qp, kp, kind in calls:
            g = blk.backward(douts[qp], qs[qp], _part(kk, kp).contiguous(), _part(vv, kp).contiguous(), outs[qp],
                             lses[qp], kind == "causal", scale, how, qdocs[qp], _part(kdocs, kp, 1), cast=False)
            _part(dq, qp).add_(g[0])
            # fold expanded query-head groups back onto the key/value heads they share
            shares.append((kp, *(x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2) for x in g[1:])))
        if moving is None:  # the own block: nothing has arrived for it
            held = torch.zeros(block[0].shape, dtype=acc, device=k.device)
        else:  # the accumulator of the block now held, sent on by the previous rank
            moving[1].wait()
            held = moving[0][0]
        for kp, dk, dv in shares:
            _part(held[0], kp).add_(dk)
            _part(held[1], kp).add_(dv)
        moving = _exchange(comm, dim, [held], nxt, prv, async_op=True)  # on with the block
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
