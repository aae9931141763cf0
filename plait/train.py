"""The training loop: build -> (resume) -> step -> evaluate -> checkpoint -> sample.

`plait.preflight` runs once in the launching process and checks everything a user can get wrong
(config, layout, data, output folder, checkpoints) before any worker starts; `train` is what each
worker runs.
Data parallelism (DDP, ZeRO-1/2/3, HSDP) is an engine from `plait.parallel.data_parallel`: the loop
below is the same for every layout; the engine decides when and how gradients travel.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from plait import checkpoint as ckpt
from plait import faults, supervise
from plait.bad_steps import StepHealth
from plait.checkpointer import Checkpointer
from plait.config import Config, config_from_dict
from plait.data import open_data
from plait.errors import bad_value
from plait.generate import sample, sample_pipelined
from plait.metrics import (MetricsLog, Progress, flops_per_token, peak_flops, peak_memory_bytes,
                           throughput)
from plait.model import Transformer, build_model
from plait.optim import lr_at
from plait.parallel import sharded_state
from plait.parallel.build import parallelize
from plait.parallel.engine import Engine
from plait.preempt import StopRequest
from plait.preflight import warn as _warn
from plait.replica import ReplicaCheck
from plait.straggler import StragglerReport
from plait.profile import StepProfiler
from plait.resume import global_batch_of, restore_record, trim_metrics

SAMPLE_PROMPT = "def "


def _fp8_words(fp8: str, device: torch.device) -> str:
    """The start line's word on FP8 linears: on a CPU they are emulated (FP8 rounding, fp32 matmuls)."""
    if fp8 == "off":
        return ""
    return f" with FP8 {fp8} linears" + (" (emulated on the CPU)" if device.type == "cpu" else "")


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


def init_weights_from(path: str, model_cfg) -> dict[str, torch.Tensor]:
    from plait import hf

    if hf.is_hf_dir(path):
        return {k: v.float() for k, v in hf.load_hf_weights(path, model_cfg, field="train.init_from").items()}
    return sharded_state.full_weights(ckpt.resolve_for_reading(path, field="train.init_from"))


def micro_batch(data, cfg: Config, par, step: int, micro: int) -> tuple:
    """(inputs, targets) of this rank's micro-batch, and with document masking each position's
    document index."""
    t = cfg.train
    kw = dict(micro_batch=t.micro_batch, grad_accum=t.grad_accum, dp_rank=par.data_rank, dp_size=par.data_size,
              seq_len=t.seq_len, seed=t.seed)
    x, y = data.batch(step, micro, **kw)
    return (x, y, data.batch_documents(step, micro, **kw)) if cfg.data.document_mask else (x, y)


def evaluate(par, data, cfg: Config, device) -> float:
    """Mean validation loss over eval_batches global batches of held-out windows, each data-parallel
    rank taking its slice: the same windows, and so the same loss, at every layout of one global
    batch (micro_batch x grad_accum x dp)."""
    t = cfg.train
    par.engine.begin_step()  # a pipeline's ZeRO-3 stage is gathered once for all the batches
    try:
        losses = [par.runner.loss(*(a.to(device) for a in batch))
                  for batch in data.val_batches(t.eval_batches * t.grad_accum, micro_batch=t.micro_batch,
                                                dp_rank=par.data_rank, dp_size=par.data_size,
                                                seq_len=cfg.train.seq_len, seed=cfg.train.seed,
                                                documents=cfg.data.document_mask)]
    finally:
        par.engine.end_forward_only()
    # under a pipeline only the last stage holds the loss; global_mean counts the ranks that do
    return par.engine.global_mean(torch.stack(losses).mean().item() if losses[0] is not None else None)


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(saver: ckpt.Saver, step: int, cfg: Config, engine: Engine, tokenizer,
                    device: torch.device, val_loss: float | None, data_size: int = 1,
                    record: dict | None = None) -> Path:
    """Every rank writes its state files (the engine decides which); rank 0 adds the rest.
    data_size: data-parallel ranks (the global batch a resume compares against is recorded).
    record: the step's metrics.jsonl entry, which the run logs after this save: a run killed in
    between would resume after a step its curve never got (`resume.restore_record`)."""
    batch, terms = global_batch_of(cfg.train.micro_batch, cfg.train.grad_accum, data_size)
    state, rng = saver.snapshot(engine), _rng_state(device)  # taken now: an async save writes them later

    def write(folder: Path) -> None:
        state(folder)
        if saver.rank != 0:
            return
        torch.save(rng, folder / "rng.pt")
        (folder / "train_state.json").write_text(json.dumps(
            {"step": step, "config": cfg.to_dict(), "tokenizer": tokenizer.spec, "val_loss": val_loss,
             "layout": layout_of(cfg, engine), "global_batch": batch, "global_batch_terms": terms,
             "metrics": record},
            indent=1))
        if tokenizer.spec.get("kind") == "hf":
            tokenizer.save_to(folder)

    return saver.save(step, write, {"format": 2})


def resume_from(folder: Path, engine: Engine, device) -> int:
    """Load a checkpoint of any layout into this engine; returns its step."""
    state = json.loads((folder / "train_state.json").read_text())
    engine.load(folder)
    rng = ckpt.torch_load(folder / "rng.pt")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    return int(state["step"])


def param_count(model_cfg) -> int:
    """Parameters of the whole model, whatever part of it this rank holds."""
    from plait.planner.costs import ModelDims, param_count as count

    return count(ModelDims.from_config(model_cfg))


def layout_of(cfg: Config, engine: Engine) -> dict:
    """The layout a checkpoint was written at (informational: any layout reads any checkpoint)."""
    p = cfg.parallel
    return {"nproc": p.nproc, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp,
            "sp": p.sp, "zero": p.zero}


def train(cfg: Config, dims=None) -> dict:
    """Run the training loop in this process; returns a summary (losses, paths, throughput).

    dims: this worker's `ParallelDims` (mesh built by `plait.launch.init_distributed`), or None for
    a single process without a process group (the default job).
    """
    stop = StopRequest()  # SIGUSR1: every rank saves the same step, then leaves the loop
    try:
        return _train(cfg, dims, stop)
    finally:
        stop.close()


def _train(cfg: Config, dims, stop: StopRequest) -> dict:
    t = cfg.train
    device = dims.device if dims is not None and dims.device is not None else resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    torch.manual_seed(t.seed)
    out = Path(t.out).expanduser()
    data = open_data(cfg.data)
    tokenizer = data.tokenizer()
    comm = None
    if dims is not None:
        from plait.comm import Comm, Ledger

        comm = Comm(dims, Ledger())
    use_compile = t.compile == "on" or (t.compile == "auto" and device.type == "cuda")
    par = parallelize(cfg, comm, device, dtype, use_compile)
    model, engine = par.model, par.engine
    world = dims.world_size if dims is not None else 1
    rank = dims.rank if dims is not None else 0
    is_main = rank == 0
    barrier = (lambda: comm.barrier("world")) if comm is not None else (lambda: None)
    ckpts = Checkpointer(cfg, out / "checkpoints", rank, world, comm, barrier, device)  # when, sync or async
    saver = ckpts.saver
    start = 0
    if cfg.checkpoint.resume:
        folder = ckpt.latest_valid(out / "checkpoints", log=lambda m: None)  # preflight named the damaged ones
        if folder is not None:
            start = resume_from(folder, engine, device)
            if is_main:
                _warn(f"resumed from {folder} (step {start})")
    if start == 0 and t.init_from:
        engine.load_weights(init_weights_from(t.init_from, cfg.model), "train.init_from", t.init_from)
    ckpts.saved.add(start)
    restart = supervise.restart_note(out, start) if is_main else None  # the first record after a restart says why
    faults.install(rank, model, engine)  # a test hook: nothing unless PLAIT_FAULTS is set
    health = StepHealth(t.max_bad_steps, t.spike_factor, start, say=_warn if is_main else (lambda m: None))
    replicas = ReplicaCheck(engine, comm, t.replica_check_every)
    stragglers = StragglerReport(comm, t.straggler_every, t.straggler_threshold, device, is_main)

    if is_main:
        ckpt.write_atomic(out / "config.toml", cfg.to_toml())  # a resume reads it: never half of it
        supervise.record_elastic_run(out)  # a peer node's failure restarts this job's workers: they resume
        if dropped := trim_metrics(out / "metrics.jsonl", start):  # one curve: the resumed segment replaces them
            _warn(f"metrics.jsonl: dropped {dropped} entries past step {start}, logged after that checkpoint" if start
                  else f"metrics.jsonl: replaced {dropped} entries of an earlier start in this folder that saved no "
                       "checkpoint")
        if start:  # the checkpoint's own step, when the run that saved it died before logging it
            saved_record = json.loads((folder / "train_state.json").read_text()).get("metrics")
            restore_record(out / "metrics.jsonl", start, saved_record)
    log = MetricsLog(out if is_main else None, t.tensorboard, wandb_project=t.wandb, run_name=out.name,
                     config=cfg.to_dict())
    tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * par.data_size
    fpt = flops_per_token(cfg.model, t.seq_len)
    peak = peak_flops(device, dtype)
    end = t.steps if not t.max_steps_this_run else min(t.steps, start + t.max_steps_this_run)
    if t.max_steps_this_run:  # a restart stops where the invocation's first attempt planned to
        end = supervise.planned_end(out, end) if is_main else 0
        if comm is not None and world > 1:  # the main rank's answer: every rank stops at one step
            agreed = torch.tensor([end], dtype=torch.int64, device=device)
            comm.broadcast(agreed, "world", src=0)
            end = int(agreed.item())
    bar = Progress(end, start, enabled=is_main, bar=t.progress)
    if is_main:
        bar.message(f"plait: {cfg.model.preset} model, {param_count(cfg.model) / 1e6:.2f}M parameters, "
                    f"{device.type} {str(dtype).replace('torch.', '')}{_fp8_words(t.fp8, device)}"
                    f"{describe_layout(cfg, world)}, "
                    f"{tokens_per_step:,} tokens/step, steps {start}->{end}, out {out}")
        bar.message(f"plait: {log.describe()}")
    val_loss, losses, stopping = None, [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prof = StepProfiler(t.profile_steps, out / "profile", rank, device, say=_warn if is_main else None, world=world)
    t_run = time.perf_counter()
    timeline = getattr(par.runner, "timeline", None)  # a pipeline records per-action times while profiled
    timeline_written = False
    for step in range(start, end):
        prof.step(step + 1)  # starts, marks or ends --train.profile_steps; outside the step's timing
        if timeline is not None:
            timeline.enabled = prof.window is not None and prof.window[0] <= step + 1 <= prof.window[1]
        t0 = time.perf_counter()
        stragglers.begin()
        faults.at("step", step + 1)
        lr = lr_at(step, t)
        batches = [tuple(a.to(device, non_blocking=True) for a in micro_batch(data, cfg, par, step, micro))
                   for micro in range(t.grad_accum)]
        loss, grad_norm = par.runner.step(batches, lr)
        loss_val = loss.item()  # one host sync per step: the loss is logged every step
        dt = time.perf_counter() - t0
        losses.append(loss_val)
        record = {"step": step + 1, "loss": loss_val, "lr": lr, "grad_norm": grad_norm.item(),
                  **throughput(tokens_per_step, dt, world, fpt, peak),
                  "peak_mem_bytes": peak_memory_bytes(device), "step_time_s": dt}
        if comm is not None:  # bytes this device sent this step, all mesh dims and ops together
            record["comm_sent_bytes"] = sum(d["sent_bytes"] for d in comm.ledger.step().values())
        done = step + 1
        if (t.eval_every and done % t.eval_every == 0) or done == end:
            val_loss = evaluate(par, data, cfg, device)
            record["val_loss"] = val_loss
            bar.message(f"step {done}: val loss {val_loss:.4f} (train {loss_val:.4f})")
        record.update(health.check(done, loss_val, record["grad_norm"]))  # a skipped update, a loss spike
        stragglers.end(done, record)
        ckpts.poll(record)  # a background save that failed raises here
        if restart:
            record["restart"], restart = restart, None
        stopping = stop.agreed(comm, device)
        # no checkpoint at a skipped step (but at the end or a stop): the newest one is then always the
        # last good state's
        saving = (ckpts.due(done, end) or (stopping and done not in ckpts.saved)) and not health.stop and \
            (not health.bad or done == end or stopping)
        if replicas.due(done, saving):  # before a checkpoint is written from a corrupted replica
            replicas.check(done, before_raise=ckpts.close)
        if saving:
            with ckpts.timed(done, record):
                folder = save_checkpoint(saver, done, cfg, engine, tokenizer, device, val_loss, par.data_size,
                                         dict(record))
            # an asynchronous save is not saved yet: a rank that died while writing lost it
            bar.message(f"checkpoint {folder}: taken, writing in the background" if ckpts.is_async
                        else f"saved checkpoint {folder}")
        log.log(record)
        bar.update(done, loss_val, record["tokens_per_s"])
        if timeline is not None and prof.window is not None and done == prof.window[1] and timeline.steps:
            # as the window closes, not at the run's end: a run stopped later (Ctrl-C) keeps its timeline
            _pipeline_report(par, out / "profile", is_main, t.grad_accum, device)
            timeline_written = True
        if health.stop:  # the weights are still those of the last good step: keep them, then stop
            last = health.last_good
            folder = ckpts.keep(last, lambda: save_checkpoint(saver, last, cfg, engine, tokenizer, device,
                                                              val_loss, par.data_size))
            raise health.error(done, folder)
        if stopping:
            if is_main:
                _warn(f"{stopping}: stopped after step {done}" + (", its checkpoint saved" if saving else ""))
                supervise.record_stop(out, stopping, done)  # a torchrun restart of these workers ends there
            end = done
            break
    prof.close()
    if timeline is not None and timeline.steps and not timeline_written:  # a window the run stopped inside
        _pipeline_report(par, out / "profile", is_main, t.grad_accum, device)
    ckpts.close()  # the last background save must be complete when the run ends
    bar.close()
    log.close()
    summary = {"out": str(out), "steps": end, "losses": losses, "val_loss": val_loss,
               "seconds": time.perf_counter() - t_run, "main": is_main,
               # bytes of parameters, gradients and optimizer state this rank holds at the update (plan --validate)
               "state_bytes": engine.state_bytes(), "checkpoint_stall_s": ckpts.stalls, "stopped": stopping}
    if stopping:  # no sample: the time left before the machines go is the scheduler's
        return summary
    if t.sample_tokens and end > start:
        engine.gather_for_inference()  # ZeRO-3: every rank takes part in gathering the model
        prompt = [int(i) for i in tokenizer.encode(SAMPLE_PROMPT)]
        ids = None
        # (context parallelism needs nothing: generation's KV cache attends without the ring)
        if cfg.parallel.pp > 1:  # every rank runs its stages, each pipeline on its own
            ids = sample_pipelined(par.runner, prompt, t.sample_tokens, temperature=0.8, top_k=40, seed=t.seed)
        elif is_main or cfg.parallel.tp > 1:  # tensor-parallel ranks generate together (same seed, same tokens)
            ids = sample(model, prompt, t.sample_tokens, temperature=0.8, top_k=40, seed=t.seed)
        if is_main:
            summary["sample"] = SAMPLE_PROMPT + tokenizer.decode(ids)
            print(f"--- sample ---\n{summary['sample']}\n--------------", file=sys.stderr)
    return summary


def _pipeline_report(par, folder, is_main: bool, microbatches: int, device) -> None:
    """The measured pipeline timeline (every pipeline rank takes part), said once by the main rank."""
    report = par.runner.write_timeline(folder, is_main, microbatches)
    if report is None:
        return
    _warn(f"pipeline timeline in {folder}: measured bubble {report['measured_bubble']:.1%} "
          f"(the schedule simulated with equal costs: {report['simulated_bubble']:.1%}; with the measured "
          f"action times: {report['replayed_bubble']:.1%})")
    split = report["split"]
    if "suggested_stage_layers" in split:
        _warn(f"stage times {split['stage_ms']} ms a micro-batch with layers {split['stage_layers']}; "
              f"--parallel.stage_layers {split['suggested_stage_layers']} would give {split['suggested_stage_ms']} ms")
    launch = [r for r, share in enumerate(report["host_share"]) if share >= 0.9]
    if device.type == "cuda" and launch:  # on a CPU both clocks are the host's: always 1
        _warn(f"pipeline ranks {launch} spent {max(report['host_share']):.0%} of their actions' GPU time "
              f"launching them: launch-bound (larger micro-batches, or fewer graph pieces, keep the GPU fed)")


def describe_layout(cfg: Config, world: int) -> str:
    """The header's layout, e.g. ', 8 ranks: dp 4 (2 replicas x 2 shards, HSDP) x tp 2, zero 3' or
    ', 8 ranks: dp 1 x cp 2 (ring) x tp 2 + sp x pp 2 (1f1b, 4 micro-batches), zero 1'; empty on one
    process. Replicas are named only where ZeRO shards within them: under DDP (zero 0) every
    data-parallel rank holds everything, whatever dp_replicate says."""
    p = cfg.parallel
    if world == 1:
        return ""
    tp, pp, cp = p.tp, p.pp, p.cp
    dp = world // (tp * pp * cp)
    shard = dp // p.dp_replicate
    hsdp = p.dp_replicate > 1 and p.zero >= 1
    dp_s = f"dp {dp} ({p.dp_replicate} replicas x {shard} shards, HSDP)" if hsdp else f"dp {dp}"
    from plait.parallel.rules import sequence_parallel

    cp_s = f" x cp {cp} ({p.cp_impl})" if cp > 1 else ""
    tp_s = f" x tp {tp}{' + sp' if sequence_parallel(p.sp, tp) else ''}" if tp > 1 else ""
    # in a pipelined run train.grad_accum is the micro-batch count every pipeline runs a step
    v_s = f", v {p.v}" if p.v > 1 else ""
    m = cfg.train.grad_accum
    pp_s = f" x pp {pp} ({p.schedule}, {m} micro-batch{'es' if m > 1 else ''}{v_s})" if pp > 1 else ""
    return f", {world} ranks: {dp_s}{cp_s}{tp_s}{pp_s}, zero {p.zero}"


def model_from_checkpoint(path: str, device: str = "cpu") -> tuple[Transformer, object, Config, Path]:
    """Load a checkpoint (folder or run folder, any layout) for inference: model, tokenizer, config,
    and the folder read (a run folder's newest valid checkpoint: what a command reports it used)."""
    from plait import hf
    from plait.tokenizer import from_spec

    if hf.is_hf_dir(path):
        cfg = Config()
        cfg.model = hf.config_from_hf(path, field="--checkpoint")
        model = build_model(cfg.model, 0, device)
        model.load_state_dict(hf.load_hf_weights(path, cfg.model, field="--checkpoint"), strict=False)
        return model, hf.tokenizer_of(path, cfg.model.vocab_size), cfg, Path(path)
    folder = ckpt.resolve_for_reading(path)
    state = json.loads((folder / "train_state.json").read_text())
    cfg = config_from_dict(state["config"])
    model = build_model(cfg.model, cfg.train.seed, device)
    weights = sharded_state.full_weights(folder)
    missing = model.load_state_dict(weights, strict=False).missing_keys
    missing = [k for k in missing if not (k == "output.weight" and model.cfg.tie_embeddings)]
    if missing:
        raise bad_value("--checkpoint", str(folder), f"lacks weights {missing[:3]}; it is not a plait checkpoint")
    return model, from_spec(state["tokenizer"], folder), cfg, folder
