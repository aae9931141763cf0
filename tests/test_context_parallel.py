"""Context parallelism: ring attention against full causal attention (forward and backward), the
load balance, and training at CP=2, CP=4, CP=2 x TP=2, CP=2 x ZeRO-3 x DP=2 and a 4D layout
(CP=2 x TP=2 x PP=2, 8 processes) against the single-process run, with the ring's traffic to the
byte against the formula and the planner.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist import run_dist
from dp_runs import Groups, MICRO, assert_equivalent, config, reference, train
from plait.parallel.sharded_state import full_weights

CPM = {"preset": "custom", "vocab_size": 259, "dim": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 96, "max_seq_len": 64}
SEQ, STEPS = 32, 20
# (heads, kv heads): plain, grouped-query, one shared KV head, an odd head count
HEADS = [(4, 4), (4, 2), (6, 1), (3, 3)]


def _ring_vs_full(comm, cp_size: int, impl: str = "ring") -> dict:
    """max |ring - full| (or |ulysses - full|) over outputs and input gradients, per head layout and
    dtype (every rank checks its part); Ulysses takes the head layouts its all-to-all can split."""
    from plait.parallel.context import ContextParallel

    cp = ContextParallel(comm, "cp", impl)
    worst = {}
    heads = [(h, kv) for h, kv in HEADS if impl == "ring" or (h % cp_size == 0 and (kv % cp_size == 0 or cp_size % kv == 0))]
    for (h, kv), dtype in [(hk, dt) for hk in heads for dt in (torch.float64, torch.float32)]:
        g = torch.Generator().manual_seed(h * 10 + kv)
        q, k, v = (torch.randn(2, n, SEQ, 8, generator=g, dtype=dtype) for n in (h, kv, kv))
        dout = torch.randn(2, h, SEQ, 8, generator=g, dtype=dtype)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv != h)
        ref.backward(dout)

        def local(t):  # (B, H, T, d): this rank's chunks along T
            return cp.local(t.transpose(1, 2)).transpose(1, 2)

        mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
        out = cp.attend(*mine)
        out.backward(local(dout))
        diffs = [(out - local(ref)).abs().max()] + [(a.grad - local(b.grad)).abs().max() for a, b in zip(mine, full)]
        worst[(h, kv, str(dtype))] = max(d.item() for d in diffs)
        # document masking: three documents per row, boundaries inside chunks and on a chunk's edge
        docs = torch.zeros(2, SEQ, dtype=torch.long)
        docs[:, 5:] += 1
        docs[1, SEQ // 2:] += 1
        docs[0, 21:] += 1
        same = (docs[:, :, None] == docs[:, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, attn_mask=same[:, None], enable_gqa=kv != h)
        ref.backward(dout)
        mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
        out = cp.attend(*mine, cp.local(docs))
        out.backward(local(dout))
        diffs = [(out - local(ref)).abs().max()] + [(a.grad - local(b.grad)).abs().max() for a, b in zip(mine, full)]
        worst[(h, kv, str(dtype) + " documents")] = max(d.item() for d in diffs)
    return worst


def _ring_bytes(comm) -> tuple[int, int, tuple[float, float]]:
    """Bytes the ring's element-wise work reads and writes on this rank (every aten op of its forward
    and backward but the attention kernels and views, inputs plus outputs), bf16 inputs with head
    dim 64, and `bookkeeping_bytes`' (forward, backward) for them."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from plait.parallel.context import _ring_backward, _ring_forward, bookkeeping_bytes

    free = {"view", "_unsafe_view", "transpose", "unsqueeze", "slice", "select", "narrow", "alias", "detach",
            "empty_like", "empty", "promote_types", "randn_like", "eq", "nonzero"}

    class Counted(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            if func.namespace == "aten" and name not in free and "attention" not in name:
                made = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
                read = [] if name in ("zeros", "full") else [x for x in tree_flatten((args, kwargs))[0]
                                                                  if isinstance(x, torch.Tensor)]
                self.n += sum(x.numel() * x.element_size() for x in read + made)
            return out

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 64, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 64, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    with Counted() as fwd:
        out, lse = _ring_forward(q, k, v, None, comm, "cp")
        out = out.to(q.dtype).contiguous()  # as the registered op returns it
    with Counted() as bwd:
        _ring_backward(torch.randn_like(q), q, k, v, out, lse, None, comm, "cp")
    return fwd.n, bwd.n, bookkeeping_bytes(q.numel(), k.numel(), comm.size("cp"), 2)


KV1 = {**CPM, "n_kv_heads": 1}  # Ulysses at cp 2 repeats the one key/value head for both ranks


def _activations(corpus, comm) -> dict:
    """Bytes layer 0 keeps for backward on this rank of cp 2, per (impl, recompute mode, compiled)
    (plait.parallel.activations.kept_bytes / compiled_kept_bytes)."""
    from plait.parallel.activations import compiled_kept_bytes, kept_bytes
    from plait.parallel.build import parallelize

    out = {}
    for impl in ("ring", "ulysses"):
        for mode in ("none", "selective"):
            cfg = config(corpus, model=KV1, recompute=mode, cp=2, cp_impl=impl)
            model = parallelize(cfg, comm, torch.device("cpu"), torch.float32, compile=False).model
            pos = model.cp.positions(SEQ, "cpu")
            cos, sin = model.rope_cos[pos], model.rope_sin[pos]
            x = torch.randn(MICRO, SEQ // 2, KV1["dim"], requires_grad=True)
            for compiled, measure in ((False, kept_bytes), (True, compiled_kept_bytes)):
                out[(impl, mode, compiled)], y = measure(lambda x: model.layers["0"](x, cos, sin), x)
                y.sum().backward()  # both ranks run the same collectives in backward
    return out


def _body(dims, corpus, root, docs_corpus):
    import torch.distributed as dist

    from plait.comm import Comm, Ledger

    groups = Groups()
    r = dims.rank
    pair, world = (Comm(None, Ledger(), groups={"cp": g}) for g in (groups.pair[r // 2], dist.group.WORLD))
    out = {impl: {2: _ring_vs_full(pair, 2, impl), 4: _ring_vs_full(world, 4, impl)} for impl in ("ring", "ulysses")}
    out["ring_bytes"] = {2: _ring_bytes(pair), 4: _ring_bytes(world)}
    if r < 2:
        out["activations"] = _activations(corpus, Comm(None, Ledger(), groups=_groups(groups, "pair", r)))
    for name, (layout, kw) in RUNS.items():
        if layout == "pair" and r >= 2:
            continue
        comm = Comm(None, Ledger(), groups=_groups(groups, layout, r))
        out[name] = train(_cfg(docs_corpus if name in DOCS else corpus, name in DOCS, **kw), comm, root / name)
    return out


def _cfg(corpus, docs: bool = False, **kw):
    cfg = config(corpus, model=CPM, steps=STEPS, **kw)
    cfg.data.document_mask = docs
    return cfg


def _groups(groups, layout, r):
    import torch.distributed as dist

    one = groups.single[r]
    base = {"tp": one, "pp": one, "dp": one, "dp_shard": one, "dp_replicate": one}
    if layout == "pair":  # CP 2 on ranks {0,1}
        g = groups.pair[r // 2]
        return {**base, "cp": g, "dp_cp": g, "dp_shard_cp": g, "world": g}
    if layout == "world":  # CP 4
        w = dist.group.WORLD
        return {**base, "cp": w, "dp_cp": w, "dp_shard_cp": w}
    if layout == "cp-tp":  # CP {0,2}/{1,3} x TP {0,1}/{2,3}
        cp = groups.cross[r % 2]
        return {**base, "tp": groups.pair[r // 2], "cp": cp, "dp_cp": cp, "dp_shard_cp": cp}
    # CP {0,1}/{2,3} x DP {0,2}/{1,3}, ZeRO-3 over all four
    w = dist.group.WORLD
    return {**base, "cp": groups.pair[r // 2], "dp": groups.cross[r % 2], "dp_shard": groups.cross[r % 2],
            "dp_cp": w, "dp_shard_cp": w}


# name -> (group layout, config) ; every run trains on the same global batch as its reference
RUNS = {"cp2": ("pair", dict(cp=2)), "cp4": ("world", dict(cp=4)), "cp2-tp2": ("cp-tp", dict(cp=2, tp=2)),
        "cp2-z3-dp2": ("cp-dp", dict(cp=2, zero=3)), "cp4-docs": ("world", dict(cp=4)),
        # selective recomputation keeps the ring's output: backward does not run the ring again
        "cp2-selective": ("pair", dict(cp=2, recompute="selective")),
        # Ulysses: at TP 2 each rank's one key/value head is repeated for the two cp ranks
        "cp2-ulysses": ("pair", dict(cp=2, cp_impl="ulysses")),
        # ... and keeps Ulysses' exchanged q, k, v and output: backward runs no all-to-all again
        "cp2-ulysses-selective": ("pair", dict(cp=2, cp_impl="ulysses", recompute="selective")),
        "cp2-tp2-ulysses": ("cp-tp", dict(cp=2, tp=2, cp_impl="ulysses")),
        "cp4-docs-ulysses": ("world", dict(cp=4, cp_impl="ulysses"))}
DOCS = {"cp4-docs", "cp4-docs-ulysses"}  # trained with document masking (against a masked single-process run)


@pytest.fixture(scope="module")
def docs_corpus(tmp_path_factory):
    """Short documents (8-40 bytes, JSONL records): most 32-token windows cross a boundary."""
    import json
    import random

    from conftest import WORDS
    from plait.prepare import prepare
    from plait.tokenizer import ByteTokenizer

    root = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))}) for _ in range(3000)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return prepare([str(root / "docs.jsonl")], root / "prepared", ByteTokenizer(), val_fraction=0.1, quiet=True)


@pytest.fixture(scope="module")
def runs(corpus, docs_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    per_rank = run_dist(_body, 4, corpus, root, docs_corpus, timeout=600)
    refs = {}
    for dp in (1, 2):  # the tensor-parallel tests' references too (CPM is their model)
        refs[dp], folder = reference(config(corpus, micro_batch=MICRO * dp, model=CPM, steps=STEPS), root / f"ref-{dp}")
        refs[dp]["weights"] = full_weights(folder)
    refs["docs"] = train(_cfg(docs_corpus, True), None, root / "ref-docs")
    refs["docs"]["weights"] = full_weights(root / "ref-docs")
    refs["docs-unmasked"] = train(_cfg(docs_corpus, False), None, root / "ref-docs-unmasked")
    return per_rank, refs, root


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_causal_attention(runs, cp, impl):
    for rank in range(4):
        got = runs[0][rank][impl][cp]
        assert len(got) >= (16 if impl == "ring" else 4)
        for (h, kv, dtype), worst in got.items():
            bound = 1e-10 if dtype.startswith("torch.float64") else 1e-5  # fp64: the algebra itself
            assert worst <= bound, (impl, cp, rank, h, kv, dtype, worst)


def test_activation_bytes_equal_the_formula(runs):
    """What a block keeps per rank at cp 2 (one key/value head, repeated for Ulysses), ring and
    Ulysses, without and with selective recomputation, eager and compiled: measured == formula
    (which the planner prices memory with). Under selective, Ulysses keeps its exchanged tensors."""
    from plait.parallel.activations import layer_bytes

    for rank in (0, 1):
        got = runs[0][rank]["activations"]
        assert len(got) == 8
        for (impl, mode, compiled), n in got.items():
            want = layer_bytes(MICRO, SEQ // 2, KV1["dim"], KV1["n_heads"], KV1["n_kv_heads"], KV1["ffn_dim"],
                               recompute=mode, e=4, compiled=compiled, cp=2, ulysses=impl == "ulysses")
            assert n == want, (impl, mode, compiled, n, want)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bookkeeping_bytes_equal_the_formula(runs, cp):
    """The planner prices the ring's own element-wise work (merges, accumulators, copies) with
    `bookkeeping_bytes`: the rank where they add up to most moves what the formula says, plus the
    log-sum-exp's work (1/head-dim of it) and no more."""
    got = [runs[0][rank]["ring_bytes"][cp] for rank in range(4)]
    want = sum(got[0][2])
    assert 1.0 <= max(f + b for f, b, _ in got) / want <= 1.06, [(f, b) for f, b, _ in got]


def test_every_rank_does_the_same_attention_work():
    """Rank r holds chunks r and 2C-1-r: every rank's causal work is equal (a contiguous split would
    give the last rank 2C-1 times the first's)."""
    from plait.parallel.context import block_plan, work

    for cp in (2, 4, 8):
        assert len({work(cp, r) for r in range(cp)}) == 1
        # all (query chunk, key chunk) pairs with key <= query: 2C full chunks' causal triangle
        assert sum(work(cp, r) for r in range(cp)) == (2 * cp) * (2 * cp - 1) / 2 + 2 * cp * 0.5
        assert all(len(step) <= 4 for r in range(cp) for step in block_plan(cp, r))


def test_batched_ring_calls_cover_exactly_the_chunk_pairs():
    """The flash kernels' plan (one call a ring step: the own block causally over both chunks, an
    earlier block's early chunk for both queries, a later block for the late queries) attends
    exactly the (query chunk, key chunk) pairs `block_plan` lists, each with the same mask."""
    from plait.parallel.context import block_plan, ring_calls

    chunks = {"early": [0], "late": [1], "both": [0, 1]}
    for cp in (2, 3, 4, 8):
        for r in range(cp):
            batched = ring_calls(cp, r)
            assert all(len(step) == 1 for step in batched)
            for step, calls in zip(block_plan(cp, r), batched):
                got = set()
                for qp, kp, kind in calls:
                    for qi in chunks[qp]:
                        for ki in chunks[kp]:
                            if kind == "full":
                                got.add((qi, ki, "full"))
                            elif ki <= qi:  # a square causal call over the chunks in position order
                                got.add((qi, ki, "causal" if ki == qi else "full"))
                assert got == set(step), (cp, r)


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_the_single_process_run(runs, name):
    per_rank, refs, root = runs
    dp = 2 if name == "cp2-z3-dp2" else 1
    ref = refs["docs" if name in DOCS else dp]
    got = per_rank[0][name]
    assert_equivalent(name, got, ref, root / name, ref["weights"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.5


@pytest.mark.parametrize("name", ["cp2", "cp4", "cp2-tp2", "cp2-selective"])
def test_ring_traffic_to_the_byte(runs, name):
    """Per layer and micro-batch a rank sends C-1 K/V blocks forward and C-1 backward, plus the C
    hops of the block's dK/dV accumulator (fp32); a block is K and V of this rank's tokens, key/value
    heads only (grouped-query attention sends no repeated heads). The planner prices the same."""
    from plait.config import build_config
    from plait.planner.costs import ModelDims
    from plait.planner.hardware import cluster
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    layout, kw = RUNS[name]
    C, tp = kw["cp"], kw.get("tp", 1)
    block = 2 * MICRO * (CPM["n_kv_heads"] // tp) * (SEQ // C) * (CPM["dim"] // CPM["n_heads"]) * 4
    want = CPM["n_layers"] * (2 * (C - 1) + C) * block
    got = runs[0][0][name]["ledger"]
    for step in got:
        assert step["cp"]["send"]["bytes"] == want
    d = ModelDims.from_config(build_config({"model": CPM}).model, seq=SEQ)
    pred = predict(d, Layout(cp=C, tp=tp, micro_batch=MICRO), cluster("h100", 1, C * tp), MICRO, prec="fp32")
    assert pred.traffic["cp"].bytes_per_device == want


@pytest.mark.parametrize("name", ["cp2-ulysses", "cp2-tp2-ulysses", "cp2-ulysses-selective"])
def test_ulysses_traffic_to_the_byte(runs, name):
    """Per layer and micro-batch, forward and backward: all-to-alls of q and the output (this rank's
    heads x its tokens) and of k and v (key/value heads, repeated up to cp when fewer), each sending
    (C-1)/C of it. The planner prices the same."""
    from plait.config import build_config
    from plait.planner.costs import ModelDims
    from plait.planner.hardware import cluster
    from plait.planner.layout import Layout
    from plait.planner.predict import predict

    layout, kw = RUNS[name]
    C, tp = kw["cp"], kw.get("tp", 1)
    hd, tokens = CPM["dim"] // CPM["n_heads"], MICRO * SEQ // C
    kv_sent = max(CPM["n_kv_heads"] // tp, C)  # 2 heads over 2 ranks; 1 head (at tp 2) sent twice
    per_layer = 2 * (2 * tokens * CPM["n_heads"] // tp * hd + 2 * tokens * kv_sent * hd) * 4
    want = CPM["n_layers"] * per_layer * (C - 1) / C
    for step in runs[0][0][name]["ledger"]:
        assert step["cp"]["all_to_all"]["sent_bytes"] == want
    d = ModelDims.from_config(build_config({"model": CPM}).model, seq=SEQ)
    pred = predict(d, Layout(cp=C, tp=tp, micro_batch=MICRO, cp_impl="ulysses"), cluster("h100", 1, C * tp), MICRO,
                   prec="fp32")
    assert pred.traffic["cp"].bytes_per_device == pytest.approx(want)


def test_ulysses_needs_heads_it_can_split():
    from plait.config import build_config
    from plait.errors import UserError
    from plait.validate import validate_config

    cfg = build_config({"model": dict(CPM, n_heads=6, n_kv_heads=2, dim=48), "train": {"seq_len": 32},
                        "parallel": {"nproc": 4, "cp": 4, "cp_impl": "ulysses"}})
    with pytest.raises(UserError, match=r"parallel.cp_impl = 'ulysses'.*6 query and 2 key/value heads"):
        validate_config(cfg)
    cfg.parallel.cp_impl = "spiral"
    with pytest.raises(UserError, match="parallel.cp_impl.*choose ring or ulysses"):
        validate_config(cfg)


FOUR_D = {"preset": "custom", "vocab_size": 259, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
          "ffn_dim": 64, "max_seq_len": 64}


def _body_4d(dims, corpus, root):
    from plait.comm import Comm, Ledger

    cfg = config(corpus, model=FOUR_D, steps=STEPS, grad_accum=2, cp=2, tp=2, sp="on", pp=2, schedule="1f1b")
    return train(cfg, Comm(dims, Ledger()), root / "4d")


def test_4d_matches_the_single_process_run(corpus, tmp_path_factory):
    """CP 2 x TP 2 (+SP) x PP 2 (1F1B, tied embeddings) on 8 processes against one process."""
    root = tmp_path_factory.mktemp("cp4d")
    got = run_dist(_body_4d, 8, corpus, root, cp=2, tp=2, pp=2, timeout=600)[-1]
    ref = train(config(corpus, model=FOUR_D, steps=STEPS, grad_accum=2), None, root / "ref")
    assert_equivalent("4d", got, ref, root / "4d", full_weights(root / "ref"))


def test_plait_train_cp_and_resume_on_one_process(corpus, tmp_path, capfd):
    """`plait train --cp 2` end to end, ending with a sample as any run does (generation reads a KV
    cache, which attends without the ring); its checkpoint resumes on one process with the same
    losses."""
    import json

    from plait.cli import main

    def args(out, extra):
        a = ["train", "--out", str(out), "--steps", "4", "--data.path", str(corpus), "--train.seq_len", "32",
             "--train.eval_batches", "1", "--train.eval_every", "2", "--train.progress", "false",
             "--train.sample_tokens", "0", "--train.compile", "off", "--train.tensorboard", "false",
             "--train.device", "cpu", "--checkpoint.every", "2", "--train.micro_batch", "2"]
        return a + [f"--model.{k}={v}" for k, v in CPM.items()] + extra

    assert main(args(tmp_path / "one", [])) == 0
    run = tmp_path / "cp"
    capfd.readouterr()
    assert main(args(run, ["--nproc", "2", "--cp", "2", "--train.max_steps_this_run", "2",
                           "--train.sample_tokens", "8"])) == 0
    err = capfd.readouterr().err
    assert "--- sample ---\ndef " in err and "no sample" not in err, err[-500:]
    assert main(args(run, ["--nproc", "1", "--cp", "1", "--resume"])) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(rows, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]
        assert ("val_loss" in a) == ("val_loss" in b)
        if "val_loss" in a:
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"]


def test_document_masking_attends_within_documents(corpus):
    """A packed row [document A | document B] gives document B the hidden states it has alone: RoPE
    scores depend on relative positions, and the mask hides A. Masking changes the training loss."""
    from plait.config import build_config
    from plait.model import build_model

    cfg = build_config({"model": CPM})
    model = build_model(cfg.model, 0, "cpu")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 11), generator=g), torch.randint(0, 256, (1, 21), generator=g)
    packed = torch.cat([a, b], dim=1)
    docs = torch.cat([torch.zeros(1, 11, dtype=torch.long), torch.ones(1, 21, dtype=torch.long)], dim=1)
    with torch.no_grad():
        together = model.hidden(packed, docs=docs)[:, 11:]
        alone = model.hidden(b)
        unmasked = model.hidden(packed)[:, 11:]
    assert (together - alone).abs().max() < 1e-5
    assert (unmasked - alone).abs().max() > 1e-2


def test_document_masking_changes_what_is_learned(runs):
    """On short documents the masked run trains differently from the unmasked one (the mask is used)."""
    refs = runs[1]
    assert max(abs(a - b) for a, b in zip(refs["docs"]["losses"], refs["docs-unmasked"]["losses"])) > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's attention kernels need a GPU")
@pytest.mark.parametrize("how", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_kernels_agree_on_cuda(how, causal, kv_heads):
    """On a GPU a bf16 block takes cuDNN's kernel (flash where cuDNN fails its check), key/value
    heads as they are, fed the final output and log-sum-exp of a two-block row in backward - one
    block of twice the queries' length (a batched ring step's shape), one as long; each kernel
    matches the fp32 math path on the same bf16 inputs (key/value heads expanded there) to bf16's
    precision."""
    from plait.parallel import block_attention as blk

    g = torch.Generator().manual_seed(2)
    B, H, T, d, rep = 2, 4, 256, 128, 4 // kv_heads
    q, dout = (torch.randn(B, H, T, d, generator=g).cuda().bfloat16() for _ in range(2))
    k1, v1 = (torch.randn(B, kv_heads, 2 * T, d, generator=g).cuda().bfloat16() for _ in range(2))
    k2, v2 = (torch.randn(B, kv_heads, T, d, generator=g).cuda().bfloat16() for _ in range(2))
    assert blk.kernel(q, None, k1) in ("cudnn", "flash") and blk.kernel(q.float(), None, k1.float()) == "math"
    if torch.cuda.get_device_capability() >= (9, 0):
        assert blk.kernel(q, None, k1) == "cudnn"  # Hopper: what SDPA itself runs
    wide = (lambda t: t.repeat_interleave(rep, 1)) if rep > 1 else (lambda t: t)
    fold = lambda t: t.view(B, kv_heads, rep, *t.shape[2:]).sum(2)  # noqa: E731
    got = {}
    for kind in (how, "math"):
        ex = wide if kind == "math" else (lambda t: t)
        o1, l1 = blk.forward(q, ex(k1), ex(v1), False, d ** -0.5, kind)
        o2, l2 = blk.forward(q, ex(k2), ex(v2), causal, d ** -0.5, kind)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
        g1 = blk.backward(dout, q, ex(k1), ex(v1), out, lse, False, d ** -0.5, kind)
        g2 = blk.backward(dout, q, ex(k2), ex(v2), out, lse, causal, d ** -0.5, kind)
        if kind == "math":
            g1, g2 = ((g[0], fold(g[1]), fold(g[2])) for g in (g1, g2))
        got[kind] = (out, lse, *g1, *g2)
    for name, a, b in zip(("out", "lse", "dq1", "dk1", "dv1", "dq2", "dk2", "dv2"), got[how], got["math"]):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err < 2e-2, (name, err)


@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_agree(causal):
    """A ring block through the device's flash kernel and through the math path: the same output,
    log-sum-exp and, given the final output and log-sum-exp of a two-block row, the same gradients
    (fp64). Without a document mask a CPU block takes the fused kernel."""
    from plait.parallel import block_attention as blk

    g = torch.Generator().manual_seed(1)
    q, k1, v1, k2, v2 = (torch.randn(2, 3, 8, 16, generator=g, dtype=torch.float64) for _ in range(5))
    dout = torch.randn(2, 3, 8, 16, generator=g, dtype=torch.float64)
    assert blk.kernel(q, None, k1) == "fused" and blk.kernel(q, torch.zeros(2, 8), k1) == "math"
    got = {}
    for how in ("fused", "math"):
        o1, l1 = blk.forward(q, k1, v1, False, 0.25, how)
        o2, l2 = blk.forward(q, k2, v2, causal, 0.25, how)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
        grads = blk.backward(dout, q, k1, v1, out, lse, False, 0.25, how) + blk.backward(dout, q, k2, v2, out, lse,
                                                                                         causal, 0.25, how)
        got[how] = (out, lse, *grads)
    # and the reference: attention over both blocks at once
    qq, kk, vv = q.clone().requires_grad_(), torch.cat([k1, k2], 2).requires_grad_(), torch.cat([v1, v2], 2).requires_grad_()
    mask = torch.ones(8, 16, dtype=torch.bool)
    if causal:
        mask[:, 8:] = torch.ones(8, 8, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=0.25)
    ref.backward(dout)
    for how, (out, lse, dq1, dk1, dv1, dq2, dk2, dv2) in got.items():
        assert (out - ref).abs().max() < 1e-12, how
        assert (dq1 + dq2 - qq.grad).abs().max() < 1e-12, how
        assert (torch.cat([dk1, dk2], 2) - kk.grad).abs().max() < 1e-12, how
        assert (torch.cat([dv1, dv2], 2) - vv.grad).abs().max() < 1e-12, how


@pytest.fixture(scope="module")
def one_selective(corpus, tmp_path_factory):
    """The eager one-process run both compiled CP runs are compared with."""
    from dp_runs import cli_train
    from plait.cli import main

    one = tmp_path_factory.mktemp("cp_compiled") / "one"
    assert main(cli_train(corpus, one, CPM, 2, ["--train.micro_batch", "2", "--train.recompute", "selective"])) == 0
    return one


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_compiled_cp_with_selective_recompute_trains_as_one_process(corpus, tmp_path, impl, one_selective):
    """What a GPU user runs: compiled blocks with selective recompute around the ring's registered op
    (and Ulysses' all-to-alls), CP 2 against one eager process - the compiled graph takes the op's
    outputs as they come (shape and strides) and recompute does not run the ring again."""
    from dp_runs import assert_same_cli_run, cli_train
    from plait.cli import main

    one, cp = one_selective, tmp_path / f"cp-{impl}"
    assert main(cli_train(corpus, cp, CPM, 2, ["--nproc", "2", "--cp", "2", "--dp", "1", "--parallel.cp_impl", impl,
                                               "--train.micro_batch", "2", "--train.recompute", "selective",
                                               "--train.compile", "on"])) == 0
    assert_same_cli_run(cp, one, 2, loss_tol=1e-4, weights=False)  # compiled kernels round differently
