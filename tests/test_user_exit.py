"""User-found defects at the edges of a command: argparse's usage block before a mistake in plan,
schedule, plot and generate (train gave one line), and a Ctrl-C just after a run had finished
printing the tracebacks of the interpreter's exit hooks."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import MICRO_MODEL
from plait.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "8b", "--schedule", "foo"], "argument --schedule: invalid choice: 'foo'"),
    (["plan", "--model", "8b", "--zero", "5"], "argument --zero: invalid choice: 5"),
    (["schedule", "--pp", "x"], "argument --pp: invalid int value: 'x'"),
    (["generate"], "the following arguments are required: --checkpoint"),
    (["nonsense"], "argument COMMAND: invalid choice: 'nonsense'"),
])
def test_a_mistake_in_the_arguments_is_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].endswith("--help)"), err


def test_ctrl_c_after_a_run_finished_is_quiet(corpus, tmp_path):
    """SIGINT to the command's whole group right after its last line, while it joins its fork
    server and runs torch's exit hooks: the run's exit code, and no traceback."""
    args = [sys.executable, "-m", "plait.cli", "train", "--nproc", "2", "--dp", "2", "--out", str(tmp_path / "r"),
            "--data.path", str(corpus), "--train.steps", "2", "--train.micro_batch", "2", "--train.seq_len", "32",
            "--train.eval_every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0",
            "--train.progress", "false", "--train.tensorboard", "false", "--train.compile", "off",
            "--train.device", "cpu"]
    for k, v in MICRO_MODEL.items():
        args += [f"--model.{k}", str(v)]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # a group of its own, as a terminal gives it
    lines = []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("final val loss"):
                time.sleep(0.2)
                os.killpg(proc.pid, signal.SIGINT)
                break
            assert time.monotonic() < deadline, "".join(lines)
        lines += proc.stderr.readlines()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = "".join(lines)
    assert any(ln.startswith("final val loss") for ln in lines), err
    assert rc == 0 and "Traceback" not in err and "Exception ignored" not in err, err
