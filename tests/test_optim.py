"""FlatAdamW over the flat parameter space: equal to torch.optim.AdamW, clipping, bf16 masters."""

import pytest
import torch

from plait.config import TrainConfig
from plait.flat import FlatParams
from plait.optim import FlatAdamW


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3, bias=False))
    return m.to(dtype)


def _grads(step, model):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) * (3.0 if step % 2 else 0.1) for p in model.parameters()]


@pytest.mark.parametrize("compile", [False, True])
def test_matches_torch_adamw_with_decay_groups_and_clipping(compile):
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0)
    ref, mine = _model(), _model()
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    rest = [p for p in ref.parameters() if p.ndim < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    flat = FlatParams(list(mine.named_parameters()))
    opt = FlatAdamW(flat, cfg, compile=compile)
    for step in range(6):
        for p, g in zip(ref.parameters(), _grads(step, ref)):
            p.grad = g.clone()
        for p, g in zip(mine.parameters(), _grads(step, mine)):
            p.grad = g.clone()  # as autograd hands a gradient after zero_grad: the step settles it
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        norm = opt.step(lr=1e-2 * (step + 1) / 6)
        for group in torch_opt.param_groups:
            group["lr"] = 1e-2 * (step + 1) / 6
        torch_opt.step()
        opt.zero_grad()
        assert torch.allclose(norm, norm_ref, rtol=1e-6)
    for (n, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), n
    assert not torch.equal(_model().state_dict()["0.weight"], mine.state_dict()["0.weight"])


def test_bf16_params_keep_fp32_masters_and_state_round_trips(tmp_path):
    model = _model(torch.bfloat16)
    flat = FlatParams(list(model.named_parameters()))
    opt = FlatAdamW(flat, TrainConfig(grad_clip=0.5, weight_decay=0.0))
    assert opt.master.dtype == torch.float32 and flat.data.dtype == torch.bfloat16
    for p in model.parameters():
        p.grad.fill_(3.0)
    norm = opt.step(lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(norm.item() - 3.0 * n_params ** 0.5) < 1e-3
    assert torch.equal(flat.data, opt.master.to(torch.bfloat16))
    # the state round-trips through the checkpoint form, keyed by name
    from plait.parallel import sharded_state

    sharded_state.write(tmp_path, sharded_state.flat_pieces(flat, 0, flat.padded), opt, None)
    other_flat = FlatParams(list(_model(torch.bfloat16).named_parameters()))
    other = FlatAdamW(other_flat, TrainConfig())
    sharded_state.load(tmp_path, sharded_state.flat_pieces(other_flat, 0, other_flat.padded), other)
    assert torch.equal(other.master, opt.master) and torch.equal(other.exp_avg_sq, opt.exp_avg_sq)
    assert other.steps == 1


def test_gradients_accumulate_into_the_flat_buffer():
    model = _model()
    flat = FlatParams(list(model.named_parameters()), pad_to=8)
    assert flat.padded % 8 == 0 and flat.padded >= flat.numel
    x = torch.randn(4, 7)
    model(x).sum().backward()
    model(x).sum().backward()
    ref = _model()
    (2 * ref(x).sum()).backward()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, atol=1e-6), n
        assert p.grad.data_ptr() >= flat.grad.data_ptr()  # still a view, not a fresh tensor
    model.zero_grad()  # torch sets .grad = None; the flat buffer must be rebound
    flat.zero_grad()
    model(x).sum().backward()
    assert flat.grad.abs().sum() > 0


def test_global_norm_is_exact_across_chunks(monkeypatch):
    import plait.optim
    from plait.optim import global_norm

    g = torch.randn(1000, dtype=torch.float64)
    whole = global_norm(g)
    monkeypatch.setattr(plait.optim, "_NORM_CHUNK", 64)  # 16 chunks, the last one partial
    assert torch.allclose(global_norm(g), whole, rtol=1e-12)
    assert torch.allclose(whole, g.norm(), rtol=1e-12)
    assert global_norm(torch.zeros(0)).item() == 0.0


def test_a_steps_first_gradient_lands_by_copy_and_unreached_slots_read_zero():
    """zero_grad drops every .grad instead of zeroing the buffer; autograd's fresh gradient is copied
    into its slot (`FlatParams._land`), later backwards add into it, and `settle` zeroes the slots
    no backward reached this step - they must not keep the previous step's gradient."""
    model, ref = _model(), _model()
    flat = FlatParams(list(model.named_parameters()))
    x = torch.randn(4, 7)
    model(x).sum().backward()
    flat.zero_grad()
    before = flat.grad.clone()
    assert all(p.grad is None for p in model.parameters()) and torch.equal(flat.grad, before)  # no zeroing pass
    first, last = list(model.children())[0], list(model.children())[-1]
    for _ in range(2):  # two micro-batches reaching only the first layer
        first(x).sum().backward()
    assert all(p.grad.data_ptr() >= flat.grad.data_ptr() for p in first.parameters())  # landed in the buffer
    assert all(p.grad is None for p in last.parameters())
    flat.settle()
    list(ref.children())[0](x).sum().mul(2).backward()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        want = r.grad if r.grad is not None else torch.zeros_like(p)
        assert torch.allclose(p.grad, want, atol=1e-6), n
        assert p.grad.data_ptr() >= flat.grad.data_ptr(), n  # every .grad a view again
    assert any(before[s.offset:s.offset + s.numel].abs().sum() > 0 for s in flat.slots if s.name.startswith("2."))
