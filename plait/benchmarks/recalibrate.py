"""`plait bench calibrate --only PART --out FILE`: measure one part of a hardware profile and write
it into an existing one, keeping the rest (a profile made before the part existed, or a part worth
re-measuring alone); and the lockstep part, which the full calibration measures too."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from plait.benchmarks.calibrate import _collectives, _nccl

ONLY = ("lockstep", "collectives", "overlap", "gaps", "fp8")  # gaps, fp8: one GPU; the others need a group


def lockstep(device: str, nproc: int) -> dict:
    from plait.benchmarks import lockstep as ls

    got = ls.measure(device, nproc) if nproc > 1 else {}
    print("# lockstep: " + (", ".join(f"{n} GPUs +{100 * s:.2f}%" for n, s in got["groups"].items())
                            + f" (spread {100 * got['sigma']:.2f}%)" if got else "not measured (one GPU)"), flush=True)
    return got


def step_gap(device: str) -> float:
    """Seconds a training step leaves the GPU idle (plait/benchmarks/step_gaps.py); 0 on a CPU."""
    import torch

    from plait.benchmarks import step_gaps

    if device != "cuda":
        return 0.0
    got = step_gaps.measure(torch.device("cuda"))
    print(f"# step gaps: {1e3 * got['seconds']:.2f} ms a step idle ({got['model']}, micro-batch {got['micro_batch']}, "
          f"seq {got['seq']}; longest: " + ", ".join(f"{g[0]:.2f} ms before {g[2][:40]}" for g in got["gaps"][:2]) + ")",
          flush=True)
    return got["seconds"]


def fp8(args, device: str) -> tuple:
    """plait's FP8 linears at the shapes of --models, --tp and --tokens (plait/benchmarks/fp8_linears.py)."""
    import torch

    from plait.benchmarks import fp8_linears
    from plait.benchmarks.calibrate import _ints, warm_up
    from plait.errors import bad_value

    dev = torch.device(device)
    if device == "cuda":
        if torch.cuda.get_device_capability(dev) < (8, 9):
            raise bad_value("--only", "fp8", f"{torch.cuda.get_device_name(dev)} has no FP8 tensor cores")
        warm_up(dev)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if not args.quick else ["tiny"]
    tps = [1] if args.quick else _ints(args.tp, "--tp")
    tokens = [64] if args.quick else _ints(args.tokens, "--tokens")
    return fp8_linears.measure(models, tps, tokens, dev, torch.bfloat16 if device == "cuda" else torch.float32)


def only(args, device: str, nproc: int, t0: float) -> int:
    """Measure one part and write it into the profile at --out, keeping everything else there
    (a profile made before the part existed, or a part worth re-measuring on its own)."""
    import dataclasses

    import torch

    from plait.errors import bad_value
    from plait.planner import profile as prof

    if not args.out or not Path(args.out).exists():
        raise bad_value("--out", args.out, "--only updates an existing profile: name it with --out")
    old = prof.load(args.out)
    card = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    if old.card != card:
        raise bad_value("--out", args.out, f"it was measured on {old.card}, this machine has {card}")
    if nproc < 2 and args.only not in ("gaps", "fp8"):
        raise bad_value("--nproc", nproc, f"{args.only} needs two or more GPUs")
    if args.only == "gaps":
        fields = {"step_gap_s": step_gap(device)}
    elif args.only == "fp8":  # a table of shapes: those measured now replace their old rows, the rest stay
        new = fp8(args, device)
        shape = lambda r: (*r[:4], tuple(r[4]))  # noqa: E731 - (recipe, gathered, tokens, in, outs)
        fresh = {shape(r) for r in new}
        fields = {"fp8_linear": tuple(r for r in old.fp8_linear if shape(r) not in fresh) + new}
    elif args.only == "lockstep":
        fields = {"lockstep": lockstep(device, nproc)}
    elif args.only == "collectives":
        fields = {"collectives": tuple(_collectives(device, nproc, args.max_bytes or ("1G" if device == "cuda" else "4M")))}
        print(f"# collectives: {len(fields['collectives'])} timings over groups up to {nproc}", flush=True)
    else:
        from plait.benchmarks import overlap as ov

        fields = ov.measure_groups(device, nproc)
        print(ov.describe(fields), flush=True)
    where = {"command": "plait " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
             "torch": torch.__version__, "nccl": _nccl()}
    prof.save(dataclasses.replace(old, **fields, source={**old.source, args.only: where}), args.out)
    print(f"# updated {args.out} in {time.time() - t0:.0f} s")
    return 0
