"""plait's one config system: dataclasses with a docstring per field, TOML files, CLI overrides.

A run's configuration is built in three layers, later ones winning:
  1. the dataclass defaults (and, for `model`, the named preset's shape),
  2. a TOML file (`--config run.toml`, sections `[model]`, `[train]`, ...),
  3. `--section.key value` overrides on the command line.
`plait.validate.validate_config` then checks everything before any process starts, so a bad input costs one line
and exit code 2 instead of a stack trace from deep inside a worker.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from plait.errors import UserError, bad_value


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Named shape to start from: tiny, small, 125m, 1b, 8b, 70b, 405b (custom = the field defaults). Fields given explicitly override it."""
    vocab_size: int = 256
    """Tokens in the vocabulary (256 for the built-in byte tokenizer)."""
    dim: int = 256
    """Width of the residual stream (hidden size)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Attention query heads; must divide `dim`."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide `n_heads`."""
    ffn_dim: int = 768
    """Inner width of the SwiGLU feed-forward block."""
    max_seq_len: int = 1024
    """Longest sequence the model is trained or sampled at (sizes the RoPE table)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: float = 0.0
    """Llama-3 RoPE scaling factor (0 = off; 32 for Llama-3.2)."""
    rope_low_freq_factor: float = 1.0
    """Llama-3 RoPE scaling: low-frequency factor."""
    rope_high_freq_factor: float = 4.0
    """Llama-3 RoPE scaling: high-frequency factor."""
    rope_original_max_len: int = 8192
    """Llama-3 RoPE scaling: the context length the base model was trained at."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    tie_embeddings: bool = True
    """Share the input embedding matrix with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation (residual projections get 1/sqrt(2*n_layers) of it)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Shapes of the presets. tiny/small serve CPU tests and the default job; 1b..405b follow Llama 3
# (1b = Llama-3.2-1B) and serve GPU runs and the planner.
PRESETS: dict[str, dict[str, Any]] = {
    "custom": {},
    "tiny": dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                 max_seq_len=1024, tie_embeddings=True),
    "small": dict(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536,
                  max_seq_len=2048, tie_embeddings=True),
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                 max_seq_len=4096, tie_embeddings=True),
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               max_seq_len=8192, rope_theta=500000.0, rope_scaling=32.0, tie_embeddings=True),
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    "70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    "405b": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                 ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
}


@dataclass
class DataConfig:
    path: str = ""
    """Folder of token shards made by `plait data prepare`; empty = the Python standard library of this interpreter, prepared on first use."""
    cache_dir: str = "~/.cache/plait"
    """Where the default corpus is prepared once and reused."""
    val_fraction: float = 0.01
    """Share of the default corpus's files held out for validation."""
    document_mask: bool = False
    """Attend only within a document: packed windows hold several documents (boundaries recorded by `plait data prepare`), and a token does not see the ones before its document's start."""
    mix: str = ""
    """Several prepared folders with relative weights, "dirA:0.7,dirB:0.3", instead of data.path: each row of a batch comes from one folder, drawn by weight from (seed, step)."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps to run."""
    micro_batch: int = 16
    """Sequences per micro-batch on each data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    seq_len: int = 256
    """Tokens per training sequence."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to `lr`."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    seed: int = 0
    """Seed of the weights (per parameter name) and of the data order (per step)."""
    dtype: str = "auto"
    """Compute precision: auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16. Master weights stay fp32."""
    fp8: str = "off"
    """FP8 matmuls in the blocks' linear layers: off, tensorwise (one scale per tensor: the fastest) or rowwise (one scale per row: more accurate). Needs bf16 compute and FP8 tensor cores (H100/H200) on a GPU (a CPU emulates the FP8 rounding in fp32 matmuls: for tests, not speed); the embedding, attention, output head and master weights keep their precision. Composes with every layout and schedule."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    compile: str = "auto"
    """torch.compile the blocks and loss: auto (on for CUDA), on, off."""
    eval_every: int = 50
    """Validation loss every this many steps (0 = only at the end)."""
    eval_batches: int = 8
    """Global batches (micro_batch x grad_accum x dp windows) of held-out data per validation: the same windows at every layout of one global batch. Each costs grad_accum forward passes per rank (a pipeline runs them one after another): lower it for long accumulations."""
    out: str = ""
    """Run folder for config, metrics and checkpoints (default runs/<timestamp>)."""
    progress: bool = True
    """Show a progress bar on stderr (the run's other lines - the banner, validation losses, checkpoints saved - print either way)."""
    tensorboard: bool = True
    """Also write TensorBoard events when the tensorboard package is installed."""
    sample_tokens: int = 200
    """Tokens generated at the end of the run as a sample (0 = none)."""
    init_from: str = ""
    """Start from these weights instead of random ones: a HuggingFace Llama folder (its config.json replaces [model]) or a plait checkpoint."""
    max_steps_this_run: int = 0
    """Stop after this many steps in this process (0 = run to `steps`); the LR schedule still follows `steps`."""
    max_restarts: int = 0
    """Restart the workers from the newest valid checkpoint up to this many times when one dies, hangs past parallel.timeout_s or fails a collective (plait's own launcher; under torchrun give torchrun --max-restarts instead)."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient norm (each is skipped: weights and optimizer untouched), saving the state of the last good step."""
    spike_factor: float = 0.0
    """Warn about a loss spike when a step's loss exceeds this multiple of the median of the last 100 losses (0 = off; e.g. 2)."""
    replica_check_every: int = 0
    """Every this many steps and before each checkpoint, data-parallel replicas compare a checksum of their parameters; a mismatch stops the run naming the ranks (0 = off)."""
    straggler_every: int = 0
    """Every this many steps, compare each rank's CPU time per step and warn about a rank slower than the median by more than straggler_threshold (0 = off)."""
    straggler_threshold: float = 0.2
    """How much slower than the median a rank may be before it is named (0.2 = 20%)."""
    recompute: str = "none"
    """Activation recomputation: none, selective (keep matmul and attention outputs, recompute norms, SwiGLU and RoPE) or full (keep only each block's input)."""
    global_batch: int = 0
    """Sequences per optimizer step over all data-parallel ranks (0 = micro_batch x grad_accum x dp). When set, grad_accum is derived as global_batch / (micro_batch x dp), so a run keeps its batch when the layout changes."""
    wandb: str = ""
    """Weights & Biases project to log to (needs the wandb package; WANDB_MODE=offline logs to files only); empty = off."""
    profile_steps: str = ""
    """"A:B" = record a torch profiler trace of optimizer steps A..B (Chrome/Perfetto JSON) and, on CUDA, a memory snapshot, under <out>/profile/; empty = off."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every this many steps (0 = only at the end)."""
    at_end: bool = True
    """Save a checkpoint when the run ends (off for throwaway runs such as `plait plan --validate`)."""
    every_minutes: float = 0.0
    """Also save every this many minutes (0 = off); the ranks agree on when."""
    async_save: bool = False
    """Write checkpoints in a background thread from a copy in host memory, so training waits only for the copy (`--checkpoint.async true`)."""
    keep_last: int = 3
    """Keep the newest K valid checkpoints; older ones are deleted after a successful save."""
    resume: bool | str = False
    """Resume from the newest valid checkpoint in the run folder: true (refuse when there is none), auto (start fresh when there is none) or false. `plait train --resume` starts from the config saved with the run (the layout, [parallel], excepted: it comes from the command line); options given on the command line override it."""


@dataclass
class ParallelConfig:
    nproc: int = 1
    """Processes to start on this machine (one per GPU, or CPU processes over gloo)."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP: replicate across this dimension)."""
    dp_shard: int = -1
    """Data-parallel ranks that shard (ZeRO/FSDP); -1 = whatever the other dims leave."""
    zero: int = 0
    """ZeRO stage over the dp_shard dimension: 0 (DDP), 1, 2 or 3 (FSDP)."""
    tp: int = 1
    """Tensor-parallel degree."""
    sp: str = "auto"
    """Sequence parallelism (norms and residuals sharded along the sequence between the tensor-parallel regions): auto (on whenever tp > 1), on, off."""
    pp: int = 1
    """Pipeline-parallel stages."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb (ZB-H1), zbv (ZB-V: v = 2 chunks per rank in a V, both ends of the model on rank 0)."""
    v: int = 1
    """Virtual pipeline stages per rank (interleaved, zbv): 2 unless given for those schedules, else 1 (zbv runs only 2)."""
    stage_layers: str = ""
    """Layers of each of the pp x v pipeline stages, comma-separated (e.g. 3,5,5,3); empty = as even as possible; balance = fewer on the last stage (zbv: on rank 0, which holds the first and the last) by what its output head and loss cost in FLOPs. The first and last stages also hold the embedding and the loss."""
    microbatches: int = 0
    """Pipeline micro-batches per step: sets train.grad_accum (0 = use train.grad_accum)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks."""
    cp_impl: str = "ring"
    """How context-parallel attention sees the other ranks' tokens: ring (K/V blocks pass around the cp ranks, overlapped with attention; any head count) or ulysses (all-to-all from sequence to heads and back around a fused attention kernel; needs the heads per tensor-parallel rank divisible by cp)."""
    gpus_per_node: int = 8
    """GPUs per node for `plait mesh` and `plait plan` (a run's nodes are what its launcher started: processes per node)."""
    allow_cross_node_tp: bool = False
    """Warn instead of refusing when a tensor-parallel group would span nodes."""
    bind_cpus: str = "auto"
    """auto: on GPUs, each local rank's threads run on physical cores of their own, its GPU's share of the cores of the GPU's NUMA node (split evenly among that node's GPUs, whichever job uses them; a process a launcher already bound is left as it is); off: leave placement to the OS. A rank's host issues its step: sharing a core with another rank slows every collective to that rank's pace."""
    timeout_s: float = 600.0
    """A collective that does not finish within this many seconds ends the run with an error."""
    bucket_mb: float = 25.0
    """Gradient bucket size for data-parallel reduction, in MiB."""
    embedding_rows: str = "auto"
    """DDP: send the embedding's gradient as the rows the step touched (each rank's token ids and their gradients, all-gathered) instead of all-reducing the dense vocab x dim matrix, which the backward makes last and nothing can overlap; a tied output matrix's dense part then reduces as the backward starts. auto: for an untied embedding, where it sends fewer bytes (ranks x tokens a rank a step < 2 x vocab) and the model is not split by tp/pp/cp (measured on 4 x H200: +1.6% for 8b's shape; a tied matrix gained nothing, so auto leaves it dense); on; off."""
    overlap_ctas: int = 0
    """NCCL thread blocks (each an SM) that DDP's gradient all-reduce may take while it runs beside the backward's matmuls, on a second communicator; 0 = NCCL's choice. Fewer leave the matmuls more SMs; the step's last bucket, which nothing overlaps, keeps NCCL's choice. GPUs only."""
    zero3_cast_once: bool = False
    """ZeRO-3: keep the 16-bit copy of this rank's shard that a gather sends, from the step's first gather to its update, instead of casting the fp32 shard again for every gather (twice a micro-batch). Costs 2 bytes a parameter over the shard group of memory; saves the casts' passes over the shard when a step runs several micro-batches a GPU."""
    zero3_fp8_gather: bool = False
    """ZeRO-3 with train.fp8 tensorwise: gather the blocks' weights in FP8 (one byte a parameter on the wire and in a gathered block, not two), each rank quantizing its chunk with the whole weight's scale (found once a step); the FP8 matmuls read them as gathered. Trains bit for bit as the 16-bit gather does."""
    reduce_dtype: str = "auto"
    """dtype in which ZeRO-2/3 reduce gradients: auto (the parameters' dtype), fp32 (bf16 gradients summed without rounding to bf16 at each add, at twice the bytes on the wire and in the gradient shard) or bf16."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in fields(self)}

    def to_toml(self) -> str:
        """The config as TOML. With train.global_batch set, grad_accum is what that batch made at the
        run's layout: it is written as a comment, so that the file, given back as --config or
        resumed at another layout, derives it again instead of contradicting the batch."""
        d = self.to_dict()
        notes = {}
        if self.train.global_batch:
            notes[("train", "grad_accum")] = "derived: global_batch / (micro_batch x dp) at this layout"
        # how this start ran, not what the run is: given back with --config into a new --out, a
        # resume = true refused ("holds no checkpoint to resume")
        if self.checkpoint.resume:
            notes[("checkpoint", "resume")] = "this start resumed the run; --resume continues it"
        if self.train.max_steps_this_run:
            notes[("train", "max_steps_this_run")] = "a limit of this start only"
        return dump_toml(d, notes)


SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
                  "checkpoint": CheckpointConfig, "parallel": ParallelConfig}


def field_docs(cls) -> dict[str, str]:
    """Read the docstring under each dataclass field (for `--help` and docs)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


class BoolOrAuto:
    """The type of a switch that can also be left to plait: True, False or the string "auto".

    Kept as a bool where it is one, so configs saved when the field was a plain bool still load and
    `if switch:` still means "on or auto"."""


def _coerce(section: str, key: str, value: Any, typ: type) -> Any:
    """Turn a TOML or command-line value into the field's type, or say what was wrong."""
    name = f"{section}.{key}"
    if typ is BoolOrAuto:
        if isinstance(value, str) and value.lower() == "auto":
            return "auto"
        try:
            return _coerce(section, key, value, bool)
        except UserError:
            hint = ""
            if name == "checkpoint.resume" and isinstance(value, str) and ("/" in value or Path(value).is_dir()):
                hint = f"; to continue the run in a folder, give it as --out: --out {value} --resume"
            raise bad_value(name, value, "expected true, false or auto" + hint) from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise bad_value(name, value, "expected true or false")
    if typ is int:
        if isinstance(value, bool):
            raise bad_value(name, value, "expected an integer")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise bad_value(name, value, "expected an integer") from None
    if typ is float:
        if isinstance(value, bool):
            raise bad_value(name, value, "expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad_value(name, value, "expected a number") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise bad_value(name, value, "expected a string")
        return str(value)
    raise AssertionError(f"unsupported field type {typ} for {name}")


def _field_types(cls) -> dict[str, type]:
    hints = {"int": int, "float": float, "bool": bool, "str": str, "bool | str": BoolOrAuto}
    return {f.name: hints[f.type] if isinstance(f.type, str) else f.type for f in fields(cls)}


def _unknown(kind: str, name: str, choices) -> UserError:
    close = difflib.get_close_matches(name, list(choices), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(sorted(choices))}"
    return UserError(f"unknown {kind} {name!r}: {hint}")


# other names a field answers to: `async` is a Python keyword, so no dataclass field can have it
KEY_ALIASES = {("checkpoint", "async"): "async_save"}


def dealias(raw: dict) -> dict:
    """{section: {key: value}} with every alias replaced by its field's name."""
    return {s: {KEY_ALIASES.get((s, k), k): v for k, v in values.items()} if isinstance(values, dict) else values
            for s, values in raw.items()}


def build_config(raw: dict[str, dict[str, Any]] | None = None) -> Config:
    """Build a Config from nested {section: {key: value}} (TOML or overrides), presets applied."""
    raw = dealias(raw or {})
    for section, values in raw.items():
        if section not in _SECTION_TYPES:
            raise _unknown("config section", section, _SECTION_TYPES)
        if not isinstance(values, dict):
            raise bad_value(section, values, f"[{section}] must be a table of key = value")
        types = _field_types(_SECTION_TYPES[section])
        for key in values:
            if key not in types:
                raise _unknown(f"key in [{section}]", key, types)
    cfg = Config()
    model_raw = dict(raw.get("model", {}))
    preset = str(model_raw.get("preset", cfg.model.preset))
    if preset not in PRESETS:
        raise bad_value("model.preset", preset, f"choose one of {', '.join(PRESETS)}")
    cfg.model = ModelConfig(preset=preset, **PRESETS[preset])
    for section, values in raw.items():
        obj = getattr(cfg, section)
        types = _field_types(type(obj))
        for key, value in values.items():
            setattr(obj, key, _coerce(section, key, value, types[key]))
    if "v" not in raw.get("parallel", {}):  # interleaved and ZB-V run two chunks a rank unless told otherwise
        from plait.parallel.schedules import default_v

        cfg.parallel.v = default_v(cfg.parallel.schedule)
    return cfg


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if p.is_dir():  # "no such file" would send the user looking for a typo in a path that exists
        inside = p / "config.toml"  # a run folder holds the config it was started with
        such = f" such as {inside}" if inside.is_file() else " (a .toml file)"
        raise bad_value("--config", str(path), f"is a folder, not a file; give the path of a TOML config{such}")
    if not p.is_file():
        raise bad_value("--config", str(path), "no such file; give the path of a TOML config")
    try:
        return dealias(tomllib.loads(p.read_text()))
    except tomllib.TOMLDecodeError as e:
        raise bad_value("--config", str(path), f"not valid TOML ({e})") from None
    except UnicodeDecodeError:
        raise bad_value("--config", str(path), "is not a text file; give the path of a TOML config") from None


def dotted_pairs(args: list[str], example: str) -> list[tuple[str, str]]:
    """`--a.b VALUE` / `--a.b=VALUE` arguments as ("a.b", "VALUE") pairs; `example` shows the
    right form in the error for anything else."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise UserError(f"unexpected argument {arg!r}: overrides look like {example}")
        if "=" in arg:
            pairs.append(tuple(arg[2:].split("=", 1)))
            i += 1
        else:
            if i + 1 >= len(args):
                raise UserError(f"{arg} needs a value: write {arg} VALUE")
            pairs.append((arg[2:], args[i + 1]))
            i += 2
    return pairs


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `--section.key value` (or `--section.key=value`) pairs into a nested dict."""
    for arg in args:  # a field's name without its section (`--profile-steps 2:3`): say which one it is
        name = arg.split("=")[0]
        key = name[2:].replace("-", "_") if name.startswith("--") and "." not in name else ""
        owners = [f"--{s}.{key}" for s, cls in _SECTION_TYPES.items() if key in _field_types(cls)]
        if owners:
            raise UserError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE; "
                            f"did you mean {' or '.join(owners)}?")
    out: dict[str, dict[str, Any]] = {}
    for name, value in dotted_pairs(args, "--section.key VALUE (e.g. --train.steps 20)"):
        section, key = name.split(".", 1)
        out.setdefault(section, {})[key.replace("-", "_")] = value
    return dealias(out)


def merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def config_from_dict(d: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config saved with `to_dict` (checkpoints) without re-applying a preset over it."""
    cfg = Config()
    for section, cls in _SECTION_TYPES.items():
        known = {f.name for f in fields(cls)}
        setattr(cfg, section, cls(**{k: v for k, v in d.get(section, {}).items() if k in known}))
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def dump_toml(d: dict[str, dict[str, Any]], notes: dict[tuple[str, str], str] | None = None) -> str:
    """`notes`: (section, key) -> why that key is written as a comment (a value derived from others)."""
    notes = notes or {}
    lines = []
    for section, values in d.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            note = notes.get((section, k))
            lines.append(f"# {k} = {_toml_value(v)}  ({note})" if note else f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
