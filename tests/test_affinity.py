"""parallel.bind_cpus: which cores each local GPU rank gets, read from a fake sysfs tree."""

from __future__ import annotations

import functools

import pytest

from plait import affinity
from plait.config import build_config
from plait.errors import UserError
from plait.validate import validate_config


def _fake_sys(tmp_path, cpus: int, siblings: int, nodes: dict[int, str]):
    """A machine of `cpus` logical CPUs, `siblings` a physical core (Linux numbering: core k's
    siblings are k, k + cpus/siblings, ...), NUMA nodes {node: cpulist}."""
    cpu_dir, node_dir = tmp_path / "cpu", tmp_path / "node"
    per = cpus // siblings
    for c in range(cpus):
        t = cpu_dir / f"cpu{c}" / "topology"
        t.mkdir(parents=True)
        core = c % per
        (t / "physical_package_id").write_text(f"{0 if core < per // 2 or len(nodes) == 1 else 1}\n")
        (t / "core_id").write_text(f"{core}\n")
    for n, lst in nodes.items():
        (node_dir / f"node{n}").mkdir(parents=True)
        (node_dir / f"node{n}" / "cpulist").write_text(lst + "\n")
    return cpu_dir, node_dir


def test_cpulist_parsing():
    assert affinity.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert affinity.parse_cpulist("") == []


def test_smt_siblings_form_one_core(tmp_path):
    cpu_dir, _ = _fake_sys(tmp_path, 8, 2, {0: "0-7"})
    assert affinity.physical_cores(range(8), cpu_dir) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # unreadable topology: each CPU a core of its own
    assert affinity.physical_cores([0, 1], tmp_path / "nowhere") == [[0], [1]]


def test_ranks_split_their_gpus_numa_node(tmp_path):
    # 2 sockets x 8 cores x 2 threads: node 0 = cores 0-7 (CPUs 0-7, 16-23), node 1 = cores 8-15
    cpu_dir, node_dir = _fake_sys(tmp_path, 32, 2, {0: "0-7,16-23", 1: "8-15,24-31"})
    nodes = affinity.node_cpus(node_dir)
    cores = functools.partial(affinity.physical_cores, sys_cpu=cpu_dir)
    gpu_nodes = [0, 0, 1, 1]  # GPUs 0-1 on socket 0, 2-3 on socket 1
    got = [affinity.plan(r, gpu_nodes, set(range(32)), nodes, cores) for r in range(4)]
    assert got[0] == [0, 1, 2, 3, 16, 17, 18, 19]
    assert got[1] == [4, 5, 6, 7, 20, 21, 22, 23]
    assert got[2] == [8, 9, 10, 11, 24, 25, 26, 27]
    assert got[3] == [12, 13, 14, 15, 28, 29, 30, 31]
    # no two ranks share a physical core (an SMT sibling), every rank stays on its GPU's node
    owner = {}
    for r, cpus in enumerate(got):
        for c in cpus:
            assert owner.setdefault(c % 16, r) == r
            assert c in nodes[gpu_nodes[r]]


def test_every_gpu_of_the_machine_has_its_slice_whichever_job_uses_it(tmp_path):
    """Two 4-GPU jobs on one 8-GPU node: the second job's local rank 0 runs on GPU 4, whose cores
    are not the first job's rank 0's."""
    cpu_dir, node_dir = _fake_sys(tmp_path, 32, 2, {0: "0-7,16-23", 1: "8-15,24-31"})
    nodes = affinity.node_cpus(node_dir)
    cores = functools.partial(affinity.physical_cores, sys_cpu=cpu_dir)
    gpu_nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    slices = [affinity.plan(g, gpu_nodes, set(range(32)), nodes, cores) for g in range(8)]
    assert all(len(s) == 4 for s in slices)  # 8 physical cores a node, 4 GPUs: 2 cores (4 CPUs) each
    seen = [c for s in slices for c in s]
    assert len(seen) == len(set(seen)) == 32


def test_the_machines_gpus_come_from_pci(tmp_path):
    for addr, vendor, cls in [("0000:1b:00.0", "0x10de", "0x030200"), ("0000:0a:00.0", "0x10de", "0x030000"),
                              ("0000:05:00.0", "0x10de", "0x068000"),  # an NVSwitch: a bridge, not a GPU
                              ("0000:03:00.0", "0x8086", "0x030000")]:  # another vendor's display
        d = tmp_path / addr
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    assert affinity.machine_gpus(tmp_path) == ["0000:0a:00.0", "0000:1b:00.0"]
    assert affinity.machine_gpus(tmp_path / "nowhere") == []


def test_unknown_numa_splits_the_machine(tmp_path):
    cpu_dir, _ = _fake_sys(tmp_path, 8, 2, {0: "0-7"})
    cores = functools.partial(affinity.physical_cores, sys_cpu=cpu_dir)
    got = [affinity.plan(r, [None, None], set(range(8)), {}, cores) for r in range(2)]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # more GPUs than physical cores: no binding rather than two ranks on one core
    assert affinity.plan(0, [None] * 5, set(range(8)), {}, cores) is None


def test_gpu_numa_node_from_pci(tmp_path):
    dev = tmp_path / "0000:1b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert affinity.gpu_numa_node("0000:1B:00.0", tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")
    assert affinity.gpu_numa_node("0000:1b:00.0", tmp_path) is None
    assert affinity.gpu_numa_node("0000:99:00.0", tmp_path) is None
    assert affinity.gpu_numa_node(None, tmp_path) is None


def test_a_launchers_binding_is_kept(monkeypatch):
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(affinity.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda *a: pytest.fail("rebound a bound process"))
    assert affinity.bind(0, 4) is None


def test_bad_value_is_one_line():
    cfg = build_config({"parallel": {"bind_cpus": "yes"}})
    with pytest.raises(UserError, match="parallel.bind_cpus.*auto or off"):
        validate_config(cfg)


def test_binding_never_fails_a_run(monkeypatch):
    """Placement is a speed-up: a topology it cannot read or an affinity the OS refuses leaves the
    rank where it is, and otherwise the chosen CPUs are applied."""
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(affinity.os, "cpu_count", lambda: 8)
    applied = []
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cpus: applied.append(sorted(cpus)))
    monkeypatch.setattr(affinity, "_choose", lambda *a: [2, 3])
    assert affinity.bind(1, 4) == [2, 3] and applied == [[2, 3]]

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(affinity.os, "sched_setaffinity", refuse)
    assert affinity.bind(1, 4) is None

    def unreadable(*a):
        raise ValueError("odd sysfs")

    monkeypatch.setattr(affinity, "_choose", unreadable)
    assert affinity.bind(1, 4) is None
