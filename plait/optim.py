"""AdamW on fp32 master weights, the warmup + cosine learning rate, and global-norm clipping.

Precision convention (the ZeRO paper's): with bf16 training the model holds bf16 parameters and
bf16 gradients (2 + 2 bytes per parameter) and the optimizer holds an fp32 master copy plus the two
fp32 Adam moments (K = 12 bytes per parameter). With fp32 training (CPU) the parameters are their
own masters: 4 + 4 + 8 bytes per parameter.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from plait.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices only: decaying norm gains toward 0 just fights the normalisation."""
    return p.ndim >= 2


class MasterAdamW:
    """AdamW whose state and update are fp32 even when the model computes in bf16.

    `params` is (name, parameter) pairs; names key the state, so a checkpoint does not depend on
    the order parameters happen to be listed in on a given layout.
    """

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig):
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        # parameters already in fp32 are their own masters: no copy, no extra memory
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                        for p in self.params]
        self.separate = [m is not p for m, p in zip(self.masters, self.params)]
        on_cuda = bool(self.params) and self.params[0].is_cuda
        groups = [
            {"params": [m for n, m in zip(self.names, self.masters) if decays(n, m)], "weight_decay": cfg.weight_decay},
            {"params": [m for n, m in zip(self.names, self.masters) if not decays(n, m)], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                                     betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     fused=on_cuda, foreach=None if on_cuda else True)
        self.clip = cfg.grad_clip

    def _master_grads(self) -> list[torch.Tensor]:
        grads = []
        for m, p, sep in zip(self.masters, self.params, self.separate):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if sep:
                m.grad = p.grad.float()
            grads.append(m.grad)
        return grads

    @torch.no_grad()
    def step(self, lr: float, sum_sq_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Clip by global norm, update the masters, copy them back into the model. Returns the
        pre-clip norm. `sum_sq_reduce` sums the squared norm over ranks that hold other shards."""
        grads = self._master_grads()
        norm = global_norm(grads, sum_sq_reduce)
        if self.clip > 0:
            # scale without a host sync: factor is 1 when the norm is already under the limit
            factor = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, factor)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        pairs = [(p, m) for p, m, sep in zip(self.params, self.masters, self.separate) if sep]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        return norm

    def zero_grad(self) -> None:
        for p, m, sep in zip(self.params, self.masters, self.separate):
            p.grad = None
            if sep:
                m.grad = None

    def _index(self) -> dict[str, int]:
        """Name -> index in torch's optimizer state_dict (params numbered across groups in order)."""
        by_id = {id(m): n for n, m in zip(self.names, self.masters)}
        flat = [m for g in self.opt.param_groups for m in g["params"]]
        return {by_id[id(m)]: i for i, m in enumerate(flat)}

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 truth of every parameter, by name (what a checkpoint stores as the model)."""
        return {n: m.detach() for n, m in zip(self.names, self.masters)}

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set masters and model parameters from fp32 weights keyed by name."""
        for n, m, p, sep in zip(self.names, self.masters, self.params, self.separate):
            m.copy_(weights[n])
            if sep:
                p.copy_(m)

    def state_dict(self) -> dict:
        """The Adam moments (fp32) keyed by parameter name, independent of parameter order."""
        torch_sd = self.opt.state_dict()
        index = self._index()
        return {"moments": {n: torch_sd["state"][index[n]] for n in self.names if index[n] in torch_sd["state"]}}

    def load_state_dict(self, sd: dict) -> None:
        moments = sd["moments"]
        missing = [n for n in self.names if n not in moments]
        if missing and len(missing) != len(self.names):
            raise KeyError(f"optimizer state lacks {missing[:3]}")
        index = self._index()
        torch_sd = self.opt.state_dict()
        torch_sd["state"] = {index[n]: moments[n] for n in self.names if n in moments}
        # torch's own loader puts each moment on its parameter's device and dtype
        self.opt.load_state_dict(torch_sd)


def global_norm(grads: list[torch.Tensor], sum_sq_reduce=None) -> torch.Tensor:
    """L2 norm over all gradients (fp32), optionally summed across ranks holding other shards."""
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads)
    sum_sq = torch.stack([n.float() for n in norms]).pow(2).sum()
    if sum_sq_reduce is not None:
        sum_sq = sum_sq_reduce(sum_sq)
    return sum_sq.sqrt()
