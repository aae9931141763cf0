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
        # fp32 parameters are their own masters: no copy, no extra memory
        self.separate = flat.dtype != torch.float32
        if self.separate:
            self.master = torch.empty(self.hi - self.lo, dtype=torch.float32, device=flat.device)
            for off, values in flat.initial(self.lo, self.hi):
                self.master[off - self.lo:off - self.lo + values.numel()].copy_(values)
            flat.attach_master(self.master, self.lo)  # a slot without a 16-bit copy reads its master
        else:
            self.master = flat.data[self.lo:self.hi]
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps = 0
        # weight decay applies to the flat prefix of matrices; split this range at that boundary
        self.split = min(max(flat.n_decay - self.lo, 0), self.hi - self.lo)
        # one kernel for every length: the update runs on segments of several sizes (the decayed prefix
        # and the rest, ZeRO-3's units), and static shapes compiled it once per size (3 times a rank
        # under ZeRO-3, ~1.4 s each on CPU; past 8 sizes dynamo would fall back to eager)
        self._update = torch.compile(adamw_update, dynamic=True) if compile else adamw_update

    def grad_segments(self) -> list[tuple[int, torch.Tensor]]:
        """The gradients this optimizer consumes, as (offset, gradient) segments of its range: a view
        of the flat gradient buffer, or its pieces (ZeRO passes the reduce-scattered shard instead)."""
        return self.flat.grad_segments(self.lo, self.hi)

    @torch.no_grad()
    def step(self, lr: float, grad: torch.Tensor | list[tuple[int, torch.Tensor]] | None = None,
             norm: torch.Tensor | None = None) -> torch.Tensor:
        """Clip by global norm, update, write the new weights into the flat parameters. Returns the
        pre-clip global norm. `grad`: the flat gradient of this range (default `grad_segments()`), or
        (offset, gradient) segments covering it - ZeRO-3 keeps one per unit, allocated only while a
        step needs it. `norm`: the global gradient norm when other ranks hold other parts of the
        gradient (the engine reduces it); default the norm of `grad` alone."""
        grad = self.grad_segments() if grad is None else grad
        segments = [(0, grad)] if isinstance(grad, torch.Tensor) else list(grad)
        if norm is None:
            norm = global_norm([g for _, g in segments])
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
        for off, g in segments:
            end = off + g.numel()
            # weight decay covers the prefix [0, split) of the range: cut each segment there
            for a, b, h in ((off, min(end, self.split), hp), (max(off, self.split), end, hp_plain)):
                if a >= b:
                    continue
                # the 16-bit copy written back (none for fp32, its own master, nor for a master-only slot)
                out = self.flat.data_view(self.lo + a, self.lo + b) if self.separate else None
                self._update(self.master[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b], g[a - off:b - off], out, h)
        return norm

    def zero_grad(self) -> None:
        self.flat.zero_grad()


_NORM_CHUNK = 1 << 26  # elements per partial norm: bounds the fp32 upcast copy torch makes of bf16 (256 MB)


def global_norm(grads) -> torch.Tensor:
    """L2 norm of a flat gradient, or of several together (fp32 accumulation)."""
    return sum_of_squares(grads).sqrt()


def sum_of_squares(grads, device=None) -> torch.Tensor:
    """Sum of the squares of every element of `grads` (one tensor or several), as an fp32 scalar.

    Asking torch for an fp32 norm of a bf16 tensor upcasts a full copy first (16 GB for a 4B-element
    shard, more than the step's activations): the sum of squares is taken chunk by chunk instead."""
    grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    parts = [torch.linalg.vector_norm(g[i:i + _NORM_CHUNK], dtype=torch.promote_types(g.dtype, torch.float32))
             for g in grads for i in range(0, max(g.numel(), 1), _NORM_CHUNK)]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(parts).square().sum() if len(parts) > 1 else parts[0].square()
