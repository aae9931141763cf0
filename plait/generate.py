"""Sampling text from a trained model: greedy, temperature and top-k."""

from __future__ import annotations

import torch

from plait.model import Transformer


@torch.no_grad()
def sample(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
           top_k: int = 0, seed: int = 0) -> list[int]:
    """Extend `prompt_ids` by `max_new_tokens`. temperature 0 = greedy (deterministic).

    Each new token re-runs the model over the last max_seq_len tokens: fine for the short samples
    plait prints; long-form serving wants a KV cache, which is outside plait's scope.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids or [0]], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(max_new_tokens):
        window = ids[:, -model.cfg.max_seq_len:]
        logits = model(window)[:, -1, :].float()  # (1, vocab)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    model.train(was_training)
    return ids[0, len(prompt_ids or [0]):].tolist()
