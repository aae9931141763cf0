"""plait.launch: launcher detection (torchrun, srun), spawning, failures, timeouts, teardown."""

import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

from dist import run_dist
from plait import launch
from plait.comm import Comm, Ledger
from plait.config import ParallelConfig
from plait.errors import UserError
from plait.launch import LaunchEnv, SpawnError, detect_launch, first_host, slurm_port, tasks_on_node


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[01-04,07]", "gpu01"), ("node1,node2", "node1"), ("node7", "node7"), ("gpu-[007-009],cpu1", "gpu-007"),
    ("a[3,5-7]", "a3"), ("rack[1-2]-node[05-06],x1", "rack1-node05"), (" n[2]", "n2"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_tasks_per_node():
    assert tasks_on_node("4(x2),3", 0) == 4 and tasks_on_node("4(x2),3", 1) == 4 and tasks_on_node("4(x2),3", 2) == 3
    assert tasks_on_node("8", 0) == 8


SRUN = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}


def test_srun_environment():
    le = detect_launch(SRUN)
    assert le == LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, master_addr="gpu01",
                           master_port=slurm_port("123456"), launcher="slurm")
    assert 15000 <= le.master_port < 30000 and slurm_port("123456") == slurm_port("123456")
    # every task of the job computes the same port; an explicit MASTER_ADDR / MASTER_PORT wins
    assert detect_launch(dict(SRUN, SLURM_PROCID="0", SLURM_LOCALID="0")).master_port == le.master_port
    mine = detect_launch(dict(SRUN, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert (mine.master_addr, mine.master_port) == ("10.0.0.1", 29500)
    # two steps of one allocation at once (a sweep of srun calls) took one port: the second failed to bind
    ports = {detect_launch(dict(SRUN, SLURM_STEP_ID=str(s))).master_port for s in range(8)}
    assert len(ports) == 8 and all(15000 <= p < 30000 for p in ports) and le.master_port == 15000 + 123456 % 15000
    # nodes with different task counts: each rank judged TP placement by its own node's count, and
    # the ranks disagreed (two refused, two waited out the timeout); now every rank says the same
    uneven = {k: v for k, v in dict(SRUN, SLURM_TASKS_PER_NODE="2,1,1", SLURM_NTASKS="4").items()
              if k != "SLURM_STEP_TASKS_PER_NODE"}
    with pytest.raises(UserError, match=r"^SLURM_TASKS_PER_NODE = '2,1,1': plait places ranks on nodes in equal"):
        detect_launch(dict(uneven, SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NODEID="1"))


def test_a_rendezvous_that_never_gathers_is_one_line(monkeypatch):
    """Rank 1 of 2 whose rank 0 never comes (a task given another world size, a host it cannot
    reach): one line naming the rendezvous and what to check, not torch's store traceback."""
    import torch.distributed as dist

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port())}.items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(UserError, match=r"^the rendezvous at 127.0.0.1:\d+ waited parallel.timeout_s = 2 s for "
                                            r"2 ranks as rank 1, and they did not all come: .*same world size"):
            launch.init_distributed(ParallelConfig(timeout_s=2), "cpu")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    """torchrun --nproc_per_node 2 on a one-GPU machine: both processes took GPU 0 and NCCL failed
    each with a traceback (seen on an H200). Refused before any GPU is touched; srun, which may hand
    each task one GPU of its own, is left to NCCL, whose refusal says the same."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
    with pytest.raises(UserError, match=r"^2 processes on this node share 1 visible GPU\(s\), and NCCL needs one "
                                        r"GPU a process: start at most 1 a node .* --train.device cpu; "
                                        r"bench comm: --device cpu\)$"):
        launch.init_distributed(ParallelConfig(), "cuda", env=env)
    assert not torch.distributed.is_initialized()


def test_a_rendezvous_port_in_use_is_one_line(monkeypatch):
    import socket

    import torch.distributed as dist

    with socket.socket() as held:  # another run's rendezvous on this node
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(k, v)
        try:
            with pytest.raises(UserError, match=rf"^MASTER_PORT = {port}: already in use on 127.0.0.1 .*free port$"):
                launch.init_distributed(ParallelConfig(timeout_s=5), "cpu")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_batch_script_without_srun_is_not_a_launch():
    # sbatch's own shell has SLURM_PROCID=0 and SLURM_NTASKS=8 but no step: rank 0 of 8 would wait forever
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert detect_launch(dict(batch, SLURM_PROCID="0")) is None


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "node0",
           "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job1"}
    assert detect_launch(env) == LaunchEnv(3, 16, 3, 8, "node0", 29400, "torchrun")
    assert detect_launch(dict(env, **SRUN)).launcher == "torchrun"  # torchrun inside an allocation
    with pytest.raises(UserError, match="MASTER_ADDR"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "2"})
    assert detect_launch({}) is None
    assert launch.planned_world(ParallelConfig(nproc=4), env) == (16, 8)
    assert launch.planned_world(ParallelConfig(nproc=4), {}) == (4, 4)


def _train_like(cfg, fail_rank):
    """What a `plait train --nproc N` worker does: init, a collective through Comm, return, shutdown."""
    dims = launch.init_distributed(cfg, "cpu")
    ledger = Ledger()
    x = torch.full((4,), float(dims.rank))
    Comm(dims, ledger).all_reduce(x, "dp")
    if dims.rank == fail_rank:
        raise ValueError(f"deliberate failure on rank {dims.rank}")
    return dims.rank, os.getpid(), x.tolist(), ledger.summary()["dp"]["sent_bytes"], dims.device.type


def test_run_spawns_workers_and_returns_results_in_rank_order():
    out = launch.run(_train_like, (ParallelConfig(nproc=2), -1), nproc=2)
    assert [o[0] for o in out] == [0, 1]
    assert all(o[2] == [1.0] * 4 and o[3] == 16.0 and o[4] == "cpu" for o in out)
    for _, pid, *_ in out:  # the workers are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(SpawnError) as e:
        launch.spawn(_train_like, (ParallelConfig(nproc=3), 2), 3)
    assert str(e.value).startswith("rank 2 failed: ValueError: deliberate failure on rank 2")
    assert "\n" not in str(e.value)
    assert e.value.rank == 2 and "_train_like" in e.value.traceback and "raise ValueError" in e.value.traceback


def _user_mistake():
    raise UserError("parallel.tp = 3: must divide model.n_heads = 8")


def test_a_user_error_in_a_worker_stays_one_line():
    # both ranks raise it; which one the launcher hears first depends on the scheduler
    with pytest.raises(UserError, match=r"^rank [01]: parallel.tp = 3: must divide"):
        launch.spawn(_user_mistake, (), 2)


def _started_differently():
    """Two "nodes" started with different commands: rank 1 asks for ZeRO-3 where rank 0 asked for 1."""
    rank = int(os.environ["RANK"])
    launch.init_distributed(ParallelConfig(nproc=2, timeout_s=20), "cpu",
                            agree={"train.seq_len": 64, "parallel.zero": 3 if rank == 1 else 1})


def test_ranks_started_with_different_configs_stop_at_once_naming_the_field():
    # it trained until a collective met another shape or never met it: parallel.timeout_s, then a
    # failed collective deep in a traceback
    t0 = time.time()
    with pytest.raises(UserError) as e:
        launch.spawn(_started_differently, (), 2, timeout_s=60)
    assert time.time() - t0 < 30
    assert str(e.value).endswith("rank 1 was started with parallel.zero = 3, rank 0 with 1: start every node "
                                 "with the same command")


def _two_run_folders(root):
    """Two "nodes" whose --out is node-local: each rank's folder is its own."""
    from plait.run import one_run_folder

    rank = int(os.environ["RANK"])
    launch.init_distributed(ParallelConfig(nproc=2, timeout_s=20), "cpu")
    out = os.path.join(root, f"node{rank}")
    os.makedirs(out, exist_ok=True)
    one_run_folder(__import__("pathlib").Path(out), rank)


def test_nodes_that_do_not_share_the_run_folder_are_refused_at_the_start(tmp_path):
    """They trained to the first checkpoint, then failed there ("Parent directory ... does not
    exist") or waited out the timeout for each other's files."""
    # every rank says the same line (each named its own folder, and which rank's came first varied)
    with pytest.raises(UserError, match=r"^rank 0: train.out = .*node0' \(rank 0's\): rank\(s\) 1 do not see that run"):
        launch.spawn(_two_run_folders, (str(tmp_path),), 2, timeout_s=60)
    assert os.listdir(tmp_path / "node0") == []  # its token went


def test_nodes_with_other_data_or_weights_do_not_agree(corpus, tmp_path):
    """data.path and init_from may be other paths on each node (a mount point), not other content."""
    from plait.config import build_config
    from plait.prepare import prepare
    from plait.run import _must_agree
    from plait.tokenizer import ByteTokenizer

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("other text " * 400)
    prepare([str(tmp_path / "src")], tmp_path / "other", ByteTokenizer(), val_fraction=0.2, quiet=True)
    agree = [_must_agree(build_config({"data": {"path": str(p)}})) for p in (corpus, tmp_path / "other")]
    key = "data (what its folders hold)"
    assert agree[0][key] != agree[1][key] and "data.path" not in agree[0]
    import shutil

    shutil.copytree(corpus, tmp_path / "mounted-elsewhere")
    assert _must_agree(build_config({"data": {"path": str(tmp_path / "mounted-elsewhere")}}))[key] == agree[0][key]


def _missing_peer():
    """Rank 1 never joins rank 0's all-reduce on the tp sub-group (ranks 2 and 3 finish normally)."""
    dims = launch.init_distributed(ParallelConfig(nproc=4, tp=2, timeout_s=2), "cpu")
    if dims.rank == 0:
        Comm(dims).all_reduce(torch.ones(3), "tp")
    elif dims.rank == 1:
        time.sleep(60)  # alive but absent: only the timeout can end rank 0's wait


def test_a_stuck_collective_times_out_naming_op_dim_and_rank():
    t0 = time.time()
    with pytest.raises(SpawnError) as e:
        launch.spawn(_missing_peer, (), 4, timeout_s=40)
    assert time.time() - t0 < 25, "the collective timeout, not the harness bound, must end the run"
    msg = str(e.value)
    assert msg.startswith("rank 0 failed: CollectiveError: all_reduce on mesh dim 'tp'")
    assert "did not complete within parallel.timeout_s = 2 s" in msg and "on rank 0" in msg
    assert "rank(s) 1 raised no error and were still running" in msg  # the absent peer, named
    assert "CollectiveError" in e.value.traceback


def _sleeper(dims):
    if dims.rank == 1:
        time.sleep(60)


def test_the_harness_bound_kills_a_hung_rank():
    t0 = time.time()
    with pytest.raises(BaseException) as e:  # pytest.fail raised by run_dist
        run_dist(_sleeper, 2, timeout=3)
    assert time.time() - t0 < 20
    assert "rank 1 failed: TimeoutError: rank 1 still running after 3 s" in str(e.value)
    assert "time.sleep(60)" in str(e.value)  # the stack of the stuck rank is shown


def test_single_process_runs_as_a_world_of_one(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError, match="parallel.nproc = 2"):
        launch.init_distributed(ParallelConfig(nproc=2), "cpu", env={})
    before = dict(os.environ)
    dims = launch.init_distributed(ParallelConfig(), "cpu", env={})
    assert detect_launch() is None and {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"} == \
        {k: v for k, v in before.items() if k != "GLOO_SOCKET_IFNAME"}  # no RANK etc. left behind
    try:
        assert dims.world_size == 1 and dims.shape == (1, 1, 1, 1, 1)
        x = torch.ones(3)
        assert Comm(dims).all_reduce(x, "dp") is x
    finally:
        launch.shutdown()
    assert not torch.distributed.is_initialized()


def test_nproc_conflicts_with_an_outer_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(UserError, match="torchrun already started 4"):
        launch.run(print, (), nproc=2)


def _clean_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                    "SLURM_", "TORCHELASTIC", "PLAIT_"))}
    return dict(env, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")


def _free_port_between(lo, hi):
    for port in random.Random().sample(range(lo, hi), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip(f"no free port between {lo} and {hi}")


def _bench_cmd(path):
    # on the CPU also where a GPU is visible: two processes would share a one-GPU machine's GPU
    return [sys.executable, "-m", "plait.cli", "bench", "comm", "--device", "cpu", "--min-bytes", "1K", "--max-bytes",
            "1K", "--ops", "all_reduce", "--impl", "torch,ring", "--json", str(path)]


def test_the_same_command_runs_under_torchrun(tmp_path):
    out = tmp_path / "tr.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] + _bench_cmd(out)[1:]
    subprocess.run(cmd, env=_clean_env(tmp_path), check=True, timeout=120, capture_output=True)
    res = json.loads(out.read_text())
    assert res["nproc"] == 2 and all(r["correct"] for r in res["results"])


def test_the_same_command_runs_under_srun(tmp_path):
    port = _free_port_between(15000, 30000)  # SLURM_JOB_ID picks the port: use a job id that maps to a free one
    out = tmp_path / "srun.json"
    procs = []
    for rank in range(2):  # what `srun --ntasks 2` would start on one node
        env = dict(_clean_env(tmp_path), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                   SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_JOB_ID=str(port - 15000),
                   SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2")
        procs.append(subprocess.Popen(_bench_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    res = json.loads(out.read_text())
    assert res["nproc"] == 2 and all(r["correct"] for r in res["results"])


def _talk(tag):
    print(f"stdout of rank {os.environ['RANK']} {tag}", flush=True)
    print(f"stderr of rank {os.environ['RANK']} {tag}", file=sys.stderr, flush=True)


def test_worker_output_goes_where_the_callers_output_goes_now(capfd):
    # the fork server was started by an earlier spawn, with whatever stdout existed then; workers must
    # still write to the caller's current stdout/stderr (here: this test's capture)
    launch.spawn(_talk, ("first",), 2)
    launch.spawn(_talk, ("second",), 2)
    out, err = capfd.readouterr()
    assert "stdout of rank 0 first" in out and "stdout of rank 1 second" in out
    assert "stderr of rank 1 first" in err and "stderr of rank 0 second" in err
