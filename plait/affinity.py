"""Which CPU cores each GPU rank's threads run on (`parallel.bind_cpus`).

A rank's host thread issues every kernel, collective and hook of its step. Where a step's GPU work
is short - a ZeRO-3 block at one sequence, a pipeline stage's micro-batch - that thread is on the
critical path, and every collective runs at the pace of the slowest rank's host. Left to the OS,
two ranks' threads can share a physical core (SMT siblings) or sit on the socket away from their
GPU: measured on 4 x H200 (8b, ZeRO-3, one sequence a GPU), one rank's host took 3.5 ms to issue a
block's forward where the others took 1.8, and the other three GPUs waited in every all-gather.

So each local rank gets physical cores of its own, with their SMT siblings: the cores of its GPU's
NUMA node, split evenly (in order) among the local ranks whose GPUs sit on that node. A process a
launcher already restricted (srun's --cpu-bind, numactl, taskset: fewer CPUs allowed than the
machine has) is left as it is.
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


def physical_cores(cpus, sys_cpu: Path = SYS_CPU) -> list[list[int]]:
    """`cpus` grouped by physical core (package, core id), each group's logical CPUs sorted, groups
    in the order of their first CPU; a CPU whose topology is unreadable is a core of its own."""
    cores: dict[tuple, list[int]] = {}
    for c in sorted(cpus):
        pkg = _read(sys_cpu / f"cpu{c}" / "topology" / "physical_package_id")
        core = _read(sys_cpu / f"cpu{c}" / "topology" / "core_id")
        key = (int(pkg), int(core)) if pkg is not None and core is not None else ("cpu", c)
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
    text = _read(sys_pci / pci_bus_id.lower() / "numa_node")
    node = int(text) if text is not None and text.strip().lstrip("-").isdigit() else -1
    return node if node >= 0 else None


def plan(local_rank: int, gpu_nodes: list[int | None], allowed: set[int], nodes: dict[int, set[int]],
         cores_of=physical_cores) -> list[int] | None:
    """The CPUs local rank `local_rank` should run on, given every local rank's GPU NUMA node
    (`gpu_nodes`, None = unknown), the CPUs this process may use and the machine's NUMA nodes; None
    where no split gives each rank a physical core of its own."""
    node = gpu_nodes[local_rank]
    if node is not None and nodes.get(node, set()) & allowed and all(n is not None for n in gpu_nodes):
        pool = nodes[node] & allowed
        peers = [r for r, n in enumerate(gpu_nodes) if n == node]
    else:  # NUMA unknown: all ranks share the whole machine
        pool, peers = allowed, list(range(len(gpu_nodes)))
    cores = cores_of(pool)
    k, i = len(peers), peers.index(local_rank)
    if len(cores) < k:
        return None
    per = len(cores) // k
    mine = cores[i * per:(i + 1) * per]
    return sorted(c for core in mine for c in core)


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
    this rank's share of cores; the CPUs chosen, or None where it was left alone (already restricted,
    or too few cores). Call it before the process group starts its threads."""
    import torch

    allowed = set(os.sched_getaffinity(0))
    if len(allowed) < (os.cpu_count() or 0):
        return None  # a launcher chose already: keep its binding
    count = torch.cuda.device_count()
    gpus = [r % count for r in range(local_world_size)]
    gpu_nodes = [gpu_numa_node(pci_bus_id(g)) for g in gpus]
    cpus = plan(local_rank, gpu_nodes, allowed, node_cpus())
    if cpus:
        os.sched_setaffinity(0, cpus)
    return cpus
