"""How long a checkpoint stalls training: synchronous against asynchronous (`--checkpoint.async`).

    python bench/checkpoint_stall.py --preset 8b --nproc 4 --zero 3          # 4 GPUs, seq 2048
    python bench/checkpoint_stall.py --device cpu --preset tiny --nproc 2 --seq 64 --micro-batch 2

Both variants train the same model, layout and seeded random tokens in this one invocation, with a
checkpoint every `--every` steps, and read back what plait's trainer measures on rank 0:
  stall      `checkpoint_stall_s`, the time the training loop waited for a save: the whole write,
             hashing and commit when synchronous; the copy of the state into (pinned) host memory
             when asynchronous - plus, if the previous background write is still running when the
             next save is due, the wait for it (`checkpoint_wait_s`; `copy_s` is the stall without
             it). Keep --every x step time above the write time, or async degenerates to waiting.
             The first asynchronous save also allocates the host buffers, so it is reported apart
             (`first_stall_s`); the goal is the steady state.
  write      `checkpoint_write_s` (async): how long the background write and commit took.
  step time  median step time away from checkpoints, and - async - of the steps that ran while a
             write was in the background (what the writer thread costs the steps it overlaps).
Writes bench/results/checkpoint-stall-<card>-<N>gpu.json (or -cpu-<N>proc.json on CPU) with the card,
torch version, date, config and both variants, and prints `async stall / sync stall`.

Disk: a checkpoint is ~12 bytes per parameter (8b: ~96 GB); each variant keeps one and is deleted
before the next (`--dir` on a fast local disk). `--model n_layers=8` shrinks an 8b-shaped model.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def card_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100' (as bench/data_parallel.py names its results)."""
    m = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


def random_tokens(folder: Path, vocab: int, n_tokens: int, seed: int = 0) -> Path:
    """A throwaway dataset of uniform random tokens (the step's cost does not depend on the text)."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", n_tokens), ("val", max(n_tokens // 8, 1))):
        rng.integers(0, vocab, size=n, dtype=np.int64).astype(dtype).tofile(folder / f"{split}_000.bin")
        splits[split] = [{"file": f"{split}_000.bin", "tokens": n}]
    (folder / "meta.json").write_text(json.dumps({"format": 1, "vocab_size": vocab, "dtype": np.dtype(dtype).name,
                                                  "tokenizer": {"kind": "byte"}, "splits": splits,
                                                  "files_used": 0, "files_skipped": 0}))
    return folder


def variant(a, data: Path, out: Path, is_async: bool) -> dict:
    from plait.config import build_config
    from plait.run import launch_training

    model = {"preset": a.preset, "max_seq_len": max(a.seq, 64), **dict(kv.split("=", 1) for kv in a.model)}
    cfg = build_config({
        "model": model, "data": {"path": str(data)},
        "train": {"steps": a.steps, "micro_batch": a.micro_batch, "seq_len": a.seq, "eval_every": 0,
                  "eval_batches": 1, "sample_tokens": 0, "progress": False, "tensorboard": False, "out": str(out),
                  "warmup_steps": 0, "device": a.device, "compile": "on" if a.compile else "off"},
        "checkpoint": {"every": a.every, "at_end": False, "keep_last": 1, "async": is_async},
        "parallel": {"nproc": a.nproc, "zero": a.zero, "gpus_per_node": max(a.nproc, 1)},
    })
    t0 = time.perf_counter()
    launch_training(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in rows if "checkpoint_stall_s" in r]
    stalls = [r["checkpoint_stall_s"] for r in saves]
    # steps that ran while an async write was in the background: from a save to the report of its end
    overlapping, pending = set(), None
    for r in rows:
        if pending is not None and r["step"] > pending:
            overlapping.add(r["step"])
        if "checkpoint_written" in r:
            pending = None
        if "checkpoint_stall_s" in r and is_async:
            pending = r["step"]
    warm = rows[2:]  # the first steps compile and warm the allocators
    quiet = [r["step_time_s"] for r in warm if r["step"] not in overlapping and "checkpoint_stall_s" not in r]
    during = [r["step_time_s"] for r in warm if r["step"] in overlapping]
    waits = [r.get("checkpoint_wait_s", 0.0) for r in saves]
    steady = slice(1, None) if is_async and len(stalls) > 1 else slice(None)
    out_row = {"async": is_async, "saves": len(stalls), "stalls_s": stalls, "waits_s": waits,
               "stall_s": statistics.median(stalls[steady]),
               # the copy alone: the stall less any wait for a previous write still running
               "copy_s": statistics.median(s - w for s, w in zip(stalls[steady], waits[steady])),
               "step_time_s": statistics.median(quiet) if quiet else None,
               "step_time_during_write_s": statistics.median(during) if during else None,
               "write_s": [r["checkpoint_write_s"] for r in rows if "checkpoint_write_s" in r], "wall_s": wall}
    if is_async:
        out_row["first_stall_s"] = stalls[0] if stalls else None
    return out_row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="8b")
    p.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE", help="model field overrides, e.g. n_layers=8")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="a checkpoint every this many steps")
    p.add_argument("--compile", action="store_true", help="torch.compile the blocks (slower to start)")
    p.add_argument("--dir", default="", help="where checkpoints are written (default: a temporary folder)")
    p.add_argument("--json", default="", help="result file (default bench/results/checkpoint-stall-<card>-<N>gpu.json)")
    a = p.parse_args()

    import torch

    from plait.config import build_config

    cuda = a.device == "cuda"
    card = torch.cuda.get_device_name(0) if cuda else "cpu"
    base = Path(a.dir or tempfile.mkdtemp(prefix="plait-ckpt-stall-"))
    vocab = build_config({"model": {"preset": a.preset, **dict(kv.split("=", 1) for kv in a.model)}}).model.vocab_size
    data = random_tokens(base / "data", vocab, max(1 << 16, 4 * a.micro_batch * a.nproc * (a.seq + 1)))
    result = {"card": card, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
              "config": {k: v for k, v in vars(a).items() if k not in ("json", "dir")}}
    try:
        for name, is_async in (("sync", False), ("async", True)):
            out = base / name
            result[name] = variant(a, data, out, is_async)
            shutil.rmtree(out, ignore_errors=True)  # one checkpoint on disk at a time
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    result["async_over_sync_stall"] = result["async"]["stall_s"] / result["sync"]["stall_s"]
    slug = f"{card_slug(card)}-{a.nproc}gpu" if cuda else f"cpu-{a.nproc}proc"
    path = Path(a.json or ROOT / "bench" / "results" / f"checkpoint-stall-{slug}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    s, y = result["sync"], result["async"]
    print(f"{card}, {a.preset} x {a.nproc}, zero {a.zero}: stall per checkpoint sync {s['stall_s']:.3f} s, async "
          f"{y['stall_s']:.4f} s (copy {y['copy_s']:.4f} s, first {y['first_stall_s']:.3f} s) = "
          f"{100 * result['async_over_sync_stall']:.1f}% of sync; step {s['step_time_s']:.3f} s, during an async "
          f"write {y['step_time_during_write_s'] or 0:.3f} s; -> {path}")
    if any(w > 0.001 for w in y["waits_s"]):
        print(f"note: {sum(w > 0.001 for w in y['waits_s'])} async save(s) waited for the previous write (writes "
              f"took {statistics.median(y['write_s'] or [0]):.3f} s, saves came every {a.every} steps): raise --every")
    return 0


if __name__ == "__main__":
    sys.exit(main())
