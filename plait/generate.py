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


def _decode(next_token, prompt_ids: list[int], max_new_tokens: int, window: int) -> list[int]:
    """The decoding loop: `next_token(tokens, prefill)` runs `tokens` - the prompt, or the recent
    part of the window after the cache filled up, when `prefill` (the cache starts over), else the
    one token just chosen - and returns the token that follows them."""
    if not prompt_ids:  # a model continues text: with none, a caller chooses what stands for "nothing yet"
        raise ValueError("sample needs at least one prompt token (e.g. the tokenizer's EOS for a new document)")
    keep = max(1, window - max(1, window // 4))
    ids = list(prompt_ids)
    n_prompt = len(ids)
    pos = min(len(ids), window)  # positions in the cache
    nxt = next_token(ids[-window:], True)
    for i in range(max_new_tokens):
        ids.append(nxt)
        if i + 1 == max_new_tokens:
            break
        if pos == window:  # full: keep the recent part of the window and start over
            pos = keep
            nxt = next_token(ids[-keep:], True)
        else:
            pos += 1
            nxt = next_token([nxt], False)
    return ids[n_prompt:]


def _sample(model, prompt_ids, max_new_tokens, temperature, top_k, seed) -> list[int]:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    window = model.cfg.max_seq_len
    gen = torch.Generator(device=device).manual_seed(seed)
    # no bigger than this generation needs (an 8b model's full window is 1 GB of cache)
    cache = KVCache.for_model(model, batch=1, max_len=min(window, len(prompt_ids) + max_new_tokens))

    def next_token(tokens: list[int], prefill: bool) -> int:
        if prefill:
            cache.reset()
        logits = model(torch.tensor([tokens], dtype=torch.long, device=device), cache=cache)[:, -1, :].float()
        return int(_pick(logits, temperature, top_k, gen))

    try:
        return _decode(next_token, prompt_ids, max_new_tokens, window)
    finally:
        model.train(was_training)


@torch.no_grad()
def sample_pipelined(runner, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                     top_k: int = 0, seed: int = 0) -> list[int]:
    """`sample` through a pipeline (`plait.parallel.pipeline.PipelineRunner`; every rank of it calls
    this): each rank runs its chunks' layers with a KV cache of their own and hands the hidden
    states to the next stage's rank, as the forward of evaluation does; the rank with the last stage
    picks the token and broadcasts it to the pipeline, so every rank returns the same ids - those
    one process would sample from the same weights. The parameters must be whole on this rank
    (`Engine.gather_for_inference`). Context parallelism needs nothing: with a KV cache attention
    runs without the ring, and each context-parallel rank decodes the same tokens."""
    from plait.parallel.schedules import place

    model, comm, dim = runner.model, runner.comm, runner.pp_dim
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype  # the hidden states' (no autocast in decoding)
    window = model.cfg.max_seq_len
    S = runner.pp * runner.v
    rank_of = [place(runner.name, runner.pp, runner.v, s)[0] for s in range(S)]
    head_rank = rank_of[S - 1]
    max_len = min(window, len(prompt_ids) + max_new_tokens)
    # a chunk of no layers (`parallel.stage_layers` 0 for a stage) keeps nothing
    caches = [KVCache.for_model(model, batch=1, max_len=max_len, layers=keys) if keys else None
              for keys in runner.chunks]
    gen = torch.Generator(device=device).manual_seed(seed)

    def next_token(tokens: list[int], prefill: bool) -> int:
        if prefill:
            for c in caches:
                if c is not None:
                    c.reset()
        x = torch.tensor([tokens], dtype=torch.long, device=device)
        h, picked = None, torch.zeros(1, dtype=torch.long, device=device)
        for s in range(S):
            if rank_of[s] != runner.rank:
                continue
            chunk = runner.local_chunk(s)
            if s > 0 and rank_of[s - 1] != runner.rank:
                h = torch.empty(1, len(tokens), model.cfg.dim, dtype=dtype, device=device)
                comm.send_recv(dim, recvs=[(h, rank_of[s - 1])])
            h = model.hidden(x if s == 0 else None, h, cache=caches[chunk], layers=runner.chunks[chunk])
            if s == S - 1:
                picked = _pick(model.head(h, eager=True)[:, -1, :].float(), temperature, top_k, gen).view(1)
            elif rank_of[s + 1] != runner.rank:
                comm.send_recv(dim, sends=[(h, rank_of[s + 1])])
        comm.broadcast(picked, dim, src=head_rank)
        return int(picked)

    try:
        with model.tp.inference():  # one position at a time: nothing to split along the sequence
            return _decode(next_token, prompt_ids, max_new_tokens, window)
    finally:
        model.train(was_training)
