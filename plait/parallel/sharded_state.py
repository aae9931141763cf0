"""A run's trainable state on disk as name-keyed pieces: what each rank writes, how any layout reads it.

Two file forms, both keyed by parameter name, never by position:
  full     `model.pt` {name: fp32 tensor} and `optim.pt` {"steps", "moments": {name: {exp_avg,
           exp_avg_sq}}}: written by rank 0 when one rank holds everything (one device, DDP).
  sharded  `model.shard003-of-004.pt` {"pieces": {name: {start, shape, data[, origin, extent]}}} and
           the matching `optim.shard...pt` {"steps", "pieces": {name: {start, exp_avg, exp_avg_sq
           [, origin, extent]}}}: one pair per writing rank. An entry holds elements [start, start +
           len(data)) of a box of the full tensor of `shape`: the box at `origin` of size `extent`
           (a tensor-parallel shard; absent = the whole tensor), flattened row-major. A row-parallel
           shard is a column block, strided in the full tensor's flat order: the box says so exactly.

A reader copies, for every piece it holds, the overlap with every piece on disk, one file at a time
(`plait.ranges.copy_overlap`). So a checkpoint resumes at any layout - DDP, any ZeRO stage, any
number of shards, any tensor-parallel degree - and a full model (generate, export, init_from) is
assembled from shards the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from plait import checkpoint as ckpt
from plait.errors import UserError, bad_value
from plait.parallel.shard_space import Piece
from plait.ranges import Box, copy_overlap, overlap



def flat_pieces(flat, lo: int, hi: int) -> list[Piece]:
    """The pieces of a `FlatParams` range [lo, hi), with offsets relative to `lo`."""
    out = []
    for s in flat.slots:
        ov = overlap(s.offset, s.offset + s.numel, lo, hi)
        if ov is not None:
            out.append(Piece(s.name, ov[0] - s.offset, ov[1] - ov[0], ov[0] - lo, Box.whole(s.shape)))
    return out


def _whole(p: Piece) -> bool:
    return p.box.is_whole and p.start == 0 and p.numel == p.box.numel


def write(folder: Path, pieces: list[Piece], opt, shard: tuple[int, int] | None) -> None:
    """Write this rank's files: the full form when `shard` is None, else shard (index, count)."""
    m, v, w = opt.exp_avg, opt.exp_avg_sq, opt.master

    def part(t, p):
        return t[p.offset:p.offset + p.numel].detach().float().clone()

    if shard is None:
        assert all(_whole(p) for p in pieces), "the full form needs every parameter whole"
        torch.save({p.name: part(w, p).view(p.shape) for p in pieces}, folder / "model.pt")
        torch.save({"steps": opt.steps, "moments": {p.name: {"exp_avg": part(m, p).view(p.shape),
                                                              "exp_avg_sq": part(v, p).view(p.shape)}
                                                     for p in pieces}}, folder / "optim.pt")
        return

    def where(p: Piece) -> dict:
        box = {} if p.box.is_whole else {"origin": list(p.box.origin), "extent": list(p.box.shape)}
        return {"start": p.start, "shape": list(p.box.full), **box}

    tag = f"shard{shard[0]:03d}-of-{shard[1]:03d}"
    torch.save({"pieces": {p.name: {**where(p), "data": part(w, p)} for p in pieces}}, folder / f"model.{tag}.pt")
    torch.save({"steps": opt.steps, "pieces": {p.name: {**where(p), "exp_avg": part(m, p), "exp_avg_sq": part(v, p)}
                                               for p in pieces}}, folder / f"optim.{tag}.pt")


def state_files(folder: Path, kind: str) -> list[Path]:
    """`model` or `optim` files of a checkpoint folder: the full one, or every shard (checked complete).
    Only the files its manifest lists (and checksums) count: a stray file beside them is not read."""
    listed = _listed(folder)
    full = folder / f"{kind}.pt"
    if full.is_file() and (listed is None or full.name in listed):
        return [full]
    shards = sorted((int(m.group(2)), int(m.group(3)), f) for f in folder.iterdir() if (m := ckpt.SHARD_FILE.match(f.name))
                    and m.group(1) == kind and (listed is None or f.name in listed))
    counts = {c for _, c, _ in shards}
    if not shards or len(counts) != 1 or [i for i, _, _ in shards] != list(range(next(iter(counts)))):
        raise bad_value("checkpoint", str(folder), f"has no complete set of {kind} files ({kind}.pt or "
                        f"{kind}.shardIII-of-NNN.pt); it is not a plait checkpoint")
    return [f for _, _, f in shards]


def _listed(folder: Path) -> set[str] | None:
    """The file names a checkpoint's manifest lists; None for a folder without a readable one."""
    try:
        return set(ckpt.load_manifest(folder)["files"])
    except (OSError, ValueError, KeyError):
        return None


def _entries(path: Path, keys: tuple[str, ...]) -> tuple[int | None, dict[str, tuple[Box, int, list]]]:
    """(step count or None, {name: (box, start, [1-D tensors for `keys`])}) of one file, either form."""
    obj = ckpt.torch_load(path)
    steps = int(obj["steps"]) if "steps" in obj else None
    if "pieces" in obj and isinstance(obj["pieces"], dict):
        out = {}
        for name, e in obj["pieces"].items():
            full = tuple(int(d) for d in e["shape"])
            box = Box(full, tuple(e["origin"]), tuple(e["extent"])) if "origin" in e else Box.whole(full)
            out[name] = (box, int(e["start"]), [e[k].reshape(-1) for k in keys])
        return steps, out
    table = obj["moments"] if "moments" in obj else obj
    out = {}
    for name, e in table.items():
        tensors = [e[k] for k in keys] if isinstance(e, dict) else [e]
        out[name] = (Box.whole(tensors[0].shape), 0, [t.reshape(-1) for t in tensors])
    return steps, out


def _copy_overlaps(pieces: list[Piece], dsts: list[torch.Tensor], src: dict, covered: dict) -> None:
    """For each piece, copy its overlap with src[name] = (box, start, tensors) into dsts (owned buffers)."""
    for p in pieces:
        entry = src.get(p.name)
        if entry is None:
            continue
        box, start, tensors = entry
        views = [d[p.offset:p.offset + p.numel] for d in dsts]
        n = copy_overlap(p.box, p.start, p.numel, views, box, start, tensors)
        covered[p.name] = covered.get(p.name, 0) + n


def load(folder: Path, pieces: list[Piece], opt, with_optimizer: bool = True, field: str = "checkpoint") -> None:
    """Fill this rank's masters (and moments, step count) from a checkpoint of any layout."""
    covered: dict[str, int] = {}
    for f in state_files(folder, "model"):
        _copy_overlaps(pieces, [opt.master], _entries(f, ("data",))[1], covered)
    _check_covered(pieces, covered, folder, field, "weights")
    if with_optimizer:
        covered.clear()
        steps = None
        for f in state_files(folder, "optim"):
            steps, moments = _entries(f, ("exp_avg", "exp_avg_sq"))
            _copy_overlaps(pieces, [opt.exp_avg, opt.exp_avg_sq], moments, covered)
        _check_covered(pieces, covered, folder, field, "optimizer state")
        opt.steps = steps


def load_weights(weights: dict[str, torch.Tensor], pieces: list[Piece], opt, field: str, source: str) -> None:
    """Fill this rank's masters from full tensors keyed by name (init_from)."""
    covered: dict[str, int] = {}
    src = {n: (Box.whole(t.shape), 0, [t.reshape(-1)]) for n, t in weights.items()}
    _copy_overlaps(pieces, [opt.master], src, covered)
    _check_covered(pieces, covered, source, field, "weights")


def _check_covered(pieces, covered, where, field, what) -> None:
    need: dict[str, int] = {}
    for p in pieces:
        need[p.name] = need.get(p.name, 0) + p.box.real_numel(p.start, p.numel)
    missing = [n for n, k in need.items() if covered.get(n, 0) < k]
    if missing:
        raise bad_value(field, str(where), f"lacks {what} for {missing[:3]}; it does not match this model")


def full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter whole (fp32), assembled from whichever form the checkpoint has."""
    files = state_files(folder, "model")
    if len(files) == 1 and files[0].name == "model.pt":
        return ckpt.torch_load(files[0])
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for f in files:
        for name, (box, start, (data,)) in _entries(f, ("data",))[1].items():
            if name not in out:
                out[name] = torch.zeros(box.full, dtype=data.dtype)
            whole = Box.whole(box.full)
            n = copy_overlap(whole, 0, whole.numel, [out[name].view(-1)], box, start, [data])
            filled[name] = filled.get(name, 0) + n
    short = [n for n, t in out.items() if filled[n] < t.numel()]
    if short:
        raise UserError(f"checkpoint {folder} is missing parts of {short[:3]}; a shard file is incomplete")
    return out
