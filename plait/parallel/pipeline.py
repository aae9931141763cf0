"""The pipeline executor: one loop that runs any schedule's per-rank action list.

A schedule (`plait.parallel.schedules`) is data: for this rank, an ordered list of F, B, W and
SEND_F / RECV_F / SEND_B / RECV_B actions. The executor walks it:
  - a run of consecutive sends and receives goes out as one batched non-blocking P2P call (its
    receive buffers allocated from the known activation shape) and is completed before the next
    compute action - exactly the rendezvous execution `schedules.check` proves deadlock-free;
  - F runs a chunk's layers on the received activation (stage 0: on the tokens; ZB-V's stage pp on
    the last rank: on stage pp - 1's output, handed over on the rank without a message, as B hands
    the gradient back);
  - B runs backward from the chunk's output with the received gradient and leaves the gradient of
    the chunk's input to be sent; in a zero-bubble schedule B computes input gradients only and W
    the deferred weight gradients (`plait.parallel.wgrad`). The last stage's B first runs the
    output head and the loss of the micro-batch (divided by the number of micro-batches) on the
    hidden states its F kept, then backward from that loss (in a zero-bubble schedule the output
    matrix's gradient waits for the stage's W: `plait.loss.linear_cross_entropy`'s `defer`). plait's
    fused loss forms the head's gradients while it computes the loss, so it costs as much as 3-4
    layers; in F it would make the last stage's forward the slowest action of every schedule, which
    GPipe's all-forward phase runs at the pace of (the planner prices 1b's GPipe step on 4 x H100
    1.15x longer so). Its F and B
    together are unchanged;
    1F1B, interleaved and ZB-H1 run the pair back to back on the last stage anyway;
  - before every action that produces parameter gradients the engine is told whether it is the
    first / last of the step for this rank (`Engine.before_backward`), in the order they run.
No global synchronisation between actions; nothing is kept for a micro-batch once its backward ran:
its input, output and received gradient are dropped, and a sent activation's storage is released
once the send completed when nothing of autograd reads it.

Statistics: the last stage's loss is the only loss; the engine's step sums squared norms over every
stage (its statistics all-reduce spans the job). Tied embeddings: stage 0's embedding and the last
stage's output matrix are two copies; the engine adds their gradients over the `pp_ends` group and
both take the same update (ZeRO-2/3 add their reduced chunks: `Sharded._sum_tied_chunks`) (ZB-V holds both stages on rank 0: one matrix, nothing to add).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from plait.host_share import mark
from plait.parallel.schedules import COMPUTE, Schedule, build_schedule, check, place, stage_of


@functools.lru_cache(maxsize=64)
def checked_schedule(name: str, pp: int, m: int, v: int, costs: tuple | None = None) -> Schedule:
    """The schedule's lists, proven well formed and deadlock-free (`schedules.check`) before any rank
    runs them: a wrongly ordered list raises here, on every rank alike, instead of hanging."""
    sched = build_schedule(name, pp, m, v, costs)
    check(sched)
    return sched


@dataclass
class Timeline:
    """Start and end (seconds from the step's start) of every compute action of recorded steps, and
    the seconds the host spent issuing it.

    On CUDA the times are events recorded on the compute stream as the actions are launched, read
    after the step: when the GPU reached each action, waits for arriving activations included, with
    no host synchronisation inside the step (that would remove the overlap being measured). The host
    time says whether an action was launch-bound: where issuing its kernels takes as long as running
    them, the GPU waits on the CPU (small layers, many graph pieces)."""

    enabled: bool = False
    steps: list = field(default_factory=list)

    def begin(self, device, barrier=None) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            torch.cuda.synchronize(device)
        if barrier is not None:  # the ranks start the step together, so their timelines line up
            barrier()
        self._t0 = self.now()
        self.current: list = []

    def now(self):
        """(device mark, host time): a CUDA event recorded on the current stream, or the host clock."""
        return mark(self._cuda)

    def record(self, action, start) -> None:
        # the allocator's bytes once the action is issued (a host counter: no synchronisation): what
        # the rank holds between actions, activations in flight and deferred W's inputs among them
        held = torch.cuda.memory_allocated() if self._cuda else 0
        self.current.append((action.kind, action.microbatch, action.chunk, start, self.now(), held))

    def end(self) -> None:
        end = self.now()[0]
        if self._cuda:
            end.synchronize()
            since = lambda ev: self._t0[0].elapsed_time(ev) / 1e3  # noqa: E731
        else:
            since = lambda t: t - self._t0[0]  # noqa: E731
        # (kind, micro-batch, chunk, device start, device end, host seconds issuing it, bytes held after)
        acts = [(k, mb, c, since(a[0]), since(b[0]), b[1] - a[1], held) for k, mb, c, a, b, held in self.current]
        self.steps.append({"actions": acts, "step_s": since(end)})


class PipelineRunner:
    """`step(micro_batches, lr)` for this pipeline rank's chunks and engine (see the module docstring).

    chunks: per local chunk, the keys of its layers in `model.layers`; stage of chunk c: `stage_of`
    (c * pp + rank; ZB-V's V: rank, then 2 pp - 1 - rank).
    act_shape(batch, seq) -> the shape of an activation crossing stages (SP: (B*T/tp, dim)).
    costs: per stage, the relative (F, B, W) times ZB-V's order is found with (`stages.stage_work`;
    every rank passes the same).
    """

    def __init__(self, model, engine, comm, schedule_name: str, pp: int, v: int, rank: int, chunks,
                 autocast, act_shape, dtype, store=None, pp_dim: str = "pp", costs: tuple | None = None):
        self.model, self.engine, self.comm, self.autocast = model, engine, comm, autocast
        self.name, self.pp, self.v, self.rank, self.chunks = schedule_name, pp, v, rank, chunks
        self.S = pp * v
        self.act_shape, self.dtype, self.store, self.pp_dim, self.costs = act_shape, dtype, store, pp_dim, costs
        self.timeline = Timeline()
        self.in_flight_peak = 0  # most micro-batch chunks held between F and B in a step (checked by tests)
        self._connected: set = set()  # activation shapes whose connections `_connect` has made

    def schedule(self, m: int) -> Schedule:
        return checked_schedule(self.name, self.pp, m, self.v, self.costs)

    def stage(self, chunk: int) -> int:
        return stage_of(self.name, self.pp, self.rank, chunk)

    def local_chunk(self, stage: int) -> int | None:
        """This rank's chunk running `stage`, or None when another rank (or no rank) runs it."""
        if not 0 <= stage < self.S:
            return None
        r, c = place(self.name, self.pp, self.v, stage)
        return c if r == self.rank else None

    # ---- one optimizer step --------------------------------------------------------------------------

    def step(self, micro_batches, lr: float):
        m = len(micro_batches)
        actions = self.schedule(m).ranks[self.rank]
        grad_acts = [i for i, a in enumerate(actions) if a.kind in ("B", "W")]
        first_grad, last_grad = grad_acts[0], grad_acts[-1]
        device = micro_batches[0][0].device
        seq = micro_batches[0][0].shape[1]
        self._connect(self.act_shape(micro_batches[0][0].shape[0], seq), device)
        inputs, outputs, grads_in, to_send, targets = {}, {}, {}, {}, {}
        loss_sum = None
        held = peak = 0
        batch: list = []
        self.engine.begin_step()
        if self.timeline.enabled:
            self.timeline.begin(device, lambda: self.comm.barrier(self.pp_dim))

        def flush():
            if batch:
                self._exchange(batch, inputs, outputs, grads_in, to_send, micro_batches, seq, device)
                batch.clear()

        for i, a in enumerate(actions):
            if a.kind not in COMPUTE:
                batch.append(a)
                continue
            flush()
            t0 = self.timeline.now() if self.timeline.enabled else 0.0
            key, s = (a.chunk, a.microbatch), self.stage(a.chunk)
            if a.kind == "F":
                x, y, docs, pos, seq_l = self._local(micro_batches[a.microbatch], seq)
                with self.autocast():
                    h = self.model.hidden(x if s == 0 else None, None if s == 0 else inputs[key], positions=pos,
                                          layers=self.chunks[a.chunk], seq_len=seq_l, docs=docs)
                nxt = self.local_chunk(s + 1)
                if s == self.S - 1:
                    targets[key] = (y, seq_l)  # the head and loss run in B
                elif nxt is not None:  # the next stage is this rank's too (ZB-V's turn): no message
                    inputs[(nxt, a.microbatch)] = h.detach().requires_grad_()
                else:
                    to_send[("act", key)] = h.detach()  # an alias, not a copy
                outputs[key] = h
                held += 1
                peak = max(peak, held)
            elif a.kind == "B":
                self.engine.before_backward(first=i == first_grad, last=i == last_grad)
                out = outputs.pop(key)
                grad = None
                if s == self.S - 1:
                    y, seq_l = targets.pop(key)
                    with self.autocast():
                        out = self.model.head(out, y, seq_l) / m
                    loss_sum = out.detach().float() if loss_sum is None else loss_sum + out.detach().float()
                else:
                    grad = grads_in.pop(key)
                if self.store is not None:
                    with self.store.input_grads_only(key):
                        torch.autograd.backward(out, grad)
                else:
                    torch.autograd.backward(out, grad)
                if s > 0:
                    prv = self.local_chunk(s - 1)
                    if prv is not None:
                        grads_in[(prv, a.microbatch)] = inputs.pop(key).grad
                    else:
                        to_send[("grad", key)] = inputs.pop(key).grad
                held -= 1
            else:  # W: the weight gradients B deferred
                self.engine.before_backward(first=i == first_grad, last=i == last_grad)
                self.store.run(key)
            if self.timeline.enabled:
                self.timeline.record(a, t0)
        flush()
        self.in_flight_peak = max(self.in_flight_peak, peak)
        if self.timeline.enabled:
            self.timeline.end()
        return self.engine.step(lr, loss_sum)

    def _local(self, batch, seq: int):
        """(tokens, targets, document indices or None, positions, length) of this rank's part of a
        micro-batch's sequences."""
        x, y, *docs = batch
        docs = docs[0] if docs else None
        cp = self.model.cp
        if cp is None:
            return x, y, docs, None, seq
        docs = cp.local(docs) if docs is not None else None
        return cp.local(x), cp.local(y), docs, cp.positions(seq, x.device), seq // cp.cp

    def write_timeline(self, folder, is_main: bool, m: int) -> dict | None:
        """The recorded steps' per-action times: each rank of the main rank's pipeline writes its
        JSON into `folder`; the main rank then merges them (the last recorded step), draws the PNG and
        returns the measured bubble beside the schedule's (simulated with unit costs, textbook, and
        replayed with the measured action times: see `plait.timeline.replayed_bubble`)."""
        import json
        from pathlib import Path

        import torch.distributed as dist

        from plait import timeline as tl

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # the main rank's pipeline writes: with tp, cp or dp every pipeline rank index has a copy in
        # each other group, and they wrote the same file while the main rank read it
        dims = self.comm.dims
        mine = dims.coords(dist.get_rank()) if dims is not None and dist.is_initialized() else {}
        if all(c == 0 for name, c in mine.items() if name != self.pp_dim):
            path = folder / f"pipeline-rank{self.rank}.json"
            part = path.with_suffix(".json.part")
            part.write_text(json.dumps({"rank": self.rank, "global_rank": dist.get_rank() if mine else 0,
                                        "pp": self.pp, "v": self.v, "schedule": self.name,
                                        "steps": self.timeline.steps, "layers": [len(c) for c in self.chunks]}))
            part.replace(path)
        self.comm.barrier(self.pp_dim)
        if not is_main:
            return None
        ranks = [json.loads((folder / f"pipeline-rank{r}.json").read_text()) for r in range(self.pp)]
        spans = [(r["rank"], a[3], a[4], a[0], a[1], a[2]) for r in ranks for a in r["steps"][-1]["actions"]]
        counts = [ranks[r]["layers"][c] for r, c in (place(self.name, self.pp, self.v, s) for s in range(self.S))]
        out = {"schedule": self.name, "pp": self.pp, "v": self.v, "microbatches": m,
               **tl.report(spans, self.schedule(m), counts), "step_s": max(r["steps"][-1]["step_s"] for r in ranks),
               "host_share": tl.host_share([r["steps"][-1]["actions"] for r in ranks]),
               "held_after_action": tl.held([r["steps"][-1]["actions"] for r in ranks])}
        (folder / "pipeline.json").write_text(json.dumps({**out, "spans": spans}, indent=1))
        try:
            tl.draw(spans, self.pp, self.v, folder / "pipeline.png",
                    f"measured {self.name}, pp {self.pp}, {m} micro-batches: bubble {out['measured_bubble']:.1%} "
                    f"(replayed {out['replayed_bubble']:.1%}, equal stages {out['simulated_bubble']:.1%})")
        except Exception as e:  # noqa: BLE001 (no matplotlib: the JSON holds everything)
            out["png"] = f"not drawn: {e}"
        return out

    @torch.no_grad()
    def loss(self, x, y, docs=None):
        """The loss of one held-out batch, forward through every stage in order (evaluation): the
        last stage returns it, every other rank None. The stage's parameters must be whole: the
        caller brackets its batches with `Engine.begin_step` / `end_forward_only` (ZeRO-3)."""
        was = self.model.training
        self.model.eval()
        seq, out, h = x.shape[1], None, None
        self._connect(self.act_shape(x.shape[0], seq), x.device)
        x, y, docs, pos, seq_l = self._local((x, y) if docs is None else (x, y, docs), seq)
        rank_of = [place(self.name, self.pp, self.v, s)[0] for s in range(self.S)]
        try:
            for s in range(self.S):
                if rank_of[s] != self.rank:
                    continue
                if s > 0 and rank_of[s - 1] != self.rank:
                    h = torch.empty(self.act_shape(x.shape[0], seq), dtype=self.dtype, device=x.device)
                    self.comm.send_recv(self.pp_dim, recvs=[(h, rank_of[s - 1])])
                with self.autocast():
                    h = self.model.hidden(x if s == 0 else None, h, positions=pos, layers=self.chunks[self.local_chunk(s)],
                                          seq_len=seq_l, docs=docs)
                    if s == self.S - 1:
                        out = self.model.head(h, y, seq_l).float()
                if s < self.S - 1 and rank_of[s + 1] != self.rank:
                    self.comm.send_recv(self.pp_dim, sends=[(h, rank_of[s + 1])])
        finally:
            self.model.train(was)
        return out

    def _connect(self, shape, device) -> None:
        """Open every link this rank's schedule uses, on all ranks at once, before the schedule runs.

        NCCL connects two ranks the first time they exchange a message, and the CPU waits in that call
        until the peer makes the same connection. Left to the schedule, a rank can wait there on a peer
        that is itself waiting for a third rank (or for its GPU, which waits on the first): GPipe and
        interleaved 1F1B hung so on 4 GPUs. One exchange of activation-sized buffers with both
        neighbours (the wrap-around too when chunks loop, v > 1) makes every connection together; the
        size matters, as NCCL may use more channels for larger messages. Not counted as traffic."""
        if shape in self._connected or self.pp == 1:
            return
        self._connected.add(shape)
        loop = self.v > 1 and self.name != "zbv"  # ZB-V's chunks turn back at the last rank: no wrap-around
        nxt = (self.rank + 1) % self.pp if loop or self.rank < self.pp - 1 else None
        prv = (self.rank - 1) % self.pp if loop or self.rank > 0 else None
        peers = [p for p in (nxt, prv) if p is not None]
        sends = [(torch.zeros(shape, dtype=self.dtype, device=device), p) for p in peers]
        recvs = [(torch.empty(shape, dtype=self.dtype, device=device), p) for p in reversed(peers)]
        self.comm.send_recv(self.pp_dim, sends=sends, recvs=recvs, record=False)

    def _exchange(self, batch, inputs, outputs, grads_in, to_send, micro_batches, seq, device) -> None:
        """Post one batch of sends and receives, complete it, file what arrived."""
        sends, recvs, filed, sent = [], [], [], []
        for a in batch:
            key = (a.chunk, a.microbatch)
            if a.kind in ("SEND_F", "SEND_B"):
                t = to_send.pop(("act" if a.kind == "SEND_F" else "grad", key))
                sends.append((t, a.peer))
                sent.append(t)
            else:
                b = micro_batches[a.microbatch][0].shape[0]
                buf = torch.empty(self.act_shape(b, seq), dtype=self.dtype, device=device)
                recvs.append((buf, a.peer))
                filed.append((a, buf))
        self.comm.send_recv(self.pp_dim, sends=sends, recvs=recvs)
        for a, buf in filed:
            key = (a.chunk, a.microbatch)
            if a.kind == "RECV_F":
                inputs[key] = buf.requires_grad_()
            else:
                grads_in[key] = buf
        del sent  # the sent tensors' last references here: activations live on only as autograd needs them
        for a in batch:
            if a.kind == "SEND_F":
                release(outputs.get((a.chunk, a.microbatch)))


def release(out) -> None:
    """Free a sent activation's storage when backward cannot read it: the output of the residual add
    that ends every block (its backward needs no values; autograd keeps only the graph and the shape).
    A compiled block's output may be saved inside its graph, so it is kept."""
    if out is not None and out._base is None and type(out.grad_fn).__name__ == "AddBackward0":
        out.untyped_storage().resize_(0)
