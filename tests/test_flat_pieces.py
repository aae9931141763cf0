"""One device's gradients in pieces (`FlatParams(lazy_grads=True)`): cut at the model's units,
allocated as backward reaches them, dropped after the update, and training exactly as the whole
buffer does."""

import torch

from plait.config import ModelConfig, TrainConfig
from plait.flat import FlatParams, unit_of
from plait.model import build_model
from plait.optim import FlatAdamW

CFG = ModelConfig(preset="custom", vocab_size=97, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96,
                  max_seq_len=64, tie_embeddings=False)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 97, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _model_and_opt(lazy: bool):
    model = build_model(CFG, seed=0)
    flat = FlatParams(list(model.named_parameters()), lazy_grads=lazy)
    return model, flat, FlatAdamW(flat, TrainConfig(lr=1e-2, grad_clip=0.5, weight_decay=0.1))


def test_pieces_are_the_models_units():
    _, flat, _ = _model_and_opt(True)
    assert flat.grad is None
    units = []
    for lo, hi in flat.pieces:
        inside = {unit_of(s.name) for s in flat.slots if lo <= s.offset < hi}
        units.append(inside)
        assert sum(s.numel for s in flat.slots if lo <= s.offset < hi) == hi - lo
    decayed = [u for u in units if len(u) == 1]
    assert [next(iter(u)) for u in decayed] == ["output", "layers.2", "layers.1", "layers.0", "embed"]
    assert len(units) == len(decayed) + 1  # the norm gains, every unit's, in one small piece
    assert flat.pieces[0][0] == 0 and flat.pieces[-1][1] == flat.numel
    assert all(a[1] == b[0] for a, b in zip(flat.pieces, flat.pieces[1:]))


def test_pieces_are_allocated_by_backward_and_dropped_after_the_update():
    model, flat, opt = _model_and_opt(True)
    seen = []  # pieces allocated when each parameter's gradient has landed, in backward's order
    for p in flat.params:
        p.register_post_accumulate_grad_hook(lambda p: seen.append(len(flat.grad_buffers())))
    handed = []  # what autograd hands the output matrix (after the fused loss's backward)
    model.output.weight.register_hook(lambda g: handed.append(g.data_ptr()))
    x, y = _batch(0)
    loss = model(x, y)
    assert flat.grad_buffers() == []  # nothing during the forward, where activations peak
    loss.backward()
    assert seen[0] == 1  # the output matrix's gradient comes first, and only its piece is there
    # a piece of one parameter is the gradient autograd made (the loss's own GEMM output): no copy
    assert model.output.weight.grad.data_ptr() == handed[0] == flat.grad_buffers()[0].data_ptr()
    assert seen == sorted(seen) and seen[-1] == len(flat.pieces)
    assert sum(b.numel() for b in flat.grad_buffers()) == flat.numel
    opt.step(lr=1e-3)
    opt.zero_grad()
    assert flat.grad_buffers() == [] and all(p.grad is None for p in model.parameters())
    # what the engine reports for `plan --validate`: the gradient at the update, every piece there
    from plait.parallel.engine import Local

    assert Local(model, opt).state_bytes()["grads"] == flat.numel * 4


def test_training_in_pieces_equals_the_whole_buffer_with_accumulation_and_unreached_units():
    """Three steps of two micro-batches; in the last step one block's parameters get no gradient in
    one micro-batch and the output matrix none at all (their pieces must read zero, not the
    previous step's gradient or uninitialised memory)."""
    runs = []
    for lazy in (False, True):
        model, flat, opt = _model_and_opt(lazy)
        norms = []
        for step in range(3):
            for micro in range(2):
                x, y = _batch(10 * step + micro)
                frozen = [model.output.weight] + (list(model.layers["1"].parameters()) if micro == 0 else [])
                for p in frozen if step == 2 else []:
                    p.requires_grad_(False)
                model(x, y).backward()
                for p in frozen:
                    p.requires_grad_(True)
            norms.append(opt.step(lr=1e-2))
            opt.zero_grad()
        runs.append((model, torch.stack(norms), opt.master.clone()))
    (whole, n0, m0), (pieces, n1, m1) = runs
    # fp32 norms summed in another grouping (one whole vector, or piece by piece) agree to ~1e-6
    assert torch.allclose(n0, n1, rtol=1e-5), (n0, n1)
    assert torch.allclose(m0, m1, rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(whole.named_parameters(), pieces.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), n
