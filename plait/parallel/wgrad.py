"""Weight gradients computed later than input gradients: what zero-bubble pipelines (ZB-H1, Qi et
al. 2023) schedule apart as B and W.

For y = x W^T the backward has two matmuls: dx = dy W (which the previous stage is waiting for) and
dW = dy^T x (which nobody waits for). While a `WeightGradStore` defers, the linear layers it serves
compute dx at once and keep (x, dy) for dW; `run(key)` later does the dW matmuls of one
micro-batch and accumulates them through autograd, so gradient hooks (DDP buckets, ZeRO-2/3
reductions) fire as they would have. Norm gains and the embedding keep their gradients in B: they
are a few element-wise passes, not worth deferring.

The deferral is a side effect of backward, which a compiled graph cannot carry: the served linears
are left out of the compiled block (`torch._dynamo.disable`), so torch.compile fuses what lies
between them (norms, RoPE, attention, SwiGLU, residuals) into graphs of their own while each
linear, a GEMM either way, runs eagerly with its deferral.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.fp8 import FP8Linear, aligned, forward_gemm, input_grad_gemm, weight_grad_gemm


class WeightGradStore:
    def __init__(self):
        self.key = None  # the micro-batch whose dW are being deferred, or None: compute at once
        self.pending: dict = {}

    @contextlib.contextmanager
    def input_grads_only(self, key):
        """Inside, the served linears defer their weight gradients under `key`."""
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def run(self, key) -> None:
        """The deferred dW of micro-batch `key`, accumulated into .grad through autograd."""
        items = self.pending.pop(key, [])
        if not items:
            return
        weights = [w for w, _, _, _ in items]
        grads = [_weight_grad(dy, x, w, rowwise) for w, x, dy, rowwise in items]
        torch.autograd.backward(weights, grads)

    def serve(self, linear: nn.Linear) -> None:
        """Route `linear`'s forward through this store (in place: parameters, names and hooks stay);
        an FP8 linear (plait.fp8) keeps its recipe for all three of its GEMMs."""
        recipe = getattr(linear, "recipe", None) if isinstance(linear, FP8Linear) else None
        linear.__class__ = DeferrableLinear
        linear.store, linear.rowwise = self, None if recipe is None else recipe == "rowwise"


class DeferrableLinear(nn.Linear):
    """A linear whose weight gradient its store may defer. A class, not a bound forward per module:
    compiled blocks then guard on the same code and share one graph set."""

    store: WeightGradStore
    rowwise: bool | None = None  # None: bf16 GEMMs; else FP8 with rowwise or tensorwise scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight)

    @torch._dynamo.disable  # a graph break: the deferral is a side effect of backward
    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T for this layer's weight or part of it (a replicated KV head's rows): the
        deferred gradient flows through the slice to the parameter."""
        fp8 = self.rowwise if self.rowwise is not None and aligned(x, weight) else None
        return _Linear.apply(x, weight, self.store, fp8)


def _weight_grad(dy, x, weight, rowwise):
    if rowwise is not None:
        return weight_grad_gemm(dy, x, rowwise, weight.dtype)
    return (dy.flatten(0, -2).t() @ x.flatten(0, -2).to(dy.dtype)).to(weight.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store, rowwise):
        if rowwise is not None:
            x = x.to(weight.dtype)
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.rowwise = store, rowwise
        return F.linear(x, weight) if rowwise is None else forward_gemm(x, weight, rowwise)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        rowwise = ctx.rowwise
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight.to(dy.dtype) if rowwise is None else input_grad_gemm(dy, weight, rowwise, x.dtype)
        store = ctx.store
        if store.key is not None:
            store.pending[store.key].append((weight, x, dy, rowwise))
            return dx, None, None, None
        return dx, _weight_grad(dy, x, weight, rowwise), None, None
