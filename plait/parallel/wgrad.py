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
        weights = [w for w, _, _ in items]
        grads = [(dy.flatten(0, -2).t() @ x.flatten(0, -2).to(dy.dtype)).to(w.dtype) for w, x, dy in items]
        torch.autograd.backward(weights, grads)

    def serve(self, linear: nn.Linear) -> None:
        """Route `linear`'s forward through this store (in place: parameters, names and hooks stay)."""
        linear.__class__ = DeferrableLinear
        linear.store = self


class DeferrableLinear(nn.Linear):
    """A linear whose weight gradient its store may defer. A class, not a bound forward per module:
    compiled blocks then guard on the same code and share one graph set."""

    store: WeightGradStore

    @torch._dynamo.disable  # a graph break: the deferral is a side effect of backward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.store)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] else None
        store = ctx.store
        if store.key is not None:
            store.pending[store.key].append((weight, x, dy))
            return dx, None, None
        dw = (dy.flatten(0, -2).t() @ x.flatten(0, -2).to(dy.dtype)).to(weight.dtype)
        return dx, dw, None
