"""The Llama model: shapes, GQA, layout-independent init, fused loss, RoPE scaling."""

import torch
import torch.nn.functional as F

from plait.config import ModelConfig
from plait.loss import linear_cross_entropy
from plait.model import Transformer, build_model, rope_frequencies

CFG = ModelConfig(preset="custom", vocab_size=97, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96,
                  max_seq_len=64)


def test_shapes_and_names():
    m = build_model(CFG, seed=0)
    x = torch.randint(0, 97, (2, 17))
    assert m(x).shape == (2, 17, 97)
    names = dict(m.named_parameters())
    assert "layers.2.attn.wq.weight" in names and "layers.0.mlp.w2.weight" in names
    assert names["layers.0.attn.wk.weight"].shape == (2 * 8, 64)  # GQA: 2 kv heads of size 8
    assert m.output.weight is m.embed.weight  # tied
    untied = build_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": False}), seed=0)
    assert untied.output.weight is not untied.embed.weight


def test_init_depends_on_seed_and_name_only():
    full = build_model(CFG, seed=3)
    with torch.device("meta"):
        part = Transformer(CFG, layer_ids=[2], first=False, last=True)
    part.to_empty(device="cpu")
    part.init_weights(3)
    for name, p in part.named_parameters():
        assert torch.equal(p, full.state_dict()[name]), name
    other = build_model(CFG, seed=4)
    assert not torch.equal(other.layers["0"].attn.wq.weight, full.layers["0"].attn.wq.weight)


def test_causal():
    m = build_model(CFG, seed=0)
    x = torch.randint(0, 97, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % 97
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :12], m(y)[0, :12], atol=1e-6)
        assert not torch.allclose(m(x)[0, 12:], m(y)[0, 12:], atol=1e-3)


def test_fused_loss_matches_unfused_values_and_grads(monkeypatch):
    import plait.loss

    monkeypatch.setattr(plait.loss, "_CHUNK_ELEMENTS", 97 * 5)  # force several chunks (5 tokens each)
    torch.manual_seed(0)
    h = torch.randn(23, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(97, 64, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 97, (23,))
    t[4] = -100  # ignored position
    loss = linear_cross_entropy(h, w, t)
    (2.0 * loss).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    (2.0 * ref).backward()
    assert torch.allclose(loss, ref, atol=1e-12)
    assert torch.allclose(gh, h.grad, atol=1e-12) and torch.allclose(gw, w.grad, atol=1e-12)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig(preset="custom", dim=2048, n_heads=32, n_kv_heads=8, rope_theta=500000.0,
                      rope_scaling=32.0, rope_original_max_len=8192, max_seq_len=131072)
    hc = LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
    assert torch.allclose(rope_frequencies(cfg), ref, rtol=1e-6, atol=0)
