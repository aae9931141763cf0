"""Sampling through a pipeline (`plait.generate.sample_pipelined`, what `plait train` prints at the end
of a pipelined run): every rank of every pipeline returns the tokens one process samples from the
same weights - greedy and with temperature and top-k, past the window, where the KV caches start
over - for 1F1B, interleaved and ZB-V stage placements, stages of no layers, under ZeRO-1 and
ZeRO-3 (the weights gathered for inference), on 2 stages x 2 context-parallel ranks and on 2 stages x 2 tensor-parallel
ranks with sequence parallelism (decoding runs without the sequence split)."""

from __future__ import annotations

import pytest
import torch
from dist import run_dist
from dp_runs import config

# max_seq_len 24: a 6-token prompt and 40 new tokens fill the window and start the caches over twice
GEN = {"preset": "custom", "vocab_size": 259, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 64, "max_seq_len": 24}
PROMPT, NEW = [100, 101, 32, 102, 58, 10], 40
CASES = {"1f1b": dict(schedule="1f1b", zero=0), "interleaved-zero1": dict(schedule="interleaved", v=2, zero=1),
         "zbv-zero3": dict(schedule="zbv", v=2, zero=3), "1f1b-zero3": dict(schedule="1f1b", zero=3),
         # a stage of no layers (parallel.stage_layers): its rank embeds, or runs the head, and caches nothing
         "empty-first": dict(schedule="1f1b", stage_layers="0,4"), "empty-last": dict(schedule="1f1b", stage_layers="4,0")}
DRAWS = {"greedy": dict(temperature=0.0), "top-k": dict(temperature=0.8, top_k=5, seed=3)}
TP_CASES = {"tp-1f1b": dict(schedule="1f1b", sp="on"), "tp-zbv": dict(schedule="zbv", v=2, sp="on")}


def _body(dims, corpus, cases, layout):
    from plait.comm import Comm
    from plait.generate import sample_pipelined
    from plait.parallel.build import parallelize

    comm = Comm(dims)
    out = {}
    for name, kw in cases.items():
        cfg = config(corpus, model=GEN, pp=2, **layout, **kw)
        par = parallelize(cfg, comm, torch.device("cpu"), torch.float32, compile=False)
        par.engine.gather_for_inference()
        for draw, how in DRAWS.items():
            out[(name, draw)] = sample_pipelined(par.runner, PROMPT, NEW, **how)
        par.close()
    return out


@pytest.fixture(scope="module")
def sampled(corpus):
    from plait.generate import sample
    from plait.parallel.build import parallelize

    got = run_dist(_body, 4, corpus, CASES, {"cp": 2}, pp=2, cp=2, timeout=120)
    tp = run_dist(_body, 4, corpus, TP_CASES, {"tp": 2}, pp=2, tp=2, timeout=120)
    got = [{**a, **b} for a, b in zip(got, tp)]
    model = parallelize(config(corpus, model=GEN), None, torch.device("cpu"), torch.float32, compile=False).model
    want = {draw: sample(model, PROMPT, NEW, **how) for draw, how in DRAWS.items()}
    return got, want


@pytest.mark.parametrize("name", [*CASES, *TP_CASES])
def test_every_rank_samples_what_one_process_samples(sampled, name):
    got, want = sampled
    assert len(set(map(tuple, want.values()))) == 2  # the two draws differ: the comparison can tell
    for draw in DRAWS:
        for rank in range(4):
            assert got[rank][(name, draw)] == want[draw], (name, draw, rank)
