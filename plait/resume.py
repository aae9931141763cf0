"""Continuing a run: the config it was saved with, what the command line changes in it, and the
checks that a checkpoint fits the run about to continue it.

`plait train --out RUN --resume` starts from RUN's own config (the one its newest valid checkpoint
was trained with; else RUN/config.toml, written when the run last started), not from the defaults,
so continuing a `small` run needs no `--model.preset small`. Options given on the command line (or
in `--config`) override it, and the run names the ones that change something in one line. What describes this
invocation rather than the run starts from the defaults again, as for any command: the layout
([parallel]: processes, degrees, ZeRO stage; a checkpoint loads at any layout, so it is chosen for
the machine at hand) and `PER_INVOCATION`'s fields. `--train.global_batch` keeps the batch when the
layout changes, and the run says when it does not.

Whatever the config, a checkpoint whose weights have another shape than the model the config
builds is refused before any worker starts, and a change of the global batch is named.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

from plait import checkpoint as ckpt
from plait.config import Config, ModelConfig, build_config, config_from_dict, merge
from plait.errors import UserError, bad_value

# what says how this one command runs, not what the run is: sections, then single fields
PER_INVOCATION_SECTIONS = ("parallel",)
PER_INVOCATION = (("checkpoint", "resume"), ("train", "max_steps_this_run"))
# the model fields that decide the shape of some weight (rope_theta, max_seq_len... do not)
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")


def saved_config(out: Path, log=lambda msg: None) -> tuple[dict, Path] | None:
    """The config a run folder continues with, and the file it came from; None if it holds none.

    The newest valid checkpoint's own config (its train_state.json) first: it is what trained the
    weights the run continues from. config.toml records the run's last start, which may have ended
    before it saved anything - a trial at another learning rate stopped with Ctrl-C, a test with
    checkpoint.at_end false - and a later plain `--resume` took those values over in silence (the
    run then trained at the trial's rate, or saved no checkpoint at all). What config.toml holds
    beyond the checkpoint is named by `later_start_changes`. A folder without a valid checkpoint
    (a run that never saved) falls back to config.toml; `log` says when that file is unreadable.
    """
    folder = ckpt.latest_valid(out / "checkpoints", log=lambda m: None) if (out / "checkpoints").is_dir() else None
    if folder is not None:
        state = folder / "train_state.json"
        try:
            return json.loads(state.read_text())["config"], state
        except (OSError, ValueError, KeyError):
            pass
    toml = out / "config.toml"
    saved, why = _read_toml(toml)
    if saved is not None:
        return saved, toml
    if why is not None:
        log(f"{toml} is unreadable ({why}) and the run holds no valid checkpoint: its config is lost; "
            "start again with the options it needs")
    return None


def _read_toml(toml: Path) -> tuple[dict | None, str | None]:
    """A run's config.toml, or None and why not (None, None: there is none)."""
    if not toml.is_file():
        return None, None
    try:
        saved = tomllib.loads(toml.read_text())
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        return None, (str(e).splitlines()[0] if str(e) else type(e).__name__)
    missing = [s for s in ("model", "data", "train") if not isinstance(saved.get(s), dict)]
    if missing:  # emptied or cut short: its defaults would be another run
        return None, f"it lacks [{'], ['.join(missing)}]"
    return saved, None


def later_start_changes(out: Path, saved: dict, explicit: dict) -> list[str]:
    """The run's settings that config.toml (its last start) holds other than `saved` (the checkpoint
    it continues from) and that the command line does not give again: a start that saved no
    checkpoint after it set them. They are not carried over; the run says which."""
    toml, _ = _read_toml(out / "config.toml")
    if toml is None:
        return []
    try:
        was, last = _comparable(saved), _comparable(toml)
    except (UserError, ValueError, TypeError) as e:  # an edit plait cannot read: said, not applied
        return [f"values it cannot read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"]
    if was["train"].get("global_batch") or last["train"].get("global_batch"):
        for cfg in (was, last):  # derived from the batch at each start's layout (config.toml: a comment)
            cfg["train"].pop("grad_accum", None)
    out_list = []
    for section, values in last.items():
        for key, value in values.items():
            old = was.get(section, {}).get(key)
            if key in explicit.get(section, {}) or old == value:
                continue
            if (section, key) in PATH_FIELDS and old and value and _same_path(str(old), str(value)):
                continue
            out_list.append(f"{section}.{key} = {value!r} (the checkpoint's: {old!r})")
    return sorted(out_list)


def _comparable(saved: dict) -> dict:
    """A saved config's run settings as plait reads them (defaults filled in), without where it
    writes (train.out)."""
    cfg = config_from_dict(_run_settings(saved)).to_dict()
    cfg["train"].pop("out", None)
    return {s: v for s, v in cfg.items() if s not in PER_INVOCATION_SECTIONS}


def _run_settings(saved: dict) -> dict:
    """The saved sections and fields that describe the run, not one invocation of it (the layout,
    `PER_INVOCATION`): fresh dicts, safe to edit."""
    base = {s: v for s, v in _known(saved).items() if s not in PER_INVOCATION_SECTIONS}
    for section, key in PER_INVOCATION:
        base.get(section, {}).pop(key, None)
    return base


def _known(saved: dict) -> dict:
    """The saved sections and fields this plait still has (a config from an older plait may hold more)."""
    known = Config().to_dict()
    return {s: {k: v for k, v in values.items() if k in known[s]}
            for s, values in saved.items() if s in known and isinstance(values, dict)}


def resumed_config(saved: dict, explicit: dict) -> tuple[Config, list[str]]:
    """The run's saved config with `explicit` ({section: {key: value}} from the command line and
    --config) on top; returns it and a "field old -> new" entry for each value that changed.

    A `model.preset` other than the saved one means a model built from that preset (and the
    explicit model fields), not the saved shape with a new label: the shape check then says whether
    the checkpoint fits it.
    """
    base = _run_settings(saved)
    was = config_from_dict(base)
    replaced = []
    for (section, key), (other_section, other) in REPLACES:
        # given now, it replaces the saved field it excludes: both set were refused as a contradiction
        # (or the saved global batch overrode the accumulation given), though only one was typed
        if key in explicit.get(section, {}) and base.get(other_section, {}).get(other):
            base[other_section].pop(other)
            if other not in explicit.get(other_section, {}):
                replaced.append(f"{other_section}.{other} {getattr(getattr(was, other_section), other)!r} -> "
                                f"{getattr(getattr(Config(), other_section), other)!r} ({section}.{key} replaces it)")
    model_explicit = explicit.get("model", {})
    if "preset" in model_explicit and str(model_explicit["preset"]) != str(base.get("model", {}).get("preset")):
        base.pop("model", None)
    cfg = build_config(merge(base, explicit))
    changed = []
    for section, key in PATH_FIELDS:  # the same folder named another way (relative, a link): no change
        old, new = getattr(getattr(was, section), key), getattr(getattr(cfg, section), key)
        if old and new and old != new and _same_path(old, new):
            setattr(getattr(cfg, section), key, old)  # the run's record stays as it was
    for section, values in explicit.items():
        for key in values:
            old, new = getattr(getattr(was, section), key), getattr(getattr(cfg, section), key)
            per_invocation = section in PER_INVOCATION_SECTIONS or (section, key) in PER_INVOCATION
            if not per_invocation and (section, key) != ("train", "out") and old != new:
                changed.append(f"{section}.{key} {old!r} -> {new!r}")
    return cfg, sorted(changed + replaced)


PATH_FIELDS = (("data", "path"), ("train", "init_from"))
# (given now, saved field it replaces): pairs a run sets one of
REPLACES = ((("data", "mix"), ("data", "path")), (("data", "path"), ("data", "mix")),
            (("train", "grad_accum"), ("train", "global_batch")), (("parallel", "microbatches"), ("train", "global_batch")))


def _same_path(a: str, b: str) -> bool:
    import os

    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def describe_resume(source: Path, changed: list[str]) -> str:
    """The one line a resumed run prints about its config."""
    line = f"resuming with the config saved in {source}"
    return line + (f"; the command line changes {', '.join(changed)}" if changed else "")


def check_model_shape(model: ModelConfig, folder: Path, given: dict | None = None) -> ModelConfig:
    """Refuse (one line) a checkpoint whose weights have another shape than `model`; returns the
    checkpoint's model config. `given`: the [model] fields the user set; where a field that does
    not fit came from a preset given with --preset, not set itself, the line names the preset."""
    saved = config_from_dict(json.loads((folder / "train_state.json").read_text())["config"]).model
    given = given or {}
    for name in SHAPE_FIELDS:
        new, old = getattr(model, name), getattr(saved, name)
        if new != old:
            if name not in given and "preset" in given:  # else the line names a value the user never typed
                raise bad_value("model.preset", given["preset"], f"builds a model with {name} = {new!r}, but the "
                                f"checkpoint {folder} holds a {saved.preset!r} model with {name} = {old!r}; resume "
                                "without --preset (the run's saved config already has its shape), or train into "
                                "a new --out")
            how = ("resume without the --model options that change it (the run's saved config already has "
                   "its shape)" if name in given else "the run's saved config says so: restore it")
            raise bad_value(f"model.{name}", new, f"but the checkpoint {folder} holds a {saved.preset!r} model with "
                            f"{name} = {old!r}; {how}, or train into a new --out")
    return saved


# the model fields other than the shape that change what the same weights compute
FUNCTION_FIELDS = ("rope_theta", "rope_scaling", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_len", "norm_eps")


def model_changes(model: ModelConfig, saved: ModelConfig, given: dict | None = None) -> list[str]:
    """The model fields other than its shape that differ from `saved` (what the checkpoint trained
    with: `check_model_shape` returns it): any that no flag given now sets (a saved config that is
    not the checkpoint's), and those given that change what the same weights compute (RoPE,
    norm epsilon: on purpose when a run extends its context, a silent wrong model otherwise)."""
    given = given or {}
    return [f"model.{f.name} = {getattr(model, f.name)!r} (trained with {getattr(saved, f.name)!r})"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in (*SHAPE_FIELDS, "preset") and (f.name not in given or f.name in FUNCTION_FIELDS)
            and getattr(model, f.name) != getattr(saved, f.name)]


def saved_global_batch(folder: Path) -> tuple[int, str] | None:
    """Sequences per optimizer step of the run that wrote the checkpoint, and how they came about;
    None where an old checkpoint does not say (it recorded no global batch and no resolvable dp)."""
    state = json.loads((folder / "train_state.json").read_text())
    if "global_batch" in state:
        return int(state["global_batch"]), str(state.get("global_batch_terms", ""))
    t, layout = state["config"]["train"], state.get("layout", {})
    dp_shard, replicate = layout.get("dp_shard", -1), layout.get("dp_replicate", 1)
    if dp_shard == -1:  # inferred from the world: only a local run recorded it (nproc)
        dp = layout.get("nproc", 1) // max(1, layout.get("tp", 1))
    else:
        dp = dp_shard * replicate
    if dp < 1:
        return None
    return global_batch_of(t["micro_batch"], t["grad_accum"], dp)


def global_batch_of(micro_batch: int, grad_accum: int, dp: int) -> tuple[int, str]:
    """(sequences per optimizer step, "micro_batch 4 x grad_accum 2 x dp 2")."""
    return micro_batch * grad_accum * dp, f"micro_batch {micro_batch} x grad_accum {grad_accum} x dp {dp}"


def global_batch_note(before: tuple[int, str] | None, now: tuple[int, str], micro_batch: int = 1, dp: int = 1,
                      microbatches: int = 0) -> str | None:
    """One line when a resumed run trains another number of sequences per step than its checkpoint,
    with the options that keep the run's batch at this layout (`micro_batch`, `dp`; a pipeline's
    `microbatches` would contradict them) - or why none can."""
    if before is None or before[0] == now[0]:
        return None
    b = before[0]
    line = (f"the checkpoint trained {b} sequences per step ({before[1]}); this run trains {now[0]} ({now[1]}), "
            "which changes the tokens per step and the loss curve")
    if b % dp:
        return line + f"; this layout's {dp} data-parallel ranks cannot split {b} sequences evenly"
    mb = max(m for m in range(1, min(micro_batch, b // dp) + 1) if (b // dp) % m == 0)  # the largest that fits
    keep = f"--train.global_batch {b}" + (f" --train.micro_batch {mb}" if mb != micro_batch else "")
    drop = " without --microbatches" if microbatches else ""
    return line + f"; pass {keep}{drop} to keep the run's batch at this layout"


def trim_metrics(path: Path, step: int) -> int:
    """Drop the entries of metrics.jsonl past `step` (what the run logged after the checkpoint it
    resumes from), so the file holds one curve; returns how many went. Rewritten atomically."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            s = json.loads(line).get("step")
        except (ValueError, AttributeError):
            s = None  # a line cut short by a killed run: never part of the curve
        if isinstance(s, int) and s <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return dropped


def restore_record(path: Path, step: int, record: dict | None) -> bool:
    """Append a checkpoint's own metrics entry (`record`, saved with it) when metrics.jsonl lacks
    its step: the run that saved it was killed between committing the checkpoint and logging the
    step, and a resume from there starts at the next step. Returns whether it was added."""
    if not record or record.get("step") != step:
        return False
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                if json.loads(line).get("step") == step:
                    return False
            except (ValueError, AttributeError):
                continue
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return True
