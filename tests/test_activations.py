"""What a block keeps for its backward, per recomputation mode: measured (storages alive after the
forward) against plait's formula (plait.parallel.activations), and recomputation changes nothing
in the gradients. Tensor-parallel layouts are measured in test_tensor_parallel."""

from __future__ import annotations

import pytest
import torch

from plait.config import build_config
from plait.parallel.activations import kept_bytes, layer_bytes
from plait.parallel.build import parallelize

MODEL = {"preset": "custom", "vocab_size": 259, "dim": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 96, "max_seq_len": 64}
B, S = 2, 32


def block_bytes(model, mode: str, dtype) -> tuple[int, dict]:
    """Bytes layer 0 keeps for backward with inputs of shape (B, S, dim) (or (B*S/tp, dim) with SP,
    given by the caller's model), and the gradients of its parameters after a backward."""
    torch.manual_seed(0)
    block = model.layers["0"]
    cos, sin = model.rope_cos[:S].to(dtype), model.rope_sin[:S].to(dtype)
    x = torch.randn(B, S, model.cfg.dim, dtype=dtype, requires_grad=True)
    n, out = kept_bytes(lambda x: block(x, cos, sin), x)
    out.float().square().sum().backward()
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    return n, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_equals_the_formula(dtype):
    e = torch.empty((), dtype=dtype).element_size()
    got, grads = {}, {}
    for mode in ("none", "selective", "full"):
        cfg = build_config({"model": MODEL, "train": {"recompute": mode}})
        par = parallelize(cfg, None, torch.device("cpu"), dtype, compile=False)
        got[mode], grads[mode] = block_bytes(par.model, mode, dtype)
        want = layer_bytes(B, S, 48, 4, 2, 96, recompute=mode, e=e)
        print(f"{dtype} {mode}: measured {got[mode]} bytes, formula {want:.0f}")
        assert got[mode] == want
    assert got["full"] < got["selective"] < 0.6 * got["none"]
    for mode in ("selective", "full"):  # recomputation gives the very same gradients
        for k in grads["none"]:
            assert torch.equal(grads[mode][k], grads["none"][k]), (mode, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_block_keeps_what_the_formula_says(dtype):
    """Under torch.compile the partitioner picks what to save (plait's GPU default): read off the
    partitioned graph, it equals `layer_bytes(..., compiled=True)` in every mode, and is about 70%
    of eager's for `none`."""
    from plait.parallel.activations import compiled_kept_bytes

    e = torch.empty((), dtype=dtype).element_size()
    got = {}
    for mode in ("none", "selective", "full"):
        cfg = build_config({"model": MODEL, "train": {"recompute": mode}})
        model = parallelize(cfg, None, torch.device("cpu"), dtype, compile=False).model
        cos, sin = model.rope_cos[:S].to(dtype), model.rope_sin[:S].to(dtype)
        x = torch.randn(B, S, MODEL["dim"], dtype=dtype, requires_grad=True)
        got[mode], out = compiled_kept_bytes(lambda x: model.layers["0"](x, cos, sin), x)
        out.float().square().sum().backward()
        assert got[mode] == layer_bytes(B, S, 48, 4, 2, 96, recompute=mode, e=e, compiled=True), mode
    assert got["none"] < 0.8 * layer_bytes(B, S, 48, 4, 2, 96, recompute="none", e=e)
    assert got["full"] < got["selective"] < got["none"]


FP8_MODEL = {**MODEL, "dim": 64, "ffn_dim": 128}  # every FP8 GEMM dimension a multiple of 16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_block_keeps_what_the_formula_says(recipe):
    """FP8 linears change what a block keeps: compiled, the norms' outputs and SwiGLU's product are
    rebuilt in backward and wo's input is kept in FP8; eager tensorwise keeps each weight's FP8 copy.
    Measured both ways against `layer_bytes(..., fp8=recipe)`, up to the scales' few bytes."""
    from plait.fp8 import apply_fp8
    from plait.parallel.activations import compiled_kept_bytes

    h, dtype = FP8_MODEL["dim"], torch.bfloat16
    for compiled in (False, True):
        for mode in ("none", "selective", "full"):
            cfg = build_config({"model": FP8_MODEL, "train": {"recompute": mode}})
            model = parallelize(cfg, None, torch.device("cpu"), dtype, compile=False).model
            apply_fp8(model, recipe, torch.device("cpu"))
            cos, sin = model.rope_cos[:S].to(dtype), model.rope_sin[:S].to(dtype)
            x = torch.randn(B, S, h, dtype=dtype, requires_grad=True)
            measure = compiled_kept_bytes if compiled else kept_bytes
            got, out = measure(lambda x: model.layers["0"](x, cos, sin), x)
            out.float().square().sum().backward()
            want = layer_bytes(B, S, h, 4, 2, 128, recompute=mode, e=2, compiled=compiled, fp8=recipe)
            print(f"{recipe} compiled={compiled} {mode}: measured {got}, formula {want:.0f}")
            assert 0 <= got - want <= 64 + 2 * h, (compiled, mode, got, want)
    bf16 = layer_bytes(B, S, h, 4, 2, 128, e=2, compiled=True)
    assert layer_bytes(B, S, h, 4, 2, 128, e=2, compiled=True, fp8=recipe) < 0.8 * bf16
