"""The training loop: build -> (resume) -> step -> evaluate -> checkpoint -> sample.

`preflight` runs once in the launching process and checks everything a user can get wrong (config,
data, output folder, checkpoints) before any worker starts; `train` is what each worker runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from plait import checkpoint as ckpt
from plait.config import Config, config_from_dict
from plait.data import TokenData, default_corpus_dir
from plait.errors import bad_value
from plait.generate import sample
from plait.metrics import MetricsLog, Progress, flops_per_token, peak_flops, peak_memory_bytes
from plait.model import Transformer, build_model
from plait.flat import FlatParams
from plait.optim import FlatAdamW, lr_at

SAMPLE_PROMPT = "def "


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise bad_value("train.device", want, "no CUDA device is visible; use --train.device cpu")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.train.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.train.dtype]


def preflight(cfg: Config) -> Config:
    """Validate and resolve paths in the launching process; returns the config workers will use."""
    t = cfg.train
    if t.init_from:  # the model's shape comes from the weights being continued
        cfg.model = init_model_config(t.init_from)
    cfg.validate()
    if not t.out:
        t.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    out = Path(t.out).expanduser()
    ckpt.check_writable(out, "train.out")
    existing = ckpt.list_checkpoints(out / "checkpoints")
    if existing and not cfg.checkpoint.resume:
        raise bad_value("train.out", t.out, f"already holds {len(existing)} checkpoint(s); pass --resume to "
                        "continue that run or choose another --out")
    if cfg.checkpoint.resume and existing and ckpt.latest_valid(out / "checkpoints", log=_warn) is None:
        raise bad_value("checkpoint.resume", True, f"every checkpoint in {out / 'checkpoints'} is damaged; "
                        "move them away to start fresh")
    if not cfg.data.path:
        cfg.data.path = str(default_corpus_dir(cfg.data.cache_dir, cfg.data.val_fraction))
    TokenData(cfg.data.path).check(cfg.model.vocab_size, t.seq_len)
    return cfg


def init_model_config(path: str):
    """The model config of the weights `train.init_from` names (HF folder or plait checkpoint)."""
    from plait import hf

    if hf.is_hf_dir(path):
        return hf.config_from_hf(path, field="train.init_from")
    folder = ckpt.resolve_for_reading(path, field="train.init_from")
    state = json.loads((folder / "train_state.json").read_text())
    return config_from_dict(state["config"]).model


def init_weights_from(path: str, model_cfg) -> dict[str, torch.Tensor]:
    from plait import hf

    if hf.is_hf_dir(path):
        return {k: v.float() for k, v in hf.load_hf_weights(path, model_cfg, field="train.init_from").items()}
    return ckpt.torch_load(ckpt.resolve_for_reading(path, field="train.init_from") / "model.pt")


def _warn(msg: str) -> None:
    print(f"plait: {msg}", file=sys.stderr)


@dataclass
class DataParallel:
    """Where this process sits among the data-parallel ranks (1 of 1 on a single device)."""

    rank: int = 0
    size: int = 1


def apply_compile(model: Transformer) -> None:
    """Compile each block on its own: identical blocks share one compiled graph, so compile time
    does not grow with depth, and the fused loss gets its softmax/one-hot arithmetic fused."""
    from plait.loss import ce_chunk

    for block in model.layers.values():
        block.compile()
    model.ce_chunk_fn = torch.compile(ce_chunk)


def train_step(model, opt: FlatAdamW, micro_batches, lr: float, autocast, sum_sq_reduce=None):
    """One optimizer step over `micro_batches` [(x, y), ...] already on the device.
    Returns (mean loss, pre-clip grad norm) as device tensors: no host sync here."""
    n = len(micro_batches)
    loss_sum = None
    for x, y in micro_batches:
        with autocast():
            loss = model(x, y) / n
        loss.backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    grad_norm = opt.step(lr, sum_sq_reduce)
    opt.zero_grad()
    return loss_sum, grad_norm


def autocast_for(dtype: torch.dtype, device: torch.device):
    if dtype == torch.bfloat16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def evaluate(model, data: TokenData, cfg: Config, dp: DataParallel, device, autocast) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in data.val_batches(cfg.train.eval_batches, micro_batch=cfg.train.micro_batch,
                                     dp_rank=dp.rank, dp_size=dp.size, seq_len=cfg.train.seq_len,
                                     seed=cfg.train.seed):
            with autocast():
                losses.append(model(x.to(device), y.to(device)).float())
    model.train()
    return torch.stack(losses).mean().item()


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(saver: ckpt.Saver, step: int, cfg: Config, opt: FlatAdamW, tokenizer,
                    device: torch.device, val_loss: float | None) -> Path:
    def write(folder: Path) -> None:
        torch.save({n: t.float() for n, t in opt.master_weights().items()}, folder / "model.pt")
        torch.save(opt.state_dict(), folder / "optim.pt")
        torch.save(_rng_state(device), folder / "rng.pt")
        (folder / "train_state.json").write_text(json.dumps(
            {"step": step, "config": cfg.to_dict(), "tokenizer": tokenizer.spec, "val_loss": val_loss}, indent=1))
        if tokenizer.spec.get("kind") == "hf":
            tokenizer.save_to(folder)

    return saver.save(step, write, {"format": 1})


def load_checkpoint(folder: Path, opt: FlatAdamW | None, model: Transformer | None, device) -> dict:
    state = json.loads((folder / "train_state.json").read_text())
    weights = ckpt.torch_load(folder / "model.pt")
    if opt is not None:
        opt.load_weights(weights)
        opt.load_state_dict(ckpt.torch_load(folder / "optim.pt"))
        rng = ckpt.torch_load(folder / "rng.pt")
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    elif model is not None:
        missing = model.load_state_dict({k: v for k, v in weights.items()}, strict=False).missing_keys
        missing = [k for k in missing if not (k == "output.weight" and model.cfg.tie_embeddings)]
        if missing:
            raise bad_value("--checkpoint", str(folder), f"lacks weights {missing[:3]}; it is not a plait checkpoint")
    return state


def train(cfg: Config, dp: DataParallel | None = None) -> dict:
    """Run the training loop in this process; returns a summary (losses, paths, throughput)."""
    dp = dp or DataParallel()
    t, is_main = cfg.train, dp.rank == 0
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    torch.manual_seed(t.seed)
    out = Path(t.out).expanduser()
    data = TokenData(cfg.data.path)
    tokenizer = data.tokenizer()

    model = build_model(cfg.model, t.seed, device)
    model.to(dtype)  # bf16 compute weights; the optimizer keeps the fp32 masters
    use_compile = t.compile == "on" or (t.compile == "auto" and device.type == "cuda")
    flat = FlatParams(list(model.named_parameters()))
    opt = FlatAdamW(flat, t, compile=use_compile)
    saver = ckpt.Saver(out / "checkpoints", cfg.checkpoint.keep_last, rank=dp.rank)
    start = 0
    if cfg.checkpoint.resume:
        folder = ckpt.latest_valid(out / "checkpoints", log=_warn if is_main else (lambda m: None))
        if folder is not None:
            start = load_checkpoint(folder, opt, model, device)["step"]
            if is_main:
                _warn(f"resumed from {folder} (step {start})")
    if start == 0 and t.init_from:
        opt.load_weights(init_weights_from(t.init_from, cfg.model))
    if use_compile:
        apply_compile(model)
    autocast = autocast_for(dtype, device)

    if is_main:
        (out / "config.toml").write_text(cfg.to_toml())
    log = MetricsLog(out if is_main else None, t.tensorboard)
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * dp.size
    fpt = flops_per_token(cfg.model, t.seq_len)
    peak = peak_flops(device, dtype)
    end = t.steps if not t.max_steps_this_run else min(t.steps, start + t.max_steps_this_run)
    bar = Progress(end, start, enabled=is_main and t.progress)
    if is_main:
        bar.message(f"plait: {cfg.model.preset} model, {model.num_params() / 1e6:.2f}M parameters, "
                    f"{device.type} {str(dtype).replace('torch.', '')}, {tokens_per_step:,} tokens/step, "
                    f"steps {start}->{end}, out {out}")
    val_loss, losses = None, []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_run = time.perf_counter()
    for step in range(start, end):
        t0 = time.perf_counter()
        lr = lr_at(step, t)
        batches = [tuple(a.to(device, non_blocking=True) for a in
                         data.batch(step, micro, micro_batch=t.micro_batch, grad_accum=t.grad_accum,
                                    dp_rank=dp.rank, dp_size=dp.size, seq_len=t.seq_len, seed=t.seed))
                   for micro in range(t.grad_accum)]
        loss_sum, grad_norm = train_step(model, opt, batches, lr, autocast)
        loss_val = loss_sum.item()  # one host sync per step: the loss is logged every step
        dt = time.perf_counter() - t0
        tok_s = tokens_per_step / dt
        losses.append(loss_val)
        record = {"step": step + 1, "loss": loss_val, "lr": lr, "grad_norm": grad_norm.item(),
                  "tokens_per_s": tok_s, "mfu": tok_s * fpt / peak if peak else "n/a",
                  "peak_mem_bytes": peak_memory_bytes(device), "step_time_s": dt}
        done = step + 1
        if (t.eval_every and done % t.eval_every == 0) or done == end:
            val_loss = evaluate(model, data, cfg, dp, device, autocast)
            record["val_loss"] = val_loss
            bar.message(f"step {done}: val loss {val_loss:.4f} (train {loss_val:.4f})")
        log.log(record)
        bar.update(done, loss_val, tok_s)
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == end:
            folder = save_checkpoint(saver, done, cfg, opt, tokenizer, device, val_loss)
            bar.message(f"saved checkpoint {folder}")
    bar.close()
    log.close()
    summary = {"out": str(out), "steps": end, "losses": losses, "val_loss": val_loss,
               "seconds": time.perf_counter() - t_run}
    if is_main and t.sample_tokens and end > start:
        ids = sample(model, [int(i) for i in tokenizer.encode(SAMPLE_PROMPT)], t.sample_tokens,
                     temperature=0.8, top_k=40, seed=t.seed)
        summary["sample"] = SAMPLE_PROMPT + tokenizer.decode(ids)
        print(f"--- sample ---\n{summary['sample']}\n--------------", file=sys.stderr)
    return summary


def model_from_checkpoint(path: str, device: str = "cpu") -> tuple[Transformer, object, Config]:
    """Load a checkpoint (folder or run folder) for inference: model, tokenizer, config."""
    from plait import hf
    from plait.tokenizer import ByteTokenizer, HFTokenizer, from_spec

    if hf.is_hf_dir(path):
        cfg = Config()
        cfg.model = hf.config_from_hf(path, field="--checkpoint")
        model = build_model(cfg.model, 0, device)
        model.load_state_dict(hf.load_hf_weights(path, cfg.model, field="--checkpoint"), strict=False)
        tok_file = Path(path) / "tokenizer.json"
        return model, HFTokenizer(tok_file) if tok_file.is_file() else ByteTokenizer(), cfg
    folder = ckpt.resolve_for_reading(path)
    state = json.loads((folder / "train_state.json").read_text())
    cfg = config_from_dict(state["config"])
    model = build_model(cfg.model, cfg.train.seed, device)
    load_checkpoint(folder, None, model, device)
    return model, from_spec(state["tokenizer"], folder), cfg
