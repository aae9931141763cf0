"""`plait train --nproc N --dp N --zero K` end to end: worker processes, metrics from rank 0 only,
sharded checkpoints, resume at another layout, generate from shards, bad layouts refused up front."""

from __future__ import annotations

import time

import pytest
import torch

from dp_runs import cli_train, metrics_rows, UNEVEN
from plait.cli import main
from plait.parallel.sharded_state import full_weights


UNTIED = dict(UNEVEN, tie_embeddings="false")  # ZeRO-3 then gathers the output matrix as a unit of its own


def _args(corpus, out, steps=6, extra=(), model=UNEVEN):
    return cli_train(corpus, out, model, steps, extra, sample_tokens=8)


def _rows(run):
    return metrics_rows(run)


def test_train_resume_at_another_layout_and_generate(corpus, tmp_path, capfd):
    """Untied: ZeRO-3's head unit resumes, evaluates, samples and is saved like the rest."""
    one = tmp_path / "one"
    assert main(_args(corpus, one, extra=["--train.micro_batch", "4"], model=UNTIED)) == 0
    run = tmp_path / "dp"
    # steps 1-3 as ZeRO-2 on 2 processes, then 4-6 resumed as ZeRO-3 with 2 processes
    assert main(_args(corpus, run, extra=["--nproc", "2", "--dp", "2", "--zero", "2", "--train.micro_batch", "2",
                                          "--train.max_steps_this_run", "3"], model=UNTIED)) == 0
    assert sorted(f.name for f in (run / "checkpoints" / "step_00000003").iterdir()) == [
        "manifest.json", "model.shard000-of-002.pt", "model.shard001-of-002.pt", "optim.shard000-of-002.pt",
        "optim.shard001-of-002.pt", "rng.pt", "train_state.json"]
    assert main(_args(corpus, run, extra=["--nproc", "2", "--dp", "2", "--zero", "3", "--train.micro_batch", "2",
                                          "--resume"], model=UNTIED)) == 0
    # (the workers' stderr goes where the fork server's went when it started: not checked here)
    rows, ref = _rows(run), _rows(one)
    assert [r["step"] for r in rows] == list(range(1, 7))  # one writer, and the second run resumed at step 4
    for a, b in zip(rows, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]
        assert a["comm_sent_bytes"] > 0
        assert a["tokens_per_s_per_gpu"] == pytest.approx(a["tokens_per_s"] / 2)  # two processes
    assert abs(rows[-1]["val_loss"] - ref[-1]["val_loss"]) <= 1e-5 * ref[-1]["val_loss"]
    w, wref = full_weights(run / "checkpoints" / "step_00000006"), full_weights(one / "checkpoints" / "step_00000006")
    assert max((w[k] - wref[k]).abs().max().item() for k in wref) <= 1e-5 and "output.weight" in w  # untied
    capfd.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capfd.readouterr().out.startswith("def ")
    # and a single process continues from the shards too
    assert main(_args(corpus, run, steps=7, extra=["--train.micro_batch", "4", "--resume"], model=UNTIED)) == 0
    assert [r["step"] for r in _rows(run)][-1] == 7
    assert isinstance(torch.load(run / "checkpoints" / "step_00000007" / "model.pt", weights_only=True), dict)


@pytest.mark.parametrize("extra, needle", [
    (["--nproc", "3", "--dp", "2"], "dp_shard=2"),
    # (3 divides the heads but not the 2 processes: not suggested)
    (["--nproc", "2", "--tp", "2"], "parallel.tp = 2: must divide the 3 attention heads; choose one of 1 (dividing"),
    # a knob of context parallelism without it trained silently as before
    (["--parallel.cp_impl", "ulysses"], "parallel.cp_impl = 'ulysses': chooses how context parallelism splits"),
    (["--tp", "3", "--model.ffn_dim", "114", "--train.seq_len", "48"], "parallel.tp = 3: needs 3 processes (one per GPU) but one would run: add --nproc 3"),
    (["--nproc", "2", "--sp"], "parallel.sp = 'on': sequence parallelism shards what tensor parallelism replicates"),
    (["--nproc", "3", "--cp", "3"], "parallel.cp = 3: the causal load balance splits each sequence into 2 x cp chunks"),
    # it failed in the first step's reduce-scatter, and --train.max_restarts restarted into it again
    (["--nproc", "3", "--tp", "3", "--model.ffn_dim", "114", "--train.micro_batch", "1", "--train.seq_len", "32"],
     "parallel.sp = 'auto': sequence parallelism splits a micro-batch's 1 x 32 = 32 tokens over tp = 3 ranks"),
    (["--nproc", "2", "--zero", "1", "--parallel.reduce_dtype", "fp32"], "parallel.reduce_dtype = 'fp32': needs --zero 2 or 3"),
    (["--nproc", "2", "--zero", "4"], "parallel.zero = 4"),
])
def test_bad_layout_is_one_line_before_any_process(corpus, tmp_path, capfd, extra, needle):
    t0 = time.perf_counter()
    assert main(_args(corpus, tmp_path / "r", extra=extra)) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert time.perf_counter() - t0 < 5  # refused in this process: no worker was started
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_torchrun_needs_an_explicit_run_folder(corpus, monkeypatch, capfd):
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
                     TORCHELASTIC_RUN_ID="t").items():
        monkeypatch.setenv(k, v)
    args = [a for a in _args(corpus, "x") if a not in ("--out", "x")]
    assert main(args) == 2
    assert "train.out = '': must be given when torchrun starts the processes" in capfd.readouterr().err
