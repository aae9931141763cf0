"""Checks on a whole Config, run before any process, file or GPU is touched.

Each failure is one `UserError` line: the field, the value, and what to do instead.
"""

from __future__ import annotations

from plait.config import PRESETS, Config
from plait.errors import UserError, bad_value
from plait.parallel import rules


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if not value >= 0 or (value == 0 and not allow_zero):  # `not >=`: NaN (--train.lr nan) fails too
        raise bad_value(name, value, "must be " + ("zero or more" if allow_zero else "a positive number"))
    if value == float("inf"):  # TOML's `inf` passed: an infinite lr trains NaNs, an infinite timeout overflows
        raise bad_value(name, value, "must be a finite number")


def validate_model(m) -> None:
    if m.preset not in PRESETS:
        raise bad_value("model.preset", m.preset, f"choose one of {', '.join(PRESETS)}")
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        _positive(f"model.{name}", getattr(m, name))
    if m.dim % m.n_heads:
        raise bad_value("model.n_heads", m.n_heads, f"must divide model.dim = {m.dim} ({_heads_near(m)})")
    if m.head_dim % 2:
        raise bad_value("model.n_heads", m.n_heads,
                        f"gives an odd head size {m.head_dim}; RoPE needs an even head size ({_heads_near(m)})")
    if m.n_heads % m.n_kv_heads:
        raise bad_value("model.n_kv_heads", m.n_kv_heads,
                        f"must divide model.n_heads = {m.n_heads} (e.g. {_divisor_near(m.n_heads, m.n_kv_heads)})")
    _positive("model.rope_theta", m.rope_theta)
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _positive("model.rope_scaling", m.rope_scaling, allow_zero=True)
    # Llama-3's rescaling band (plait.model.rope_frequencies): wavelengths between old/hi and old/lo
    # are blended, so a zero divides by zero and hi <= lo inverts or empties the band
    _positive("model.rope_low_freq_factor", m.rope_low_freq_factor)
    _positive("model.rope_high_freq_factor", m.rope_high_freq_factor)
    _positive("model.rope_original_max_len", m.rope_original_max_len)
    if m.rope_scaling > 0 and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise bad_value("model.rope_high_freq_factor", m.rope_high_freq_factor, f"must exceed "
                        f"model.rope_low_freq_factor = {m.rope_low_freq_factor} (Llama 3 uses 4 and 1)")


def check_seed(name: str, seed) -> None:
    """A seed numpy's and torch's generators both take (numpy refuses negatives, torch more than 64 bits):
    it failed only once the run had started, in the data's first batch."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise bad_value(name, seed, f"must be an integer from 0 to {2**63 - 1}")


def _heads_near(m) -> str:
    """A head count near model.n_heads that passes every check after this one (it divides dim into
    even head sizes, and model.n_kv_heads divides it), or with the KV head count it then needs."""
    even = [d for d in range(1, m.dim // 2 + 1) if m.dim % d == 0 and (m.dim // d) % 2 == 0]
    if not even:
        return f"no head count splits an odd model.dim = {m.dim} into even head sizes: make it even"
    fits = [d for d in even if d % m.n_kv_heads == 0]
    best = min(fits or even, key=lambda d: (abs(d - m.n_heads), d))
    return f"e.g. {best}" if fits else f"e.g. {best} with model.n_kv_heads {_divisor_near(best, m.n_kv_heads)}"


def _divisor_near(n: int, k: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - k), d))


def validate_config(cfg: Config) -> Config:
    """Check everything in `cfg`; returns it (normalised: `parallel.sp` true/false -> on/off)."""
    validate_model(cfg.model)
    t = cfg.train
    check_seed("train.seed", t.seed)
    for name in ("steps", "micro_batch", "grad_accum", "seq_len", "eval_batches"):
        _positive(f"train.{name}", getattr(t, name))
    for name in ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "eps", "eval_every",
                 "sample_tokens", "max_steps_this_run"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    if t.min_lr > t.lr:
        raise bad_value("train.min_lr", t.min_lr, f"must not exceed train.lr = {t.lr}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            raise bad_value(f"train.{name}", getattr(t, name), "must be in [0, 1)")
    if t.seq_len > cfg.model.max_seq_len:
        raise bad_value("train.seq_len", t.seq_len,
                        f"exceeds model.max_seq_len = {cfg.model.max_seq_len}; shorten it or raise model.max_seq_len")
    if t.dtype not in ("auto", "fp32", "bf16"):
        raise bad_value("train.dtype", t.dtype, "choose auto, fp32 or bf16")
    if t.device not in ("auto", "cpu", "cuda"):
        raise bad_value("train.device", t.device, "choose auto, cpu or cuda")
    if t.compile not in ("auto", "on", "off"):
        raise bad_value("train.compile", t.compile, "choose auto, on or off")
    if t.recompute not in rules.RECOMPUTE:
        raise bad_value("train.recompute", t.recompute, f"choose {', '.join(rules.RECOMPUTE)}")
    if not 0.0 <= cfg.data.val_fraction < 0.5:
        raise bad_value("data.val_fraction", cfg.data.val_fraction, "must be in [0, 0.5)")
    if cfg.data.mix:
        from plait.data import parse_mix

        if cfg.data.path:
            raise bad_value("data.mix", cfg.data.mix, f"is set beside data.path = {cfg.data.path!r}; "
                            "give one of them (add that folder to the mix with a weight)")
        parse_mix(cfg.data.mix)  # syntax and weights; the folders are opened with the data
    _positive("train.global_batch", t.global_batch, allow_zero=True)
    if t.profile_steps:
        from plait.profile import parse_steps

        parse_steps(t.profile_steps, t.steps)
    c = cfg.checkpoint
    validate_resilience(cfg)
    _positive("checkpoint.every", c.every, allow_zero=True)
    _positive("checkpoint.keep_last", c.keep_last)
    dims = validate_parallel(cfg)
    derive_grad_accum(cfg, dims.dp_replicate * dims.dp_shard)
    validate_pipeline(cfg)
    _check_fp8(cfg)
    return cfg


def validate_pipeline(cfg: Config) -> None:
    """Schedule, micro-batches and stage split of a pipelined run (`parallel.microbatches` is
    train.grad_accum's name there: the micro-batches every pipeline runs per step)."""
    from plait.parallel.schedules import check_args, check_no_pipeline
    from plait.parallel.stages import check_ranks_hold_parameters, resolve_counts

    p, t, m = cfg.parallel, cfg.train, cfg.model
    if p.pp == 1:
        if p.stage_layers:
            raise bad_value("parallel.stage_layers", p.stage_layers, "splits a pipeline: it needs --pp > 1")
        # virtual stages, a schedule or a micro-batch count without a pipeline were meant for one:
        # say so rather than ignore them (the same rule `plait plan` applies, in field names here)
        check_no_pipeline(p.schedule, p.v, field=rules.run_field)
        if p.microbatches:
            raise bad_value("parallel.microbatches", p.microbatches, "counts a pipeline's micro-batches: it needs "
                            "--pp > 1 (without a pipeline, train.grad_accum accumulates micro-batches)")
        return
    if p.microbatches:
        if t.global_batch and t.grad_accum != p.microbatches:
            raise bad_value("parallel.microbatches", p.microbatches, f"contradicts train.global_batch = "
                            f"{t.global_batch}, which makes {t.grad_accum} micro-batches a step here: give one of them")
        t.grad_accum = p.microbatches
    try:
        p.schedule = check_args(p.schedule, p.pp, t.grad_accum, p.v, field=rules.run_field)
    except UserError as e:
        if p.microbatches or not str(e).startswith("parallel.microbatches = "):
            raise
        raise _derived_microbatches(cfg, str(e)) from None  # the user gave the batch, not the count
    counts = resolve_counts(p.stage_layers, m, t.seq_len, p.pp * p.v, p.schedule)
    if counts is not None:
        check_ranks_hold_parameters(counts, p.pp, p.v, p.schedule, p.stage_layers)
    if counts is None and m.n_layers % (p.pp * p.v) and p.v > 1:
        raise bad_value("parallel.v", p.v, f"pp x v = {p.pp * p.v} stages do not divide the {m.n_layers} layers "
                        "evenly; give --parallel.stage_layers balance (split by cost) or a count per stage, or another v")


def _derived_microbatches(cfg: Config, why: str) -> UserError:
    """A micro-batch count the schedule refuses, where the user gave train.global_batch or
    train.grad_accum rather than parallel.microbatches: the line names the field they set, and its
    fix is a value of that field (--microbatches would contradict a global batch)."""
    p, t = cfg.parallel, cfg.train
    m = t.grad_accum
    reason = why.split(": ", 1)[1]
    if p.schedule == "interleaved" and m % p.pp:  # the one count rule a schedule has past the limits
        near = max(p.pp, round(m / p.pp) * p.pp)
        reason = f"the interleaved schedule runs micro-batches in groups of pp = {p.pp}"
    else:
        near = None
    if t.global_batch:
        per = t.global_batch // m  # micro_batch x dp
        fix = f": use a global batch of {near * per} ({near} micro-batches)" if near else ""
        return bad_value("train.global_batch", t.global_batch, f"makes {m} micro-batches a step (global_batch / "
                         f"(micro_batch x dp = {per})); {reason}{fix}")
    fix = f": use {near} (or --microbatches {near})" if near else ""
    return bad_value("train.grad_accum", m, f"is the pipeline's micro-batches a step; {reason}{fix}")


def derive_grad_accum(cfg: Config, dp: int) -> None:
    """With train.global_batch set, grad_accum = global_batch / (micro_batch x dp), so the batch a
    step trains on stays the same at every layout (the per-rank micro-batch, hence memory, too)."""
    t = cfg.train
    if not t.global_batch:
        return
    per_pass = t.micro_batch * dp
    if t.global_batch % per_pass:
        near = max(1, round(t.global_batch / per_pass)) * per_pass
        raise bad_value("train.global_batch", t.global_batch, f"is not a multiple of micro_batch x dp = "
                        f"{t.micro_batch} x {dp} = {per_pass}; use a multiple of {per_pass} (e.g. {near}) or "
                        "change --train.micro_batch")
    t.grad_accum = t.global_batch // per_pass


def data_parallel_size(cfg: Config) -> int:
    """Data-parallel ranks the run will have (each reads its own rows of the global batch)."""
    from plait.launch_env import planned_world
    from plait.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, planned_world(cfg.parallel)[0])
    return dims.dp_replicate * dims.dp_shard


def validate_parallel(cfg: Config):
    """Degrees, world size, the model's split and placement, as the launcher will see them, before
    any process starts; returns the run's `ParallelDims` (inferred degrees filled in)."""
    from plait.launch_env import planned_world
    from plait.parallel.dims import NAMES, ParallelDims

    p, m = cfg.parallel, cfg.model
    _positive("parallel.nproc", p.nproc)
    for name in ("dp_replicate", "tp", "pp", "cp", "v", "gpus_per_node"):
        _positive(f"parallel.{name}", getattr(p, name))
    if p.dp_shard != -1:
        _positive("parallel.dp_shard", p.dp_shard)
    if p.zero not in (0, 1, 2, 3):
        raise bad_value("parallel.zero", p.zero, "choose 0 (DDP), 1, 2 or 3 (FSDP)")
    _positive("parallel.timeout_s", p.timeout_s)
    _positive("parallel.bucket_mb", p.bucket_mb)
    if p.embedding_rows not in rules.EMBEDDING_ROWS:
        raise bad_value("parallel.embedding_rows", p.embedding_rows, "choose auto, on or off")
    if p.embedding_rows == "on" and (p.zero != 0 or max(p.tp, p.pp, p.cp) > 1):
        raise bad_value("parallel.embedding_rows", "on", "sends DDP's embedding gradient as rows: it needs "
                        "--zero 0 and no tp, pp or cp split; use auto or off")
    if not isinstance(p.overlap_ctas, int) or isinstance(p.overlap_ctas, bool) or not 0 <= p.overlap_ctas <= 64:
        raise bad_value("parallel.overlap_ctas", p.overlap_ctas, "give 0 (NCCL's choice) or a count of 1-64 thread blocks")
    if p.overlap_ctas and p.zero != 0:
        raise bad_value("parallel.overlap_ctas", p.overlap_ctas,
                        f"it budgets DDP's all-reduce only (parallel.zero = 0, not {p.zero}): leave it 0")
    if not isinstance(p.zero3_cast_once, bool):
        raise bad_value("parallel.zero3_cast_once", p.zero3_cast_once, "give true or false")
    if p.zero3_cast_once and p.zero != 3:
        raise bad_value("parallel.zero3_cast_once", p.zero3_cast_once,
                        f"it keeps ZeRO-3's cast shard (parallel.zero = 3, not {p.zero}): drop it or set --zero 3")
    if not isinstance(p.zero3_fp8_gather, bool):
        raise bad_value("parallel.zero3_fp8_gather", p.zero3_fp8_gather, "give true or false")
    if p.zero3_fp8_gather:
        _check_fp8_gather(cfg)
    _positive("parallel.microbatches", p.microbatches, allow_zero=True)
    if p.bind_cpus not in ("auto", "off"):
        raise bad_value("parallel.bind_cpus", p.bind_cpus, "choose auto or off")
    if p.reduce_dtype not in ("auto", "fp32", "bf16"):
        raise bad_value("parallel.reduce_dtype", p.reduce_dtype, "choose auto, fp32 or bf16")
    if p.reduce_dtype != "auto" and p.zero < 2:
        raise bad_value("parallel.reduce_dtype", p.reduce_dtype, "needs --zero 2 or 3 (DDP and ZeRO-1 reduce "
                        "the gradient buffer in place, in the parameters' dtype); use --zero 2 or drop it")
    p.sp = {"true": "on", "false": "off", "1": "on", "0": "off"}.get(str(p.sp).lower(), str(p.sp).lower())
    if p.pp > 1:  # the schedule's own rules on v before the stage count v makes (zbv v 3: "use pp x v <= 4")
        from plait.parallel.schedules import check_args

        check_args(p.schedule, p.pp, p.pp, p.v, field=rules.run_field)  # any valid micro-batch count: v only
    if p.cp_impl == "ulysses" and p.cp == 1:  # as every knob of a parallelism not asked for (a bad name: below)
        raise bad_value("parallel.cp_impl", p.cp_impl, "chooses how context parallelism splits attention: it "
                        "needs parallel.cp > 1 (--cp C); without it, drop parallel.cp_impl")
    # Under torchrun/srun the world is what they started; locally it is nproc, all on this node, so
    # the TP-inside-a-node check uses the real processes per node rather than parallel.gpus_per_node.
    world, per_node = planned_world(p)
    rules.check_split(heads=m.n_heads, kv_heads=m.n_kv_heads, ffn=m.ffn_dim, layers=m.n_layers,
                      seq=cfg.train.seq_len, tp=p.tp, pp=p.pp, v=p.v, cp=p.cp, sp=p.sp, cp_impl=p.cp_impl,
                      micro_batch=cfg.train.micro_batch, world=world if world > 1 else None)
    model_degrees = {n: getattr(p, n) for n in ("tp", "pp", "cp") if getattr(p, n) > 1}
    if world == 1 and model_degrees:
        name, deg = next(iter(model_degrees.items()))
        need = 1
        for n in NAMES:
            need *= max(1, getattr(p, n)) if n != "dp_shard" or p.dp_shard != -1 else 1
        raise bad_value(f"parallel.{name}", deg, f"needs {need} processes (one per GPU) but one would run: "
                        f"add --nproc {need}")
    # a run's nodes are what its launcher started (processes per node), not parallel.gpus_per_node: that
    # field refused `--nproc 2 --tp 2 --parallel.gpus_per_node 1`, whose group sits in one machine
    dims = ParallelDims.from_config(p, world)
    dims.check_placement(per_node, p.allow_cross_node_tp)  # refuses; a permitted crossing warns in the workers
    return dims


def validate_resilience(cfg: Config) -> None:
    """The fault-tolerance fields: restarts, bad steps, replica and straggler checks, checkpoint timing."""
    from plait.errors import UserError
    from plait.launch_env import detect_launch, planned_world
    from plait.parallel.dims import ParallelDims

    t, c = cfg.train, cfg.checkpoint
    for name in ("max_restarts", "replica_check_every", "straggler_every"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    _positive("train.max_bad_steps", t.max_bad_steps)
    _positive("train.straggler_threshold", t.straggler_threshold)
    _positive("checkpoint.every_minutes", c.every_minutes, allow_zero=True)
    if t.spike_factor != 0 and not t.spike_factor > 1:
        raise bad_value("train.spike_factor", t.spike_factor,
                        "must be above 1 (a multiple of the median loss), or 0 = off")
    le = detect_launch()
    if t.max_restarts and le is not None and le.launcher != "plait":
        how = "sbatch --requeue" if le.launcher == "slurm" else f"torchrun --max-restarts {t.max_restarts}"
        raise bad_value("train.max_restarts", t.max_restarts, f"{le.launcher} started these processes, so it must "
                        f"restart them: use {how} and drop this option (plait resumes by itself after a restart)")
    if t.replica_check_every:
        try:
            dims = ParallelDims.from_config(cfg.parallel, planned_world(cfg.parallel)[0])
        except UserError:
            return  # validate_parallel names what is wrong with the layout
        replicas = dims.dp_replicate * dims.dp_shard if cfg.parallel.zero == 0 else dims.dp_replicate
        if replicas < 2:
            raise bad_value("train.replica_check_every", t.replica_check_every, "this layout keeps no two copies of "
                            "the same parameters (one data-parallel rank, or ZeRO shards them); use --zero 0 with "
                            "--dp 2 or more, or --parallel.dp_replicate 2 or more")


def _check_fp8_gather(cfg: Config) -> None:
    """What the FP8 all-gather needs: ZeRO-3 gathering per micro-batch, one tensorwise scale per
    weight, and linears that read their whole weight."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    v = p.zero3_fp8_gather
    if p.zero != 3:
        raise bad_value("parallel.zero3_fp8_gather", v, f"it changes ZeRO-3's all-gather (parallel.zero = 3, "
                        f"not {p.zero}): drop it or set --zero 3")
    if t.fp8 != "tensorwise":
        raise bad_value("parallel.zero3_fp8_gather", v, f"the weights travel in the FP8 the matmuls read, with "
                        f"one scale a weight: it needs train.fp8 tensorwise (not {t.fp8!r})")
    if p.pp > 1:
        raise bad_value("parallel.zero3_fp8_gather", v, "a pipeline stage gathers its ZeRO-3 units once a step, "
                        "so there is little to save: drop it with --pp > 1")
    if p.tp > m.n_kv_heads:
        raise bad_value("parallel.zero3_fp8_gather", v, f"with tp = {p.tp} > {m.n_kv_heads} KV heads each rank "
                        "reads part of its key/value weights, whose scale is the whole weight's: use tp <= "
                        f"{m.n_kv_heads} or drop it")


def _check_fp8(cfg: Config) -> None:
    import torch

    from plait.fp8 import RECIPES

    t = cfg.train
    if t.fp8 == "off":
        return
    if t.fp8 not in RECIPES:
        raise bad_value("train.fp8", t.fp8, f"choose off, {', '.join(RECIPES)}")
    gpu = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if gpu and t.dtype == "fp32":
        raise bad_value("train.fp8", t.fp8, "needs bf16 compute on a GPU; set train.dtype bf16 (or auto)")
    # cuBLAS's FP8 GEMMs take only dimensions that are multiples of 16: every matmul of a training
    # step must be, or FP8 would quietly run in bf16 (generation's one token at a time may)
    m, p = cfg.model, cfg.parallel
    kv = max(m.n_kv_heads // p.tp, 1)
    for what, size, source in (
            ("the model width", m.dim, f"model.dim = {m.dim}"),
            ("the MLP width per tensor-parallel rank", m.ffn_dim // p.tp, f"model.ffn_dim / tp = {m.ffn_dim} / {p.tp}"),
            ("the query width per tensor-parallel rank", m.dim // p.tp, f"model.dim / tp = {m.dim} / {p.tp}"),
            ("the key/value width per tensor-parallel rank", kv * m.head_dim,
             f"{kv} KV head(s) of model.dim / model.n_heads = {m.head_dim}"),
            ("the tokens of a micro-batch per rank", t.micro_batch * t.seq_len // p.cp,
             f"train.micro_batch x train.seq_len / cp = {t.micro_batch} x {t.seq_len} / {p.cp}")):
        if size % 16:
            raise bad_value("train.fp8", t.fp8, f"needs {what} a multiple of 16 (it is {size}: {source}); "
                            "change it or set train.fp8 off")
