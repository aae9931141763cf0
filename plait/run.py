"""From a checked config to running workers: one process here, or N processes via the launcher."""

from __future__ import annotations

from plait.config import Config
from plait.train import preflight, train


def launch_training(cfg: Config) -> dict | None:
    """Preflight once, then train in this process (nproc 1)."""
    cfg = preflight(cfg)
    return train(cfg)
