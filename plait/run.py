"""From a checked config to running workers: this process alone, or N processes via the launcher.

Everything a user can get wrong is checked here, in the launching process (`preflight`), so a bad
layout costs one line and exit code 2 before any worker starts. Then:
  - one process, no launcher, no sharding: train right here, without a process group (the default
    job pays nothing for distribution);
  - otherwise `plait.launch.run` starts `parallel.nproc` workers (or joins the ones torchrun/srun
    started); each joins the process group, builds the mesh and trains its part.
A CUDA out-of-memory error in training becomes one line naming the memory snapshot it wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

from plait.config import Config
from plait.errors import UserError
from plait.profile import snapshot_on_oom
from plait.preflight import preflight
from plait.train import resolve_device, train


def launch_training(cfg: Config, note: str | None = None, model_given: dict | None = None) -> dict | None:
    """Preflight once, then train; returns rank 0's summary (None on other ranks under torchrun, and
    when a resumed run is already at train.steps). `note`: a line about the config (where a resumed
    run's came from), said once the config passed. `model_given`: the [model] fields the user set
    (`train.init_from` keeps them or refuses them)."""
    from plait.launch import detect_launch, run
    from plait.run_folder import RunFolder, discard
    from plait.supervise import resume_after_outer_restart, run_workers, stopped_before
    from plait.preflight import NothingToTrain

    le = detect_launch()
    holder = le is None or le.rank == 0
    if cfg.train.out and (stop := stopped_before(cfg.train.out)):  # torchrun restarted workers that stopped
        if holder:
            from plait.commands.train import resume_how

            print(f"plait: torchrun restarted the workers after they stopped on {stop['signal']} at step "
                  f"{stop['step']} (saved): not training on; continue {resume_how(cfg.train.out)}", file=sys.stderr)
        return None
    # preflight makes the run folder; a start refused after it (no GPU, no disk space) removes it again
    created = not cfg.train.out or not Path(cfg.train.out).expanduser().exists()
    try:
        cfg = preflight(resume_after_outer_restart(cfg), model_given)
    except NothingToTrain as e:
        if holder:
            print(f"plait: {e}", file=sys.stderr)
        return None
    p = cfg.parallel
    try:
        device_type = resolve_device(cfg).type
    except UserError:
        if created and holder:
            discard(Path(cfg.train.out).expanduser())
        raise
    # one run per folder (a lock), room for a checkpoint, no leftovers of a crash; restarts inside
    with RunFolder(cfg, holder=holder, created=created):
        if note and holder:  # once the folder is this run's: a refused start says only why
            print(f"plait: {note}", file=sys.stderr)
        if le is None and p.nproc == 1 and p.zero == 0 and not cfg.train.max_restarts:
            with snapshot_on_oom(cfg.train.out, 0):
                return train(cfg)
        results = run_workers(cfg, lambda c, env: run(_worker, (c, device_type), nproc=p.nproc, device_type=device_type,
                                                      isolate=c.train.max_restarts > 0, env=env))
    main = [r for r in results if r and r.get("main")]
    if not main:  # another rank of torchrun/srun: a stop they agreed on ends this process the same way (143)
        stopped = [r for r in results if r and r.get("stopped")]
        return {"stopped": stopped[0]["stopped"]} if stopped else None
    return main[0]


def _worker(cfg: Config, device_type: str) -> dict:
    from plait.launch import detect_launch, init_distributed
    from plait.preempt import catch_early

    catch_early()  # a SIGUSR1 before the loop is a stop at its first step, not the death of this rank
    le = detect_launch()
    if le is not None and le.launcher in ("torchrun", "slurm"):  # its agent's SIGTERM: one line, not silence
        from plait import lifeline

        lifeline.after_ctrl_c(term_line=lambda: stopped_line(cfg, le.rank, le.launcher))

    dims = init_distributed(cfg.parallel, device_type, agree=_must_agree(cfg))
    if dims.world_size > 1:
        one_run_folder(Path(cfg.train.out).expanduser(), dims.rank)
    with snapshot_on_oom(cfg.train.out, dims.rank):
        return train(cfg, dims)


def stopped_line(cfg: Config, rank: int, launcher: str) -> str:
    """What a rank its launcher ended with SIGTERM says. The newest checkpoint by name, not hashed:
    the launcher kills the rank a few seconds later (a resume skips a damaged one and says so)."""
    from plait import checkpoint as ckpt

    out = Path(cfg.train.out).expanduser()
    found = ckpt.list_checkpoints(out / "checkpoints") if (out / "checkpoints").is_dir() else []
    from plait.commands.train import resume_how

    where = (f"the newest checkpoint is {found[0][1].name}: continue {resume_how(out)}"
             if found else "no checkpoint was saved: run the command again")
    return (f"plait train: rank {rank} stopped by SIGTERM from {launcher} (it ends every rank once one fails or "
            f"the job is stopped; its report names the rank that failed first); {where}")


# What may differ between the nodes of one run: paths (a shared disk mounted elsewhere), the
# processes a node starts, how it binds its CPUs and what it prints.
NODE_LOCAL = {"train.out", "train.init_from", "data.path", "data.mix", "parallel.nproc", "parallel.bind_cpus",
              "train.progress", "train.tensorboard", "train.wandb"}


def _must_agree(cfg: Config) -> dict:
    """The config fields every rank must hold alike, flattened to "section.field", and what the
    node-local paths hold: the path may differ between nodes, the data and weights may not (each
    data-parallel rank trained on its node's corpus, in silence)."""
    out = {f"{sec}.{k}": v for sec, fields in cfg.to_dict().items() for k, v in fields.items()
           if f"{sec}.{k}" not in NODE_LOCAL}
    d = cfg.data
    folders = [p.rpartition(":")[0].strip() for p in d.mix.split(",") if p.strip()] if d.mix else [d.path]
    out["data (what its folders hold)"] = [_content_id(Path(f).expanduser() / "meta.json") for f in folders if f]
    if cfg.train.init_from:
        p = Path(cfg.train.init_from).expanduser()
        out["train.init_from (what it holds)"] = _content_id(p / "config.json" if (p / "config.json").is_file()
                                                             else p / "train_state.json")
    return out


def _content_id(path: Path) -> str:
    """A short digest of a small file that names what a folder holds (prepared data's meta.json: its
    shards, tokens and tokenizer)."""
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return f"unreadable {path.name}"


def one_run_folder(out: Path, rank: int) -> None:
    """Every rank writes into the same run folder: rank 0 leaves a token there, every rank reads it
    back. Nodes that each had their own folder (node-local disk, a per-node --out) trained to the
    first checkpoint, then failed there, or waited out the timeout for each other's save."""
    import uuid

    import torch.distributed as dist

    token = [uuid.uuid4().hex, str(out)] if rank == 0 else [None, None]
    path = out / ".plait-start"
    if rank == 0:
        path.write_text(token[0])
    dist.broadcast_object_list(token, src=0)  # after rank 0's write; and rank 0's folder, named alike everywhere
    try:
        seen = path.read_text().strip() == token[0]
    except OSError:
        seen = False
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    lost = [r for r, ok in enumerate(everyone) if not ok]
    if rank == 0:  # everyone has read it
        path.unlink(missing_ok=True)
    if lost:
        raise UserError(f"train.out = {token[1]!r} (rank 0's): rank(s) {', '.join(map(str, lost[:8]))} do not see "
                        "that run folder where their --out points: every node must write to one shared folder (a "
                        "shared file system, the same --out on each)")
