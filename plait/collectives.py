"""Reference collective algorithms built from point-to-point sends only.

    ring_reduce_scatter(x, group)   N-1 steps: pass a chunk right, add what comes from the left
    ring_all_gather(x, group)       N-1 steps: pass the newest complete chunk right, store it
    ring_all_reduce(x, group)       = the two: 2S(N-1)/N bytes per device, bandwidth-optimal
    recursive_doubling_all_reduce   log2 N steps exchanging the whole vector: fewer, larger messages,
                                    the better choice when latency, not bandwidth, dominates

plait uses torch.distributed (NCCL) for real work; these show and verify the algorithms and are
benchmarked against NCCL (`plait bench comm`). Any size (the N chunks differ by at most one
element), any dtype torch can add or compare, any group size, ops sum / avg / max / min. Every rank
ends with bitwise identical results: ring all-gather copies each finished chunk from its owner, and
recursive doubling adds a+b on one side and b+a on the other, which IEEE addition makes equal.

Speed on GPUs: every step exchanges with both neighbours in one `batch_isend_irecv`, received
chunks land in a preallocated buffer and are added in place, and chunks are contiguous slices of one
flat buffer. With `pipeline=k` each chunk is cut into k pieces so that piece j+1 is on the wire while
piece j is being added; without it each step serialises transfer then reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Ring:
    """This rank's place in a group: index, size, global ranks of the neighbours."""

    def __init__(self, group):
        self.pg = group
        self.n = dist.get_world_size(group)
        self.r = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.n))
        self.right, self.left = ranks[(self.r + 1) % self.n], ranks[(self.r - 1) % self.n]
        self.ranks = ranks


def _bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of n chunks covering numel elements; the first numel % n chunks get one more."""
    q, rem = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (i < rem)
        out.append((start, end))
        start = end
    return out


def _reducer(op: str):
    if op in ("sum", "avg"):
        return lambda acc, inc: acc.add_(inc)
    if op == "max":
        return lambda acc, inc: torch.maximum(acc, inc, out=acc)
    if op == "min":
        return lambda acc, inc: torch.minimum(acc, inc, out=acc)
    raise ValueError(f"unknown reduction {op!r}; choose sum, avg, max or min")


def _exchange(ring: _Ring, send: torch.Tensor, recv: torch.Tensor) -> list:
    """Send right and receive from the left at once; empty pieces (tiny tensors) are skipped, which
    both ends agree on because a piece has the same size on the sending and the receiving side."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, ring.right, ring.pg))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, ring.left, ring.pg))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    """Wait for and forget each work: waiting twice on a finished gloo send blocks forever."""
    while works:
        works.pop().wait()


def _ring_reduce_scatter(buf, ring, bounds, shift, op, pipeline, trace):
    """In place on flat `buf`: afterwards rank r's chunk (r + shift) % N holds the full reduction.

    Step s: send chunk (r + shift - s - 1) right, receive chunk (r + shift - s - 2) from the left and
    reduce it into the local copy. What arrives was reduced over s + 1 ranks, so after N - 1 steps
    the chunk received last, (r + shift) % N, has all N contributions.
    """
    n, r = ring.n, ring.r
    reduce = _reducer(op)
    pieces = [_bounds(e - s, pipeline) for s, e in bounds]
    # One receive slot per piece, allocated once: chunks differ by an element, so pieces of two
    # chunks could overlap in a shared buffer while one of them is still arriving.
    tmp = buf.new_empty((pipeline, max(b - a for p in pieces for a, b in p)))

    def issue(step, j):
        c_send, c_recv = (r + shift - step - 1) % n, (r + shift - step - 2) % n
        (a, b), (ra, rb) = pieces[c_send][j], pieces[c_recv][j]
        return _exchange(ring, buf[bounds[c_send][0] + a: bounds[c_send][0] + b], tmp[j, : rb - ra])

    works = [issue(0, j) for j in range(pipeline)]
    for step in range(n - 1):
        c_recv = (r + shift - step - 2) % n
        for j in range(pipeline):
            _wait(works[j])
            ra, rb = pieces[c_recv][j]
            reduce(buf[bounds[c_recv][0] + ra: bounds[c_recv][0] + rb], tmp[j, : rb - ra])
            if step + 1 < n - 1:
                works[j] = issue(step + 1, j)  # piece j's next hop leaves while piece j+1 is reduced
        if trace:
            trace("reduce-scatter", step + 1, (r + shift - step - 1) % n, c_recv, buf)
    own = (r + shift) % n
    if op == "avg":
        buf[bounds[own][0]: bounds[own][1]].div_(n)
    return own


def _ring_all_gather(buf, ring, bounds, shift, pipeline, trace):
    """In place on flat `buf` where rank r holds chunk (r + shift) % N: afterwards all chunks.

    Step s: send chunk (r + shift - s) right (the one completed or received last), receive chunk
    (r + shift - s - 1) from the left straight into its place: no copies, no extra memory.
    """
    n, r = ring.n, ring.r
    pieces = [_bounds(e - s, pipeline) for s, e in bounds]
    works = [[] for _ in range(pipeline)]
    for step in range(n - 1):
        c_send, c_recv = (r + shift - step) % n, (r + shift - step - 1) % n
        for j in range(pipeline):
            _wait(works[j])  # the piece to forward must have arrived (gloo runs ops on its own threads)
            (a, b), (ra, rb) = pieces[c_send][j], pieces[c_recv][j]
            s0, r0 = bounds[c_send][0], bounds[c_recv][0]
            works[j] = _exchange(ring, buf[s0 + a: s0 + b], buf[r0 + ra: r0 + rb])
        if trace:
            for w in works:
                _wait(w)
            trace("all-gather", step + 1, c_send, c_recv, buf)
    for w in works:
        _wait(w)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)


def ring_all_reduce(x: torch.Tensor, group=None, op: str = "sum", pipeline: int = 1, trace=None):
    """All-reduce `x` in place with ring reduce-scatter + ring all-gather; returns x.

    As in the seed walk-through, GPU i first sends chunk i; it therefore ends the reduce-scatter
    owning chunk (i + 1) % N, which the all-gather then passes around the ring.
    trace(phase, step, sent_chunk, received_chunk, flat_buffer) is called after every step.
    """
    ring = _Ring(group)
    if ring.n == 1:
        return x.div_(1) if op == "avg" else x
    buf = _flat(x)
    bounds = _bounds(buf.numel(), ring.n)
    pipeline = max(1, min(pipeline, bounds[-1][1] - bounds[-1][0]))
    _ring_reduce_scatter(buf, ring, bounds, 1, op, pipeline, trace)
    _ring_all_gather(buf, ring, bounds, 1, pipeline, trace)
    if buf.data_ptr() != x.data_ptr():
        x.copy_(buf.view_as(x))
    return x


def ring_reduce_scatter(x: torch.Tensor, group=None, op: str = "sum", pipeline: int = 1, inplace: bool = False):
    """Reduce `x` over the group; rank r gets chunk r of x.flatten() (chunks as `_bounds`).

    When x.shape[0] is divisible by N the result has torch's shape (x.shape[0] // N, *x.shape[1:]).
    x is left unchanged (the reduction runs in a copy) unless `inplace`, which saves that copy (an
    extra read and write of S per call) and returns a view into x, whose other chunks are then junk.
    """
    ring = _Ring(group)
    buf = _flat(x) if inplace else x.reshape(-1).clone()
    bounds = _bounds(buf.numel(), ring.n)
    if ring.n > 1:
        pipeline = max(1, min(pipeline, bounds[-1][1] - bounds[-1][0]))
        _ring_reduce_scatter(buf, ring, bounds, 0, op, pipeline, None)
    elif op == "avg":
        buf.div_(1)
    s, e = bounds[ring.r]
    out = buf[s:e] if inplace else buf[s:e].clone()
    if x.dim() and x.shape[0] % ring.n == 0:
        out = out.view((x.shape[0] // ring.n,) + tuple(x.shape[1:]))
    return out


def ring_all_gather(x: torch.Tensor, group=None, pipeline: int = 1, out: torch.Tensor | None = None):
    """Concatenate every rank's `x` (same shape on all ranks) along dim 0 (into contiguous `out`)."""
    ring = _Ring(group)
    m = x.numel()
    out = x.new_empty(ring.n * m) if out is None else out.view(-1)
    out[ring.r * m: (ring.r + 1) * m].copy_(x.reshape(-1))
    if ring.n > 1 and m:
        _ring_all_gather(out, ring, [(i * m, (i + 1) * m) for i in range(ring.n)], 0, max(1, min(pipeline, m)), None)
    return out.view((ring.n * x.shape[0],) + tuple(x.shape[1:])) if x.dim() else out


def recursive_doubling_all_reduce(x: torch.Tensor, group=None, op: str = "sum"):
    """All-reduce in place by pairwise exchange of the whole vector: ceil(log2 N) (+2) steps.

    For N not a power of two, the first 2*(N - p) ranks (p = largest power of two <= N) pair up:
    each even one hands its vector to its odd neighbour and sits out; the remaining p ranks run
    recursive doubling; the odd ones then hand the result back.
    """
    ring = _Ring(group)
    n, r = ring.n, ring.r
    if n == 1:
        return x.div_(1) if op == "avg" else x
    buf = _flat(x)
    tmp = torch.empty_like(buf)
    reduce = _reducer(op)
    p = 1 << (n.bit_length() - 1)
    rem = n - p

    def exchange(peer_index):
        peer = ring.ranks[peer_index]
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer, ring.pg),
                                      dist.P2POp(dist.irecv, tmp, peer, ring.pg)]))
        reduce(buf, tmp)

    if r < 2 * rem:  # fold the extra ranks in
        if r % 2 == 0:
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, ring.ranks[r + 1], ring.pg)]))
            new = -1
        else:
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, tmp, ring.ranks[r - 1], ring.pg)]))
            reduce(buf, tmp)
            new = r // 2
    else:
        new = r - rem
    if new >= 0:
        mask = 1
        while mask < p:
            partner = new ^ mask
            exchange(partner * 2 + 1 if partner < rem else partner + rem)
            mask <<= 1
    if r < 2 * rem:  # hand the result back to the ranks that sat out
        if r % 2 == 1:
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, ring.ranks[r - 1], ring.pg)]))
        else:
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, ring.ranks[r + 1], ring.pg)]))
    if op == "avg":
        buf.div_(n)
    if buf.data_ptr() != x.data_ptr():
        x.copy_(buf.view_as(x))
    return x


def all_reduce(x: torch.Tensor, group=None, op: str = "sum", small_bytes: int = 256 * 1024, pipeline: int = 1):
    """Recursive doubling below `small_bytes` (latency-bound), ring above (bandwidth-bound)."""
    if x.numel() * x.element_size() < small_bytes:
        return recursive_doubling_all_reduce(x, group, op)
    return ring_all_reduce(x, group, op, pipeline=pipeline)


# ---- the step-by-step walk-through (`plait collectives --trace`) --------------------------------------


def trace_ring_all_reduce(nproc: int = 4) -> str:
    """Run the ring all-reduce on `nproc` real gloo processes and narrate every step.

    Rank r holds 2**r in each of its N one-element chunks, so every value is a bit mask of the
    ranks summed into it: the walk-through is decoded from the data the ring really moved.
    """
    from plait.launch import spawn

    if not 2 <= nproc <= 26:
        from plait.errors import bad_value

        raise bad_value("--nproc", nproc, "the walk-through names ranks A..Z: use 2 to 26 processes")
    return format_trace(spawn(_trace_rank, (nproc,), nproc, timeout_s=120))


def _trace_rank(n: int):
    from plait.config import ParallelConfig
    from plait.launch import init_distributed

    dims = init_distributed(ParallelConfig(nproc=n, timeout_s=60), "cpu")
    x = torch.full((n,), 1 << dims.rank, dtype=torch.int64)
    initial, events = x.tolist(), []
    ring_all_reduce(x, trace=lambda phase, step, sent, got, buf: events.append((phase, step, sent, got, buf.tolist())))
    return initial, events


def format_trace(per_rank) -> str:
    n = len(per_rank)
    letters = [chr(ord("A") + i) for i in range(n)]

    def label(v, c, compact):
        who = [letters[i] for i in range(n) if v >> i & 1]
        return f"sum_{c}" if compact and len(who) == n else "+".join(f"{w}{c}" for w in who)

    def table(states, compact):
        cells = [[label(v, c, compact) for c, v in enumerate(s)] for s in states]
        width = [max(len(row[c]) for row in cells) for c in range(n)]
        return [f"  GPU {i}: [" + "".join((x + ",").ljust(w + 2) for x, w in zip(row[:-1], width))
                + row[-1].ljust(width[-1]) + "]" for i, row in enumerate(cells)]

    def which(k):  # chunk index as a function of i, from GPU 0's index k
        k = k if 2 * k < n else k - n
        return "i" if k == 0 else f"(i{k:+d}) mod {n}"

    states = [initial for initial, _ in per_rank]
    names = ", ".join(f"{letters[i]}=GPU {i}" for i in range(n))
    out = [f"Ring all-reduce on {n} processes (gloo), a vector of {n} chunks; letters name whose data "
           f"a chunk holds ({names}). Decoded from the data the ring moved.", "", "Initial state:"]
    out += table(states, False)
    steps = len(per_rank[0][1]) // 2
    for k in range(2 * steps):
        phase, step = per_rank[0][1][k][:2]
        if step == 1:
            rs = phase == "reduce-scatter"
            out += ["", "=" * 64, f"Phase {1 if rs else 2}: {'ReduceScatter' if rs else 'AllGather'} "
                    f"({steps} steps for {n} GPUs): send one chunk right, receive one from the left; the "
                    f"received chunk is {'ADDED to the local one' if rs else 'STORED (not added)'}.", "=" * 64]
        compact = phase == "all-gather"
        _, _, sent0, got0, _ = per_rank[0][1][k]
        verb = "stores it as" if compact else "adds it into its own copy of"
        out += ["", f"Step {step}: GPU i sends chunk {which(sent0)} right, receives chunk {which(got0)} from the "
                    f"left and {verb} chunk {which(got0)}"]
        for i in range(n):
            _, _, sent, got, _ = per_rank[i][1][k]
            left = (i - 1) % n
            out.append(f"  GPU {i} sends {label(states[i][sent], sent, compact)} to GPU {(i + 1) % n};  receives "
                       f"{label(states[left][got], got, compact)} from GPU {left}")
        states = [per_rank[i][1][k][4] for i in range(n)]
        out += ["  After " + ("adding:" if not compact else "storing:")] + table(states, compact)
        if phase == "reduce-scatter" and step == steps:
            out += ["", f"After phase 1 each GPU holds one complete chunk: GPU i owns chunk (i+1) mod {n}, the one",
                    "it received last (in step 1 it sent its chunk i away, so chunk i cannot end there):"]
            out += [f"  GPU {i}: chunk {(i + 1) % n} = {label(states[i][(i + 1) % n], (i + 1) % n, False)}"
                    for i in range(n)]
    full = all(v == (1 << n) - 1 for s in states for v in s)
    out += ["", f"After phase 2 every GPU holds [{', '.join(f'sum_{c}' for c in range(n))}]: "
            + ("correct." if full else "WRONG."),
            f"Each GPU sent 2(N-1) = {2 * (n - 1)} chunks of S/N: 2S(N-1)/N bytes in all."]
    return "\n".join(out)
