"""User-found launch defects: launcher variables that cannot describe a world, a refused --nproc
under torchrun leaving a run folder, and torchrun --max-restarts whose restarts cannot connect."""

import os
import subprocess
import sys

import pytest

from dp_runs import cli_train
from plait import cli
from plait.errors import UserError
from plait.launch import check_launched, detect_launch

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job1", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
SRUN = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "2"}


@pytest.mark.parametrize("env, message", [
    # half of torchrun's pair: was a world of one (WORLD_SIZE=2 trained alone, RANK=1 beside rank 0)
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE = '2' is set but RANK is not"),
    ({"RANK": "1"}, "RANK = '1' is set but WORLD_SIZE is not"),
    # a rank outside the world: was a hang waiting for peers that never come
    (dict(TORCHRUN, RANK="3"), "RANK = 3: must be 0 to 1 (WORLD_SIZE = 2)"),
    (dict(TORCHRUN, RANK="-1"), "RANK = -1: must be 0 to 1"),
    (dict(TORCHRUN, LOCAL_RANK="2"), "LOCAL_RANK = 2: must be 0 to 1 (LOCAL_WORLD_SIZE = 2"),
    (dict(TORCHRUN, LOCAL_WORLD_SIZE="4"), "LOCAL_WORLD_SIZE = 4: more processes on this node than WORLD_SIZE = 2"),
    (dict(TORCHRUN, WORLD_SIZE="0"), "WORLD_SIZE = '0': must be a number of processes"),
    # a word where a number goes: was a ValueError traceback
    (dict(TORCHRUN, RANK="x"), "RANK = 'x': must be a whole number"),
    (dict(TORCHRUN, WORLD_SIZE="two"), "WORLD_SIZE = 'two': must be a whole number"),
    (dict(TORCHRUN, MASTER_PORT="abc"), "MASTER_PORT = 'abc': must be a whole number"),
    (dict(TORCHRUN, MASTER_PORT="99999"), "MASTER_PORT = 99999: must be a TCP port"),
    (dict(TORCHRUN, MASTER_ADDR=""), "MASTER_ADDR = '': must name rank 0's host"),
    # srun: the same, named by SLURM's variables
    (dict(SRUN, SLURM_PROCID="2"), "SLURM_PROCID = 2: must be 0 to 1 (SLURM_STEP_NUM_TASKS = 2)"),
    ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"},
     "SLURM_PROCID = 1: must be 0 to 0 (SLURM_NTASKS unset, so 1)"),
    (dict(SRUN, SLURM_LOCALID="2"), "SLURM_LOCALID = 2: must be 0 to 1 (SLURM_STEP_TASKS_PER_NODE = 2"),
    (dict(SRUN, SLURM_STEP_NUM_TASKS="n"), "SLURM_STEP_NUM_TASKS = 'n': must be a whole number"),
])
def test_launcher_variables_that_describe_no_world_are_one_line(env, message):
    with pytest.raises(UserError) as e:
        detect_launch(env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_launcher_variables_that_describe_a_world_still_work():
    assert detect_launch({"WORLD_SIZE": "1"}) is None and detect_launch({"RANK": "0"}) is None  # a world of one
    assert detect_launch(TORCHRUN).world_size == 2
    le = detect_launch(SRUN)
    assert (le.rank, le.world_size, le.local_rank, le.local_world_size, le.master_addr) == (1, 2, 1, 2, "gpu01")
    # an empty SLURM_STEP_NUM_TASKS falls back to SLURM_NTASKS, as before
    assert detect_launch(dict(SRUN, SLURM_STEP_NUM_TASKS="", SLURM_NTASKS="2")).world_size == 2


def test_world_size_without_rank_exits_2_in_one_line(tmp_path):
    # it used to train alone as a world of one; now no traceback, nothing started, no run folder
    env = dict(os.environ, WORLD_SIZE="2")
    env.pop("RANK", None)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--train.device", "cpu", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "plait train: error: WORLD_SIZE = '2' is set but RANK is not: set RANK too (with MASTER_ADDR and "
        "MASTER_PORT) for each process, start the run with torchrun or plait train --nproc N, or unset WORLD_SIZE"]
    assert not out.exists()


def _torchrun_env(monkeypatch, **extra):
    for k in ("PLAIT_SPAWNED", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(TORCHRUN, **extra).items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("extra, says", [
    (dict(MASTER_ADDR="no-such-host.invalid"), "MASTER_ADDR = 'no-such-host.invalid': no such host"),
    # srun without MASTER_ADDR: the node list's first host, here a list cut short
    (dict(SRUN, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NODELIST="gpu[01-04"),
     "rank 0's host 'gpu[01-04' (the first of the SLURM node list): no such host"),
])
def test_a_host_that_does_not_resolve_is_one_line_not_a_timeout(corpus, tmp_path, monkeypatch, capsys, extra, says):
    """It waited the whole parallel.timeout_s in the rendezvous, printing native stack frames, and
    then said the other ranks "did not all come"."""
    import time

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PLAIT_SPAWNED",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", *SRUN):
        monkeypatch.delenv(k, raising=False)
    env = extra if "SLURM_PROCID" in extra else dict(TORCHRUN, **extra)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.perf_counter()
    assert cli.main(cli_train(corpus, tmp_path / "run", {}, extra=["--parallel.timeout_s", "30"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert time.perf_counter() - t0 < 20


def test_tensor_parallel_groups_are_placed_by_the_processes_each_node_runs(corpus, tmp_path, monkeypatch, capsys):
    """A TP group across nodes is refused by where the launcher put the ranks; parallel.gpus_per_node
    (the planner's and `plait mesh`'s) refused `--nproc 4 --tp 4 --parallel.gpus_per_node 2`, one
    machine's four processes, and with --parallel.allow_cross_node_tp the run gave no warning."""
    from plait.config import build_config
    from plait.validate import validate_config

    validate_config(build_config({"parallel": {"nproc": 4, "tp": 4, "gpus_per_node": 2}}))
    _torchrun_env(monkeypatch, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")  # two nodes of two
    assert cli.main(cli_train(corpus, tmp_path / "run", {}, extra=["--tp", "4"])) == 2
    assert ("parallel.tp = 4: 1 tensor-parallel group(s) span nodes of 2 GPUs (e.g. ranks [0, 1, 2, 3])"
            in capsys.readouterr().err)


def test_nproc_under_torchrun_is_refused_before_the_run_folder_is_made(corpus, tmp_path, monkeypatch, capsys):
    # it was refused only once every rank had passed preflight: `--out` was left holding a .lock
    _torchrun_env(monkeypatch)
    out = tmp_path / "run"
    assert cli.main(cli_train(corpus, out, {}, extra=["--parallel.nproc", "4"])) == 2
    assert capsys.readouterr().err.strip() == ("plait train: error: parallel.nproc = 4: torchrun already started 2 "
                                               "process(es) on this node; drop --nproc when launching with torchrun")
    assert not out.exists()


def test_torchrun_max_restarts_with_a_shared_store_is_refused(corpus, tmp_path, monkeypatch, capsys):
    # torchrun's restarted workers read the dead attempt's addresses from the shared store and never
    # connect (measured: gloo connectFullMesh "Connection refused" on torch 2.13): refuse it up front
    _torchrun_env(monkeypatch, TORCHELASTIC_MAX_RESTARTS="3")
    out = tmp_path / "run"
    assert cli.main(cli_train(corpus, out, {})) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plait train: error: torchrun --max-restarts 3 shares its rendezvous store")
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in err and "\n" not in err
    assert not out.exists()


def test_torchrun_max_restarts_with_a_store_per_attempt_is_accepted():
    # what torchrun exports with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (c10d rendezvous), or without restarts
    le = detect_launch(TORCHRUN)
    check_launched(1, le, dict(TORCHRUN, TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_USE_AGENT_STORE="False"))
    check_launched(2, le, TORCHRUN)
    check_launched(4, None, {})  # not launched: plait starts the processes itself


def test_a_stop_recorded_by_another_torchrun_job_is_not_this_ones(tmp_path):
    """A SLURM requeue kept an earlier job's stopped.json (a requeue counts as restarted); a torchrun
    restart after a crash in the requeued job read it, said it had stopped on SIGUSR1 at that old
    step, and ended with exit 0 short of train.steps."""
    from plait.supervise import record_stop, stopped_before

    first = {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "0"}
    record_stop(tmp_path, "SIGUSR1", 15, first)
    assert stopped_before(tmp_path, {**first, "TORCHELASTIC_RESTART_COUNT": "1"})["step"] == 15  # its own restart
    later = {"TORCHELASTIC_RUN_ID": "job-b", "TORCHELASTIC_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "1"}
    assert stopped_before(tmp_path, later) is None


def test_a_torchrun_restart_after_a_stop_on_sigusr1_does_not_train_on(corpus, tmp_path, monkeypatch, capsys):
    """torchrun counts the workers' exit after SIGUSR1 (143) as a failure and restarts them: they
    resumed and trained on, right before the scheduler that sent the notice ended the job."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "stopped.json").write_text('{"signal": "SIGUSR1", "step": 45}\n')
    _torchrun_env(monkeypatch, TORCHELASTIC_RESTART_COUNT="1", TORCHELASTIC_USE_AGENT_STORE="False")
    assert cli.main(cli_train(corpus, out, {}, extra=["--resume"])) == 0
    assert capsys.readouterr().err.strip() == (
        "plait: torchrun restarted the workers after they stopped on SIGUSR1 at step 45 (saved): not training "
        "on; continue by running the same torchrun command again with --resume added (on every node)")
    assert sorted(p.name for p in out.iterdir()) == ["stopped.json"]


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_one_process_command_under_a_launcher_is_one_line(command, tmp_path, monkeypatch, capsys):
    """`torchrun -m plait.cli eval` ran the whole evaluation on every rank and printed it once a
    rank; plait eval and generate run in one process, and say so before loading anything."""
    _torchrun_env(monkeypatch)
    assert cli.main([command, "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == (f"plait {command}: error: plait {command} runs in one process, but "
                                               f"torchrun started it as rank 0 of 2 (each would repeat the whole "
                                               f"{command}): start it once, without a launcher")
    for key in TORCHRUN:
        monkeypatch.delenv(key)
    for key, value in SRUN.items():
        monkeypatch.setenv(key, value)
    assert cli.main([command, "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "but srun started it as rank 1 of 2" in capsys.readouterr().err


def test_the_resume_hint_keeps_the_layout_inside_a_slurm_allocation(monkeypatch):
    """`plait train --nproc 2 --dp 2 --zero 3` in a batch script (SLURM_JOB_ID set, no srun) was told to
    continue with a bare `--resume`: one process at a smaller batch. Only a run torchrun or srun
    started leaves the layout to that launcher's own command."""
    from plait.commands.train import layout_flags
    from plait.config import build_config

    cfg = build_config({"parallel": {"nproc": 2, "dp_shard": 2, "zero": 3}})
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "999")
    assert layout_flags(cfg) == " --nproc 2 --dp 2 --zero 3"
    _torchrun_env(monkeypatch)
    assert layout_flags(cfg) == ""


@pytest.mark.parametrize("argv, says", [
    (["--model.preset", "nope"], "model.preset = 'nope'"),  # the command line itself
    (["--tp", "3"], "parallel.tp = 3: must divide the 8 attention heads"),  # the config's checks
])
def test_a_mistake_in_the_command_is_said_once_under_torchrun(corpus, tmp_path, monkeypatch, capsys, argv, says):
    """Every torchrun process printed the same refusal: two ranks, two identical lines, eight on a node
    of eight. Rank 0 says it; the others exit 2 quietly."""
    for rank, lines in (("0", 1), ("1", 0)):
        _torchrun_env(monkeypatch, RANK=rank, LOCAL_RANK=rank)
        assert cli.main(cli_train(corpus, tmp_path / "run", {}, extra=argv)) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == lines and all(says in e for e in err), (rank, err)


def test_what_only_one_rank_meets_is_said_by_that_rank(corpus, tmp_path, monkeypatch, capsys):
    """A refusal that depends on the process (here its launcher variables) is said by whichever rank
    meets it, or a job whose rank 1 alone failed would stop without a word."""
    _torchrun_env(monkeypatch, RANK="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # a second node's one process
    assert cli.main(cli_train(corpus, tmp_path / "run", {}, extra=["--parallel.nproc", "4"])) == 2
    assert "parallel.nproc = 4" in capsys.readouterr().err


def test_python_dash_m_plait_is_the_plait_command():
    out = subprocess.run([sys.executable, "-m", "plait", "train", "--model.preset", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("plait train: error: model.preset = 'nope'"), out.stderr


def test_a_rank_its_launcher_ends_with_sigterm_says_where_the_run_goes_on(tmp_path):
    """torchrun ends a node's other ranks with SIGTERM milliseconds after one dies (kill -9, out of
    memory): before any collective could tell them, and they ended without a word, the README's
    "each surviving rank says ... which checkpoint --resume continues from" untrue there."""
    from plait.config import build_config
    from plait.run import stopped_line

    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000070").mkdir(parents=True)
    cfg = build_config({"train": {"out": str(out)}})
    line = stopped_line(cfg, 1, "torchrun")
    assert line.startswith("plait train: rank 1 stopped by SIGTERM from torchrun") and line.endswith(
        f"the newest checkpoint is step_00000070: continue with `plait train --out {out} --resume`")
    code = ("import sys, time; from plait import lifeline; "
            "lifeline.after_ctrl_c(term_line=lambda: 'the line'); print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    p.send_signal(15)
    assert p.wait(timeout=30) == 143 and p.stderr.read() == "the line\n"


def test_the_resume_hint_under_torchrun_or_srun_names_their_command(tmp_path, monkeypatch):
    """Under torchrun the hint was a bare `plait train --out RUN --resume` (run as given: one process
    at a fraction of the batch); under srun, once plait had exported RANK and the rest for the task,
    the launcher read as hand-set variables and the hint carried --dp flags that one process refused."""
    from plait.commands.train import resume_how

    _torchrun_env(monkeypatch)
    assert resume_how(tmp_path) == "by running the same torchrun command again with --resume added (on every node)"
    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)
    for k, v in dict(SRUN, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29400").items():  # what init_distributed exports for an srun task
        monkeypatch.setenv(k, v)
    assert detect_launch().launcher == "slurm"
    assert resume_how(tmp_path).startswith("by running the same srun command again with --resume")
    for k in ("SLURM_STEP_ID", "SLURM_PROCID"):  # variables set by hand, no srun: plait's own command
        monkeypatch.delenv(k)
    assert resume_how(tmp_path) == f"with `plait train --out {tmp_path} --resume`"
