"""Training curves of one or more runs from their metrics.jsonl, drawn with matplotlib.

Six panels: loss, val loss, learning rate, tokens/s, MFU and peak memory, against the optimizer
step or the tokens trained; each run is one colour in every panel.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from plait.errors import UserError, bad_value

# (metrics.jsonl key, panel title, factor applied to the value)
PANELS = [("loss", "loss", 1.0), ("val_loss", "val loss", 1.0), ("lr", "learning rate", 1.0),
          ("tokens_per_s", "tokens/s", 1.0), ("mfu", "MFU", 1.0), ("peak_mem_bytes", "peak memory (GiB)", 2.0**-30)]


def metrics_file(run: str) -> Path:
    """A run folder's metrics.jsonl, or the file itself."""
    p = Path(run).expanduser()
    if not p.exists():
        raise bad_value("RUN", run, "does not exist; give a run folder (the --out of `plait train`) or its metrics.jsonl")
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise bad_value("RUN", run, "has no metrics.jsonl; give a run folder (the --out of `plait train`) or the file")
    return f


def read_metrics(path: Path) -> list[dict]:
    """The entries of one run in step order, one per step, as the run finally went.

    A resumed run logs again the steps after its checkpoint. An entry whose step is at or below
    the last one kept starts a new segment: it replaces every kept entry from that step on (the
    latest entry of a step wins, and steps the old segment logged past the resume point go too),
    so the file reads as one curve. A line that is not JSON (a run killed mid-write) is skipped.
    """
    rows: list[dict] = []
    foreign = False  # a line no metrics.jsonl holds: not a run's file still waiting for its first step
    lines = path.read_text(errors="replace").splitlines()
    unread = 0
    for i, line in enumerate(lines):
        try:
            r = json.loads(line)
        except ValueError:
            # a run killed mid-write leaves the start of an entry, "{..."; a TOML or text file holds other lines
            foreign = foreign or (bool(line.strip()) and not line.lstrip().startswith("{"))
            unread += bool(line.strip()) and i < len(lines) - 1  # the last: a write cut short, expected
            continue
        if not isinstance(r, dict) or not isinstance(r.get("step"), int):
            foreign = True
            continue
        while rows and rows[-1]["step"] >= r["step"]:
            rows.pop()
        rows.append(r)
    if not rows and foreign:
        raise bad_value("RUN", str(path), "is not a metrics file; plait plot takes run folders (the --out of "
                        "`plait train`) or their metrics.jsonl files")
    if not rows:
        raise bad_value("RUN", str(path), "holds no metrics entries yet; plot it once the run has logged a step")
    if unread:  # a damaged file plots what it can, and says what it left out
        print(f"plait plot: {path}: skipped {unread} line(s) that are not JSON", file=sys.stderr)
    return rows


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def tokens_axis(rows: list[dict], where: str) -> list[float]:
    """Tokens trained at each entry: its `tokens` field if logged, else the running sum of
    tokens_per_s * step_time_s (= tokens per step), a skipped step counting as its neighbour."""
    if all(_number(r.get("tokens")) for r in rows):
        return [float(r["tokens"]) for r in rows]
    out, total, last_step = [], 0.0, 0
    for r in rows:
        if not (_number(r.get("tokens_per_s")) and _number(r.get("step_time_s"))):
            raise bad_value("--x", "tokens", f"{where} step {r['step']} lacks tokens_per_s or step_time_s; use --x step")
        total += (r["step"] - last_step) * r["tokens_per_s"] * r["step_time_s"]
        last_step = r["step"]
        out.append(total)
    return out


def render(runs: list[tuple[str, list[dict]]], out: str | Path, x: str = "step") -> Path:
    """Draw the panels for runs [(label, entries)] into `out` (format from its suffix: png, pdf, svg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plait plot needs matplotlib: pip install 'plait[plot]' (or pip install matplotlib)") from None
    out = Path(out).expanduser()
    if out.is_dir():
        raise bad_value("--out", str(out), "is a folder; give an image file, e.g. curves.png")
    if not out.suffix:  # matplotlib would write out.png: say the name it gets
        out = out.with_name(out.name + ".png")
    if not out.parent.exists():  # a typo in it must not leave a tree of new folders (a file there: savefig says)
        raise bad_value("--out", str(out), f"its folder {out.parent} does not exist; create it first")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, factor) in zip(axes.flat, PANELS):
        drawn = False
        for i, (label, rows) in enumerate(runs):
            xs = [r["step"] for r in rows] if x == "step" else tokens_axis(rows, label)
            pts = [(xv, r[key] * factor) for xv, r in zip(xs, rows) if _number(r.get(key))]
            if pts:
                # val loss is logged every eval_every steps: markers show where the points are; a
                # series of one point (a run that logged one step) is a line of no length, drawn as nothing
                ax.plot(*zip(*pts), color=f"C{i}", label=label,
                        marker="o" if key == "val_loss" or len(pts) == 1 else None, markersize=3)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not logged" + (" (n/a on CPU)" if key == "mfu" else ""), ha="center",
                    va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    if axes.flat[0].get_legend_handles_labels()[0]:  # no loss drawn: matplotlib warns of an empty legend
        axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except (ValueError, OSError) as e:  # unknown suffix, unwritable folder
        raise bad_value("--out", str(out), f"cannot be written ({e}); use a .png, .pdf or .svg path") from None
    finally:
        plt.close(fig)
    return out
