"""The run header's layout: HSDP shows its replicas x shards, tensor parallelism its degree, and a
replicate degree under plain DDP (nothing sharded) claims no HSDP."""

import pytest

from plait.config import build_config
from plait.train import describe_layout


@pytest.mark.parametrize("parallel, world, want", [
    ({"nproc": 4, "dp_replicate": 2, "dp_shard": 2, "zero": 3}, 4, ", 4 ranks: dp 4 (2 replicas x 2 shards, HSDP), zero 3"),
    ({"nproc": 8, "dp_replicate": 2, "zero": 1}, 8, ", 8 ranks: dp 8 (2 replicas x 4 shards, HSDP), zero 1"),
    ({"nproc": 8, "dp_replicate": 2, "tp": 2, "zero": 3}, 8, ", 8 ranks: dp 4 (2 replicas x 2 shards, HSDP) x tp 2 + sp, zero 3"),
    ({"nproc": 4, "dp_replicate": 2, "zero": 0}, 4, ", 4 ranks: dp 4, zero 0"),  # DDP: every rank holds all
    ({"nproc": 4, "tp": 2, "sp": "off", "zero": 1}, 4, ", 4 ranks: dp 2 x tp 2, zero 1"),
    ({}, 1, ""),
])
def test_the_header_names_the_layout(parallel, world, want):
    cfg = build_config({"parallel": parallel})
    assert describe_layout(cfg, world) == want
