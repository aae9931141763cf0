"""Generation with a KV cache gives what a full pass over the text gives: the cached attention sees
exactly the keys it should, at the right positions, under grouped-query attention."""

from __future__ import annotations

import pytest
import torch

from plait.config import build_config
from plait.generate import sample
from plait.kv_cache import KVCache
from plait.model import build_model

# 4 query heads over 2 KV heads; RoPE with Llama-3 scaling, so positions matter
MODEL = {"preset": "custom", "vocab_size": 97, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 80, "max_seq_len": 24, "rope_scaling": 8.0}


@pytest.fixture(scope="module")
def model():
    return build_model(build_config({"model": MODEL}).model, 3, "cpu").eval()


def _full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float()  # (T, vocab)


def test_prefill_then_chunks_then_single_tokens_equal_one_full_pass(model):
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _full_logits(model, ids)
    cache = KVCache.for_model(model)
    assert cache.k.shape == (3, 1, 2, 24, 8)  # KV heads, not query heads
    got = []
    with torch.no_grad():
        # a 7-token prefill, a 5-token chunk (needs the offset causal mask), then one at a time
        for a, b in [(0, 7), (7, 12)] + [(i, i + 1) for i in range(12, 20)]:
            got.append(model(torch.tensor([ids[a:b]]), cache=cache)[0].float())
    got = torch.cat(got)
    assert cache.pos == 20
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


def test_greedy_sampling_equals_rerunning_the_window(model):
    prompt = [5, 17, 42, 8]
    ids = list(prompt)
    for _ in range(20 - len(prompt)):  # the old way: a full pass per token (everything fits the window)
        ids.append(int(_full_logits(model, ids)[-1].argmax()))
    assert sample(model, prompt, 20 - len(prompt)) == ids[len(prompt):]


def test_past_the_window_the_cache_is_rebuilt_from_its_recent_part(model):
    out = sample(model, [1, 2, 3], 60)  # 63 tokens through a 24-position window
    assert len(out) == 60 and all(0 <= t < 97 for t in out)
    # right after a rebuild the logits are those of a full pass over the kept 18 tokens
    ids = [1, 2, 3] + out
    keep = 24 - 24 // 4
    first_rebuild = 24 - 3 + 1  # the prompt fills 3, the cache is full after 21 new tokens
    ctx = ids[:3 + first_rebuild][-keep:]
    assert ids[3 + first_rebuild] == int(_full_logits(model, ctx)[-1].argmax())


def test_sampling_is_seeded_and_top_k_restricts(model):
    a = sample(model, [4, 4], 15, temperature=1.0, top_k=3, seed=7)
    assert a == sample(model, [4, 4], 15, temperature=1.0, top_k=3, seed=7)
    ids = [4, 4] + a
    for i, t in enumerate(a[:8]):  # while the window is not full: each token among its step's top 3
        top = _full_logits(model, ids[:2 + i])[-1].topk(3).indices.tolist()
        assert t in top


def test_a_tiny_temperature_samples_the_greedy_token(model):
    """Logits over 1e-40 overflowed to inf, and softmax turned them to NaN: multinomial raised."""
    greedy = sample(model, [4, 4], 6)
    assert sample(model, [4, 4], 6, temperature=1e-40) == greedy
    assert sample(model, [4, 4], 6, temperature=1e-300, top_k=5) == greedy


def test_a_full_cache_says_so(model):
    cache = KVCache.for_model(model, max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)


def test_a_prompt_longer_than_the_window_keeps_its_end(model):
    prompt = [i % 97 for i in range(30)]
    out = sample(model, prompt, 3)
    assert out[0] == int(_full_logits(model, prompt[-24:])[-1].argmax())


def test_sampling_needs_a_prompt_token(model):
    with pytest.raises(ValueError, match="at least one prompt token"):
        sample(model, [], 3)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """A checkpoint of the micro model after two steps (enough to generate from)."""
    from conftest import micro_config
    from plait.preflight import preflight
    from plait.train import train

    out = tmp_path_factory.mktemp("gen") / "run"
    train(preflight(micro_config(corpus, out, train={"steps": 2})))
    return out


def _generate(capsys, *argv):
    from plait.cli import main

    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_empty_prompt_starts_a_document(run, capsys):
    """Every document of the byte corpus follows a newline: an empty prompt generates what follows
    one, as `--prompt "\\n"` does (it once continued a NUL byte the model never saw: U+FFFD garbage)."""
    from plait.commands.generate import document_start
    from plait.tokenizer import ByteTokenizer

    assert document_start(ByteTokenizer()) == ord("\n")
    rc, empty, _ = _generate(capsys, "--checkpoint", str(run), "--prompt", "", "--max-new-tokens", "16")
    _, newline, _ = _generate(capsys, "--checkpoint", str(run), "--prompt", "\n", "--max-new-tokens", "16")
    assert rc == 0 and empty == newline[1:] and len(empty) > 1


@pytest.mark.parametrize("device, needle", [
    ("cuda", "--device = 'cuda': no CUDA device is visible on this machine; use --device cpu"),
    ("cuda:1", "--device = 'cuda:1': no CUDA device is visible"),
    ("gpu", "--device = 'gpu': is not a device; use cpu, cuda or cuda:N"),
    ("meta", "--device = 'meta': is not supported"),
])
def test_a_device_that_is_not_there_is_one_line(run, capsys, monkeypatch, device, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, wherever this runs
    rc, out, err = _generate(capsys, "--checkpoint", str(run), "--device", device)
    assert rc == 2 and out == "" and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_a_temperature_that_is_not_a_number_is_one_line(run, capsys, temperature):
    rc, out, err = _generate(capsys, "--checkpoint", str(run), "--temperature", temperature)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "--temperature" in err and "must be zero (greedy) or a positive number" in err, err
