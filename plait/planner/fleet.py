"""Many jobs on one fleet of nodes: where to put each arriving job so that its tensor-parallel groups
stay inside a node and the GPUs left free stay usable (the seeds' "fragmentation problem").

A job asks for `gpus` GPUs made of `gpus // tp` tensor-parallel groups of `tp` GPUs; each group must
sit in one node (NVSwitch connects every GPU of a node to every other, so *which* GPUs of the node
does not matter). Three policies:

  first-fit  naive: the lowest-numbered free GPUs, whatever the node boundaries. It never refuses
             a job that fits in the free count, but may cut a TP group across two nodes (that job
             would run its TP traffic over the network: counted as `split_groups`).
  spread     load balancing: each group to the node with the most free GPUs (what a spreading
             scheduler does; it reproduces the seeds' "bad placement").
  pack       plait's: the whole job in one node if any node can take it, choosing the node with the
             fewest free GPUs that still fits (best fit); otherwise group by group, best fit again.
             Full nodes stay full and empty nodes stay empty, so large jobs still find room.

Fragmentation of the free GPUs for groups of size g: the share of free GPUs that cannot host a
whole group, 1 - sum_nodes(floor(free_n / g) * g) / sum_nodes(free_n).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from plait.errors import bad_value

POLICIES = ("first-fit", "spread", "pack")


@dataclass(frozen=True)
class Job:
    name: str
    gpus: int
    tp: int = 1
    arrive: float = 0.0
    duration: float = float("inf")

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise bad_value(f"job {self.name}.gpus", self.gpus, f"must be a positive multiple of its tp = {self.tp}")


@dataclass
class Fleet:
    nodes: int
    gpus_per_node: int
    owner: list[list[str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.owner:
            self.owner = [[None] * self.gpus_per_node for _ in range(self.nodes)]

    def free(self, node: int) -> list[int]:
        return [g for g, o in enumerate(self.owner[node]) if o is None]

    def free_total(self) -> int:
        return sum(len(self.free(n)) for n in range(self.nodes))

    def release(self, name: str) -> None:
        for row in self.owner:
            for g, o in enumerate(row):
                if o == name:
                    row[g] = None

    def fragmentation(self, group: int) -> float:
        free = [len(self.free(n)) for n in range(self.nodes)]
        total = sum(free)
        return 0.0 if total == 0 else 1 - sum(f // group * group for f in free) / total

    def render(self) -> str:
        return "\n".join(f"node {n}: " + " ".join(f"[{(o or 'free'):>4}]" for o in row)
                         for n, row in enumerate(self.owner))


def place(fleet: Fleet, job: Job, policy: str) -> list[tuple[int, int]] | None:
    """Choose GPUs for `job` (and take them); None if the policy cannot place it."""
    if policy not in POLICIES:
        raise bad_value("--policy", policy, f"choose one of {', '.join(POLICIES)}")
    if job.tp > fleet.gpus_per_node or job.gpus > fleet.free_total():
        return None
    if policy == "first-fit":
        slots = [(n, g) for n in range(fleet.nodes) for g in fleet.free(n)][: job.gpus]
    else:
        slots = _place_groups(fleet, job, policy)
        if slots is None:
            return None
    for n, g in slots:
        fleet.owner[n][g] = job.name
    return slots


def _place_groups(fleet: Fleet, job: Job, policy: str) -> list[tuple[int, int]] | None:
    free = {n: fleet.free(n) for n in range(fleet.nodes)}
    if policy == "pack":
        whole = [n for n in free if len(free[n]) >= job.gpus]
        if whole:  # best fit for the whole job: the fullest node that still takes it
            n = min(whole, key=lambda k: (len(free[k]), k))
            return [(n, g) for g in free[n][: job.gpus]]
    slots = []
    for _ in range(job.gpus // job.tp):
        fits = [n for n in free if len(free[n]) >= job.tp]
        if not fits:
            return None
        if policy == "pack":
            n = min(fits, key=lambda k: (len(free[k]), k))
        else:  # spread: the emptiest node
            n = max(fits, key=lambda k: (len(free[k]), -k))
        slots += [(n, g) for g in free[n][: job.tp]]
        free[n] = free[n][job.tp:]
    return slots


@dataclass
class FleetReport:
    policy: str
    placed: list[str] = field(default_factory=list)
    unplaceable: list[str] = field(default_factory=list)
    split_groups: int = 0
    """TP groups placed across two nodes (first-fit only)."""
    split_jobs: list[str] = field(default_factory=list)
    """Jobs with at least one such group: placed, but with TP traffic on the network."""
    fragmentation: list[float] = field(default_factory=list)
    """Fragmentation for full-node groups, sampled after every arrival."""
    final: str = ""

    @property
    def mean_fragmentation(self) -> float:
        return sum(self.fragmentation) / len(self.fragmentation) if self.fragmentation else 0.0


def run(jobs: list[Job], nodes: int, gpus_per_node: int, policy: str) -> FleetReport:
    """Play the jobs' arrivals and departures through a policy; a job that cannot be placed when it
    arrives is refused (no queue, so the count compares policies directly)."""
    fleet = Fleet(nodes, gpus_per_node)
    rep = FleetReport(policy)
    events = sorted([(j.arrive, 1, j) for j in jobs]
                    + [(j.arrive + j.duration, 0, j) for j in jobs if j.duration != float("inf")],
                    key=lambda e: (e[0], e[1], e[2].name))
    for _, kind, job in events:
        if kind == 0:
            if job.name in rep.placed:
                fleet.release(job.name)
            continue
        slots = place(fleet, job, policy)
        if slots is None:
            rep.unplaceable.append(job.name)
        else:
            rep.placed.append(job.name)
            nodes_of = [n for n, _ in slots]
            cut = sum(len(set(nodes_of[i:i + job.tp])) > 1 for i in range(0, len(slots), job.tp))
            rep.split_groups += cut
            if cut:
                rep.split_jobs.append(job.name)
        rep.fragmentation.append(fleet.fragmentation(gpus_per_node))
    rep.final = fleet.render()
    return rep


def random_jobs(n: int, nodes: int, gpus_per_node: int, seed: int = 0) -> list[Job]:
    """A reproducible mix of small and large jobs with TP groups of up to a node."""
    rng = random.Random(seed)
    jobs = []
    t = 0.0
    for i in range(n):
        tp = rng.choice([t_ for t_ in (1, 2, 4, 8) if t_ <= gpus_per_node])
        groups = rng.choice([1, 1, 1, 2, 2, 3, 4])
        t += rng.expovariate(1.0)
        jobs.append(Job(f"j{i}", tp * groups, tp, t, rng.expovariate(1 / (nodes * 0.8))))
    return jobs
