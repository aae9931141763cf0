"""What the launching process checks before any worker starts, so a bad command costs one line and
exit code 2: the config and layout, the output folder and its checkpoints (resume or refuse), the
data and its tokenizer against the weights being continued, and `train.init_from`'s model.

Under torchrun/srun every rank runs `preflight`; only the first says anything.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from plait import checkpoint as ckpt
from plait.config import Config, config_from_dict
from plait.data import open_data
from plait.prepare import default_corpus_dir
from plait.errors import UserError, bad_value
from plait.metrics import check_wandb
from plait.resume import (SHAPE_FIELDS, check_model_shape, global_batch_note, global_batch_of, model_changes,
                          saved_global_batch)
from plait.validate import data_parallel_size, validate_config


def warn(msg: str) -> None:
    """One line to the user, on stderr."""
    print(f"plait: {msg}", file=sys.stderr)


class NothingToTrain(Exception):
    """A resumed run whose newest checkpoint is already at train.steps: nothing to do (not an error:
    a requeued job that finds its run finished ends as it would have)."""


def preflight(cfg: Config, model_given: dict | None = None) -> Config:
    """Validate and resolve paths in the launching process; returns the config workers will use.
    `model_given`: the [model] fields the command line or --config set, which `train.init_from`
    must not silently replace."""
    t = cfg.train
    if cfg.checkpoint.resume is True and not t.out:  # a made-up folder would hold nothing to resume
        raise bad_value("checkpoint.resume", True, "needs the run folder to continue: pass --out RUN")
    if t.init_from and not (t.out and ckpt.list_checkpoints(Path(t.out).expanduser() / "checkpoints")
                            and cfg.checkpoint.resume):  # a resumed run's own checkpoint decides its model
        cfg.model = init_model_config(t.init_from, model_given or {})
    try:
        validate_config(cfg)
    except UserError as e:
        raise e.everywhere()
    if t.device == "cuda":  # before the default corpus is prepared (minutes on a first run) and the folder made
        from plait.train import resolve_device

        resolve_device(cfg)
    from plait.launch import check_launched, detect_launch

    le = detect_launch()
    check_launched(cfg.parallel.nproc, le)  # before the run folder is made: a refused start leaves none
    if not t.out:
        if le is not None and le.world_size > 1 and le.launcher != "plait":
            # each process runs this: a timestamp could differ between them by a second
            raise bad_value("train.out", t.out, f"must be given when {le.launcher} starts the processes, so that "
                            "all of them write to one run folder; pass --out runs/NAME")
        t.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    out = Path(t.out).expanduser()
    created = not out.exists()
    try:
        ckpt.check_writable(out, "train.out")
        check_wandb(t.wandb)
        folder = _check_resume(cfg, out, model_given)
        if not cfg.data.path and not cfg.data.mix:
            cfg.data.path = str(default_corpus_dir(cfg.data.cache_dir, cfg.data.val_fraction))
        data = open_data(cfg.data)
        # the tokenizer before the vocabulary: data of another tokenizer with a larger vocabulary
        # was told to raise model.vocab_size, which the weights' shape then refused
        weights = folder if folder is not None else t.init_from  # what the model continues, if anything
        unchecked = _check_tokenizer(data, weights)
        data.check(cfg.model.vocab_size, t.seq_len, weights=weights)
        _absolute_data(cfg)
        p = cfg.parallel
        if p.pp > 1 and t.grad_accum == 1 and _first_process():  # legal, and idle (pp-1)/pp of the step
            warn(f"a pipeline of {p.pp} stages runs 1 micro-batch a step: each rank idles while the others run "
                 f"it ({(p.pp - 1) / p.pp:.0%} of the step); --microbatches M (M >= {p.pp}) splits the batch into M")
        if unchecked and _first_process():
            warn(unchecked)
        if t.init_from and folder is None and _first_process():  # said once everything passed
            m = cfg.model
            warn(f"starting from the weights in {t.init_from}: {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads "
                  f"({m.n_kv_heads} KV), vocabulary {m.vocab_size}, max_seq_len {m.max_seq_len}")
    except UserError:
        if created:  # a refused command leaves no empty run folder behind
            try:
                out.rmdir()
            except OSError:
                pass
        raise
    return cfg


def _absolute_data(cfg: Config) -> None:
    """Name the data folders and `train.init_from` by absolute path in the config the run saves:
    `--resume`, `plait eval` and a restart read it, maybe from another directory, where a relative
    path named nothing (or another folder of the same name)."""
    import os

    d = cfg.data
    if d.mix:  # checked by open_data: "DIR:WEIGHT,..."; each weight is kept as written
        items = (item.strip().rpartition(":") for item in d.mix.split(",") if item.strip())
        d.mix = ",".join(f"{os.path.abspath(os.path.expanduser(p.strip()))}:{w.strip()}" for p, _, w in items)
    elif d.path:
        d.path = os.path.abspath(os.path.expanduser(d.path))
    if cfg.train.init_from and os.path.exists(os.path.expanduser(cfg.train.init_from)):
        cfg.train.init_from = os.path.abspath(os.path.expanduser(cfg.train.init_from))


def _check_tokenizer(data, weights) -> str | None:
    """Refuse data prepared with another tokenizer than the weights being continued were trained
    with (the resumed checkpoint's, or train.init_from's): the ids would mean other text. Returns
    what to say when it cannot tell (an HF folder without tokenizer.json)."""
    from plait import hf
    from plait.tokenizer import from_spec, same_tokenizer

    if not weights:
        return None
    path = Path(weights)
    part = data.parts[0] if hasattr(data, "parts") else data
    if hf.is_hf_dir(str(path)):
        vocab = json.loads((path / "config.json").read_text()).get("vocab_size", 0)
        tok = hf.tokenizer_of(path, vocab)
        if tok is not None and tok.vocab_size > vocab:  # else the data, prepared with it, was blamed
            raise bad_value("train.init_from", str(weights), f"has a tokenizer of {tok.vocab_size} tokens for a model of "
                            f"vocabulary {vocab}: the tokenizer belongs to another model; put the model's own "
                            "tokenizer.json beside its weights")
        if tok is None:  # the folder does not say which tokenizer its weights read
            if part.tokenizer_spec.get("kind") != "hf":  # bytes for a model of another vocabulary: never right
                raise bad_value("data.path", str(part.path), f"was prepared as bytes, but the weights in {weights} "
                                f"(vocabulary {vocab}) read another tokenizer's ids; prepare the data with the model's "
                                "tokenizer (`plait data prepare --tokenizer` with its tokenizer.json)")
            return (f"{weights} has no tokenizer.json: that {part.path} was prepared with the model's own tokenizer "
                    "cannot be checked (add the model's tokenizer.json to the folder to have it checked)")
    else:
        folder = path if (path / "train_state.json").is_file() else ckpt.resolve_for_reading(str(path),
                                                                                           field="train.init_from")
        tok = from_spec(json.loads((folder / "train_state.json").read_text()).get("tokenizer", {"kind": "byte"}), folder)
    if not same_tokenizer(tok, part):
        raise bad_value("data.path", str(part.path), f"was prepared with another tokenizer than the weights in {weights}; "
                        "prepare the data with their tokenizer (`plait data prepare --tokenizer` with the "
                        "tokenizer.json saved beside them)")
    return None


def _check_resume(cfg: Config, out: Path, model_given: dict | None = None) -> Path | None:
    """The run folder's checkpoints against checkpoint.resume: refuse to overwrite a run, to
    "resume" nothing, to go back before its step or to load weights of another shape; name a
    change of the global batch. Returns the checkpoint the run continues from (None: a fresh run)."""
    resume, existing = cfg.checkpoint.resume, ckpt.list_checkpoints(out / "checkpoints")
    if existing and not resume:
        raise bad_value("train.out", cfg.train.out, f"already holds {len(existing)} checkpoint(s); pass --resume to "
                        "continue that run or choose another --out")
    if not existing:
        run = ckpt.run_folder_of(out) if resume else None
        if run is not None:  # --resume auto would start a new run inside the old one's checkpoints
            what = "the checkpoints folder" if ckpt.list_checkpoints(out) else "a checkpoint"
            flag = "--resume auto" if resume == "auto" else "--resume"
            raise bad_value("train.out", cfg.train.out, f"is {what} of the run in {run}; pass the run folder: "
                            f"--out {run} {flag}")
        if resume is True:  # a mistyped --out must not silently begin a new run
            raise bad_value("checkpoint.resume", True, f"{out} holds no checkpoint to resume; check --out, or pass "
                            "--resume auto to start fresh when there is none")
        if (out / "config.toml").is_file() and _first_process():  # a run that saved nothing yet: say it starts over
            from plait.run_folder import RunFolder

            if RunFolder.holder(out) is None:  # (one that is still running: its lock refuses this start)
                warn(f"{out} holds no checkpoint yet: the run starts again from step 0")
        return None
    if not resume:
        return None
    folder = ckpt.latest_valid(out / "checkpoints", log=warn if _first_process() else (lambda m: None))
    if folder is None:
        raise bad_value("checkpoint.resume", resume, f"every checkpoint in {out / 'checkpoints'} is damaged; "
                        "move them away to start fresh")
    saved = check_model_shape(cfg.model, folder, model_given)
    if (changed := model_changes(cfg.model, saved, model_given)) and _first_process():
        warn(f"the run's config changes {', '.join(changed)} from what {folder.name} was trained with")
    step = int(json.loads((folder / "train_state.json").read_text())["step"])
    if cfg.train.steps < step:
        raise bad_value("train.steps", cfg.train.steps, f"but the run in {out} is already at step {step}; give "
                        f"--steps above {step} to train it further")
    if cfg.train.steps == step:
        raise NothingToTrain(f"{out} is already at step {step} of {cfg.train.steps}: nothing to train; "
                             "raise --steps to train it further")
    if cfg.train.profile_steps and _first_process():  # not an error: a restart resumes past its window too
        from plait.profile import parse_steps

        first, last = parse_steps(cfg.train.profile_steps, cfg.train.steps)
        if last <= step:
            warn(f"train.profile_steps = {cfg.train.profile_steps!r} lies before step {step + 1}, where this run "
                 f"resumes: nothing is recorded; profile steps within {step + 1}:{cfg.train.steps}")
    dp = data_parallel_size(cfg)
    note = global_batch_note(saved_global_batch(folder), global_batch_of(cfg.train.micro_batch, cfg.train.grad_accum, dp),
                             cfg.train.micro_batch, dp, cfg.parallel.microbatches)
    if note and _first_process():
        warn(note)
    return folder


def _first_process() -> bool:
    """Whether this launching process speaks for the run (under torchrun/srun every rank runs preflight)."""
    from plait.launch import detect_launch

    le = detect_launch()
    return le is None or le.rank == 0


def init_model_config(path: str, given: dict | None = None):
    """The model config of the weights `train.init_from` names (HF folder or plait checkpoint),
    with the [model] fields the user `given` on top where they do not change a weight's shape
    (max_seq_len, rope_theta...); one that does is refused: the weights decide the shape."""
    from dataclasses import replace

    from plait import hf
    from plait.config import build_config

    if hf.is_hf_dir(path):
        model = hf.config_from_hf(path, field="train.init_from")
        hf.check_hf_weights(path, model, field="train.init_from")
    else:
        folder = ckpt.resolve_for_reading(path, field="train.init_from")
        model = config_from_dict(json.loads((folder / "train_state.json").read_text())["config"]).model
    given = given or {}
    if not given:
        return model
    asked = build_config({"model": given}).model  # typed and checked; a preset brings its shape
    keys = (set(given) - {"preset"}) | (set(SHAPE_FIELDS) if "preset" in given else set())
    for key in sorted(keys & set(SHAPE_FIELDS)):
        if getattr(asked, key) != getattr(model, key):
            flag = "preset" if key not in given else key
            raise bad_value(f"model.{flag}", getattr(asked, flag), f"but train.init_from {path} holds a model with {key} = "
                            f"{getattr(model, key)!r}: its weights decide the shape; drop --model.{flag}")
    return replace(model, **{k: getattr(asked, k) for k in keys - set(SHAPE_FIELDS)})
