"""A run's trainable state on disk as name-keyed pieces: what each rank writes, how any layout reads it.

Two file forms, both keyed by parameter name, never by position:
  full     `model.pt` {name: fp32 tensor} and `optim.pt` {"steps", "moments": {name: {exp_avg,
           exp_avg_sq}}}: written by rank 0 when one rank holds everything (one device, DDP).
  sharded  `model.shard003-of-004.pt` {"pieces": {name: {start, shape, data}}} and the matching
           `optim.shard...pt` {"steps", "pieces": {name: {start, exp_avg, exp_avg_sq}}}: one pair
           per ZeRO shard, holding elements [start, start + len(data)) of each flattened parameter.

A reader copies, for every piece it owns, the overlap with every piece on disk, one file at a time.
So a checkpoint resumes at any layout - DDP, any ZeRO stage, any number of shards - and a full
model (generate, export, init_from) is assembled from shards the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from plait import checkpoint as ckpt
from plait.errors import UserError, bad_value
from plait.parallel.shard_space import Piece

_SHARD = re.compile(r"^(model|optim)\.shard(\d+)-of-(\d+)\.pt$")


def flat_pieces(flat, lo: int, hi: int) -> list[Piece]:
    """The pieces of a `FlatParams` range [lo, hi), with offsets relative to `lo`."""
    out = []
    for s in flat.slots:
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a < b:
            out.append(Piece(s.name, a - s.offset, b - a, s.shape, a - lo))
    return out


def _full(p: Piece) -> bool:
    n = 1
    for d in p.shape:
        n *= d
    return p.start == 0 and p.numel == n


def write(folder: Path, pieces: list[Piece], opt, shard: tuple[int, int] | None) -> None:
    """Write this rank's files: the full form when `shard` is None, else shard (index, count)."""
    m, v, w = opt.exp_avg, opt.exp_avg_sq, opt.master

    def part(t, p):
        return t[p.offset:p.offset + p.numel].detach().float().clone()

    if shard is None:
        assert all(_full(p) for p in pieces), "the full form needs every parameter whole"
        torch.save({p.name: part(w, p).view(p.shape) for p in pieces}, folder / "model.pt")
        torch.save({"steps": opt.steps, "moments": {p.name: {"exp_avg": part(m, p).view(p.shape),
                                                              "exp_avg_sq": part(v, p).view(p.shape)}
                                                     for p in pieces}}, folder / "optim.pt")
        return
    tag = f"shard{shard[0]:03d}-of-{shard[1]:03d}"
    torch.save({"pieces": {p.name: {"start": p.start, "shape": list(p.shape), "data": part(w, p)}
                           for p in pieces}}, folder / f"model.{tag}.pt")
    torch.save({"steps": opt.steps, "pieces": {p.name: {"start": p.start, "exp_avg": part(m, p),
                                                        "exp_avg_sq": part(v, p)} for p in pieces}},
               folder / f"optim.{tag}.pt")


def state_files(folder: Path, kind: str) -> list[Path]:
    """`model` or `optim` files of a checkpoint folder: the full one, or every shard (checked complete)."""
    full = folder / f"{kind}.pt"
    if full.is_file():
        return [full]
    shards = sorted((int(m.group(2)), int(m.group(3)), f) for f in folder.iterdir() if (m := _SHARD.match(f.name))
                    and m.group(1) == kind)
    counts = {c for _, c, _ in shards}
    if not shards or len(counts) != 1 or [i for i, _, _ in shards] != list(range(next(iter(counts)))):
        raise bad_value("checkpoint", str(folder), f"has no complete set of {kind} files ({kind}.pt or "
                        f"{kind}.shardIII-of-NNN.pt); it is not a plait checkpoint")
    return [f for _, _, f in shards]


def _weights(path: Path) -> dict[str, tuple[int, torch.Tensor]]:
    """{name: (start, 1-D data)} of one model file, either form."""
    obj = ckpt.torch_load(path)
    if "pieces" in obj and isinstance(obj["pieces"], dict):
        return {n: (int(e["start"]), e["data"]) for n, e in obj["pieces"].items()}
    return {n: (0, t.reshape(-1)) for n, t in obj.items()}


def _moments(path: Path) -> tuple[int, dict[str, tuple[int, torch.Tensor, torch.Tensor]]]:
    obj = ckpt.torch_load(path)
    if "pieces" in obj:
        return int(obj["steps"]), {n: (int(e["start"]), e["exp_avg"], e["exp_avg_sq"]) for n, e in obj["pieces"].items()}
    return int(obj["steps"]), {n: (0, e["exp_avg"].reshape(-1), e["exp_avg_sq"].reshape(-1))
                               for n, e in obj["moments"].items()}


def _copy_overlaps(pieces: list[Piece], dsts: list[torch.Tensor], src: dict, covered: dict) -> None:
    """For each piece, copy the overlap with src[name] = (start, *tensors) into dsts (owned buffers)."""
    for p in pieces:
        entry = src.get(p.name)
        if entry is None:
            continue
        start, tensors = entry[0], entry[1:]
        a, b = max(p.start, start), min(p.start + p.numel, start + tensors[0].numel())
        if a >= b:
            continue
        for dst, t in zip(dsts, tensors):
            dst[p.offset + a - p.start:p.offset + b - p.start].copy_(t[a - start:b - start])
        covered[p.name] = covered.get(p.name, 0) + b - a


def load(folder: Path, pieces: list[Piece], opt, with_optimizer: bool = True, field: str = "checkpoint") -> None:
    """Fill this rank's masters (and moments, step count) from a checkpoint of any layout."""
    covered: dict[str, int] = {}
    for f in state_files(folder, "model"):
        _copy_overlaps(pieces, [opt.master], _weights(f), covered)
    _check_covered(pieces, covered, folder, field, "weights")
    if with_optimizer:
        covered.clear()
        steps = None
        for f in state_files(folder, "optim"):
            steps, moments = _moments(f)
            _copy_overlaps(pieces, [opt.exp_avg, opt.exp_avg_sq], moments, covered)
        _check_covered(pieces, covered, folder, field, "optimizer state")
        opt.steps = steps


def load_weights(weights: dict[str, torch.Tensor], pieces: list[Piece], opt, field: str, source: str) -> None:
    """Fill this rank's masters from full tensors keyed by name (init_from)."""
    covered: dict[str, int] = {}
    _copy_overlaps(pieces, [opt.master], {n: (0, t.reshape(-1)) for n, t in weights.items()}, covered)
    _check_covered(pieces, covered, source, field, "weights")


def _check_covered(pieces, covered, where, field, what) -> None:
    need: dict[str, int] = {}
    for p in pieces:
        need[p.name] = need.get(p.name, 0) + p.numel
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
        obj = ckpt.torch_load(f)
        for name, e in obj["pieces"].items():
            if name not in out:
                out[name] = torch.zeros(e["shape"], dtype=e["data"].dtype)
            start = int(e["start"])
            out[name].view(-1)[start:start + e["data"].numel()].copy_(e["data"])
            filled[name] = filled.get(name, 0) + e["data"].numel()
    short = [n for n, t in out.items() if filled[n] < t.numel()]
    if short:
        raise UserError(f"checkpoint {folder} is missing parts of {short[:3]}; a shard file is incomplete")
    return out
