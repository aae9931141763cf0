"""The planner's layout ranking against what runs: `plait plan --search` for a model and global batch
on this machine, then the top layouts (and any named with --also) each trained for a few steps by
plait's own trainer (`plait plan --validate`), every prediction beside its measurement.

    python bench/layouts.py --model 8b --seq 2048 --global-batch 32 --top 4 \
        --hardware bench/results/hardware-h200.json --also "tp2 dp2 zero1 mb4"

Layouts are written as the planner prints them: "tp1 pp1 dp4 zero3 mb8 rc:none" (dp RxS for
replicate x shard, "cpN/ulysses" for the all-to-all variant). Pipeline layouts are left out: --validate
reports one rank, and a pipeline's ranks differ (bench/pipeline.py measures those).

Writes bench/results/layouts-<card>-<G>gpu-<model>-s<seq>.json (`plait plan --check` prices its rows
too) and prints the ranking with the measured step times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.planner.hardware import card_key  # noqa: E402


def parse_layout(name: str) -> dict:
    """"tp2+sp pp1 dp2x2 zero3 cp2/ulysses mb4 rc:selective" -> make_layout arguments."""
    lay: dict = {}
    for word in name.split():
        if word.startswith("rc:"):
            lay["recompute"] = word[3:]
        elif word.startswith("zero"):
            lay["zero"] = int(word[4:])
        elif word.startswith("mb"):
            lay["micro_batch"] = int(word[2:])
        elif word.startswith("cp"):
            deg, _, impl = word[2:].partition("/")
            lay["cp"] = int(deg)
            if impl:
                lay["cp_impl"] = impl
        elif word.startswith("dp"):
            rep, _, shard = word[2:].partition("x")
            lay["dp"] = int(rep) * int(shard) if shard else int(rep)
            if shard:
                lay["dp_replicate"] = int(rep)
        elif word[:2] in ("tp", "pp") and word[2:].removesuffix("+sp").isdigit():
            lay[word[:2]] = int(word[2:].removesuffix("+sp"))  # sequence parallelism is on wherever tp > 1
        else:
            raise SystemExit(f"layout {name!r}: cannot read {word!r} (write it as plait plan prints layouts)")
    return lay


def _flags(lay: dict) -> list[str]:
    names = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "dp_replicate": "--dp-replicate",
             "zero": "--zero", "micro_batch": "--micro-batch", "recompute": "--recompute", "cp_impl": "--cp-impl"}
    return [x for k, flag in names.items() if k in lay for x in (flag, str(lay[k]))]


def _plan(a, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "plait.cli", "plan", "--model", a.model, "--seq", str(a.seq), "--global-batch",
           str(a.global_batch), "--gpu", a.gpu, "--gpus-per-node", str(a.gpus), "--json"]
    cmd += ["--hardware", a.hardware] if a.hardware else []
    cmd += ["--layers", str(a.layers)] if a.layers else []
    out = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if out.returncode:
        raise RuntimeError((out.stderr.strip().splitlines() or ["failed"])[-1][:300])
    return json.loads(out.stdout[out.stdout.index("{"):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b")
    ap.add_argument("--layers", type=int, default=0, help="the preset with this many layers (default: its own)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs of this machine to plan for (default: all)")
    ap.add_argument("--hardware", default="", help="the card's profile (plait bench calibrate)")
    ap.add_argument("--top", type=int, default=3, help="how many of the search's best layouts to run")
    ap.add_argument("--also", action="append", default=[], help="another layout to run, as the planner names it")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=300, help="seconds each layout's run may take")
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        ap.error("needs GPUs: the measured step times are what the ranking is checked against")
    a.gpus = a.gpus or torch.cuda.device_count()
    card = torch.cuda.get_device_name(0)
    a.gpu = card_key(card)
    slug = a.gpu
    model = a.model + (f"-{a.layers}L" if a.layers else "")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"layouts-{slug}-{a.gpus}gpu-{model}-s{a.seq}.json"
    search = _plan(a, ["--search", "--top", str(max(a.top * 4, 20))], 120)
    ranked = search["ranked"]
    names = [r["layout_name"] for r in ranked if r["layout"]["pp"] == 1][:a.top] + a.also
    from plait.planner.recorded import RUNTIME_MARKS

    result = {"benchmark": "layouts", **RUNTIME_MARKS, "card": card, "gpus": a.gpus, "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", "bench/layouts.py"] + (argv or sys.argv[1:])),
              "config": {"preset": a.model, "model": [f"n_layers={a.layers}"] if a.layers else [], "seq": a.seq, "global_batch": a.global_batch, "hardware": a.hardware,
                         "embedding_rows": "auto"},
              "search": [{"rank": i + 1, "layout": r["layout_name"], "step_s": r["step_time_s"]}
                         for i, r in enumerate(ranked)],
              "rows": []}
    t0 = time.perf_counter()
    for name in dict.fromkeys(names):
        lay = parse_layout(name)
        rank = next((i + 1 for i, r in enumerate(ranked) if r["layout_name"] == name), None)
        row = {"variant": name, "layout": lay, "search_rank": rank}
        try:
            got = _plan(a, _flags(lay) + ["--validate", "--validate-steps", str(a.steps)], a.timeout)
            m, p = got["measured"], got["prediction"]
            row.update(step_s_median=m["step_time_s"], peak_mem_gb=m["peak_mem_bytes"] / 1e9,
                       tokens_per_s_per_gpu=a.global_batch * a.seq / m["step_time_s"] / a.gpus,
                       predicted_step_s=p["step_time_s"], predicted_peak_gb=p["memory_total_bytes"] / 1e9)
        except Exception as e:  # noqa: BLE001 (out of memory, a time limit: the row says which)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "wall_s": time.perf_counter() - t0}, indent=1))
    done = [r for r in result["rows"] if "error" not in r]
    if done:
        best = min(done, key=lambda r: r["step_s_median"])
        for r in result["rows"]:
            got = (f"measured {r['step_s_median']:.3f} s ({r['step_s_median'] / best['step_s_median'] - 1:+.1%} "
                   f"vs the fastest tried), predicted {r['predicted_step_s']:.3f} s") if "error" not in r else r["error"]
            print(f"#{r['search_rank'] or '-':<3} {r['variant']:40} {got}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
