"""The GPU benchmarks' torch peers still run on plait's model, and train what plait trains.

bench/tensor_parallel.py and bench/pipeline.py put torch's own tensor parallelism and
torch.distributed.pipelining on plait's module tree. A change to a module's signature breaks a
peer only when it runs (torch's PrepareModuleInput counts the attention's inputs), which used to be
found on a GPU machine. Here each runs over gloo on two processes, a tiny untied model in fp32, and
its per-step losses must equal plait's on the same weights and tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--device", "cpu", "--preset", "tiny", "--model", "tie_embeddings=false", "--seq", "128",
          "--no-compile", "--gpus", "2", "--steps", "3", "--warmup", "1"]


def _run(script: str, extra: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *COMMON, *extra, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    errors = [(r["variant"], r["error"]) for r in rows if r.get("error")]
    assert not errors, errors
    return rows


def _same_losses(rows: list[dict], plait: str, torch_peer: str, later_rel: float = 1e-5):
    by = {r["variant"]: r["losses"] for r in rows}
    assert len(by[plait]) == 3 and len(by[torch_peer]) == 3
    # the first step reads the same weights and tokens; later steps follow the updates
    assert by[plait][0] == pytest.approx(by[torch_peer][0], rel=1e-6)
    assert by[plait][1:] == pytest.approx(by[torch_peer][1:], rel=later_rel)
    assert by[plait][-1] < by[plait][0]  # it trains


def test_tensor_parallel_peer_matches_plait(tmp_path):
    rows = _run("tensor_parallel.py", ["--global-batch", "2", "--variants", "plait-tp2-sp,torch-tp2"],
                tmp_path / "tp.json")
    _same_losses(rows, "plait-tp2-sp", "torch-tp2")


def test_pipeline_peer_matches_plait(tmp_path):
    rows = _run("pipeline.py", ["--microbatches", "4", "--variants", "plait-1f1b,torch-1f1b"], tmp_path / "pp.json")
    # the peer clips each stage's gradients by that stage's own norm (torch's default under
    # pipelining), plait by the whole model's: the updates differ by the clip, not the gradients
    _same_losses(rows, "plait-1f1b", "torch-1f1b", later_rel=1e-3)
