"""`plait plan --validate`: run the layout for a few steps and set what was measured beside what the
planner predicted: model-state bytes by component, peak memory, step time, bytes sent per GPU.

The run uses plait's real trainer on this machine (GPUs over NCCL, else CPU processes over gloo)
on random tokens, so it needs no data. On a CPU the run is fp32, so the prediction is made again
with the fp32 convention, and times and peak memory are shown but not compared: the planner
models GPUs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from plait.errors import UserError, bad_value

# planner shape -> plait ModelConfig fields
_SHAPE = {"layers": "n_layers", "hidden": "dim", "heads": "n_heads", "kv_heads": "n_kv_heads",
          "ffn": "ffn_dim", "vocab": "vocab_size", "tie_embeddings": "tie_embeddings"}


def _model_section(preset: str | None, d) -> dict:
    """The model the planner priced, as a plait [model] table (a preset keeps its RoPE settings)."""
    return {"preset": preset or "custom", **{name: getattr(d, dim) for dim, name in _SHAPE.items()}}


def _random_tokens(folder: Path, vocab: int, n_tokens: int, seed: int = 0) -> Path:
    """A throwaway dataset of uniform random tokens (the step's cost does not depend on the text)."""
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", n_tokens), ("val", max(n_tokens // 8, 1))):
        rng.integers(0, vocab, size=n, dtype=np.int64).astype(dtype).tofile(folder / f"{split}_000.bin")
        splits[split] = [{"file": f"{split}_000.bin", "tokens": n}]
    meta = {"format": 1, "vocab_size": vocab, "dtype": np.dtype(dtype).name, "tokenizer": {"kind": "byte"},
            "splits": splits, "files_used": 0, "files_skipped": 0}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def measure(preset: str | None, d, lay, global_batch: int, steps: int, cuda: bool | None = None) -> dict:
    """Train the layout for `steps` steps (on the GPUs where `cuda`, by default where there are any);
    returns what rank 0 measured."""
    import torch

    from plait.config import build_config
    from plait.run import launch_training

    if lay.pp > 1:
        # the run would train, but the comparison reports one rank: a pipeline's ranks hold different
        # parts and send different traffic, which the prediction prices for a middle stage
        raise UserError(f"--validate compares one rank's measurements with the prediction, the same on every "
                        f"rank for data, tensor and context parallelism; a pipeline's ranks differ: set --pp 1 "
                        f"(train pp {lay.pp} with plait train --train.profile_steps to see its timeline)")
    per_step = lay.micro_batch * lay.dp
    if global_batch % per_step:
        raise bad_value("--global-batch", global_batch,
                        f"must be a multiple of micro-batch x dp = {per_step} to be run as given")
    model, seq = _model_section(preset, d), d.seq
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda and torch.cuda.device_count() < lay.n_gpus:
        raise UserError(f"the layout needs {lay.n_gpus} GPUs to validate; this machine has "
                        f"{torch.cuda.device_count()}: fewer GPUs in the layout, or --validate-device cpu")
    if not cuda:
        _check_host_room(d)
    with tempfile.TemporaryDirectory(prefix="plait-validate-") as tmp:
        _check_disk(Path(tmp), model)
        vocab = build_config({"model": model}).model.vocab_size
        data = _random_tokens(Path(tmp), vocab, max(1 << 16, 4 * per_step * (seq + 1)))
        cfg = build_config({
            "model": {**model, "max_seq_len": max(seq, build_config({"model": model}).model.max_seq_len)},
            "data": {"path": str(data)},
            "train": {"steps": steps, "micro_batch": lay.micro_batch, "grad_accum": global_batch // per_step,
                      "seq_len": seq, "eval_every": 0, "eval_batches": 1, "sample_tokens": 0, "progress": False,
                      "tensorboard": False, "out": str(Path(tmp) / "run"), "warmup_steps": 0,
                      "recompute": lay.recompute, "fp8": lay.fp8, "device": "cuda" if cuda else "cpu"},
            "checkpoint": {"at_end": False},
            "parallel": {"nproc": lay.n_gpus, "dp_shard": lay.dp_shard, "dp_replicate": lay.dp_replicate,
                         "zero": lay.zero, "tp": lay.tp, "sp": "on" if lay.seq_parallel else "off", "cp": lay.cp,
                         "cp_impl": lay.cp_impl, "zero3_cast_once": lay.zero3_cast_once,
                         "zero3_fp8_gather": lay.zero3_fp8_gather,
                         "gpus_per_node": max(lay.n_gpus, 1)},
        })
        summary = launch_training(cfg)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = rows[2:] if len(rows) > 3 else rows  # the first steps compile and warm allocators
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda": cuda, "steps": len(rows),
            "state_bytes": summary["state_bytes"],
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "sent_bytes": statistics.median(r.get("comm_sent_bytes", 0) for r in timed)}


def _check_host_room(d) -> None:
    """A CPU run keeps every parameter's fp32 weight, gradient and two Adam moments (16 bytes) in
    host memory, once at least whatever the layout: an 8b model needs 128 GB before one activation.
    Refuse it here, in one line, rather than let the workers be killed for memory."""
    from plait.planner.costs import param_count

    need = 16 * param_count(d)
    try:
        avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return  # not Linux: nothing to check against
    if need > avail:
        raise bad_value("--validate", True, f"runs the layout on this machine's CPU, where the model's fp32 state "
                        f"alone needs {need / 2**30:.1f} GiB and {avail / 2**30:.1f} GiB of memory is available: "
                        f"validate a smaller shape (--model tiny, small, 125m, or --layers/--hidden) or on GPUs")


def _check_disk(tmp: Path, model: dict) -> None:
    """`plait train` refuses a run folder without room for one checkpoint and names train.out and
    --out, which `plait plan` has not: the throwaway run lives in TMPDIR, so name that."""
    import shutil

    from plait.config import build_config
    from plait.run_folder import checkpoint_bytes

    need, free = checkpoint_bytes(build_config({"model": model}).model), shutil.disk_usage(tmp).free
    if free < need:
        raise bad_value("--validate", True, f"runs the layout in a throwaway folder under {tmp.parent}, which has "
                        f"{free / 2**30:.1f} GiB free where plait's trainer wants {need / 2**30:.1f} GiB for a "
                        f"checkpoint: point TMPDIR at a disk with room")


def compare(pred, measured: dict) -> list[tuple[str, float, float | None, bool]]:
    """(quantity, predicted, measured, comparable) rows."""
    m, st, s = pred.memory_bytes, pred.state_bytes, measured["state_bytes"]
    cuda = measured["cuda"]
    sent = sum(t.bytes_per_device for t in pred.traffic.values())
    return [
        ("parameters (bytes)", st["parameters"], s.get("params", 0), True),
        ("gradients (bytes)", st["gradients"], s.get("grads", 0), True),
        ("master + optimizer (bytes)", st["master_weights"] + st["optimizer_states"], s.get("optimizer", 0), True),
        ("sent per GPU per step (bytes)", sent, measured["sent_bytes"], True),
        # the run measures what the allocator handed out; the CUDA context and NCCL's buffers (the
        # prediction's `reserved`, 2 GiB) never show there: 1b ZeRO-3 on 4 x H200 read 0.937x with them
        ("peak memory (bytes)", sum(m.values()) - m.get("reserved", 0.0), measured["peak_mem_bytes"], cuda),
        ("step time (s)", pred.step_time_s, measured["step_time_s"], cuda),
    ]


def report(pred, measured: dict) -> str:
    lines = [f"validated on {measured['device']}: {measured['steps']} steps of plait's trainer"
             + ("" if measured["cuda"] else " (CPU, fp32: times and peak memory are not comparable "
                                             "with a GPU prediction)"),
             f"{'':32} {'predicted':>16} {'measured':>16} {'measured/predicted':>19}"]
    for name, p, m, comparable in compare(pred, measured):
        ratio = f"{m / p:18.3f}x" if comparable and p else f"{'n/a':>19}"
        # a CPU-sized step is a fraction of a millisecond: four decimals of a second printed 0.0000
        fmt = (lambda x: f"{x:16.4g}") if "time" in name else (lambda x: f"{x:16,.0f}")
        lines.append(f"{name:32} {fmt(p)} {fmt(m)} {ratio}")
    return "\n".join(lines)


def cpu_prediction_args(precision: str, cuda: bool) -> str:
    """A CPU run trains in fp32: predict with the fp32 convention so the byte counts compare."""
    return precision if cuda else "fp32"

