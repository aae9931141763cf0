"""Tensor parallelism (Megatron-style) with optional sequence parallelism, on plait's own model.

The plan, as data (`PLAN`): per parameter, how its weight is cut over the tp ranks. A linear layer
computes y = x W^T with W of shape (out, in):
  column   W split by rows (output features): each rank computes its slice of y from the full x
  row      W split by columns (input features): each rank multiplies its slice of x; the partial
           y's are summed across ranks
  kv       column when there are at least tp key/value heads; otherwise replicated, each rank using
           the one head its query heads share (tp a multiple of kv_heads)
  vocab    the embedding / output matrix split by vocabulary rows, padded to a multiple of tp
  (norm gains are replicated)
So attention is Q/K/V column then output row (heads split over tp), the SwiGLU MLP w1/w3 column
then w2 row. Each region needs the conjugate pair of operators at its ends (Megatron's f and g):
  without SP   enter: identity forward, all-reduce backward   leave: all-reduce forward, identity backward
  with SP      enter: all-gather of the token shards          leave: reduce-scatter into token shards
Sequence parallelism keeps the residual stream, norms and dropout-free elementwise work sharded along
the flattened token axis (B*T/tp tokens per rank): an all-gather + reduce-scatter moves the bytes
of one all-reduce, and the norms' activations and work shrink by tp. Sharding the *flattened*
token axis makes both collectives contiguous along dim 0: no copies around them. A norm gain then
sees only its rank's tokens, so its gradient is a partial sum over tp: the engine all-reduces it.

Traffic per layer and micro-batch (b*s*h activation elements): without SP, 2 all-reduces forward
(attention, MLP) and 2 backward; with SP, 2 all-gathers + 2 reduce-scatters each way. The
embedding leaves its region once (forward all-reduce / reduce-scatter, backward identity /
all-gather); the loss enters once (backward all-reduce / forward all-gather + backward reduce-scatter)
and all-gathers 2 numbers per token per rank for the vocab-parallel logsumexp.

Parameter names never change: `layers.3.attn.wq.weight` on every rank holds rows of the full
tensor, and `TensorSplit.boxes` says which, for checkpoints and initialisation.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from plait.loss import vocab_parallel_cross_entropy, vp_chunk_grad, vp_chunk_stats
from plait.parallel.engine import TensorSplit
from plait.ranges import Box

# parameter-name suffix -> how tensor parallelism cuts it (see the module docstring)
PLAN = {
    "attn.wq.weight": "column", "attn.wk.weight": "kv", "attn.wv.weight": "kv", "attn.wo.weight": "row",
    "mlp.w1.weight": "column", "mlp.w3.weight": "column", "mlp.w2.weight": "row",
    "embed.weight": "vocab", "output.weight": "vocab",
}


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def plan_box(kind: str, full: tuple[int, int], rank: int, tp: int, kv_heads: int, head_dim: int) -> Box | None:
    """The box of a (out, in) weight rank `rank` of `tp` holds, or None where it is replicated."""
    out, inp = full
    if kind == "kv" and kv_heads < tp:
        return None
    if kind in ("column", "kv"):
        return Box(full, (rank * out // tp, 0), (out // tp, inp))
    if kind == "row":
        return Box(full, (0, rank * inp // tp), (out, inp // tp))
    if kind == "vocab":
        rows = padded_vocab(out, tp) // tp
        return Box(full, (rank * rows, 0), (rows, inp))
    raise ValueError(f"unknown tensor-parallel cut {kind!r}")


class TensorParallel:
    """The model's communication points (`plait.model.Dense`) under tensor parallelism over `dim`.
    One instance serves every region of a model, so generation can turn SP off in one place."""

    def __init__(self, comm, dim: str, sequence_parallel: bool, vocab_start: int, vocab_size: int):
        self.comm, self.dim, self.sp = comm, dim, sequence_parallel
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.fns = (vp_chunk_stats, vp_chunk_grad)

    # ---- regions -----------------------------------------------------------------------------------

    def enter(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        if not self.sp:
            return self.comm.copy_to(x, self.dim)  # f: the region's ranks each add a partial input gradient
        full = self.comm.all_gather_along(x, self.dim, axis=0)  # (B*T/tp, dim) -> (B*T, dim)
        return full if seq_len is None else full.view(-1, seq_len, full.shape[-1])  # (B, T, dim)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        if not self.sp:
            return self.comm.reduce_from(y, self.dim)  # g: sum the row-parallel partial outputs
        return self.comm.reduce_scatter_along(y.reshape(-1, y.shape[-1]), self.dim, axis=0)  # (B*T/tp, dim)

    # ---- vocabulary ----------------------------------------------------------------------------------

    def embed(self, table: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the tokens its vocabulary rows hold (zeros for the rest); the sum over
        tp (the region's exit) is every token's embedding."""
        w = table.weight  # (V/tp, dim)
        local = tokens - self.vocab_start
        mine = (local >= 0) & (local < w.shape[0])
        out = F.embedding(torch.where(mine, local, 0), w) * mine[..., None].to(w.dtype)  # (B, T, dim)
        return self.leave(out)

    def logits(self, h: torch.Tensor, weight: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """Full-vocabulary logits (evaluation, generation): each rank's shard, gathered."""
        local = F.linear(self.enter(h, seq_len), weight)  # (B, T, V/tp)
        full = self.comm.all_gather_along(local, self.dim, axis=-1, grad="split")
        return full[..., :self.vocab_size]

    def loss(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_fn, defer=None) -> torch.Tensor:
        h = self.enter(h).reshape(-1, h.shape[-1])  # (B*T, dim) on every rank
        return vocab_parallel_cross_entropy(h, weight, targets.reshape(-1), self.comm, self.dim,
                                            self.vocab_start, self.vocab_size, self.fns, defer)

    def compile_kernels(self) -> None:
        """Fuse the loss's per-chunk arithmetic (as `plait.model.Transformer.ce_chunk_fn` is fused)."""
        self.fns = tuple(torch.compile(f) for f in (vp_chunk_stats, vp_chunk_grad))

    @contextlib.contextmanager
    def inference(self):
        """Generation runs one new position at a time, which cannot be split along the sequence:
        SP is off inside (the same weights; replicated activations instead of token shards)."""
        was, self.sp = self.sp, False
        try:
            yield
        finally:
            self.sp = was


def apply_tp(model, comm, dim: str, sequence_parallel: bool) -> TensorSplit:
    """Cut `model` (built on the meta device) for this rank of `dim`: every planned weight becomes
    this rank's box of it (same parameter name), the regions get their collectives. Returns the
    split for the engine (boxes, and which replicated gradients are partial sums over tp)."""
    cfg = model.cfg
    tp, rank = comm.size(dim), comm.rank(dim)
    hd, kv = cfg.head_dim, cfg.n_kv_heads
    boxes: dict[str, Box] = {}
    partial: set[str] = set()
    modules = dict(model.named_modules())
    for name, p in list(model.named_parameters()):
        kind = next((k for suffix, k in PLAN.items() if name.endswith(suffix)), None)
        if kind is None:
            if sequence_parallel and name.endswith("norm.weight"):
                partial.add(name)  # each rank normalises only its tokens
            continue
        box = plan_box(kind, tuple(p.shape), rank, tp, kv, hd)
        owner = modules[name.rsplit(".", 1)[0]]
        if box is None:  # replicated KV heads: this rank's query heads all use head rank*kv/tp
            head = rank * kv // tp
            modules[name.rsplit(".", 2)[0]].kv_rows = slice(head * hd, (head + 1) * hd)
            partial.add(name)  # only the rows of the head a rank uses get its gradient
            continue
        owner.weight = nn.Parameter(torch.empty(box.shape, device=p.device, dtype=p.dtype))
        if isinstance(owner, nn.Linear):
            owner.out_features, owner.in_features = box.shape
        else:  # nn.Embedding
            owner.num_embeddings = box.shape[0]
        boxes[name] = box
    model.tie()  # the tied output matrix is the embedding's shard again
    if cfg.tie_embeddings and "embed.weight" in boxes:
        boxes["output.weight"] = boxes["embed.weight"]
    rows = padded_vocab(cfg.vocab_size, tp) // tp
    strategy = TensorParallel(comm, dim, sequence_parallel, rank * rows, cfg.vocab_size)
    model.tp = strategy
    for block in model.layers.values():
        block.attn.tp = block.mlp.tp = strategy
    split = TensorSplit(boxes, frozenset(partial))
    model.tensor_split = split
    return split
