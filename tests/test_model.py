"""The Llama model: shapes, GQA, layout-independent init, fused loss, RoPE scaling."""

import pytest
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


@pytest.mark.parametrize("chunk_tokens", [5, 23])  # several chunks (fp32 sum of the weight's), one (the GEMM's own)
def test_fused_loss_matches_unfused_values_and_grads(monkeypatch, chunk_tokens):
    import plait.loss

    monkeypatch.setattr(plait.loss, "_CHUNK_ELEMENTS", 97 * chunk_tokens)
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


@pytest.mark.parametrize("chunk_tokens", [5, 23])
def test_a_chunks_logits_are_gone_before_the_weight_gradient_is_formed(monkeypatch, chunk_tokens):
    """The weight-gradient GEMM writes a buffer the size of the logits of a one-chunk step: the
    logits are freed before it (only the chunk's gradient is still needed), so two such buffers
    peak together, not three."""
    import gc
    import weakref

    import plait.loss
    from plait.loss import ce_chunk

    monkeypatch.setattr(plait.loss, "_CHUNK_ELEMENTS", 97 * chunk_tokens)
    alive = []

    def chunk_fn(logits, targets, scale):
        alive.append(weakref.ref(logits))
        return ce_chunk(logits, targets, scale)

    formed = plait.loss._chunk_grads

    def chunk_grads(*args):
        gc.collect()
        assert alive[-1]() is None, "the chunk's logits are still held"
        return formed(*args)

    monkeypatch.setattr(plait.loss, "_chunk_grads", chunk_grads)
    torch.manual_seed(0)
    h = torch.randn(23, 64, requires_grad=True)
    w = torch.randn(97, 64, requires_grad=True)
    t = torch.randint(0, 97, (23,))
    linear_cross_entropy(h, w, t, chunk_fn).backward()
    assert len(alive) == -(-23 // chunk_tokens) and w.grad is not None

    # vocabulary-parallel (one shard here): its fp32 logits go too, once the gradient is formed
    from plait.loss import vocab_parallel_cross_entropy, vp_chunk_grad, vp_chunk_stats

    class OneRank:
        def all_gather(self, x, dim):
            return x

    def stats(logits, *a):
        out = vp_chunk_stats(logits, *a)
        alive.append(weakref.ref(out[2]))  # the fp32 copy the gradient is formed from
        return out

    alive.clear()
    w.grad = None
    vocab_parallel_cross_entropy(h, w, t, OneRank(), "tp", 0, 97, (stats, vp_chunk_grad)).backward()
    assert len(alive) == -(-23 // chunk_tokens) and w.grad is not None


def test_the_fused_loss_hands_autograd_the_weight_gradient_it_formed(monkeypatch):
    """Backward scales the gradients the forward formed in place and hands them on: the output
    matrix's .grad is that very tensor (autograd takes it without a copy), not a product beside it.
    A second backward through the same graph is refused, not silently doubled."""
    import plait.loss

    formed = []
    finish = plait.loss._finish

    def recording(ctx, loss, grad_h, grad_w, weight):
        out = finish(ctx, loss, grad_h, grad_w, weight)
        formed.append(ctx.grads[1].data_ptr())
        return out

    monkeypatch.setattr(plait.loss, "_finish", recording)
    h = torch.randn(7, 16, requires_grad=True)
    w = torch.randn(11, 16, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 11, (7,)))
    (3.0 * loss).backward(retain_graph=True)
    assert w.grad.data_ptr() == formed[0]
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()


@pytest.mark.parametrize("one_chunk", [True, False])
def test_fused_loss_forms_the_weight_gradient_in_as_few_passes_as_its_chunks_need(monkeypatch, one_chunk):
    """bf16: in one chunk the output matrix's gradient is the GEMM's own bf16 output, already
    scaled by 1/count (inside the chunk's softmax): no fp32 buffer, no scaling or cast pass. Over 4
    chunks: an fp32 sum the first chunk's GEMM starts (no zeros to add into), and one cast."""
    import plait.loss
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(plait.loss, "_CHUNK_ELEMENTS", 97 * (64 if one_chunk else 16))
    torch.manual_seed(0)
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(97, 32, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 97, (64,))

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == w.shape and not out._is_view():
                self.seen.append((str(func), out.dtype))
            return out

    with Ops():
        loss = linear_cross_entropy(h, w, t)
    if one_chunk:
        assert Ops.seen == [("aten.mm.default", torch.bfloat16)], Ops.seen
    else:  # no zero-filled buffer: the first chunk's GEMM makes the fp32 sum (on the GPU each GEMM writes
        # or adds into it itself, here a bf16 product is cast and added), cast to bf16 once at the end
        assert "aten.zeros.default" not in (op for op, _ in Ops.seen), Ops.seen
        assert Ops.seen[-1] == ("aten._to_copy.default", torch.bfloat16), Ops.seen
        assert [dt for _, dt in Ops.seen[:-1]].count(torch.float32) >= 4, Ops.seen  # the sum is fp32
    assert not any("mul" in op for op, _ in Ops.seen)  # the 1/count is no pass of its own
    loss.backward()
    ref_h, ref_w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.cross_entropy(ref_h @ ref_w.t(), t).backward()
    assert torch.allclose(w.grad.double(), ref_w.grad, atol=2e-3, rtol=2e-2)
    assert torch.allclose(h.grad.double(), ref_h.grad, atol=2e-3, rtol=2e-2)


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


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_output_matrix_gradient_deferred_to_w_is_bit_for_bit_the_same(monkeypatch, chunks, dtype):
    """A zero-bubble last stage defers the output matrix's gradient to its W (`defer`): the input
    gradient comes at once, the weight's only when the store runs the micro-batch, each bit equal to
    the fused loss's own (one chunk or several, fp32 or bf16), its post-accumulate hooks fired with
    it once (autograd also fires them in B, with no gradient, as for the deferring linears: the
    engines stage a parameter without one as zeros); a backward outside the store's context raises
    instead of dropping it."""
    import plait.loss
    from plait.parallel.wgrad import WeightGradStore

    monkeypatch.setattr(plait.loss, "_CHUNK_ELEMENTS", 97 * 64 // chunks)
    torch.manual_seed(0)
    h0, t = torch.randn(64, 32, dtype=dtype), torch.randint(0, 97, (64,))
    t[5] = -100
    w_ref = torch.nn.Parameter(torch.randn(97, 32, dtype=dtype))
    w = torch.nn.Parameter(w_ref.detach().clone())
    h_ref, h = h0.clone().requires_grad_(), h0.clone().requires_grad_()
    (linear_cross_entropy(h_ref, w_ref, t) / 3).backward()
    store, fired = WeightGradStore(), []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
    loss = linear_cross_entropy(h, w, t, defer=store) / 3
    with store.input_grads_only("mb0"):
        loss.backward()
    assert torch.equal(h.grad, h_ref.grad) and w.grad is None and True not in fired  # dx now, dW deferred
    store.run("mb0")
    assert torch.equal(w.grad, w_ref.grad) and fired.count(True) == 1 and fired[-1]
    with pytest.raises(RuntimeError, match="the output matrix's gradient would be lost"):
        linear_cross_entropy(h0.clone().requires_grad_(), w, t, defer=store).backward()
