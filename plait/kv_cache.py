"""Keys and values of the tokens seen so far, per layer, so that generating a token costs one
position's work instead of a pass over the whole window.

    cache = KVCache.for_model(model, batch=1)
    logits = model(prompt, cache=cache)        # prefill: every layer writes its K and V
    logits = model(next_token, cache=cache)    # one position; attends to everything cached

Each layer's keys and values are preallocated as (batch, kv_heads, max_len, head_dim) - with
grouped-query attention that is n_kv_heads, not n_heads, so a Llama-3 8B cache is 1/4 of what
caching every query head would take. `pos` counts the filled positions; a forward writes its T new
ones at [pos, pos + T) in every layer and then advances `pos` once.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (n_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.pos = 0

    @classmethod
    def for_model(cls, model, batch: int = 1, max_len: int | None = None, layers=None) -> "KVCache":
        """A cache shaped for `model`'s blocks, or for those of `layers` (their keys: a pipeline
        chunk's), head counts read from the weights (so a shard with fewer heads gets a cache to
        match), in its parameters' dtype and device."""
        cfg = model.cfg
        blocks = list(model.layers.values()) if layers is None else [model.layers[k] for k in layers]
        attn = blocks[0].attn
        wk = attn.wk.weight
        rows = wk.shape[0] if attn.kv_rows is None else attn.kv_rows.stop - attn.kv_rows.start  # replicated KV: one head used
        return cls(len(blocks), batch, max_len or cfg.max_seq_len, rows // cfg.head_dim, cfg.head_dim,
                   wk.dtype, wk.device)

    def layer(self, i: int) -> "LayerCache":
        return LayerCache(self, i)

    def advance(self, t: int) -> None:
        self.pos += t

    def reset(self) -> None:
        self.pos = 0  # stale entries past pos are never read


class LayerCache:
    """One layer's view of a KVCache: where this forward's positions start, and the append."""

    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i
        self.start = cache.pos

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, kv_heads, T, head_dim) at this forward's positions; return the keys
        and values of every position so far."""
        c, s, t = self.cache, self.start, k.shape[2]
        if s + t > c.max_len:
            raise ValueError(f"KV cache holds {c.max_len} positions; {s} are filled and {t} more do not fit")
        c.k[self.i, :, :, s:s + t] = k
        c.v[self.i, :, :, s:s + t] = v
        return c.k[self.i, :, :, :s + t], c.v[self.i, :, :, :s + t]
