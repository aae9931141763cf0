"""`plait plot`: metrics.jsonl read as one curve per run (resumes replace what they re-log),
several runs overlaid into an image, one-line errors."""

import json
import math

import pytest

from plait.cli import main
from plait.errors import UserError
from plait.plot import read_metrics, tokens_axis

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(folder, steps, loss0=5.5, resumed_at=None, resumed_to=None, val_every=10, tokens_per_step=2048):
    """A synthetic metrics.jsonl; with `resumed_at`, the run went on to `steps`, then resumed from
    `resumed_at` and logged again up to `resumed_to` with a loss 1.0 lower (to tell them apart)."""
    folder.mkdir(parents=True)

    def entry(step, shift):
        e = {"step": step, "loss": loss0 * math.exp(-step / 40) - shift, "lr": 1e-3 * min(1, step / 10),
             "grad_norm": 1.0, "tokens_per_s": 1e4, "step_time_s": tokens_per_step / 1e4, "mfu": "n/a",
             "peak_mem_bytes": 2**30 + step * 2**20}
        if step % val_every == 0:
            e["val_loss"] = e["loss"] + 0.1
        return json.dumps(e)

    lines = [entry(s, 0.0) for s in range(1, steps + 1)]
    if resumed_at is not None:
        lines += [entry(s, 1.0) for s in range(resumed_at + 1, resumed_to + 1)]
    lines.append('{"step": 99, "loss": 1.')  # a run killed mid-write
    (folder / "metrics.jsonl").write_text("\n".join(lines))
    return folder


def test_a_resume_replaces_the_steps_it_logs_again(tmp_path):
    run = _run(tmp_path / "r", 30, resumed_at=20, resumed_to=25)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 26))  # 26-30 belonged to the abandoned segment
    first = 5.5 * math.exp(-1 / 40)
    assert rows[0]["loss"] == pytest.approx(first)
    assert all(r["loss"] == pytest.approx(5.5 * math.exp(-r["step"] / 40) - 1.0) for r in rows[20:])


def test_tokens_axis_sums_tokens_per_step(tmp_path):
    rows = read_metrics(_run(tmp_path / "r", 12, tokens_per_step=4096) / "metrics.jsonl")
    assert tokens_axis(rows, "r") == pytest.approx([4096.0 * s for s in range(1, 13)])
    gap = [rows[0], rows[4]]  # steps 1 and 5: the missing steps count like their neighbour
    assert tokens_axis(gap, "r") == pytest.approx([4096.0, 5 * 4096.0])


def test_plot_overlays_runs_into_a_png(tmp_path, capsys):
    mpl_image = pytest.importorskip("matplotlib.image")
    a = _run(tmp_path / "a", 60)
    b = _run(tmp_path / "b", 40, loss0=4.0, resumed_at=30, resumed_to=45)
    out = tmp_path / "curves.png"
    assert main(["plot", str(a), str(b / "metrics.jsonl"), "--out", str(out), "--x", "tokens"]) == 0
    assert "a to step 60" in capsys.readouterr().err
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    img = mpl_image.imread(str(out))[..., :3]
    assert _has_colour(img, BLUE) and _has_colour(img, ORANGE)  # a line of each run was drawn
    one = tmp_path / "one.png"
    assert main(["plot", str(a), "--out", str(one)]) == 0
    assert not _has_colour(mpl_image.imread(str(one))[..., :3], ORANGE)


BLUE, ORANGE = (0x1F / 255, 0x77 / 255, 0xB4 / 255), (1.0, 0x7F / 255, 0x0E / 255)  # matplotlib's C0, C1


def _has_colour(img, rgb) -> bool:
    return (abs(img - rgb).sum(-1) < 0.05).sum() > 200


@pytest.mark.parametrize("case, needle", [
    ("missing", "RUN = '{p}/nope': does not exist"),  # it said "has no metrics.jsonl"
    ("bare", "RUN = '{p}/bare': has no metrics.jsonl"),
    ("empty", "holds no metrics entries yet"),
    ("killed", "RUN = '{p}/killed/metrics.jsonl': holds no metrics entries yet"),  # its first entry cut short
    # once "holds no metrics entries yet", as if a run would log into it
    ("toml", "RUN = '{p}/some.toml': is not a metrics file; plait plot takes run folders (the --out of `plait train`) "
             "or their metrics.jsonl files"),
    ("json", "RUN = '{p}/some.json': is not a metrics file"),
    ("suffix", "--out = '{p}/x.nope': cannot be written"),
    ("tokens", "--x = 'tokens': {p}/old step 1 lacks tokens_per_s or step_time_s"),
])
def test_plot_errors_are_one_line(tmp_path, capsys, case, needle):
    pytest.importorskip("matplotlib")
    args = {"missing": [str(tmp_path / "nope")], "empty": [str(tmp_path / "empty")], "bare": [str(tmp_path / "bare")],
            "suffix": [str(_run(tmp_path / "r", 5)), "--out", str(tmp_path / "x.nope")],
            "tokens": [str(tmp_path / "old"), "--x", "tokens"], "killed": [str(tmp_path / "killed")],
            "toml": [str(tmp_path / "some.toml")], "json": [str(tmp_path / "some.json")]}[case]
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "metrics.jsonl").write_text('{"step": 1, "lo')
    (tmp_path / "some.toml").write_text('[train]\nsteps = 3\n')
    (tmp_path / "some.json").write_text('{\n  "step": 1\n}\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "bare").mkdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert main(["plot", *args, *([] if "--out" in args else ["--out", str(tmp_path / "c.png")])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle.format(p=tmp_path) in err


def test_plot_says_the_file_it_wrote(tmp_path, capsys):
    """--out without a suffix made matplotlib write curves.png while plot said `wrote curves`; a
    folder given as --out became folder.png beside it."""
    pytest.importorskip("matplotlib")
    run = str(_run(tmp_path / "r", 5))
    assert main(["plot", run, "--out", str(tmp_path / "curves")]) == 0
    assert f"wrote {tmp_path / 'curves.png'}:" in capsys.readouterr().err
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_MAGIC and not (tmp_path / "curves").exists()
    (tmp_path / "pics").mkdir()
    assert main(["plot", run, "--out", str(tmp_path / "pics")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out = '{tmp_path / 'pics'}': is a folder" in err, err
    assert not (tmp_path / "pics.png").exists()


def test_plot_out_in_a_missing_folder_is_refused_and_not_created(tmp_path, capsys):
    """As `plait schedule --png`: a mistyped folder is named, never created; a file where the folder
    should be is not called missing."""
    pytest.importorskip("matplotlib")
    run = str(_run(tmp_path / "r", 5))
    out = tmp_path / "nope" / "deeper" / "c.png"
    assert main(["plot", run, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"plait plot: error: --out = '{out}': its folder {out.parent} does not exist; create it first\n"
    assert not (tmp_path / "nope").exists()
    (tmp_path / "file").write_text("a file, not a folder")
    assert main(["plot", run, "--out", str(tmp_path / "file" / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be written (" in err and "does not exist" not in err, err


def test_without_matplotlib_plot_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    from plait.plot import render

    with pytest.raises(UserError, match=r"plait plot needs matplotlib: pip install 'plait\[plot\]'"):
        render([("a", read_metrics(_run(tmp_path / "a", 3) / "metrics.jsonl"))], tmp_path / "c.png")


def test_a_damaged_metrics_file_plots_what_it_can_and_says_what_it_skipped(tmp_path, capsys):
    """Lines that are not JSON in the middle of a file were skipped without a word, and a run with no
    loss drawn printed matplotlib's warning about an empty legend."""
    import warnings

    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "loss": "nan"}\ngarbage\n{"step": 2, "loss": 3.0}\n{"step": 3, "lo')
    assert main(["plot", str(bad), "--out", str(tmp_path / "a.png")]) == 0
    err = capsys.readouterr().err
    assert f"plait plot: {bad}: skipped 1 line(s) that are not JSON" in err  # not the last, cut-short one
    bad.write_text('{"step": 1, "loss": "nan"}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["plot", str(bad), "--out", str(tmp_path / "b.png")]) == 0
    assert "skipped" not in capsys.readouterr().err


def test_a_run_of_one_logged_step_is_drawn_with_markers(tmp_path, monkeypatch):
    """One point drawn as a line without a marker is invisible: only val loss had markers."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    run = _run(tmp_path / "r", 1, val_every=1)
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    assert main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 0
    drawn = {ax.get_title(): ax.get_lines() for ax in figures[0].axes if ax.get_lines()}
    assert set(drawn) == {"loss", "val loss", "learning rate", "tokens/s", "peak memory (GiB)"}
    for title, lines in drawn.items():
        assert len(lines[0].get_xdata()) == 1 and lines[0].get_marker() not in (None, "None", ""), title
