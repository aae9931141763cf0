"""Sampling text from a trained model: greedy, temperature and top-k, with a KV cache."""

from __future__ import annotations

import torch

from plait.kv_cache import KVCache
from plait.model import Transformer


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """The next token (1, 1) from the last position's logits (1, vocab)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    # shift the largest logit to 0 before dividing, in float64: a tiny temperature (1e-40) would
    # otherwise overflow the logits to inf (or, below float32's range, divide by a zero), and
    # softmax turns those into NaN; shifted, they only fall to -inf and the largest stays 0
    logits = logits.double()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)


@torch.no_grad()
def sample(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
           top_k: int = 0, seed: int = 0) -> list[int]:
    """Extend `prompt_ids` (at least one token) by `max_new_tokens`. temperature 0 = greedy (deterministic).

    The prompt runs once and fills the cache; each new token then runs one position. While the text
    fits `max_seq_len` this gives the logits of a full pass over it. Past that, the cache is rebuilt
    from the last three quarters of the window (positions restart at 0), so a long generation pays
    a prefill every max_seq_len / 4 tokens instead of a full window per token.
    """
    with model.tp.inference():  # one position at a time: nothing to split along the sequence
        return _sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed)


def _sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed) -> list[int]:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    window = model.cfg.max_seq_len
    keep = max(1, window - max(1, window // 4))
    if not prompt_ids:  # a model continues text: with none, a caller chooses what stands for "nothing yet"
        raise ValueError("sample needs at least one prompt token (e.g. the tokenizer's EOS for a new document)")
    ids = list(prompt_ids)
    n_prompt = len(ids)
    gen = torch.Generator(device=device).manual_seed(seed)
    # no bigger than this generation needs (an 8b model's full window is 1 GB of cache)
    cache = KVCache.for_model(model, batch=1, max_len=min(window, len(ids) + max_new_tokens))

    def prefill(tokens: list[int]) -> torch.Tensor:
        cache.reset()
        return model(torch.tensor([tokens], dtype=torch.long, device=device), cache=cache)[:, -1, :].float()

    logits = prefill(ids[-window:])
    for i in range(max_new_tokens):
        nxt = _pick(logits, temperature, top_k, gen)
        ids.append(int(nxt))
        if i + 1 == max_new_tokens:
            break
        if cache.pos == window:  # full: keep the recent part of the window and start over
            logits = prefill(ids[-keep:])
        else:
            logits = model(nxt.view(1, 1), cache=cache)[:, -1, :].float()
    model.train(was_training)
    return ids[n_prompt:]
