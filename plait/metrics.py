"""What a run reports: model FLOPs and MFU, memory, JSONL/TensorBoard/W&B metrics, the progress bar."""

from __future__ import annotations

import json
import resource
import sys
import time
import uuid
from pathlib import Path

import torch

from plait.config import ModelConfig
from plait.errors import bad_value

# Dense peak TFLOP/s per GPU by dtype (vendor datasheets, no sparsity). The first key found in the
# device name wins, so more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp32": 378.0}),
    ("H100", {"bf16": 989.0, "fp32": 494.5}),
    ("H200", {"bf16": 989.0, "fp32": 494.5}),
    ("GH200", {"bf16": 989.0, "fp32": 494.5}),
    ("B200", {"bf16": 2250.0, "fp32": 1125.0}),
    ("A100", {"bf16": 312.0, "fp32": 156.0}),
    ("L40S", {"bf16": 362.0, "fp32": 183.0}),
    ("A10", {"bf16": 125.0, "fp32": 62.5}),
    ("V100", {"bf16": 125.0, "fp32": 125.0}),
]


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but an untied input embedding (a lookup)."""
    d, h, kv, f, L, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    hd = d // h
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f + 2 * d
    return L * per_layer + d + V * d


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token, PaLM convention: 6N + 12·L·H·Q·T.

    6N: forward (2) and backward (4) FLOPs per matmul weight; 12·L·H·Q·T: the attention score and
    value matmuls (forward and backward), counted for the full T x T square as PaLM does.
    Recomputation is not counted: MFU measures useful work.
    """
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak dense FLOP/s of one device for this dtype, or None where MFU has no meaning (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    for pattern, table in PEAK_TFLOPS:
        if pattern in name:
            return table[key] * 1e12
    return None


def throughput(tokens_per_step: int, step_time_s: float, n_gpus: int, flops_per_tok: float,
               peak: float | None) -> dict:
    """tokens/s of the whole job, per GPU, and MFU - a per-GPU figure: tokens/s/GPU x FLOPs/token
    over one GPU's peak ("n/a" where there is no peak, as on CPU). Whatever the layout, the model
    FLOPs of a token are spread over every GPU of the job."""
    tok_s = tokens_per_step / step_time_s
    per_gpu = tok_s / n_gpus
    return {"tokens_per_s": tok_s, "tokens_per_s_per_gpu": per_gpu,
            "mfu": per_gpu * flops_per_tok / peak if peak else "n/a"}


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # CPU: the process's peak resident set (Linux reports KiB)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLog:
    """One JSON object per line in metrics.jsonl, mirrored to TensorBoard when it is installed and
    to Weights & Biases when a project is given (`WANDB_MODE=offline` logs to files only).

    `folder` None (ranks other than the main one) logs nothing. A W&B run's id is kept in
    `folder/wandb_id`, so a resumed plait run continues the same W&B run.
    """

    def __init__(self, folder: Path | None, tensorboard: bool = True, *, wandb_project: str = "",
                 run_name: str = "", config: dict | None = None):
        self.file = None
        self.tb = None
        self.wandb = None
        self.trackers: list[str] = []
        if folder is None:
            return
        folder = Path(folder)
        try:
            self.file = open(folder / "metrics.jsonl", "a", buffering=1)
        except OSError as e:  # a folder of that name, a read-only file: one line, not a traceback per rank
            from plait.checkpoint import file_write_error

            raise file_write_error(folder / "metrics.jsonl", e) from None
        self.trackers.append(f"metrics.jsonl ({folder / 'metrics.jsonl'})")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(folder / "tb"))
                self.trackers.append(f"tensorboard ({folder / 'tb'})")
            except Exception:  # tensorboard not installed: JSONL alone is the record
                self.tb = None
        if wandb_project:
            self.wandb = _start_wandb(folder, wandb_project, run_name or folder.name, config)
            mode = "offline" if getattr(self.wandb, "offline", False) else "online"
            self.trackers.append(f"wandb (project {wandb_project}, {mode})")

    def describe(self) -> str:
        """One line naming the active trackers, for the start of a run."""
        return "trackers: " + (", ".join(self.trackers) if self.trackers else "none on this rank")

    def log(self, record: dict) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: one line, not a traceback and K restarts into the same disk
            from plait.checkpoint import file_write_error

            raise file_write_error(Path(self.file.name), e) from None
        # trackers take numbers only ("n/a" MFU on CPU stays in the JSONL)
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.file:
            try:
                self.file.close()
            except OSError:  # what a full disk refused was said when it was written
                pass
        if self.tb:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def check_wandb(project: str, field: str = "train.wandb") -> None:
    """Refuse a W&B project when `wandb` is not installed (call before launching workers)."""
    if not project:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise bad_value(field, project, "needs the wandb package: pip install wandb (or leave it empty)") from None


def _start_wandb(folder: Path, project: str, name: str, config: dict | None):
    check_wandb(project)
    import wandb

    id_file = folder / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    run = wandb.init(project=project, name=name, id=run_id, resume="allow", config=config or {}, dir=str(folder))
    id_file.write_text(run_id + "\n")
    return run


def _rate(per_s: float) -> str:
    """Tokens a second as a person reads them: 64.5k, or 37 on a slow run (not 0.0k)."""
    return f"{per_s / 1e3:.1f}k" if per_s >= 1e3 else f"{per_s:.0f}"


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A one-line bar on a terminal; on a pipe or log file, a plain line every ~5% of the run.
    `enabled`: this process prints (rank 0); `bar`: the bar too (train.progress) - the run's other
    lines (banner, validation losses, checkpoints) print either way."""

    def __init__(self, total: int, start: int, enabled: bool, stream=None, bar: bool = True):
        self.total, self.start, self.enabled, self.bar = total, start, enabled, bar
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.tty = self.stream.isatty()
        self.every = max(1, (total - start) // 20)

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if not (self.enabled and self.bar):
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        width = 24
        filled = int(width * step / self.total)
        line = (f"step {step}/{self.total} [{'#' * filled}{'.' * (width - filled)}] loss {loss:.3f} "
                f"| {_rate(tokens_per_s)} tok/s | ETA {_fmt_time(eta)}{extra}")
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            self.stream.flush()
        elif done % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r" + " " * 100 + "\r" if self.tty and self.bar else "") + text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.bar and self.tty:
            self.stream.write("\n")
