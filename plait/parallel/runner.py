"""Running one optimizer step's micro-batches through a model part and its engine, without a pipeline.

The runner is what tells the engine where each backward stands in the step (`before_backward(first,
last)`), so the engine never infers it from the forward order. A pipeline executor drives engines
through the same two calls in its schedule's order.
"""

from __future__ import annotations

import torch


def train_step(model, engine, micro_batches, lr: float, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `micro_batches` [(x, y) or (x, y, docs), ...] already on the device:
    forward and backward of each in turn, then the engine's step. Returns (global mean loss, global
    pre-clip grad norm) as device tensors: no host sync here."""
    n = len(micro_batches)
    loss_sum = None
    for i, (x, y, *docs) in enumerate(micro_batches):
        with autocast():
            loss = model(x, y, docs=docs[0] if docs else None) / n
        engine.before_backward(first=i == 0, last=i == n - 1)
        loss.backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    return engine.step(lr, loss_sum)


class Runner:
    """`step(micro_batches, lr)` for a model part and its engine under one autocast policy."""

    def __init__(self, model, engine, autocast):
        self.model, self.engine, self.autocast = model, engine, autocast

    def step(self, micro_batches, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        return train_step(self.model, self.engine, micro_batches, lr, self.autocast)

    @torch.no_grad()
    def loss(self, x, y, docs=None) -> torch.Tensor:
        """The loss of one held-out batch (evaluation mode)."""
        was = self.model.training
        self.model.eval()
        try:
            with self.autocast():
                return self.model(x, y, docs=docs).float()
        finally:
            self.model.train(was)
