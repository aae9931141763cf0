"""plait.collectives (ring and recursive doubling on point-to-point only) against torch.distributed."""

import re

import pytest
import torch
import torch.distributed as dist

from dist import run_dist
from plait import collectives as C
from plait.comm import _all_gather_single

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 2e-2),
       torch.bfloat16: (2e-2, 1e-1)}
TORCH_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _input(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    low, high = (0, 30) if dtype == torch.uint8 else (-50, 50)  # no overflow when 8 ranks add up
    return torch.randint(low, high, (numel,), generator=g).to(dtype)


def _torch_reference(x, op, n):
    """torch.distributed's answer (gloo has no AVG: SUM, then divide)."""
    ref = x.clone()
    dist.all_reduce(ref, op=TORCH_OP[op])
    return ref / n if op == "avg" else ref


def _same(a, b, dtype):
    if not dtype.is_floating_point:
        return torch.equal(a, b)
    rtol, atol = TOL[dtype]
    return torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


def _identical_on_all_ranks(t, group=None):
    """Bitwise equality across ranks (compared as raw bytes, whatever the dtype)."""
    raw = t.contiguous().view(torch.uint8).view(-1)
    out = raw.new_empty(dist.get_world_size(group) * raw.numel())
    _all_gather_single(out, raw, group=group)
    return bool((out.view(-1, raw.numel()) == raw).all())


def _body(dims, dtypes, sizes, ops):
    n, r = dims.world_size, dims.rank
    bad = []
    for dtype in dtypes:
        for numel in sizes:
            x = _input(r, numel, dtype)
            for op in ops:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                ref = _torch_reference(x, op, n)
                for name, fn in (("ring", lambda t: C.ring_all_reduce(t, op=op)),
                                 ("ring-p3", lambda t: C.ring_all_reduce(t, op=op, pipeline=3)),
                                 ("rd", lambda t: C.recursive_doubling_all_reduce(t, op=op))):
                    got = fn(x.clone())
                    if not (_same(got, ref, dtype) and _identical_on_all_ranks(got)):
                        bad.append(f"{name} all_reduce {dtype} n={numel} {op}")
                # reduce-scatter: chunk r of the flat result (sizes need not divide by N)
                s, e = C._bounds(numel, n)[r]
                for pipe in (1, 2):
                    rs = C.ring_reduce_scatter(x, op=op, pipeline=pipe)
                    if not _same(rs.reshape(-1), ref[s:e], dtype):
                        bad.append(f"ring reduce_scatter {dtype} n={numel} {op} pipeline={pipe}")
            ag = C.ring_all_gather(x)
            ref = torch.empty(n * numel, dtype=dtype)
            _all_gather_single(ref, x)
            into = torch.empty(n * numel, dtype=dtype)
            C.ring_all_gather(x, pipeline=2, out=into)
            if not (torch.equal(ag, ref) and torch.equal(into, ref)):
                bad.append(f"ring all_gather {dtype} n={numel}")
    # shapes: 2-D input keeps its shape; reduce-scatter splits dim 0 like torch; non-contiguous input
    m = torch.arange(6 * n * 5, dtype=torch.float32).view(6 * n, 5) + r
    full = _torch_reference(m, "sum", n)
    if not torch.equal(C.ring_reduce_scatter(m), full.view(n, 6, 5)[r]):
        bad.append("reduce_scatter shape")
    t = m.clone().t()  # (5, 6n), not contiguous
    if not (torch.equal(C.ring_all_reduce(t), full.t()) and torch.equal(t, full.t())):
        bad.append("non-contiguous all_reduce")
    if not torch.equal(C.ring_all_gather(m[:2]), torch.cat([m[:2] - r + k for k in range(n)])):
        bad.append("all_gather 2-D")
    return bad


def _subgroup_body(dims):
    """The ring on mesh sub-groups: peers are looked up among the group's global ranks."""
    bad = []
    for name in ("tp", "dp", "pp"):
        members = dims.group_ranks(name, dims.rank)
        x = torch.arange(11, dtype=torch.float64) + dims.rank
        want = sum(torch.arange(11, dtype=torch.float64) + m for m in members)
        if not torch.equal(C.ring_all_reduce(x.clone(), dims.group(name), pipeline=2), want):
            bad.append(f"ring on {name}")
        if not torch.equal(C.recursive_doubling_all_reduce(x.clone(), dims.group(name)), want):
            bad.append(f"rd on {name}")
        if not torch.equal(C.ring_all_gather(x[:3], dims.group(name)),
                           torch.cat([torch.arange(3, dtype=torch.float64) + m for m in members])):
            bad.append(f"all_gather on {name}")
    return bad


ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]
ALL_OPS = ["sum", "avg", "max", "min"]


# The full matrix at 3 ranks (odd, not a power of two, uneven chunks: where ring and recursive
# doubling have their corner cases); fewer dtypes at 2 and 4, where ranks outnumber the CI's cores.
CASES = {
    2: ([torch.float32, torch.float16, torch.int32], [1, 3, 1003]),
    3: (ALL_DTYPES, [1, 2, 4, 37, 1003]),
    4: ([torch.float32, torch.bfloat16, torch.int64, torch.uint8], [1, 5, 1003]),
}


@pytest.mark.parametrize("nproc", sorted(CASES))
def test_against_torch_distributed(nproc):
    dtypes, sizes = CASES[nproc]
    for rank, bad in enumerate(run_dist(_body, nproc, dtypes, sizes, ALL_OPS)):
        assert not bad, (rank, bad)


def _eight_body(dims):
    return _body(dims, [torch.float32, torch.int64], [1, 9, 1003], ALL_OPS) + _subgroup_body(dims)


def test_eight_ranks_and_sub_groups():
    # one spawn of 8 (slow on 2 cores): world-size checks plus the ring on each mesh dim's groups
    for rank, bad in enumerate(run_dist(_eight_body, 8, tp=2, pp=2)):
        assert not bad, (rank, bad)


def test_world_of_one():
    assert run_dist(_body, 1, [torch.float32, torch.int64], [1, 5], ALL_OPS) == [[]]


def test_trace_reproduces_the_seed_walkthrough():
    text = C.trace_ring_all_reduce(4)
    lines = [re.sub(r"\s+\]", "]", " ".join(ln.split())) for ln in text.splitlines()]

    def after(header, k):
        i = next(j for j, ln in enumerate(lines) if ln.startswith(header))
        return lines[i + 1: i + 1 + k]

    # step 1 exactly as in the seed; GPU i sends chunk i
    assert after("Step 1: GPU i sends chunk i", 9) == [
        "GPU 0 sends A0 to GPU 1; receives D3 from GPU 3", "GPU 1 sends B1 to GPU 2; receives A0 from GPU 0",
        "GPU 2 sends C2 to GPU 3; receives B1 from GPU 1", "GPU 3 sends D3 to GPU 0; receives C2 from GPU 2",
        "After adding:", "GPU 0: [A0, A1, A2, A3+D3]", "GPU 1: [A0+B0, B1, B2, B3]",
        "GPU 2: [C0, B1+C1, C2, C3]", "GPU 3: [D0, D1, C2+D2, D3]"]
    # step 2 corrected: GPU 1 adds the A3+D3 it receives into its chunk 3, not into chunk 1
    assert after("Step 2: GPU i sends chunk (i-1) mod 4", 9)[5:] == [
        "GPU 0: [A0, A1, A2+C2+D2, A3+D3]", "GPU 1: [A0+B0, B1, B2, A3+B3+D3]",
        "GPU 2: [A0+B0+C0, B1+C1, C2, C3]", "GPU 3: [D0, B1+C1+D1, C2+D2, D3]"]
    # after the reduce-scatter GPU i owns chunk (i+1) mod 4, then the all-gather completes everyone
    assert "GPU 0: chunk 1 = A1+B1+C1+D1" in lines and "GPU 3: chunk 0 = A0+B0+C0+D0" in lines
    assert lines.count("GPU 2: [sum_0, sum_1, sum_2, sum_3]") == 1
    assert "After phase 2 every GPU holds [sum_0, sum_1, sum_2, sum_3]: correct." in lines
