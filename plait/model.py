"""The Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, optional tied embeddings.

Parameter names are the contract every other part of plait relies on:
  embed.weight, layers.{i}.attn_norm.weight, layers.{i}.attn.{wq,wk,wv,wo}.weight,
  layers.{i}.mlp_norm.weight, layers.{i}.mlp.{w1,w2,w3}.weight, norm.weight, output.weight
Layers live in a ModuleDict keyed by the *global* index, so a pipeline stage that holds layers 8..15
still calls them `layers.8`..`layers.15`, and a checkpoint does not depend on the layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ModelConfig
from plait.loss import ce_chunk, linear_cross_entropy


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, parameter name): the init of a tensor never depends on which
    other tensors exist on this rank, so every parallel layout starts from the same weights."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama-3's long-context rescaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling > 0:
        factor, lo, hi, old = (cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                               cfg.rope_original_max_len)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_table(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, head_dim), in fp32, in the rotate-half layout HF Llama uses."""
    inv_freq = rope_frequencies(cfg).to(device)
    t = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, heads, head_dim); cos/sin: (T, head_dim) -> broadcast over batch and heads
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 whatever the compute dtype: bf16 variance loses too many bits
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Dense:
    """Where a tensor-parallel layout communicates, and what happens there without one: nothing.

    Attention and the MLP call `enter` before their column-parallel matmuls and `leave` after their
    row-parallel one; the model embeds, projects to logits and takes the loss through it.
    `plait.parallel.tensor.TensorParallel` puts the collectives (and vocabulary shards) here. With
    sequence parallelism the residual stream between regions is (tokens / tp, dim) rather than
    (B, T, dim): `enter` takes the sequence length to give attention its (B, T, dim) back."""

    def enter(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return x

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def embed(self, table: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        return table(tokens)  # (B, T, dim)

    def logits(self, h: torch.Tensor, weight: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return F.linear(h, weight)  # (B, T, vocab)

    def loss(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_fn, defer=None) -> torch.Tensor:
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk_fn, defer)

    def inference(self):
        """A context for generation (one new position at a time)."""
        return contextlib.nullcontext()

    def compile_kernels(self) -> None:
        """Nothing of its own to compile (the model's `ce_chunk_fn` is compiled by the caller)."""


DENSE = Dense()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.tp = DENSE
        # rows of wk/wv this rank uses when tensor parallelism replicates the KV heads (tp > kv_heads)
        self.kv_rows: slice | None = None
        self.cp = None  # `plait.parallel.context.ContextParallel` when the sequence is split over ranks

    def _kv(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.kv_rows is None:
            return proj(x)
        # a linear that computes its matmul its own way (FP8, a deferred weight gradient) offers
        # `matmul(x, weight)` for part of its weight; a plain one is F.linear
        matmul = getattr(proj, "matmul", F.linear)
        return matmul(x, proj.weight[self.kv_rows])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, docs=None) -> torch.Tensor:
        """kv: this layer's `plait.kv_cache.LayerCache` when generating (x holds the new positions only).
        docs: (B, T) document index of each position: a token attends only within its document."""
        T = cos.shape[0]
        x = self.tp.enter(x, T)  # (B, T, dim)
        B = x.shape[0]
        # head counts come from the weights, so a tensor-parallel shard (fewer heads) runs unchanged
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, n_heads/tp, head_dim)
        k = self._kv(self.wk, x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads/tp, head_dim)
        v = self._kv(self.wv, x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        gqa = q.shape[1] != k.shape[1]
        mask, causal = None, True
        if kv is not None:
            k, v = kv.append(k, v)
            if kv.start > 0:
                # new query i sits at position start + i and sees keys 0 .. start + i (is_causal would
                # align the T queries with the first T keys instead); one new token sees every key
                causal = False
                if T > 1:
                    qpos = torch.arange(kv.start, kv.start + T, device=x.device)
                    mask = qpos[:, None] >= torch.arange(kv.start + T, device=x.device)[None, :]
        if self.cp is not None and kv is None:  # this rank's tokens attend over the whole sequence
            out = self.cp.attend(q, k, v, docs)
        elif docs is not None and kv is None:
            same = docs[:, :, None] == docs[:, None, :]  # (B, T, T): query and key in one document
            mask = (same & torch.ones(T, T, dtype=torch.bool, device=x.device).tril())[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads/tp * head_dim)
        return self.tp.leave(self.wo(out))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.tp = DENSE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp.enter(x)
        return self.tp.leave(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, docs=None) -> torch.Tensor:
        x = x + self.attend(x, cos, sin, kv, docs)
        return x + self.feed(x)

    # the two residual branches, apart so that recomputation can wrap each (plait.parallel.recompute)
    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, docs=None) -> torch.Tensor:
        return self.attn(self.attn_norm(x), cos, sin, kv, docs)

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_ids: list[int] | None = None,
                 first: bool = True, last: bool = True):
        """`layer_ids`, `first` and `last` let a pipeline stage build only its part of the model."""
        super().__init__()
        self.cfg = cfg
        ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in ids})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if last else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None
        self.tie()
        self.ce_chunk_fn = ce_chunk  # replaced by a compiled version when compiling
        # a zero-bubble pipeline's last stage: the store that takes the output matrix's gradient to
        # its W (`plait.loss.linear_cross_entropy`'s `defer`)
        self.head_defer = None
        self.tp = DENSE
        self.cp = None  # context parallelism (`apply_cp`): forward takes this rank's chunks of each sequence
        # how tensor parallelism cut the parameters (`plait.parallel.engine.TensorSplit`): set by
        # `apply_tp`; init_weights draws each tensor in full and keeps this rank's box of it
        self.tensor_split = None
        cos, sin = rope_table(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie(self) -> None:
        """Share embedding and output matrices (again after `to_empty`, which unties them)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.output is not None:
            self.output.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from (seed, name) alone; recompute the RoPE table (meta-device builds).
        A tensor-parallel shard is drawn in full and cut to this rank's box, so every layout starts
        from the single-device weights (padding rows of a split vocabulary stay zero)."""
        from plait.ranges import Box, copy_overlap

        std = self.cfg.init_std
        boxes = self.tensor_split.boxes if self.tensor_split is not None else {}
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            # a pipeline's last stage holds a tied output matrix without the embedding: same seed
            key = "embed.weight" if name == "output.weight" and self.cfg.tie_embeddings else name
            g = torch.Generator(device=p.device).manual_seed(param_seed(seed, key))
            scale = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            box = boxes.get(name)
            if box is None:
                p.normal_(0.0, scale, generator=g)
                continue
            full = torch.empty(box.full, dtype=p.dtype, device=p.device).normal_(0.0, scale, generator=g)
            p.zero_()
            copy_overlap(box, 0, box.numel, [p.view(-1)], Box.whole(box.full), 0, [full.view(-1)])
        cos, sin = rope_table(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def hidden(self, tokens: torch.Tensor | None, h: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, cache=None, layers=None,
               seq_len: int | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
        """Run the embedding (given tokens and no hidden states: the first stage) and the blocks
        `layers` (their keys; default all of this module's); returns (B, T, dim), or (B*T/tp, dim)
        with sequence parallelism - give `seq_len` then when there are no tokens."""
        if h is None:
            h = self.tp.embed(self.embed, tokens)  # (B, T, dim); (B*T/tp, dim) with sequence parallelism
        T = seq_len or (tokens.shape[1] if tokens is not None else h.shape[1])
        if cache is not None:  # the new tokens continue the cached positions
            positions = torch.arange(cache.pos, cache.pos + T, device=h.device)
        # cast once to the compute dtype here, not in every layer: each cast would be a copy that
        # every layer's RoPE keeps for its backward
        cos = (self.rope_cos[:T] if positions is None else self.rope_cos[positions]).to(h.dtype)
        sin = (self.rope_sin[:T] if positions is None else self.rope_sin[positions]).to(h.dtype)
        for i, key in enumerate(self.layers.keys() if layers is None else layers):
            block = self.layers[key]
            # with a cache, the class's `forward` directly: shapes change every token (a compiled
            # block would recompile; ZeRO-3 compiles the instance's `forward` itself), and engines
            # drop their hooks before inference (`gather_for_inference`)
            if cache is not None:
                h = type(block).forward(block, h, cos, sin, cache.layer(i))
            else:
                h = block(h, cos, sin) if docs is None else block(h, cos, sin, None, docs)
        if cache is not None:
            cache.advance(T)
        return h

    def head(self, h: torch.Tensor, targets: torch.Tensor | None = None, seq_len: int | None = None,
             eager: bool = False):
        """The last stage's end: final norm, then the fused loss against `targets`, or the logits.
        `eager`: the norm uncompiled (decoding with a cache: a new shape every token)."""
        h = RMSNorm.forward(self.norm, h) if eager else self.norm(h)
        if targets is None:
            return self.tp.logits(h, self.output.weight, seq_len)
        return self.tp.loss(h, self.output.weight, targets, self.ce_chunk_fn, self.head_defer)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                h: torch.Tensor | None = None, positions: torch.Tensor | None = None, cache=None,
                docs: torch.Tensor | None = None):
        """Logits (B, T, vocab) without targets; the mean next-token loss with them.

        With targets the output projection and cross-entropy run fused in chunks, so the full
        (B*T, vocab) logits never exist in memory. `cache` (a `plait.kv_cache.KVCache`): `tokens`
        continue the cached ones, whose keys and values are reused. `docs` (B, T): each position's
        document index; attention stays within documents.
        """
        if self.cp is not None and tokens is not None and cache is None:  # this rank's part of each sequence
            positions = self.cp.positions(tokens.shape[1], tokens.device)
            tokens, targets, docs = (self.cp.local(t) if t is not None else None for t in (tokens, targets, docs))
        h = self.hidden(tokens, h, positions, cache, docs=docs)
        if self.norm is None:
            return h
        return self.head(h, targets, tokens.shape[1] if tokens is not None else None, eager=cache is not None)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def block_linears(self) -> list[nn.Linear]:
        """Every block's projections (not the embedding or the output head): the matmuls that FP8
        and the zero-bubble pipeline's weight-gradient store take over."""
        return [lin for block in self.layers.values()
                for lin in (block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo,
                            block.mlp.w1, block.mlp.w2, block.mlp.w3)]


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """Build on the meta device (no memory, no time), then materialise and init on `device`."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.tie()
    model.init_weights(seed)
    return model
