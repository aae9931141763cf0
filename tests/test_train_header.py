"""The run header's layout: HSDP shows its replicas x shards, tensor, context and pipeline
parallelism their degrees (a pipeline its schedule and micro-batches), and a replicate degree under
plain DDP (nothing sharded) claims no HSDP."""

import pytest

from plait.config import build_config
from plait.train import describe_layout
from plait.validate import validate_config


@pytest.mark.parametrize("parallel, world, want", [
    ({"nproc": 4, "dp_replicate": 2, "dp_shard": 2, "zero": 3}, 4, ", 4 ranks: dp 4 (2 replicas x 2 shards, HSDP), zero 3"),
    ({"nproc": 8, "dp_replicate": 2, "zero": 1}, 8, ", 8 ranks: dp 8 (2 replicas x 4 shards, HSDP), zero 1"),
    ({"nproc": 8, "dp_replicate": 2, "tp": 2, "zero": 3}, 8, ", 8 ranks: dp 4 (2 replicas x 2 shards, HSDP) x tp 2 + sp, zero 3"),
    ({"nproc": 4, "dp_replicate": 2, "zero": 0}, 4, ", 4 ranks: dp 4, zero 0"),  # DDP: every rank holds all
    ({"nproc": 4, "tp": 2, "sp": "off", "zero": 1}, 4, ", 4 ranks: dp 2 x tp 2, zero 1"),
    ({"nproc": 4, "tp": 2, "pp": 2}, 4, ", 4 ranks: dp 1 x tp 2 + sp x pp 2 (1f1b, 1 micro-batch), zero 0"),
    ({"nproc": 8, "cp": 2, "tp": 2, "pp": 2, "microbatches": 4, "zero": 1}, 8,
     ", 8 ranks: dp 1 x cp 2 (ring) x tp 2 + sp x pp 2 (1f1b, 4 micro-batches), zero 1"),
    ({"nproc": 8, "dp_shard": 2, "pp": 4, "schedule": "interleaved", "v": 2, "microbatches": 8, "zero": 1}, 8,
     ", 8 ranks: dp 2 x pp 4 (interleaved, 8 micro-batches, v 2), zero 1"),
    ({"nproc": 4, "cp": 4, "cp_impl": "ulysses", "zero": 3}, 4, ", 4 ranks: dp 1 x cp 4 (ulysses), zero 3"),
    ({}, 1, ""),
])
def test_the_header_names_the_layout(parallel, world, want):
    cfg = validate_config(build_config({"model": {"preset": "tiny", "n_layers": 8}, "parallel": parallel}))
    assert describe_layout(cfg, world) == want


def test_the_header_says_fp8_linears_and_that_a_cpu_emulates_them():
    """`--train.fp8 tensorwise` on a CPU trained with fp32 matmuls under a header of `cpu float32`
    alone, though the field's help says FP8 needs a GPU's tensor cores."""
    import torch

    from plait.train import _fp8_words

    assert _fp8_words("off", torch.device("cpu")) == ""
    assert _fp8_words("tensorwise", torch.device("cpu")) == " with FP8 tensorwise linears (emulated on the CPU)"
    assert _fp8_words("rowwise", torch.device("cuda", 0)) == " with FP8 rowwise linears"
