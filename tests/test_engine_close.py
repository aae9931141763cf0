"""Engines hook the model's parameters; autograd holds those hooks in C++, where Python's garbage
collector cannot see the cycle model -> hook -> engine -> model. `Parallelized.close()` removes them,
so a second model built in the same process (a benchmark's next variant, a notebook) does not find
the first one's parameters, gradients and optimizer state still in memory."""

from __future__ import annotations

import gc
import weakref

import torch
from dist import run_dist

from plait.config import build_config


def _body(dims):
    from plait.comm import Comm, Ledger
    from plait.parallel.build import parallelize

    alive = {}
    for zero in (0, 2, 3):  # DDP, ZeRO-2 and ZeRO-3 hook the parameters' gradient accumulation
        for close in (False, True):
            cfg = build_config({"model": {"preset": "tiny"}, "train": {"micro_batch": 1, "seq_len": 16},
                                "parallel": {"zero": zero}})
            par = parallelize(cfg, Comm(dims, Ledger(enabled=False)), torch.device("cpu"), torch.float32, compile=False)
            x = torch.randint(0, cfg.model.vocab_size, (1, 16))
            par.runner.step([(x, x)], 1e-3)
            refs = [weakref.ref(par.engine), weakref.ref(par.model)]
            if close:
                par.close()
            del par
            gc.collect()
            alive[(zero, close)] = [r() is not None for r in refs]
    return alive


def test_close_frees_the_model_and_its_engine():
    alive = run_dist(_body, 2)[0]
    for zero in (0, 2, 3):
        assert alive[(zero, True)] == [False, False], zero
        assert alive[(zero, False)] == [True, True], zero  # what close() is for: without it, a leak
