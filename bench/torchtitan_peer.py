"""torchtitan as a speed peer: its own trainer, its Llama 3 model, plait's model shapes.

    python3 bench/torchtitan_peer.py --model 1b --seq 2048 --local-batch 8 --ngpu 1 --out tt-1b.json
    python3 bench/torchtitan_peer.py --model 8b --layers 8 --ngpu 4 --ac selective --float8 rowwise

The script registers a torchtitan "train spec" (torchtitan's extension point for outside models) whose
Llama 3 flavor has exactly the shape of plait's preset (plait/config.py): same dim, layers, heads,
KV heads, SwiGLU width, vocabulary, RoPE and norm settings, and the same parameter count, tied
input/output embeddings included (1b ties them, as Llama 3.2 1B and plait do; torchtitan's Llama 3
has no tying option, so the spec's model class ties the head to the embedding and FSDP shards the two
as one parameter). Everything else is
torchtitan's own code and its performance recipe (the options its benchmarks and float8 docs use):
  - FSDP2 over all GPUs (data_parallel_shard_degree = ngpu); fp32 sharded parameters with bf16
    compute and fp32 gradient reduction (torchtitan's defaults). On one GPU torchtitan does not wrap
    in FSDP and uses bf16 autocast over fp32 parameters instead.
  - torch.compile of each transformer block and of the loss; fused AdamW; grad-norm clipping at 1.0.
  - activation checkpointing none / selective (per-op policy by default) / full.
  - optional float8 linears through torchtitan's own converter (torchao): tensorwise with float8
    FSDP all-gather and precomputed scales, or rowwise; the output head stays in bf16, as in
    torchtitan's Llama 3 configs.
The data is seeded random tokens from a dataloader registered with the spec (the GPU machine is
offline, and throughput does not depend on token content), so no tokenizer is loaded.

Throughput comes from torchtitan's own per-step metrics (tokens/s per GPU, memory, MFU), captured
in-process; the first --warmup steps (compilation, allocator warm-up) are left out of the averages.
The launcher re-runs this file under torchrun and prints one JSON object (--out also writes it).
MFU is given twice: torchtitan's (its FLOP count leaves a tied output head out) and plait's
formula, tokens/s x (6N + 12*L*H*Q*T) / 989 TFLOP/s with N the parameters that take part in matmuls.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, the figure plait's benchmarks use

# Needed on the benchmark machines: NVLink SHARP multicast is not available there.
LAUNCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="plait preset whose shape to train (1b, 8b, ...)")
    p.add_argument("--layers", type=int, default=0, help="override the preset's n_layers (0 = keep)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--local-batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--ngpu", type=int, default=1, help="GPUs (torchrun processes); FSDP2 shards over all")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in all")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the averages")
    p.add_argument("--ac", choices=["none", "selective", "full"], default="none",
                   help="activation checkpointing mode")
    p.add_argument("--sac-option", default="op",
                   help="selective AC: 'op' (per-op policy) or N (every N-th block)")
    p.add_argument("--float8", choices=["none", "tensorwise", "rowwise"], default="none",
                   help="float8 linears via torchtitan's torchao converter")
    p.add_argument("--no-compile", action="store_true",
                   help="run eagerly instead of compiling each block and the loss")
    p.add_argument("--untie", action="store_true", help="untie the embeddings even if the preset ties them")
    p.add_argument("--out", default="", help="also write the JSON result here")
    p.add_argument("--extra", default="",
                   help="more torchtitan options, one string given with '=' since it starts with '--': "
                        "--extra='--parallelism.fsdp_reshard_after_forward never'")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    return args


# ---------------------------------------------------------------------------------------------
# Model shape: plait's preset, expressed as torchtitan Llama 3 model args
# ---------------------------------------------------------------------------------------------

def plait_shape(args: argparse.Namespace) -> dict:
    """The preset's fields from plait/config.py (the single source of the shapes)."""
    sys.path.insert(0, str(ROOT))
    from plait.config import ModelConfig, PRESETS

    if args.model not in PRESETS or not PRESETS[args.model]:
        raise SystemExit(f"unknown plait preset {args.model!r}; choose from "
                         f"{', '.join(k for k, v in PRESETS.items() if v)}")
    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    fields.update(PRESETS[args.model])
    if args.layers:
        fields["n_layers"] = args.layers
    if args.untie:
        fields["tie_embeddings"] = False
    fields.pop("preset", None)
    return fields


def expected_params(s: dict) -> int:
    """Parameter count of a Llama block stack of this shape (tied embeddings counted once)."""
    d, hd = s["dim"], s["dim"] // s["n_heads"]
    attn = d * s["n_heads"] * hd * 2 + d * s["n_kv_heads"] * hd * 2  # wq, wo, wk, wv
    block = attn + 3 * d * s["ffn_dim"] + 2 * d                       # SwiGLU + two RMSNorms
    emb = s["vocab_size"] * d
    return s["n_layers"] * block + d + emb * (1 if s["tie_embeddings"] else 2)


def matmul_flops_per_token(s: dict, seq: int) -> float:
    """plait's MFU numerator (plait.metrics.flops_per_token): 6N + 12*L*H*Q*T, N = all parameters
    but an untied input embedding (a lookup); a tied one is the output head's matmul weight."""
    n_matmul = expected_params(s) - (0 if s["tie_embeddings"] else s["vocab_size"] * s["dim"])
    return 6 * n_matmul + 12 * s["n_layers"] * s["n_heads"] * (s["dim"] // s["n_heads"]) * seq


def torchtitan_model_args(s: dict, seq: int):
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    @dataclasses.dataclass
    class PeerModelArgs(TransformerModelArgs):
        tie_embeddings: bool = False

    # torchtitan sizes SwiGLU as multiple_of * ceil(int(mult * int(8 * dim / 3)) / multiple_of);
    # multiple_of = ffn_dim with the multiplier ffn_dim / int(8 * dim / 3) lands exactly on it.
    base = int(2 * 4 * s["dim"] / 3)
    mult = s["ffn_dim"] / base
    # RoPE: torchtitan always applies Llama 3 frequency scaling; factor 1 leaves frequencies as they are.
    rope = RoPEScalingArgs(
        scaling_factor=s["rope_scaling"] if s["rope_scaling"] > 0 else 1.0,
        low_freq_factor=s["rope_low_freq_factor"],
        high_freq_factor=s["rope_high_freq_factor"],
        original_max_position_embeddings=s["rope_original_max_len"],
    )
    return PeerModelArgs(
        dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
        vocab_size=s["vocab_size"], multiple_of=s["ffn_dim"], ffn_dim_multiplier=mult,
        norm_eps=s["norm_eps"], rope_theta=s["rope_theta"], rope_scaling_args=rope,
        max_seq_len=max(seq, s["max_seq_len"]), tie_embeddings=s["tie_embeddings"],
    )


def tied_transformer_cls():
    """torchtitan's Llama 3 Transformer, with the output head sharing the embedding matrix when asked."""
    from torchtitan.models.llama3.model.model import Transformer

    class PeerTransformer(Transformer):
        def __init__(self, model_args):
            super().__init__(model_args)
            if model_args.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight

        def init_weights(self, buffer_device=None):
            # Moving a meta model to the GPU (to_empty) gives each module its own new tensor, which
            # unties plain parameters; tie again before initialising (torchtitan's Qwen3 does the same).
            if self.model_args.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
            super().init_weights(buffer_device=buffer_device)

    return PeerTransformer


def peer_parallelize():
    """torchtitan's parallelize_llama; with tied embeddings, the embedding joins the output head's
    FSDP group (torchtitan's own apply_fsdp otherwise, unchanged), so the shared matrix is one
    FSDP parameter, gathered once and reduce-scattered once per step."""
    import torchtitan.models.llama3.infra.parallelize as tt_par

    def parallelize(model, parallel_dims, job_config):
        if not model.model_args.tie_embeddings:
            return tt_par.parallelize_llama(model, parallel_dims, job_config)
        fully_shard = tt_par.fully_shard

        def fully_shard_tied(module, **kwargs):
            if module is model.tok_embeddings:
                return module  # sharded below, together with the output head
            if isinstance(module, list) and model.output in module:
                module = [model.tok_embeddings, *module]
            return fully_shard(module, **kwargs)

        tt_par.fully_shard = fully_shard_tied
        try:
            return tt_par.parallelize_llama(model, parallel_dims, job_config)
        finally:
            tt_par.fully_shard = fully_shard

    return parallelize


# ---------------------------------------------------------------------------------------------
# Data: seeded random tokens, no tokenizer
# ---------------------------------------------------------------------------------------------

def random_token_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    import torch
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    vocab, seq = VOCAB_SIZE, job_config.training.seq_len

    class RandomTokens(IterableDataset, Stateful):
        """A fixed pool of random sequences per rank, cycled: no per-step generation cost."""

        def __init__(self):
            g = torch.Generator().manual_seed(1234 + dp_rank)
            self.pool = torch.randint(0, vocab, (64, seq + 1), generator=g)
            self.i = 0

        def __iter__(self):
            while True:
                x = self.pool[self.i % len(self.pool)]
                self.i += 1
                yield {"input": x[:-1]}, x[1:]

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, sd):
            self.i = sd["i"]

    kwargs = {**dataclasses.asdict(job_config.training.dataloader),
              "batch_size": job_config.training.local_batch_size}
    return ParallelAwareDataloader(RandomTokens(), dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


VOCAB_SIZE = 0  # set by register_peer, read by the dataloader builder


def ensure_datasets_importable() -> None:
    """torchtitan imports HuggingFace `datasets` at module level for its text loaders, which this
    run does not use. Where the package is absent, a placeholder module stands in for it."""
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return

    def unavailable(*_a, **_k):
        raise RuntimeError("HuggingFace datasets is not installed; this peer uses random tokens")

    ds = types.ModuleType("datasets")
    ds.Dataset = type("Dataset", (), {})
    ds.IterableDataset = type("IterableDataset", (), {})
    ds.load_dataset = unavailable
    dist = types.ModuleType("datasets.distributed")
    dist.split_dataset_by_node = unavailable
    ds.distributed = dist
    sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dist


def flavor_name(args: argparse.Namespace) -> str:
    return args.model + (f"_{args.layers}l" if args.layers else "")


def register_peer(args: argparse.Namespace) -> tuple[str, dict]:
    """Registers the train spec "plait_llama3" with one flavor, the chosen plait preset."""
    global VOCAB_SIZE
    ensure_datasets_importable()
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.protocols.train_spec import TrainSpec, _extra_train_specs, register_train_spec

    shape = plait_shape(args)
    VOCAB_SIZE = shape["vocab_size"]
    flavor = flavor_name(args)
    spec = TrainSpec(
        model_cls=tied_transformer_cls(),
        model_args={flavor: torchtitan_model_args(shape, args.seq)},
        parallelize_fn=peer_parallelize(),
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=random_token_dataloader,
        build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss,
    )
    _extra_train_specs.pop("plait_llama3", None)
    register_train_spec("plait_llama3", spec)
    return flavor, shape


def count_params_on_meta(args: argparse.Namespace) -> int:
    """Builds the registered model on the meta device and counts unique parameters."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("plait_llama3")
    (model_args,) = spec.model_args.values()
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# torchtitan options
# ---------------------------------------------------------------------------------------------

def torchtitan_options(args: argparse.Namespace, flavor: str, dump: str) -> list[str]:
    o = [
        "--model.name", "plait_llama3", "--model.flavor", flavor,
        "--job.dump_folder", dump,
        "--training.seq_len", str(args.seq),
        "--training.local_batch_size", str(args.local_batch),
        "--training.steps", str(args.steps),
        "--parallelism.data_parallel_shard_degree", str(args.ngpu),
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--activation_checkpoint.mode", args.ac,
        "--activation_checkpoint.selective_ac_option", args.sac_option,
    ]
    if not args.no_compile:
        o += ["--compile.enable"]
    if args.float8 != "none":
        # The output head stays high precision (torchtitan's Llama 3 configs filter it; with tied
        # embeddings it is the embedding matrix, which float8 must not wrap).
        o += ["--model.converters", "quantize.linear.float8",
              "--quantize.linear.float8.filter_fqns", "output"]
        if args.float8 == "tensorwise":
            o += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
        else:
            o += ["--quantize.linear.float8.recipe_name", "rowwise"]
    o += shlex.split(args.extra)
    return o


# ---------------------------------------------------------------------------------------------
# Worker (one per GPU, under torchrun) and launcher
# ---------------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    result_file = os.environ["TT_PEER_RESULT"]
    tt_args = torchtitan_options(args, flavor_name(args), os.path.dirname(result_file))
    # torchtitan's ConfigManager.parse_args takes sys.argv[1:] as a default bound when its module is
    # imported, so argv must hold torchtitan's options before any torchtitan import.
    sys.argv = [sys.argv[0], *tt_args]
    flavor, shape = register_peer(args)
    import torch
    import torchtitan
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.train import Trainer, main

    steps: list[dict] = []
    peak = {}
    original_log = MetricsProcessor.log

    def recording_log(self, step, *a, **k):
        # MetricsProcessor.log computes tps/mfu/memory and hands them to its metric logger; a
        # recording logger in front of it keeps them for the summary.
        inner = self.logger

        class Recorder:
            def log(_self, metrics, step_):
                steps.append({"step": step_, **{k_: float(v) for k_, v in metrics.items()}})
                inner.log(metrics, step_)

            def close(_self):
                inner.close()

        self.logger = Recorder()
        try:
            return original_log(self, step, *a, **k)
        finally:
            self.logger = inner
            peak.setdefault("gpu", self.device_memory_monitor.device_name)
            peak["flops"] = self.gpu_peak_flops
            peak["flops_per_token"] = self.num_flops_per_token

    MetricsProcessor.log = recording_log
    main(Trainer)

    if int(os.environ.get("RANK", "0")) == 0:
        params = count_params_on_meta(args)
        with open(result_file, "w") as f:
            json.dump({"steps": steps, "params": params, "shape": shape, "flavor": flavor,
                       "torchtitan_args": tt_args, "gpu": peak.get("gpu", ""),
                       "tt_peak_flops": peak.get("flops"), "tt_flops_per_token": peak.get("flops_per_token"),
                       "torchtitan": torchtitan.__version__, "torch": torch.__version__,
                       "cuda": torch.version.cuda,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None},
                      f)


def summarize(args: argparse.Namespace, raw: dict, command: list[str]) -> dict:
    kept = [s for s in raw["steps"] if s["step"] > args.warmup]
    shape = raw["shape"]
    tps = [s["throughput(tps)"] for s in kept]
    tps_mean = statistics.fmean(tps) if tps else 0.0
    try:
        import torchao
        torchao_version = torchao.__version__
    except Exception:
        torchao_version = None
    mean = lambda key: statistics.fmean(s[key] for s in kept) if kept else None  # noqa: E731
    return {
        "peer": "torchtitan",
        "torchtitan_version": raw["torchtitan"], "torchao_version": torchao_version,
        "torch_version": raw["torch"], "cuda": raw["cuda"], "nccl": raw["nccl"], "gpu": raw["gpu"],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": {"preset": args.model, "flavor": raw["flavor"], **{k: shape[k] for k in (
            "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta",
            "rope_scaling", "norm_eps", "tie_embeddings")}},
        "params": raw["params"], "params_expected": expected_params(shape),
        "seq_len": args.seq, "local_batch": args.local_batch, "ngpu": args.ngpu,
        "tokens_per_step": args.seq * args.local_batch * args.ngpu,
        "steps": args.steps, "warmup_steps_excluded": args.warmup, "steps_averaged": len(kept),
        "ac": args.ac, "sac_option": args.sac_option if args.ac == "selective" else None,
        "float8": args.float8, "compile": not args.no_compile,
        "tokens_per_s_per_gpu": round(tps_mean, 1),
        "tokens_per_s_per_gpu_median": round(statistics.median(tps), 1) if tps else None,
        "tokens_per_s_per_gpu_min_max": [round(min(tps), 1), round(max(tps), 1)] if tps else None,
        "step_time_s": mean("time_metrics/end_to_end(s)"),
        "peak_memory_reserved_gib": max(s["memory/max_reserved(GiB)"] for s in raw["steps"]),
        "peak_memory_active_gib": max(s["memory/max_active(GiB)"] for s in raw["steps"]),
        "mfu_torchtitan_pct": mean("mfu(%)"),
        "mfu_torchtitan_peak_flops": raw["tt_peak_flops"],
        "mfu_plait_formula_pct": 100 * tps_mean * matmul_flops_per_token(shape, args.seq) / PEAK_BF16_FLOPS,
        "final_loss": raw["steps"][-1]["loss_metrics/global_avg_loss"] if raw["steps"] else None,
        "command": " ".join(shlex.quote(c) for c in command),
        "launch": raw.get("launch", ""),
        "torchtitan_args": " ".join(shlex.quote(c) for c in raw["torchtitan_args"]),
        "per_step": [{"step": s["step"], "tps": round(s["throughput(tps)"], 1),
                      "mfu_pct": round(s["mfu(%)"], 2), "loss": round(s["loss_metrics/global_avg_loss"], 4),
                      "mem_reserved_gib": round(s["memory/max_reserved(GiB)"], 2)} for s in raw["steps"]],
    }


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    env = {**os.environ, **LAUNCH_ENV}
    with tempfile.TemporaryDirectory(prefix="tt-peer-") as tmp:
        env["TT_PEER_RESULT"] = os.path.join(tmp, "result.json")
        env["TT_PEER_WORKER"] = "1"
        # torchrun, run as a module so a --target install without its console script still works.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.ngpu}", "--local-ranks-filter=0",
               os.path.abspath(__file__), *argv]
        print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
        rc = subprocess.call(cmd, env=env)
        if rc != 0 or not os.path.exists(env["TT_PEER_RESULT"]):
            print(f"torchtitan run failed (exit {rc})", file=sys.stderr)
            return rc or 1
        with open(env["TT_PEER_RESULT"]) as f:
            raw = json.load(f)
    raw["launch"] = " ".join(shlex.quote(c) for c in cmd)
    user_cmd = [sys.executable, os.path.relpath(__file__), *argv]
    summary = summarize(args, raw, user_cmd)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    a = parse_args(argv)
    if os.environ.get("TT_PEER_WORKER") == "1":
        worker(a)
    else:
        sys.exit(launch(a, argv))
