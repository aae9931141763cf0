"""Weight gradients computed later than input gradients: what zero-bubble pipelines (ZB-H1, Qi et
al. 2023) schedule apart as B and W.

For y = x W^T the backward has two matmuls: dx = dy W (which the previous stage is waiting for) and
dW = dy^T x (which nobody waits for). While a `WeightGradStore` defers, the linear layers it serves
compute dx at once and keep (x, dy) for dW; `run(key)` later does the dW matmuls of one
micro-batch, adds them into .grad and fires each parameter's post-accumulate hooks as autograd
would, so DDP buckets and ZeRO-2/3 reductions start as they would have. The last stage's fused
loss defers the output matrix's gradient the same way (`keep_fn`): it is a third of the head's
matmuls, which would otherwise all sit in the last stage's B, the action the stages before it wait
on. Norm gains and the embedding keep their gradients in B: a few element-wise passes, not worth
deferring.

The served linears stay inside the compiled blocks. Their forward is the plain GEMM, which the
compiler traces; their backward's dx is an op of plait's (`plait::linear_input_grad`) that
computes it and, as a side effect at run time, hands (x, dy) to the store. The op is opaque to the
compiler, which fuses everything around it as it would around any GEMM, so a zero-bubble block is
one graph with one host call per pass, as in the other schedules. (Breaking the graph around each
linear instead cost a 1b stage's host more time than its GPU took: bench/README.md.)

Two things make the hand-over safe: the op is registered as side-effecting, so the compiler never
drops it as dead code, and a served block compiles without buffer reuse (`COMPILE_OPTIONS`):
inductor would otherwise write later results into the buffers of x and dy - directly or in place -
once the op, to its knowledge their last reader, returned (either setting turned back on corrupts
dW; the test in tests/test_pipeline.py compiles with inductor). Freed buffers still go back to the
caching allocator, which cannot hand out one the store holds.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from plait.fp8 import FP8Linear, aligned, forward_gemm, input_grad_gemm, weight_grad_gemm

# inductor settings for a block whose linears a store serves: x and dy outlive the backward graph
COMPILE_OPTIONS = {"allow_buffer_reuse": False, "inplace_buffers": False}

# the stores by number: a compiled graph reaches its store through an int it was traced with
_STORES: "weakref.WeakValueDictionary[int, WeightGradStore]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()
BF16, TENSORWISE, ROWWISE = -1, 0, 1  # the GEMMs' format, an int the graphs can carry


class WeightGradStore:
    def __init__(self):
        self.key = None  # the micro-batch whose dW are being deferred, or None: no backward may run
        self.pending: dict = {}
        self.later: dict = {}  # micro-batch -> [(parameter, fn)]: gradients formed by a function (`keep_fn`)
        self.linears: list[nn.Linear] = []
        self.number = next(_NUMBERS)
        _STORES[self.number] = self

    @contextlib.contextmanager
    def input_grads_only(self, key):
        """Inside, the served linears defer their weight gradients under `key`."""
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def keep(self, weight: Tensor, x: Tensor, dy: Tensor, fmt: int, shards: tuple[str, ...] = ()) -> None:
        if self.key is None:
            raise RuntimeError("a zero-bubble linear ran its backward outside WeightGradStore.input_grads_only: "
                               "its weight gradient would be lost")
        self.pending[self.key].append((weight, x, dy, fmt, shards))

    def keep_fn(self, param: Tensor, fn) -> None:
        """Defer a gradient of `param` (a leaf) that `fn()` forms: the fused loss's output matrix
        (`plait.loss.linear_cross_entropy`'s `defer`), a third of the head's matmuls."""
        if self.key is None:
            raise RuntimeError("a deferring loss ran its backward outside WeightGradStore.input_grads_only: "
                               "the output matrix's gradient would be lost")
        self.later.setdefault(self.key, []).append((param, fn))

    def run(self, key) -> None:
        """The deferred dW of micro-batch `key`, added into .grad with the hooks fired (a part of a
        parameter, a replicated KV head's rows, through autograd)."""
        for param, fn in self.later.pop(key, []):
            with torch.no_grad():
                _accumulate(param, fn())
        items = self.pending.pop(key, [])
        if not items:
            return
        targets = self._parameters([w for w, *_ in items])  # slices of parameters carry autograd
        items.reverse()  # popped from the end, in the order they were kept
        rows = []
        # one dW at a time, added at once and its (x, dy) let go: formed all first, a chunk's dW sat
        # together beside the activations in flight (9 layers of 8b: 3.9 GB over 1F1B's peak)
        for t in targets:
            w, x, dy, fmt, shards = items.pop()
            with torch.no_grad():  # an eager block's kept x still requires grad; a gradient must not
                g = _weight_grad(dy, x, w, fmt, shards)
                del x, dy
                if t.is_leaf:
                    _accumulate(t, g)
                else:
                    rows.append((t, g))
            del g
        if rows:  # part of a parameter (a replicated KV head's rows): autograd takes it through the slice
            torch.autograd.backward([t for t, _ in rows], [g for _, g in rows])

    def _parameters(self, weights: list[Tensor]) -> list[Tensor]:
        """The parameter (or the rows of it: a replicated KV head) each kept weight tensor is. Inside
        a compiled graph the op sees plain tensors, so they are found by address among the served
        weights as they are now (an engine may have moved them into its flat buffer)."""
        params = [lin.weight for lin in self.linears]
        whole = {(p.data_ptr(), p.shape): p for p in params}
        out = []
        for w in weights:
            p = whole.get((w.data_ptr(), w.shape))
            if p is None:
                out.append(self._rows_of(w, params))
            else:
                out.append(p)
        return out

    @staticmethod
    def _rows_of(w: Tensor, params: list[Tensor]) -> Tensor:
        at = w.data_ptr()
        for p in params if w.is_contiguous() else ():  # rows of a row-major matrix are contiguous
            first = (at - p.data_ptr()) // p.element_size()
            if 0 <= first < p.numel():
                return p.view(-1)[first:first + w.numel()].view(w.shape)
        raise RuntimeError(f"a deferred weight gradient of shape {tuple(w.shape)} matches no served weight")

    def serve(self, linear: nn.Linear) -> None:
        """Route `linear`'s forward through this store (in place: parameters, names and hooks stay);
        an FP8 linear (plait.fp8) keeps its recipe for all three of its GEMMs."""
        recipe = getattr(linear, "recipe", None) if isinstance(linear, FP8Linear) else None
        linear.__class__ = DeferrableLinear
        linear.store_number = self.number
        linear.fmt = BF16 if recipe is None else (ROWWISE if recipe == "rowwise" else TENSORWISE)
        self.linears.append(linear)


class DeferrableLinear(nn.Linear):
    """A linear whose weight gradient its store may defer. A class, not a bound forward per module:
    compiled blocks then guard on the same code and share one graph set."""

    store_number: int
    fmt: int = BF16
    shards: tuple[str, ...] = ()  # an FP8 linear's split operands (plait.fp8.shard_linears)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight)

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ weight^T for this layer's weight or part of it (a replicated KV head's rows): the
        deferred gradient flows through the slice to the parameter."""
        fmt = self.fmt if self.fmt != BF16 and aligned(x, weight) else BF16
        return _DeferredLinear.apply(x.to(weight.dtype), weight, fmt, self.store_number, list(self.shards))


class _DeferredLinear(torch.autograd.Function):
    """The forward is an ordinary GEMM the compiler traces; the backward's dx is the opaque op that
    also hands (x, dy) to the store."""

    @staticmethod
    def forward(ctx, x, weight, fmt, store, shards):
        ctx.save_for_backward(x, weight)
        ctx.fmt, ctx.store, ctx.shards = fmt, store, shards
        return F.linear(x, weight) if fmt == BF16 else forward_gemm(x, weight, fmt == ROWWISE, tuple(shards))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return torch.ops.plait.linear_input_grad(dy, x, weight, ctx.fmt, ctx.store, ctx.shards), None, None, None, None


def _accumulate(p: Tensor, g: Tensor) -> None:
    """What autograd's AccumulateGrad does for a parameter, without a pass of the autograd engine
    (a third of W's host time on 35 linears): add into .grad in place (the engines' flat buffers
    stay the .grad), then run the post-accumulate hooks (DDP buckets, ZeRO reductions)."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        hook(p)


def _weight_grad(dy, x, weight, fmt, shards=()):
    if fmt != BF16:
        return weight_grad_gemm(dy, x, fmt == ROWWISE, weight.dtype, shards)
    g = torch.mm(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
    return g if g.dtype == weight.dtype else g.to(weight.dtype)


# plait::linear_input_grad, defined through torch.library's low-level API: the op is called once per
# linear and micro-batch, and this path costs half the host time of torch.library.custom_op's
_LIB = torch.library.Library("plait", "DEF")
_LIB.define("linear_input_grad(Tensor dy, Tensor x, Tensor weight, int fmt, int store, str[] shards) -> Tensor")


def linear_input_grad(dy: Tensor, x: Tensor, weight: Tensor, fmt: int, store: int, shards: list[str]) -> Tensor:
    """dx = dy @ weight; keeps (x, dy) in the store for the deferred dW."""
    _STORES[store].keep(weight, x, dy, fmt, tuple(shards))
    if fmt == BF16:
        return (dy @ weight.to(dy.dtype)).to(x.dtype)
    return input_grad_gemm(dy, weight, fmt == ROWWISE, x.dtype, tuple(shards))


def _input_grad_shape(dy, x, weight, fmt, store, shards):
    return x.new_empty(x.shape)


_LIB.impl("linear_input_grad", linear_input_grad, "CompositeExplicitAutograd")
_LIB.impl("linear_input_grad", _input_grad_shape, "Meta")  # what the compiler traces with
torch.fx.node.has_side_effect(torch.ops.plait.linear_input_grad.default)  # never dead code
