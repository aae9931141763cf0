"""AdamW on fp32 master weights over a flat parameter space, the LR schedule, global-norm clipping.

Precision convention (the ZeRO paper's): with bf16 training the model holds bf16 parameters and
bf16 gradients (2 + 2 bytes per parameter) and the optimizer holds an fp32 master copy plus the two
fp32 Adam moments (K = 12 bytes per parameter). With fp32 training (CPU) the parameters are their
own masters: 4 + 4 + 8 bytes per parameter.

The optimizer owns a contiguous range [lo, hi) of the flat space (`plait.flat.FlatParams`): all of
it on one device or under DDP, the rank's 1/N under ZeRO. The whole update - unscale/clip, both
moments, decoupled weight decay, the master step and the copy back into the bf16 parameters - is
one elementwise pass, compiled into a single kernel on GPU.
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


def adamw_update(master, exp_avg, exp_avg_sq, grad, param_out, hp):
    """One AdamW step on flat fp32 state, in torch.optim.AdamW's arithmetic order.

    hp = [lr, weight_decay, beta1, beta2, eps, step_size (lr/bc1), bc2_sqrt, clip_factor] as a
    device tensor, so a new learning rate each step never triggers a recompile.
    """
    lr, wd, beta1, beta2, eps, step_size, bc2_sqrt, clip = hp.unbind()
    g = grad.to(master.dtype) * clip
    master.mul_(1 - lr * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * g * g)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    master.sub_(step_size * (exp_avg / denom))
    if param_out is not None:
        param_out.copy_(master)


class FlatAdamW:
    """AdamW over `flat_params[lo:hi]` (a `plait.flat.FlatParams`), keyed for checkpoints by name."""

    def __init__(self, flat, cfg: TrainConfig, lo: int = 0, hi: int | None = None, compile: bool = False):
        self.flat, self.cfg = flat, cfg
        self.lo, self.hi = lo, flat.padded if hi is None else hi
        shard = flat.data[self.lo:self.hi]
        # fp32 parameters are their own masters: no copy, no extra memory
        self.separate = flat.dtype != torch.float32
        self.master = shard.detach().float().clone() if self.separate else shard
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps = 0
        # weight decay applies to the flat prefix of matrices; split this range at that boundary
        self.split = min(max(flat.n_decay - self.lo, 0), self.hi - self.lo)
        self._update = torch.compile(adamw_update, dynamic=False) if compile else adamw_update

    def grad_range(self) -> torch.Tensor:
        """The gradients this optimizer consumes (a view of the flat gradient buffer by default;
        ZeRO replaces it with the reduce-scattered shard)."""
        return self.flat.grad[self.lo:self.hi]

    @torch.no_grad()
    def step(self, lr: float, grad: torch.Tensor | list[tuple[int, torch.Tensor]] | None = None,
             sum_sq_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Clip by global norm, update, write the new weights into the flat parameters. Returns the
        pre-clip global norm. `grad`: the flat gradient of this range (default `grad_range()`), or
        (offset, gradient) segments covering it - ZeRO-3 keeps one per unit, allocated only while a
        step needs it. `sum_sq_reduce` sums the squared norm over ranks holding other shards."""
        grad = self.grad_range() if grad is None else grad
        segments = [(0, grad)] if isinstance(grad, torch.Tensor) else list(grad)
        norm = global_norm([g for _, g in segments], sum_sq_reduce)
        c = self.cfg
        self.steps += 1
        bc1 = 1 - c.beta1 ** self.steps
        bc2 = 1 - c.beta2 ** self.steps
        clip = torch.clamp(c.grad_clip / (norm + 1e-6), max=1.0) if c.grad_clip > 0 else torch.ones_like(norm)
        hp = torch.tensor([lr, c.weight_decay, c.beta1, c.beta2, c.eps, lr / bc1, math.sqrt(bc2), 0.0],
                          dtype=torch.float32)
        hp = hp.to(self.master.device, non_blocking=True)
        hp = torch.cat([hp[:7], clip.reshape(1).to(hp.dtype)])
        hp_plain = torch.cat([hp[:1], hp[1:2] * 0, hp[2:]])  # no weight decay
        params = self.flat.data[self.lo:self.hi] if self.separate else None
        for off, g in segments:
            end = off + g.numel()
            # weight decay covers the prefix [0, split) of the range: cut each segment there
            for a, b, h in ((off, min(end, self.split), hp), (max(off, self.split), end, hp_plain)):
                if a >= b:
                    continue
                self._update(self.master[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b], g[a - off:b - off],
                             params[a:b] if params is not None else None, h)
        return norm

    def zero_grad(self) -> None:
        self.flat.zero_grad()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 truth of every parameter in this range, by name (what checkpoints store)."""
        return self.flat.by_name(self.master, self.lo)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set masters and model parameters from fp32 weights keyed by name."""
        for name, view in self.master_weights().items():
            src = weights[name]
            view.copy_(src if src.shape == view.shape else self._overlap(name, src))
        if self.separate:
            self.flat.data[self.lo:self.hi].copy_(self.master)

    def _overlap(self, name: str, full: torch.Tensor) -> torch.Tensor:
        slot = next(s for s in self.flat.slots if s.name == name)
        a, b = max(slot.offset, self.lo), min(slot.offset + slot.numel, self.hi)
        return full.reshape(-1)[a - slot.offset:b - slot.offset]

    def state_dict(self) -> dict:
        """The Adam moments (fp32) keyed by parameter name, and the step count."""
        m, v = self.flat.by_name(self.exp_avg, self.lo), self.flat.by_name(self.exp_avg_sq, self.lo)
        return {"steps": self.steps, "moments": {n: {"exp_avg": m[n], "exp_avg_sq": v[n]} for n in m}}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        m, v = self.flat.by_name(self.exp_avg, self.lo), self.flat.by_name(self.exp_avg_sq, self.lo)
        missing = [n for n in m if n not in sd["moments"]]
        if missing:
            raise KeyError(f"optimizer state lacks {missing[:3]}")
        for n in m:
            for dst, key in ((m[n], "exp_avg"), (v[n], "exp_avg_sq")):
                src = sd["moments"][n][key]
                dst.copy_(src if src.shape == dst.shape else self._overlap(n, src))
        self.steps = int(sd["steps"])


_NORM_CHUNK = 1 << 26  # elements per partial norm: bounds the fp32 upcast copy torch makes of bf16 (256 MB)


def global_norm(grads, sum_sq_reduce=None) -> torch.Tensor:
    """L2 norm of a flat gradient, or of several together (fp32 accumulation), summed across ranks
    holding other shards.

    Asking torch for an fp32 norm of a bf16 tensor upcasts a full copy first (16 GB for a 4B-element
    shard, more than the step's activations): the sum of squares is taken chunk by chunk instead."""
    grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    parts = [torch.linalg.vector_norm(g[i:i + _NORM_CHUNK], dtype=torch.promote_types(g.dtype, torch.float32))
             for g in grads for i in range(0, max(g.numel(), 1), _NORM_CHUNK)]
    sum_sq = torch.stack(parts).square().sum() if len(parts) > 1 else parts[0].square()
    if sum_sq_reduce is not None:
        sum_sq = sum_sq_reduce(sum_sq)
    return sum_sq.sqrt()
