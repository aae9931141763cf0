"""Which CPU cores each GPU rank's threads run on (`parallel.bind_cpus`).

A rank's host thread issues every kernel, collective and hook of its step. Where a step's GPU work
is short - a ZeRO-3 block at one sequence, a pipeline stage's micro-batch - that thread is on the
critical path, and every collective runs at the pace of the slowest rank's host. Left to the OS,
the ranks' threads share cores (on other machines also SMT siblings, or the socket away from their
GPU): measured on 4 x H200 with 64 cores (8b, ZeRO-3, one sequence a GPU), one rank's host took
3.5 ms to issue a block's forward where the others took 1.8, which rank changed from run to run, and
the other GPUs waited in every all-gather.

So each GPU of the machine gets physical cores of its own, with their SMT siblings: the cores of its
NUMA node, split evenly (in PCI order) among the node's GPUs, and a rank runs on its GPU's share.
The slices are per GPU, whichever job uses it, so two jobs on different GPUs of one machine do not
share cores. A process a launcher already restricted (srun's --cpu-bind, numactl, taskset: fewer
CPUs allowed than the machine has) is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
SYS_PCI = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    """The integer a sysfs file holds (None: unreadable or not one)."""
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def physical_cores(cpus, sys_cpu: Path = SYS_CPU) -> list[list[int]]:
    """`cpus` grouped by physical core (package, core id), each group's logical CPUs sorted, groups
    in the order of their first CPU; a CPU whose topology is unreadable is a core of its own."""
    cores: dict[tuple, list[int]] = {}
    for c in sorted(cpus):
        pkg = _int(sys_cpu / f"cpu{c}" / "topology" / "physical_package_id")
        core = _int(sys_cpu / f"cpu{c}" / "topology" / "core_id")
        key = (pkg, core) if pkg is not None and core is not None else ("cpu", c)
        cores.setdefault(key, []).append(c)
    return sorted(cores.values(), key=lambda g: g[0])


def node_cpus(sys_node: Path = SYS_NODE) -> dict[int, set[int]]:
    """NUMA node -> its CPUs ({} where the kernel does not say)."""
    out = {}
    for d in sorted(sys_node.glob("node[0-9]*")):
        text = _read(d / "cpulist")
        if text is not None:
            out[int(d.name[4:])] = set(parse_cpulist(text))
    return out


def gpu_numa_node(pci_bus_id: str | None, sys_pci: Path = SYS_PCI) -> int | None:
    """The NUMA node of the GPU at PCI address `pci_bus_id` (e.g. 0000:1b:00.0); None if unknown."""
    if not pci_bus_id:
        return None
    node = _int(sys_pci / pci_bus_id.lower() / "numa_node")
    return node if node is not None and node >= 0 else None


def machine_gpus(sys_pci: Path = SYS_PCI) -> list[str]:
    """PCI addresses of every NVIDIA GPU of the machine (display or 3D controller), sorted: visible to
    this process or not, so that jobs sharing a machine slice its cores alike."""
    out = []
    for d in sorted(sys_pci.glob("*")):
        vendor, cls = _read(d / "vendor"), _read(d / "class")
        if vendor and cls and vendor.strip() == "0x10de" and cls.strip()[:6] in ("0x0300", "0x0302"):
            out.append(d.name.lower())
    return out


def plan(mine: int, gpu_nodes: list[int | None], allowed: set[int], nodes: dict[int, set[int]],
         cores_of=physical_cores) -> list[int] | None:
    """The CPUs for the GPU at position `mine` of `gpu_nodes` (every GPU of the machine in PCI order,
    each with its NUMA node, None = unknown), given the CPUs this process may use and the machine's
    NUMA nodes: that GPU's even share of its node's physical cores (of the whole machine's where
    NUMA is unknown). A slice per GPU, not per rank of this job: two jobs on one machine, on
    different GPUs, get different cores. None where the GPUs outnumber the cores."""
    node = gpu_nodes[mine]
    if node is not None and nodes.get(node, set()) & allowed and all(n is not None for n in gpu_nodes):
        pool = nodes[node] & allowed
        peers = [g for g, n in enumerate(gpu_nodes) if n == node]
    else:  # NUMA unknown: every GPU shares the whole machine
        pool, peers = allowed, list(range(len(gpu_nodes)))
    cores = cores_of(pool)
    k, i = len(peers), peers.index(mine)
    if len(cores) < k:
        return None
    per = len(cores) // k
    return sorted(c for core in cores[i * per:(i + 1) * per] for c in core)


def pci_bus_id(device_index: int) -> str | None:
    """The GPU's PCI address as sysfs spells it, from torch's device properties (None if unknown)."""
    import torch

    p = torch.cuda.get_device_properties(device_index)
    dom, bus, dev = (getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is None or dev is None:
        return None
    return f"{dom or 0:04x}:{bus:02x}:{dev:02x}.0"


def bind(local_rank: int, local_world_size: int) -> list[int] | None:
    """Restrict the calling thread, and every thread it starts later (NCCL's, the process group's), to
    this rank's GPU's share of cores; the CPUs chosen, or None where it was left alone (already
    restricted, too few cores, or a topology it could not read: placement is a speed-up, never a
    reason for a run to fail). Call it before the process group starts its threads."""
    allowed = set(os.sched_getaffinity(0))
    if len(allowed) < (os.cpu_count() or 0):
        return None  # a launcher chose already: keep its binding
    try:
        cpus = _choose(local_rank, local_world_size, allowed)
        if cpus:
            os.sched_setaffinity(0, cpus)
        return cpus or None
    except (OSError, ValueError, RuntimeError):  # e.g. a container's cpuset narrower than it reports
        return None


def _choose(local_rank: int, local_world_size: int, allowed: set[int]) -> list[int] | None:
    import torch

    count = torch.cuda.device_count()
    everyone, me = machine_gpus(), pci_bus_id(local_rank % count)
    if me in everyone:
        gpus, mine = everyone, everyone.index(me)
    else:  # no PCI address from torch or sysfs: slice among this job's local ranks
        gpus, mine = [pci_bus_id(r % count) for r in range(local_world_size)], local_rank
    return plan(mine, [gpu_numa_node(g) for g in gpus], allowed, node_cpus())
