"""`plait train --pp` end to end: a 2-stage x 2-replica run saves, resumes as a 4-stage pipeline and
on one process with the losses of an uninterrupted run; profiled steps leave a measured timeline;
`plait generate` reads the checkpoint; `plait schedule --png` draws; bad pipeline input is one line."""

from __future__ import annotations

import json
import shutil

import pytest

from dp_runs import cli_train, metrics_rows
from plait.cli import main
from plait.parallel.sharded_state import full_weights

PPM = {"preset": "custom", "vocab_size": 259, "dim": 32, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2,
       "ffn_dim": 64, "max_seq_len": 64}


def _args(corpus, out, steps=6, extra=()):
    return cli_train(corpus, out, PPM, steps, ["--train.lr", "1e-3", "--train.micro_batch", "2", *extra])


def _rows(run):
    return metrics_rows(run)


def test_resume_across_pipeline_layouts(corpus, tmp_path, capfd):
    one = tmp_path / "one"
    assert main(_args(corpus, one, extra=["--train.grad_accum", "4"])) == 0
    run = tmp_path / "run"
    # steps 1-3: 2 stages (1F1B, 2 micro-batches of 2 sequences per replica) x 2 replicas, ZeRO-1
    assert main(_args(corpus, run, extra=["--nproc", "4", "--pp", "2", "--dp", "2", "--zero", "1",
                                          "--microbatches", "2", "--train.max_steps_this_run", "3",
                                          "--train.profile_steps", "2:3"])) == 0
    report = json.loads((run / "profile" / "pipeline.json").read_text())
    assert (run / "profile" / "pipeline.png").stat().st_size > 10_000
    assert 0 < report["measured_bubble"] < 1 and len(report["spans"]) == 2 * 2 * 2  # 2 ranks x 2 micro x F, B
    # the action times replayed through the schedule (ranks' clocks are aligned only by a barrier, so
    # on shared CPU cores the replay is not bounded by the measurement), and each stage's time
    assert 0 < report["replayed_bubble"] < 1
    # host seconds issuing each rank's actions over their device seconds: one clock on a CPU
    assert report["host_share"] == [pytest.approx(1.0, abs=0.02)] * 2
    # each pipeline index written once, by the main rank's pipeline (ranks 0 and 2 of pp 2 x dp 2):
    # the other replica's ranks wrote the same files while rank 0 read them
    written = {p.name: json.loads(p.read_text())["global_rank"] for p in (run / "profile").glob("pipeline-rank*")}
    assert written == {"pipeline-rank0.json": 0, "pipeline-rank1.json": 2}
    split = report["split"]
    assert len(split["stage_ms"]) == 2 and min(split["stage_ms"]) > 0 and split["stage_layers"].count(",") == 1
    solo = tmp_path / "solo"
    shutil.copytree(run, solo)
    # steps 4-6: 4 ranks x 2 chunks = 8 stages (interleaved 1F1B, 4 micro-batches), and one process
    capfd.readouterr()
    assert main(_args(corpus, run, extra=["--nproc", "4", "--pp", "4", "--dp", "1", "--parallel.v", "2",
                                          "--schedule", "interleaved", "--microbatches", "4", "--zero", "0",
                                          "--train.sample_tokens", "8", "--resume"])) == 0
    # the end-of-run sample, decoded through the 8 stages (tests/test_pipeline_generate.py: the tokens
    # one process samples)
    assert "--- sample ---\ndef " in capfd.readouterr().err
    assert main(_args(corpus, solo, extra=["--nproc", "1", "--dp", "1", "--pp", "1", "--zero", "0",
                                           "--train.grad_accum", "4", "--resume"])) == 0
    ref = _rows(one)
    for folder in (run, solo):
        rows = _rows(folder)
        assert [r["step"] for r in rows] == list(range(1, 7))
        for a, b in zip(rows, ref):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (folder.name, a["step"])
        w, wref = full_weights(folder / "checkpoints" / "step_00000006"), full_weights(one / "checkpoints" / "step_00000006")
        assert w.keys() == wref.keys() and max((w[k] - wref[k]).abs().max().item() for k in w) <= 1e-5
    capfd.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capfd.readouterr().out.startswith("def ")


def test_schedule_png(tmp_path, capsys):
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--png",
                 str(tmp_path / "t.png")]) == 0
    data = (tmp_path / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "bubble 27.27%" in capsys.readouterr().out  # (p-1)/(m+p-1) = 3/11 with equal costs


@pytest.mark.parametrize("extra, needle", [
    (["--nproc", "2", "--pp", "2", "--model.n_layers", "1"],  # the fix too, not only what is wrong
     "parallel.pp = 2: pp x v = 2 stages exceed the model's 1 layer(s) (more stages than layers leave whole ranks "
     "without a layer): use pp x v <= 1, or a model"),
    (["--nproc", "2", "--pp", "2", "--schedule", "fifo"], "parallel.schedule = 'fifo': choose one of gpipe, 1f1b"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--parallel.v", "2", "--microbatches", "3"],
     "parallel.microbatches = 3: the interleaved schedule runs micro-batches in groups of pp = 2"),
    # the count came from the batch: the line named --microbatches, whose fix then contradicted it
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--parallel.v", "2", "--train.global_batch", "6"],
     "train.global_batch = 6: makes 3 micro-batches a step (global_batch / (micro_batch x dp = 2)); the "
     "interleaved schedule runs micro-batches in groups of pp = 2: use a global batch of 8 (4 micro-batches)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--parallel.v", "2", "--train.grad_accum", "3"],
     "train.grad_accum = 3: is the pipeline's micro-batches a step; the interleaved schedule runs micro-batches "
     "in groups of pp = 2: use 4 (or --microbatches 4)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--parallel.v", "2", "--microbatches", "2",
      "--model.n_layers", "6"], "parallel.v = 2: pp x v = 4 stages do not divide the 6 layers"),
    (["--nproc", "2", "--pp", "2", "--parallel.stage_layers", "3,4"], "parallel.stage_layers = '3,4': must be counts"),
    (["--nproc", "4", "--pp", "2", "--dp", "2", "--train.global_batch", "6"], "train.global_batch = 6: is not a multiple"),
    (["--parallel.v", "2"], "parallel.v = 2: virtual stages are chunks of a pipeline's stages: v > 1 needs parallel.pp > 1"),
    (["--schedule", "zb"], "parallel.schedule = 'zb': orders a pipeline's stages: it needs parallel.pp > 1"),
    (["--schedule", "interleaved"], "parallel.schedule = 'interleaved': orders a pipeline's stages"),
    (["--microbatches", "4"], "parallel.microbatches = 4: counts a pipeline's micro-batches: it needs --pp > 1"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "4", "--train.grad_accum", "2"],  # ran 4, ignoring the 2
     "parallel.microbatches = 4: sets train.grad_accum, given as 2 too: give one of them"),
    # ZB-V's own rule before the stage count its v makes ("pp x v = 6 stages exceed the model's 2 layers")
    (["--nproc", "2", "--pp", "2", "--schedule", "zbv", "--parallel.v", "3"],
     "parallel.v = 3: ZB-V runs two model chunks per rank, placed in a V: give --parallel.v 2"),
    (["--schedule", "1f1b"], "parallel.schedule = '1f1b': orders a pipeline's stages: it needs parallel.pp > 1"),
    # a rank of empty middle stages held no parameters and failed after launch (IndexError per rank)
    (["--nproc", "3", "--pp", "3", "--parallel.stage_layers", "4,0,4", "--microbatches", "3"],
     "parallel.stage_layers = '4,0,4': leaves pipeline rank 1 no layer (nor the embedding or the output head)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "zbv", "--parallel.v", "2", "--parallel.stage_layers", "8,0,0,0"],
     "parallel.stage_layers = '8,0,0,0': leaves pipeline rank 1 no layer"),
])
def test_bad_pipeline_input_is_one_line(corpus, tmp_path, capfd, extra, needle):
    assert main(_args(corpus, tmp_path / "r", extra=extra)) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_compiled_zero_bubble_trains_as_one_process(corpus, tmp_path):
    """What a GPU user runs: ZB-H1 with compiled blocks (the linears inside them defer their weight
    gradients) against one eager process."""
    from dp_runs import assert_same_cli_run

    one, zb = tmp_path / "one", tmp_path / "zb"
    assert main(_args(corpus, one, steps=2, extra=["--train.grad_accum", "4"])) == 0
    assert main(_args(corpus, zb, steps=2, extra=["--nproc", "2", "--pp", "2", "--dp", "1", "--schedule", "zb",
                                                  "--microbatches", "4", "--train.compile", "on"])) == 0
    assert_same_cli_run(zb, one, 2, loss_tol=1e-4, weights=False)  # compiled kernels round differently


@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_gradients_under_zero_bubble_train_and_evaluate_as_one_process(corpus, tmp_path, zero):
    """ZB-H1 on 2 stages x 2 replicas with ZeRO-2 (W adds each weight gradient as .grad, which ZeRO-2's
    hook takes, reduces and drops: it must not carry autograd history) and with ZeRO-3 (its stage,
    gathered for a step, is gathered for evaluation too), with tied embeddings: the first stage's
    embedding and the last stage's output matrix are sharded alike and their reduced chunks added,
    so both copies take the one matrix's update. Losses, the validation loss and the final weights
    (the tied matrix as the first stage saved it) match one process."""
    from dp_runs import assert_same_cli_run

    model = PPM
    common = ["--train.lr", "1e-3", "--train.micro_batch", "2"]
    one, run = tmp_path / "one", tmp_path / "run"
    assert main(cli_train(corpus, one, model, 3, [*common, "--train.grad_accum", "4"])) == 0
    assert main(cli_train(corpus, run, model, 3, [*common, "--nproc", "4", "--pp", "2", "--dp", "2", "--zero",
                                                  str(zero), "--schedule", "zb", "--microbatches", "2"])) == 0
    assert_same_cli_run(run, one, 3)
    val = [[r["val_loss"] for r in metrics_rows(f) if "val_loss" in r] for f in (run, one)]
    assert len(val[0]) == 1 and abs(val[0][0] - val[1][0]) <= 1e-5 * val[1][0], val


def test_zb_v_with_tied_embeddings_under_zero_3_resumes_as_1f1b(corpus, tmp_path):
    """ZB-V holds both ends of the model on rank 0, so a tied embedding is one matrix there and
    ZeRO-3 shards it as one device's would: 2 V-placed stages x 2 replicas with
    ZeRO-3 train 2 steps and evaluate, the checkpoint resumes as 1F1B with ZeRO-1 for 2 more, and
    losses, the validation loss and the final weights match one process."""
    from dp_runs import assert_same_cli_run

    one, run = tmp_path / "one", tmp_path / "run"
    assert main(_args(corpus, one, steps=4, extra=["--train.grad_accum", "4", "--train.eval_every", "2"])) == 0
    zbv = ["--nproc", "4", "--pp", "2", "--dp", "2", "--microbatches", "2", "--train.eval_every", "2"]
    assert main(_args(corpus, run, steps=4, extra=[*zbv, "--zero", "3", "--schedule", "zbv", "--parallel.v", "2",
                                                   "--train.max_steps_this_run", "2"])) == 0
    assert main(_args(corpus, run, steps=4, extra=[*zbv, "--zero", "1", "--schedule", "1f1b", "--resume"])) == 0
    assert_same_cli_run(run, one, 4)
    val = [[r["val_loss"] for r in metrics_rows(f) if "val_loss" in r] for f in (run, one)]
    assert len(val[0]) == 2 and all(abs(a - b) <= 1e-5 * b for a, b in zip(*val)), val


def test_one_micro_batch_through_a_pipeline_is_named(corpus, tmp_path, capsys):
    """pp 2 without --microbatches ran one micro-batch a step, half of it idle, without a word."""
    from conftest import micro_config
    from plait.preflight import preflight

    cfg = micro_config(corpus, tmp_path / "r", parallel={"nproc": 2, "pp": 2})
    preflight(cfg)
    err = capsys.readouterr().err
    assert "a pipeline of 2 stages runs 1 micro-batch a step: each rank idles while the others run it (50% of " \
           "the step); --microbatches M (M >= 2)" in err, err
    preflight(micro_config(corpus, tmp_path / "s", parallel={"nproc": 2, "pp": 2, "microbatches": 2}))
    assert "micro-batch a step" not in capsys.readouterr().err


def test_the_timeline_is_written_as_its_window_closes(corpus, tmp_path, monkeypatch, capfd):
    """The measured timeline was written when the run ended: a run that died (or was stopped) after
    its profile window closed lost it."""
    monkeypatch.setenv("PLAIT_FAULTS", "kill@rank=1,step=5")
    run = tmp_path / "r"
    assert main(_args(corpus, run, extra=["--nproc", "2", "--pp", "2", "--microbatches", "2",
                                          "--train.profile_steps", "2:3"])) != 0
    assert "pipeline timeline in" in capfd.readouterr().err
    report = json.loads((run / "profile" / "pipeline.json").read_text())
    assert 0 < report["measured_bubble"] < 1 and (run / "profile" / "pipeline.png").is_file()
