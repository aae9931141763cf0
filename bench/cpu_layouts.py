"""The 8-GPU issue's layouts, on CPU processes: each trains the same model as one process.

    python bench/cpu_layouts.py --out bench/results/cpu-8proc-layouts.json

Runs `plait train` once on one process and once per layout on 8 gloo processes (one machine, fp32, a
small 16-layer model whose heads split 8 ways, one global batch of 8 sequences for every layout),
then compares each layout's logged losses (relative) and final weights (largest element-wise
difference, as the tests measure it) (gathered from its checkpoint, which is
layout-independent) with the single process's. Adam's eps is 1e-6, as in the tests
(tests/dp_runs.py): at 1e-8 elements whose gradient is about eps (rare tokens' output rows) amplify
rounding, and correct layouts differ by ~1e-5 in the weights. What the GPUs would measure (speed, memory, bubble)
needs the 8-GPU machine; this says the layouts it would run are correct and start, beforehand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> plait train flags (8 processes each)
LAYOUTS = {
    "dp8 zero3": ["--dp", "8", "--zero", "3"],
    "tp8": ["--tp", "8"],
    "tp4 dp2 zero1": ["--tp", "4", "--dp", "2", "--zero", "1"],
    "tp2 pp2 dp2 zero1 1f1b": ["--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--schedule", "1f1b"],
    "pp8 1f1b": ["--pp", "8", "--schedule", "1f1b"],
    "pp8 interleaved v2": ["--pp", "8", "--schedule", "interleaved", "--parallel.v", "2"],
    "pp8 zb": ["--pp", "8", "--schedule", "zb"],
    "cp2 tp4 zero1": ["--cp", "2", "--tp", "4", "--zero", "1"],
}
MODEL = {"vocab_size": 256, "dim": 128, "n_layers": 16, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 384,
         "max_seq_len": 64, "tie_embeddings": "true"}


def train(out: Path, steps: int, flags: list[str], nproc: int) -> float:
    args = [sys.executable, "-m", "plait.cli", "train", "--out", str(out), "--steps", str(steps),
            "--train.seq_len", "64", "--train.micro_batch", "1", "--train.global_batch", "8",
            "--train.eval_every", "0", "--train.progress", "false", "--train.sample_tokens", "0",
            "--train.compile", "off", "--train.tensorboard", "false", "--train.device", "cpu",
            "--parallel.timeout_s", "120", "--train.eps", "1e-6"] + [a for k, v in MODEL.items() for a in (f"--model.{k}", str(v))]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    t0 = time.monotonic()
    done = subprocess.run(args + flags, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(flags) or 'one process'} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - t0


def compare(ref: Path, run: Path, steps: int) -> dict:
    from plait.parallel.sharded_state import full_weights

    def losses(r):
        rows = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return {x["step"]: x["loss"] for x in rows if isinstance(x.get("step"), int)}

    la, lb = losses(ref), losses(run)
    assert la.keys() == lb.keys(), (sorted(la), sorted(lb))
    loss_rel = max(abs(la[s] - lb[s]) / abs(la[s]) for s in la)
    step = f"step_{steps:08d}"
    wa, wb = full_weights(ref / "checkpoints" / step), full_weights(run / "checkpoints" / step)
    assert wa.keys() == wb.keys()
    # the tests' measure (tests/dp_runs.py): the largest element-wise difference; and the tensor
    # furthest off relative to its own norm
    weight_abs = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    rel_norm = {k: ((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-30)).item() for k in wa}
    worst = max(rel_norm, key=rel_norm.get)
    return {"loss_max_rel_diff": loss_rel, "weights_max_abs_diff": weight_abs,
            "weights_worst_rel_norm": [worst, rel_norm[worst]], "steps": len(la)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    p.add_argument("--out", default="", help="write the JSON result here")
    a = p.parse_args()
    names = [n.strip() for n in a.only.split(",")] if a.only else list(LAYOUTS)
    import torch

    result = {"benchmark": "8-process layouts on CPU against one process", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "model": MODEL, "steps": a.steps,
              "global_batch": 8, "seq": 64, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "one"
        secs = train(ref, a.steps, [], 1)
        print(f"one process: {secs:.0f} s", flush=True)
        for name in names:
            run = Path(tmp) / name.replace(" ", "-")
            secs = train(run, a.steps, LAYOUTS[name], 8)
            row = {"layout": name, "flags": " ".join(LAYOUTS[name]), "seconds": round(secs, 1), **compare(ref, run, a.steps)}
            result["rows"].append(row)
            print(f"{name:26s} loss {row['loss_max_rel_diff']:.1e}  weights {row['weights_max_abs_diff']:.1e} "
                  f"(worst relative: {row['weights_worst_rel_norm'][0]} {row['weights_worst_rel_norm'][1]:.1e})  "
                  f"({secs:.0f} s)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
