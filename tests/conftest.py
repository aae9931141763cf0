"""Shared fixtures: a small prepared corpus and a micro model config that trains in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.config import build_config
from plait.data import prepare
from plait.tokenizer import ByteTokenizer

PLAIT_SRC = Path(__file__).resolve().parents[1] / "plait"

MICRO_MODEL = {"preset": "custom", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4,
               "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 64}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """plait's own source as a byte-level corpus (a few hundred KB, no downloads)."""
    out = tmp_path_factory.mktemp("data") / "plait-src"
    prepare([str(PLAIT_SRC)], out, ByteTokenizer(), val_fraction=0.2, quiet=True)
    return out


def micro_config(data: Path, out: Path, **sections):
    """A Config for a ~0.1M-parameter model; `sections` = {"train": {...}, ...} overrides."""
    raw = {"model": dict(MICRO_MODEL),
           "data": {"path": str(data)},
           "train": {"steps": 6, "micro_batch": 4, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                     "eval_every": 0, "eval_batches": 2, "out": str(out), "progress": False,
                     "tensorboard": False, "sample_tokens": 0, "compile": "off", "device": "cpu"}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return build_config(raw)
