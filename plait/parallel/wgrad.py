"""Weight gradients computed later than input gradients: what zero-bubble pipelines (ZB-H1, Qi et
al. 2023) schedule apart as B and W.

For y = x W^T the backward has two matmuls: dx = dy W (which the previous stage is waiting for) and
dW = dy^T x (which nobody waits for). While a `WeightGradStore` defers, the linear layers it serves
compute dx at once and keep (x, dy) for dW; `run(key)` later does the dW matmuls of one
micro-batch and accumulates them through autograd, so gradient hooks (DDP buckets, ZeRO-2/3
reductions) fire as they would have. Norm gains and the embedding keep their gradients in B: they
are a few element-wise passes, not worth deferring.

The served linears stay inside the compiled blocks. Their matmul is a custom op (`plait::linear`)
whose backward calls a second one (`plait::linear_input_grad`) that computes dx and, as a side
effect at run time, hands (x, dy) to the store. Both are opaque to the compiler, which fuses
everything around them as it would around any GEMM, so a zero-bubble block is one graph with one
host call per pass, as in the other schedules (on CPU, with a tiny model where the host is all
there is, a stage's F + B + W issue in 6.1 ms where the linears breaking the graphs took 10.5).

Two compiler settings make the hand-over safe: the side-effect op is never dropped as dead code,
and a served block compiles without buffer reuse (`COMPILE_OPTIONS`): inductor would otherwise
write later results into the buffers of x and dy - directly or in place - once the op, to its
knowledge their last reader, returned (either setting turned back on corrupts dW; the test in
tests/test_pipeline.py compiles with inductor).
Freed buffers still go back to the caching allocator, which cannot hand out one the store holds.
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

    def keep(self, weight: Tensor, x: Tensor, dy: Tensor, fmt: int) -> None:
        if self.key is None:
            raise RuntimeError("a zero-bubble linear ran its backward outside WeightGradStore.input_grads_only: "
                               "its weight gradient would be lost")
        self.pending[self.key].append((weight, x, dy, fmt))

    def run(self, key) -> None:
        """The deferred dW of micro-batch `key`, accumulated into .grad through autograd."""
        items = self.pending.pop(key, [])
        if not items:
            return
        targets = self._parameters([w for w, _, _, _ in items])
        grads = [_weight_grad(dy, x, w, fmt) for w, x, dy, fmt in items]
        torch.autograd.backward(targets, grads)

    def _parameters(self, weights: list[Tensor]) -> list[Tensor]:
        """The parameter (or the rows of it: a replicated KV head) each kept weight tensor is. Inside
        a compiled graph the op sees plain tensors, so they are found by address among the served
        weights as they are now (an engine may have moved them into its flat buffer)."""
        spans = []
        for lin in self.linears:
            p = lin.weight
            spans.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), p))
        out = []
        for w in weights:
            at = w.data_ptr()
            p = next((p for a, e, p in spans if a <= at < e), None)
            if p is None or not w.is_contiguous():
                raise RuntimeError(f"a deferred weight gradient of shape {tuple(w.shape)} matches no served weight")
            if at == p.data_ptr() and w.shape == p.shape:
                out.append(p)
            else:
                first = (at - p.data_ptr()) // p.element_size()
                out.append(p.view(-1)[first:first + w.numel()].view(w.shape))
        return out

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

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight)

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ weight^T for this layer's weight or part of it (a replicated KV head's rows): the
        deferred gradient flows through the slice to the parameter."""
        fmt = self.fmt if self.fmt != BF16 and aligned(x, weight) else BF16
        return linear(x.to(weight.dtype), weight, fmt, self.store_number)


def _weight_grad(dy, x, weight, fmt):
    if fmt != BF16:
        return weight_grad_gemm(dy, x, fmt == ROWWISE, weight.dtype)
    return (dy.flatten(0, -2).t() @ x.flatten(0, -2).to(dy.dtype)).to(weight.dtype)


@torch.library.custom_op("plait::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, fmt: int, store: int) -> Tensor:
    """x @ weight^T in bf16 or FP8; its backward defers dW to store number `store`."""
    return F.linear(x, weight) if fmt == BF16 else forward_gemm(x, weight, fmt == ROWWISE)


@linear.register_fake
def _(x, weight, fmt, store):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("plait::linear_input_grad", mutates_args=())
def linear_input_grad(dy: Tensor, x: Tensor, weight: Tensor, fmt: int, store: int) -> Tensor:
    """dx = dy @ weight; keeps (x, dy) in the store for the deferred dW."""
    _STORES[store].keep(weight, x, dy, fmt)
    if fmt == BF16:
        return (dy @ weight.to(dy.dtype)).to(x.dtype)
    return input_grad_gemm(dy, weight, fmt == ROWWISE, x.dtype)


@linear_input_grad.register_fake
def _(dy, x, weight, fmt, store):
    return x.new_empty(x.shape)


torch.fx.node.has_side_effect(torch.ops.plait.linear_input_grad.default)  # never dead code


def _setup(ctx, inputs, output):
    x, weight, fmt, store = inputs
    ctx.save_for_backward(x, weight)
    ctx.fmt, ctx.store = fmt, store


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    return torch.ops.plait.linear_input_grad(dy, x, weight, ctx.fmt, ctx.store), None, None, None


linear.register_autograd(_backward, setup_context=_setup)
