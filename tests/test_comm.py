"""plait.comm: every wrapper against its definition, the autograd forms against one process, the ledger."""

import pytest
import torch

from dist import run_dist
from plait.comm import Comm, Ledger
from plait.ledger import ring_bytes


def test_ring_formulas():
    S = 1 << 20
    assert ring_bytes("all_reduce", S, 4) == 2 * S * 3 / 4
    assert ring_bytes("all_gather", S, 4) == ring_bytes("reduce_scatter", S, 4) == S * 3 / 4
    assert ring_bytes("all_to_all", S, 8) == S * 7 / 8
    assert ring_bytes("broadcast", S, 8) == ring_bytes("reduce", S, 8) == ring_bytes("send", S, 2) == S
    assert ring_bytes("recv", S, 2) == 0 and ring_bytes("all_reduce", S, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes("gossip", S, 2)


def test_ledger_steps():
    led = Ledger()
    led.record("all_reduce", "dp", 1000, 4)
    led.record("all_reduce", "dp", 24, 4)
    led.record("all_gather", "tp", 800, 2)
    s = led.step()
    assert s["dp"]["all_reduce"] == dict(calls=2, bytes=1024, sent_bytes=1536.0, group_size=4)
    assert s["tp"]["all_gather"]["sent_bytes"] == 400 and s["tp"]["sent_bytes"] == 400
    led.record("send", "pp", 64, 2)
    led.record("recv", "pp", 64, 2)
    assert led.summary()["dp"]["sent_bytes"] == 1536  # last closed step
    assert led.step()["pp"] == {"sent_bytes": 64.0, "send": dict(calls=1, bytes=64, sent_bytes=64.0, group_size=2),
                                "recv": dict(calls=1, bytes=64, sent_bytes=0.0, group_size=2)}
    assert led.summary(0)["dp"]["all_reduce"]["calls"] == 2
    assert led.totals()["pp"]["send"]["calls"] == 1 and len(led.steps) == 2
    assert "all_reduce" in led.table(0)
    led.reset()
    assert led.summary() == {} and led.steps == []
    with pytest.raises(ValueError, match="group sizes"):
        led.record("all_reduce", "x", 1, 2)
        led.record("all_reduce", "x", 1, 4)


def _expect(dims, name, fn):
    """What a collective over dim `name` must give: fn applied to every member's contribution."""
    return fn(dims.group_ranks(name, dims.rank))


def _data(rank, n=6):
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + rank


def _collectives_body(dims):
    """4 ranks, dp_shard=2 x tp=2: each wrapper against the definition, sync and async."""
    comm = Comm(dims, Ledger())
    r, ok = dims.rank, {}
    for name in ("tp", "dp", "world"):
        members = dims.group_ranks(name, r)
        stack = torch.stack([_data(m) for m in members])
        for op, ref in (("sum", stack.sum(0)), ("avg", stack.mean(0)), ("max", stack.max(0).values),
                        ("min", stack.min(0).values)):
            x = _data(r)
            ok[f"all_reduce/{name}/{op}"] = torch.allclose(comm.all_reduce(x, name, op=op), ref)
        h = comm.all_reduce(_data(r), name, op="avg", async_op=True)
        ok[f"async_avg/{name}"] = torch.allclose(h.wait(), stack.mean(0))
        me = members.index(r)
        ok[f"all_gather/{name}"] = torch.equal(comm.all_gather(_data(r), name), stack.reshape(-1))
        full = torch.cat([_data(m, 4 * len(members)) for m in members]).view(len(members), -1)
        rs = comm.reduce_scatter(_data(r, 4 * len(members)), name)
        ok[f"reduce_scatter/{name}"] = torch.allclose(rs, full.sum(0).view(len(members), -1)[me])
        h = comm.reduce_scatter(_data(r, 4 * len(members)), name, op="avg", async_op=True)
        ok[f"reduce_scatter_avg/{name}"] = torch.allclose(h.wait(), full.mean(0).view(len(members), -1)[me])
        ok[f"broadcast/{name}"] = torch.equal(comm.broadcast(_data(r), name, src=1), _data(members[1]))
        red = comm.reduce(_data(r), name, dst=0)
        ok[f"reduce/{name}"] = torch.allclose(red, stack.sum(0)) if me == 0 else True  # others: scratch
        # all-to-all: slice j of rank i's input lands as slice i of rank j's output
        src = torch.stack([torch.full((2,), 10.0 * r + j) for j in range(len(members))])
        got = comm.all_to_all(src, name)
        ok[f"all_to_all/{name}"] = torch.equal(got[:, 0], torch.tensor([10.0 * m + me for m in members]))
    # batched point-to-point around the tp ring
    n, me = dims.size("tp"), dims.local_rank("tp", r)
    buf = torch.empty(3)
    comm.send_recv("tp", sends=[(torch.full((3,), float(r)), (me + 1) % n)], recvs=[(buf, (me - 1) % n)])
    ok["send_recv"] = torch.equal(buf, torch.full((3,), float(dims.group_ranks("tp", r)[(me - 1) % n])))
    # a size-1 group costs nothing and still gives the right answer
    x = _data(r)
    ok["size1"] = comm.all_reduce(x, "pp") is x and torch.equal(comm.all_gather(x, "pp"), x)
    s = comm.ledger.summary()
    ok["ledger_dims"] = set(s) == {"tp", "dp", "world", "pp"} and s["pp"]["sent_bytes"] == 0
    return ok


def test_collectives_against_definitions():
    for rank, ok in enumerate(run_dist(_collectives_body, 4, tp=2)):
        assert all(ok.values()), (rank, [k for k, v in ok.items() if not v])


def _ddp_body(dims, sizes):
    """DDP-style: all-reduce every gradient over dp once; the ledger must read 2P(N-1)/N exactly."""
    torch.manual_seed(dims.rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])
    model(torch.randn(5, sizes[0])).square().sum().backward()
    ledger = Ledger()
    comm = Comm(dims, ledger)
    for p in model.parameters():
        comm.all_reduce(p.grad, "dp", op="avg")
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    return P, ledger.step()["dp"]["sent_bytes"], dims.size("dp"), [p.grad.sum().item() for p in model.parameters()]


@pytest.mark.parametrize("nproc", [3, 4])
def test_ddp_ledger_is_exactly_2P_times_N_minus_1_over_N(nproc):
    results = run_dist(_ddp_body, nproc, [7, 13, 5, 3])
    for P, sent, N, grads in results:
        assert N == nproc and P == 4 * (7 * 13 + 13 + 13 * 5 + 5 + 5 * 3 + 3)
        assert sent == 2 * P * (N - 1) / N
        assert grads == results[0][3]  # and the gradients really were averaged: equal on every rank


def _autograd_body(dims):
    """TP (column -> row parallel MLP), SP (gather / reduce-scatter along the sequence) and the
    Ulysses all-to-all, each against the same computation on one process."""
    comm = Comm(dims, Ledger())
    n, me = dims.size("tp"), dims.local_rank("tp", dims.rank)
    torch.manual_seed(0)  # same full tensors on every rank
    B, T, H, F = 2, 4 * n, 6, 8 * n
    x, w1, w2 = torch.randn(B, T, H, dtype=torch.float64), torch.randn(H, F, dtype=torch.float64), torch.randn(F, H, dtype=torch.float64)
    ref_x, ref_w1, ref_w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
    (torch.relu(ref_x @ ref_w1) @ ref_w2).pow(2).sum().backward()
    ok = {}

    # tensor parallel: w1 split by columns, w2 by rows; x replicated
    lx = x.clone().requires_grad_()
    lw1 = w1.chunk(n, 1)[me].clone().requires_grad_()
    lw2 = w2.chunk(n, 0)[me].clone().requires_grad_()
    y = comm.reduce_from(torch.relu(comm.copy_to(lx, "tp") @ lw1) @ lw2, "tp")
    y.pow(2).sum().backward()
    ok["tp_fwd"] = torch.allclose(y, torch.relu(x @ w1) @ w2)
    ok["tp_dx"] = torch.allclose(lx.grad, ref_x.grad)
    ok["tp_dw1"] = torch.allclose(lw1.grad, ref_w1.grad.chunk(n, 1)[me])
    ok["tp_dw2"] = torch.allclose(lw2.grad, ref_w2.grad.chunk(n, 0)[me])

    # sequence parallel: x sharded along T; gather before the TP region, reduce-scatter after it
    sx = x.chunk(n, 1)[me].clone().requires_grad_()
    lw1.grad = lw2.grad = None
    full = comm.all_gather_along(sx, "tp", axis=1)
    ys = comm.reduce_scatter_along(torch.relu(full @ lw1) @ lw2, "tp", axis=1)
    ys.pow(2).sum().backward()
    ok["sp_fwd"] = torch.allclose(ys, (torch.relu(x @ w1) @ w2).chunk(n, 1)[me])
    ok["sp_dx"] = torch.allclose(sx.grad, ref_x.grad.chunk(n, 1)[me])
    ok["sp_dw1"] = torch.allclose(lw1.grad, ref_w1.grad.chunk(n, 1)[me])

    # split forward / gather backward, and gather forward / split backward (negative axis too)
    v = x.clone().requires_grad_()
    part = comm.split_along(v, "tp", axis=-1)
    (part * (me + 1)).sum().backward()
    ok["split"] = torch.equal(part, x.chunk(n, -1)[me]) and torch.equal(
        v.grad, torch.cat([torch.full_like(c, j + 1.0) for j, c in enumerate(x.chunk(n, -1))], -1))
    u = x.chunk(n, 2)[me].clone().requires_grad_()
    g = comm.all_gather_along(u, "tp", axis=-1, grad="split")
    (g * 3).sum().backward()
    ok["gather_split"] = torch.equal(g, x) and torch.equal(u.grad, torch.full_like(u, 3.0))

    # Ulysses: (B, T/n, heads, D) sequence-sharded <-> (B, T, heads/n, D) head-sharded
    q = torch.randn(B, T, 2 * n, 3, dtype=torch.float64)
    sq = q.chunk(n, 1)[me].clone().requires_grad_()
    hq = comm.all_to_all_along(sq, "tp", scatter_axis=2, gather_axis=1)
    weight = torch.arange(hq.numel(), dtype=torch.float64).view_as(hq)
    (hq * weight).sum().backward()
    ok["a2a_fwd"] = torch.equal(hq, q.chunk(n, 2)[me])
    full_w = torch.cat([torch.arange(hq.numel(), dtype=torch.float64).view_as(hq)] * n, 2)  # same on all ranks
    ok["a2a_bwd"] = torch.equal(sq.grad, full_w.chunk(n, 1)[me])
    s = comm.ledger.summary()["tp"]
    # TP: an all-reduce forward and one backward; SP: gather fwd + its reduce-scatter bwd, reduce-scatter
    # fwd + its gather bwd; split bwd and gather_split fwd gather once each; all-to-all fwd and bwd
    ok["ledger"] = (s["all_reduce"]["calls"], s["reduce_scatter"]["calls"], s["all_gather"]["calls"],
                    s["all_to_all"]["calls"]) == (2, 2, 4, 2)
    return ok


@pytest.mark.parametrize("tp", [2, 3])
def test_autograd_forms_match_one_process(tp):
    for rank, ok in enumerate(run_dist(_autograd_body, tp, tp=tp)):
        assert all(ok.values()), (rank, [k for k, v in ok.items() if not v])

