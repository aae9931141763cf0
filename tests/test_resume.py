"""`plait train --out RUN --resume` as a user runs it: the run's own config, flags that override it
(named in one line), a checkpoint of another shape or no checkpoint at all refused in one line,
`--resume auto`, one curve in metrics.jsonl, and a global batch that survives a change of layout."""

from __future__ import annotations

import json
import re
import time

from conftest import MICRO_MODEL
from plait.cli import main
from plait.parallel.sharded_state import full_weights


def _first_run(corpus, out, steps=4, extra=()):
    """Every option a first run needs; a resume passes only --out and --resume (and what it changes)."""
    args = ["train", "--out", str(out), "--steps", str(steps), "--data.path", str(corpus), "--train.micro_batch", "4",
            "--train.seq_len", "32", "--train.eval_batches", "1", "--train.eval_every", "0", "--train.progress",
            "false", "--train.sample_tokens", "0", "--train.compile", "off", "--train.tensorboard", "false",
            "--train.device", "cpu", "--checkpoint.every", "2", "--checkpoint.keep_last", "5", *extra]
    for k, v in MICRO_MODEL.items():
        args += [f"--model.{k}", str(v)]
    return args


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _error_line(capfd):
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_resume_continues_with_the_runs_config_and_names_what_the_flags_change(corpus, tmp_path, capfd):
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, extra=["--train.max_steps_this_run", "2"])) == 0
    capfd.readouterr()
    # nothing but --out and --resume: the micro model, the data and the schedule come from the run
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps_this_run", "1"]) == 0
    err = capfd.readouterr().err
    # the config its newest checkpoint was trained with; no flag changed anything
    assert f"resuming with the config saved in {run / 'checkpoints' / 'step_00000002' / 'train_state.json'}\n" in err
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]
    assert full_weights(run / "checkpoints" / "step_00000003")["embed.weight"].shape == (256, 64)
    assert "dim = 64" in (run / "config.toml").read_text()
    # flags override the saved config, and the run says which
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--train.lr", "0.001"]) == 0
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if "resuming with the config" in x)
    assert line.endswith("the command line changes train.lr 0.002 -> 0.001, train.steps 4 -> 6")
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4, 5, 6]
    assert _rows(run)[-1]["lr"] <= 0.001


def test_a_checkpoint_of_another_shape_is_refused_before_anything_runs(corpus, tmp_path, capfd):
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=2)) == 0
    capfd.readouterr()
    saved = (run / "config.toml").read_bytes()
    for extra, needle, saved_shape in [(["--model.n_layers", "3"], "model.n_layers = 3: but the checkpoint", "n_layers = 2"),
                                       (["--model.preset", "tiny"], "model.preset = 'tiny': builds a model with dim = 256, but the checkpoint",
                                        "dim = 64")]:
        t0 = time.perf_counter()
        assert main(["train", "--out", str(run), "--resume", "--steps", "4", *extra]) == 2
        line = _error_line(capfd)
        assert needle in line and f"holds a 'custom' model with {saved_shape};" in line, line
        assert time.perf_counter() - t0 < 5
        assert (run / "config.toml").read_bytes() == saved  # the run's config is left as it was
        assert [r["step"] for r in _rows(run)] == [1, 2]


def test_a_start_that_saved_nothing_leaves_its_options_to_no_later_resume(corpus, tmp_path, capfd):
    """A resume that stopped before its next checkpoint (a trial at a 10x learning rate, a test run
    with checkpoint.at_end false) rewrote config.toml, and the next plain --resume took those values
    over in silence: it trained at the trial's rate, or saved no checkpoint at all. The run
    continues with the config its checkpoint was trained with, and names what config.toml holds
    beyond it in one line; an edit of config.toml is named the same way."""
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=4, extra=["--train.max_steps_this_run", "2"])) == 0
    trial = ["--train.lr", "0.02", "--checkpoint.at_end", "false", "--train.max_steps_this_run", "1"]
    assert main(["train", "--out", str(run), "--resume", *trial]) == 0  # step 3, then stops: nothing saved
    assert "lr = 0.02" in (run / "config.toml").read_text()
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_00000002"]
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps_this_run", "1"]) == 0
    err = capfd.readouterr().err
    assert (f"plait: {run / 'config.toml'} holds checkpoint.at_end = False (the checkpoint's: True), train.lr = 0.02 "
            "(the checkpoint's: 0.002): a start that saved no checkpoint after step_00000002 set them; the run "
            "continues with that checkpoint's config (give those options again to keep them)") in err, err
    assert _rows(run)[-1]["step"] == 3 and _rows(run)[-1]["lr"] <= 0.002  # the run's own rate
    assert (run / "checkpoints" / "step_00000003").is_dir()  # and its checkpoint at the end
    assert "lr = 0.002" in (run / "config.toml").read_text()
    # given again, an option is the command line's change, not a leftover
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(re.sub(r"rope_theta = .*", "rope_theta = 50000.0", text))
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps_this_run", "1", "--train.lr", "0.001"]) == 0
    err = capfd.readouterr().err
    assert "holds model.rope_theta = 50000.0 (the checkpoint's: 10000.0): a start" in err and "train.lr" not in err.split(
        "holds")[1].split("\n")[0], err
    assert "the command line changes train.lr 0.002 -> 0.001" in err


def test_a_field_given_on_resume_replaces_the_saved_one_it_excludes(corpus, tmp_path, capfd):
    """--data.mix on a run saved with data.path was refused as "set beside data.path", and
    --train.grad_accum on a run saved with train.global_batch was overridden by it in silence: the
    user typed one field. The one given replaces the saved one, and the line says so."""
    import shutil

    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=5, extra=["--train.global_batch", "8", "--train.max_steps_this_run", "2"])) == 0
    capfd.readouterr()
    # resumed with the saved global batch, nothing is a leftover: config.toml writes the accumulation
    # the batch derives as a comment, the checkpoint as a value
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps_this_run", "1"]) == 0
    assert "holds" not in capfd.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--train.grad_accum", "1", "--train.max_steps_this_run", "1"]) == 0
    line = next(x for x in capfd.readouterr().err.splitlines() if "resuming with the config" in x)
    assert line.endswith("train.global_batch 8 -> 0 (train.grad_accum replaces it), train.grad_accum 2 -> 1"), line
    assert "grad_accum = 1" in (run / "config.toml").read_text()
    other = tmp_path / "copy"
    shutil.copytree(corpus, other)
    mix = f"{corpus}:0.5,{other}:0.5"
    assert main(["train", "--out", str(run), "--resume", "--data.mix", mix, "--train.max_steps_this_run", "1"]) == 0
    line = next(x for x in capfd.readouterr().err.splitlines() if "resuming with the config" in x)
    assert f"data.path {str(corpus)!r} -> '' (data.mix replaces it)" in line and f"data.mix '' -> {mix!r}" in line, line
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4, 5]


def test_resume_without_a_checkpoint_refuses_and_auto_starts_fresh(corpus, tmp_path, capfd):
    empty = tmp_path / "typo"
    assert main(_first_run(corpus, empty, steps=2, extra=["--resume"])) == 2
    line = _error_line(capfd)
    assert line.startswith("plait train: error: checkpoint.resume = True:") and "holds no checkpoint to resume" in line
    assert "--resume auto" in line and not (empty / "metrics.jsonl").exists()
    assert main(_first_run(corpus, empty, steps=2, extra=["--resume", "auto"])) == 0  # starts fresh
    assert [r["step"] for r in _rows(empty)] == [1, 2]
    capfd.readouterr()
    # and auto resumes when there is one (the field spelled out, as in a TOML file)
    assert main(["train", "--out", str(empty), "--checkpoint.resume", "auto", "--steps", "3"]) == 0
    assert "resumed from" in capfd.readouterr().err and [r["step"] for r in _rows(empty)] == [1, 2, 3]
    assert main(["train", "--out", str(empty), "--checkpoint.resume", "maybe"]) == 2
    assert "checkpoint.resume = 'maybe': expected true, false or auto" in _error_line(capfd)
    # a run folder given to --resume (as other tools take it): the line says how plait takes it
    assert main(["train", "--resume", str(empty)]) == 2
    assert f"to continue the run in a folder, give it as --out: --out {empty} --resume" in _error_line(capfd)
    # a run that saved nothing (a requeued job that died before its first checkpoint) starts over, and says so
    never = tmp_path / "never"
    assert main(_first_run(corpus, never, steps=2, extra=["--checkpoint.at_end", "false", "--checkpoint.every", "9"])) == 0
    capfd.readouterr()
    assert main(["train", "--out", str(never), "--resume", "auto", "--checkpoint.at_end", "true"]) == 0
    assert f"plait: {never} holds no checkpoint yet: the run starts again from step 0" in capfd.readouterr().err
    assert [r["step"] for r in _rows(never)] == [1, 2]


def test_a_checkpoint_given_as_the_run_folder_names_the_run_folder(corpus, tmp_path, capfd):
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=2)) == 0
    capfd.readouterr()
    step = run / "checkpoints" / "step_00000002"
    for out, resume, what in [(step, [], "a checkpoint"), (run / "checkpoints", [], "the checkpoints folder"),
                              (run / "checkpoints", ["auto"], "the checkpoints folder")]:
        # not "holds no checkpoint to resume": it holds the very checkpoint the user wants
        assert main(["train", "--out", str(out), "--resume", *resume]) == 2
        flag = " ".join(["--resume", *resume])
        assert _error_line(capfd) == (f"plait train: error: train.out = {str(out)!r}: is {what} of the run in {run}; "
                                      f"pass the run folder: --out {run} {flag}")
    assert sorted(p.name for p in step.iterdir()) == sorted(["manifest.json", "model.pt", "optim.pt", "rng.pt",
                                                             "train_state.json"])  # no run began inside it
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def test_metrics_hold_one_curve_after_resuming_from_an_older_checkpoint(corpus, tmp_path, capfd):
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=4)) == 0
    newest = run / "checkpoints" / "step_00000004" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # steps 3-4 were logged, but only step 2 survives
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 0
    err = capfd.readouterr().err
    assert err.count("step_00000004 skipped") == 1  # said once, not by the launcher and again by the worker
    assert "metrics.jsonl: dropped 2 entries past step 2" in err
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_a_checkpointed_step_the_run_never_logged_comes_back_on_resume(corpus, tmp_path, capfd):
    """A run killed after committing step 4's checkpoint and before logging step 4 (seen with kill -9
    mid-run) resumed at step 5: its curve lacked step 4 for good. The checkpoint carries the entry."""
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=4)) == 0
    rows = _rows(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines[:-1]))  # step 4's entry never written
    assert main(["train", "--out", str(run), "--resume", "--steps", "6"]) == 0
    again = _rows(run)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    assert again[3] == {k: v for k, v in rows[3].items() if not k.startswith("checkpoint")}  # as it was, less the save's timing
    assert main(["train", "--out", str(run), "--resume", "--steps", "7"]) == 0  # present: not added twice
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4, 5, 6, 7]


def test_global_batch_survives_resuming_a_two_rank_run_on_one_process(corpus, tmp_path, capfd):
    ref, run = tmp_path / "ref", tmp_path / "dp"
    assert main(_first_run(corpus, ref, steps=4)) == 0  # one process, 4 sequences a step
    # 2 ranks x 2 sequences = the same 4 sequences a step, for steps 1-2
    assert main(_first_run(corpus, run, steps=4, extra=["--nproc", "2", "--dp", "2", "--train.micro_batch", "2",
                                                        "--train.max_steps_this_run", "2"])) == 0
    capfd.readouterr()
    # the layout is the command line's, not the run's: without --nproc this resume runs in one process,
    # where the saved micro-batch of 2 would halve the batch; the run says so in one line
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps_this_run", "1",
                 "--checkpoint.at_end", "false"]) == 0
    err = capfd.readouterr().err
    assert ("the checkpoint trained 4 sequences per step (micro_batch 2 x grad_accum 1 x dp 2); this run trains 2 "
            "(micro_batch 2 x grad_accum 1 x dp 1)") in err and "--train.global_batch 4" in err
    # --train.global_batch keeps it: grad_accum 2 is derived, and the losses are the reference run's
    assert main(["train", "--out", str(run), "--resume", "--train.global_batch", "4"]) == 0
    err = capfd.readouterr().err
    assert "sequences per step" not in err
    state = json.loads((run / "checkpoints" / "step_00000004" / "train_state.json").read_text())
    assert state["global_batch"] == 4 and state["config"]["train"]["grad_accum"] == 2
    rows, want = _rows(run), _rows(ref)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "comm_sent_bytes" in rows[1] and "comm_sent_bytes" not in rows[2]  # 2 processes, then 1
    for a, b in zip(rows, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (a, b)
    w, wref = full_weights(run / "checkpoints" / "step_00000004"), full_weights(ref / "checkpoints" / "step_00000004")
    # summation order differs (2 micro-batches of 2 vs one of 4): test_train's accumulation tolerance
    assert max((w[k] - wref[k]).abs().max().item() for k in wref) <= 3e-5


def test_a_global_batch_that_does_not_divide_is_one_line(corpus, tmp_path, capfd):
    assert main(_first_run(corpus, tmp_path / "r", extra=["--train.global_batch", "6"])) == 2
    assert ("train.global_batch = 6: is not a multiple of micro_batch x dp = 4 x 1 = 4; use a multiple of 4 (e.g. 8)"
            in _error_line(capfd))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_old_configs_with_a_bool_resume_still_load(tmp_path):
    from plait.config import build_config, config_from_dict
    from plait.resume import resumed_config

    assert config_from_dict({"checkpoint": {"resume": False}}).checkpoint.resume is False
    assert build_config({"checkpoint": {"resume": "auto"}}).checkpoint.resume == "auto"
    assert build_config({"checkpoint": {"resume": "true"}}).checkpoint.resume is True
    cfg, changed = resumed_config({"checkpoint": {"resume": False, "every": 7}, "train": {"gone_field": 1}},
                                  {"checkpoint": {"resume": "auto"}})
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.every == 7 and changed == []


def test_a_finished_run_trains_nothing_and_going_back_is_refused(corpus, tmp_path, capfd):
    """A requeued `--resume` of a run already at train.steps says so and ends (exit 0, config.toml
    as it was); asking for fewer steps than the run has is refused, not recorded."""
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=4)) == 0
    config = (run / "config.toml").read_text()
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert _error_line(capfd) == f"plait: {run} is already at step 4 of 4: nothing to train; raise --steps to train it further"
    assert main(["train", "--out", str(run), "--resume", "--steps", "2"]) == 2
    assert f"train.steps = 2: but the run in {run} is already at step 4" in _error_line(capfd)
    assert (run / "config.toml").read_text() == config


def test_resume_needs_out_and_a_refused_command_leaves_no_folder(corpus, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "--steps", "2"]) == 2
    assert "checkpoint.resume = True: needs the run folder to continue: pass --out RUN" in _error_line(capfd)
    assert not (tmp_path / "runs").exists()
    typo = tmp_path / "typo"
    assert main(_first_run(corpus, typo, steps=2, extra=["--resume"])) == 2
    capfd.readouterr()
    assert not typo.exists()  # the folder the refused command would have made


def test_one_field_given_twice_or_the_batch_twice_is_refused(corpus, tmp_path, capfd):
    """A short flag and the long form of one field must agree (neither silently wins), and
    train.global_batch derives grad_accum, so giving both is refused."""
    run = tmp_path / "r"
    assert main(_first_run(corpus, run, steps=2, extra=["--train.steps", "2000"])) == 2
    assert "--steps = '2': and --train.steps 2000 set one field: give one of them" in _error_line(capfd)
    assert main(_first_run(corpus, run, steps=2, extra=["--train.global_batch", "4", "--train.grad_accum", "3"])) == 2
    assert "train.grad_accum = '3': is derived from train.global_batch = 4" in _error_line(capfd)
    assert not run.exists()


def test_a_runs_config_toml_given_back_as_config_trains_the_same_run(corpus, tmp_path, capfd):
    """A run folder's config.toml records what the run used; given back with --config it starts the
    same run: with train.global_batch 0 ("off") beside grad_accum, and with a global batch, whose
    grad_accum the file notes as derived rather than setting it."""
    for name, extra in (("accum", ["--train.grad_accum", "2"]), ("batch", ["--train.global_batch", "8"])):
        run, again = tmp_path / name, tmp_path / f"{name}-again"
        assert main(_first_run(corpus, run, steps=2, extra=extra)) == 0
        assert main(["train", "--config", str(run / "config.toml"), "--out", str(again)]) == 0, capfd.readouterr().err
        assert [r["loss"] for r in _rows(again)] == [r["loss"] for r in _rows(run)]
        text = (run / "config.toml").read_text()
        assert ("# grad_accum = 2  (derived" in text) == (name == "batch")


def test_the_global_batch_hint_works_at_the_new_layout():
    from plait.resume import global_batch_note

    before = (2, "micro_batch 2 x grad_accum 1 x dp 1")
    note = global_batch_note(before, (4, "micro_batch 2 x grad_accum 1 x dp 2"), micro_batch=2, dp=2)
    assert note.endswith("pass --train.global_batch 2 --train.micro_batch 1 to keep the run's batch at this layout")
    note = global_batch_note(before, (4, "..."), micro_batch=2, dp=2, microbatches=2)
    assert "--train.micro_batch 1 without --microbatches" in note
    assert "cannot split 3 sequences evenly" in global_batch_note((3, "..."), (4, "..."), micro_batch=2, dp=2)
    assert global_batch_note((8, "..."), (4, "..."), micro_batch=2, dp=2).endswith(
        "pass --train.global_batch 8 to keep the run's batch at this layout")


def test_init_from_keeps_the_weights_shape_and_the_fields_given(corpus, tmp_path, capfd):
    """train.init_from decides the model's shape: a --model field that would change a weight is
    refused in one line (it used to be dropped silently); one that does not (max_seq_len) is kept;
    the run says whose weights it starts from."""
    src = tmp_path / "src"
    assert main(_first_run(corpus, src, steps=2)) == 0
    step = src / "checkpoints" / "step_00000002"
    capfd.readouterr()
    new = tmp_path / "new"
    args = _first_run(corpus, new, steps=1, extra=["--train.init_from", str(step)])  # the micro model's fields last
    assert main(args + ["--model.n_layers", "3"]) == 2
    assert (f"model.n_layers = 3: but train.init_from {step} holds a model with n_layers = 2: its weights decide the "
            "shape; drop --model.n_layers") in _error_line(capfd)
    assert not new.exists()
    assert main(args + ["--model.max_seq_len", "48"]) == 0
    assert f"plait: starting from the weights in {step}: 2 layers, dim 64" in capfd.readouterr().err
    assert "max_seq_len = 48" in (new / "config.toml").read_text()


def test_data_of_another_tokenizer_is_refused_on_resume_and_init_from(corpus, tmp_path, capfd):
    """The ids of data prepared with another tokenizer mean other text: continuing weights on it is
    refused in one line, as `plait eval` refuses it."""
    src = tmp_path / "texts"
    src.mkdir()
    for i, f in enumerate(sorted((corpus.parent / "src").iterdir())[:10]):
        (src / f"{i}.py").write_text(f.read_text())
    tok = tmp_path / "tok.json"
    assert main(["data", "tokenizer", "--input", str(src), "--vocab", "300", "--out", str(tok)]) == 0
    bpe = tmp_path / "bpe"
    assert main(["data", "prepare", "--input", str(src), "--out", str(bpe), "--tokenizer", str(tok), "--workers", "1"]) == 0
    run = tmp_path / "r"
    args = [a if a != str(corpus) else str(bpe) for a in _first_run(corpus, run, steps=2)]
    args[args.index("--model.vocab_size") + 1] = "512"
    assert main(args) == 0
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--data.path", str(corpus)]) == 2
    assert f"data.path = '{corpus}': was prepared with another tokenizer than the weights in" in _error_line(capfd)
    fresh = [a if a != str(bpe) else str(corpus) for a in args]
    fresh[fresh.index("--out") + 1] = str(tmp_path / "new")
    assert main(fresh + ["--train.init_from", str(run)]) == 2
    assert "was prepared with another tokenizer than the weights in" in _error_line(capfd)
    # the other way: byte-level weights (256 ids) on the BPE data (300) were told to set
    # --model.vocab_size 300, which their shape then refused
    byte_run = tmp_path / "bytes"
    assert main(_first_run(corpus, byte_run, steps=2)) == 0
    capfd.readouterr()
    onto = [a if a != str(corpus) else str(bpe) for a in _first_run(corpus, tmp_path / "onto", steps=2)]
    assert main(onto + ["--train.init_from", str(byte_run)]) == 2
    assert f"data.path = '{bpe}': was prepared with another tokenizer than the weights in" in _error_line(capfd)


def test_a_torchrun_job_restarted_for_a_peer_nodes_failure_resumes(corpus, tmp_path, capfd, monkeypatch):
    """After one node fails, torch restarts the healthy nodes' workers with TORCHELASTIC_RESTART_COUNT
    still 0: they refused the run's checkpoints ("pass --resume"), each refusal spending one of the
    job's --max-restarts. The run folder knows the job by its rendezvous run id; another job does not
    pass for it."""
    run = tmp_path / "r"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert main(_first_run(corpus, run, steps=2)) == 0
    assert (run / ".torchelastic_run_id").read_text() == "job-7"
    capfd.readouterr()
    assert main(_first_run(corpus, run, steps=4)) == 0  # the same command, started again by torchrun
    assert "plait: torchrun job job-7 started again (after a node's failure torch restarts every node); resumed from " \
           "step 2" in capfd.readouterr().err
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
    # another job, the static rendezvous' id every job has, and plait's own launcher do not pass for it
    for env in ({"TORCHELASTIC_RUN_ID": "another-job"}, {"TORCHELASTIC_RUN_ID": "none"},
                {"TORCHELASTIC_RUN_ID": "job-7", "PLAIT_SPAWNED": "1"}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert main(_first_run(corpus, run, steps=6)) == 2
        assert "already holds" in _error_line(capfd)
    monkeypatch.delenv("PLAIT_SPAWNED")
