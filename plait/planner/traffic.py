"""Collectives: how many bytes each device sends, how many steps, how long on a given link.

Ring algorithms over n devices, `size` = bytes of the full tensor (the all-reduced buffer, the
gathered output, the reduce-scatter input):
  all-reduce       2 (n-1)/n * size   in 2 (n-1) steps   (reduce-scatter then all-gather)
  all-gather         (n-1)/n * size   in   n-1  steps   (each device forwards n-1 shards of size/n)
  reduce-scatter     (n-1)/n * size   in   n-1  steps
  broadcast                  size     pipelined along the ring
  all-to-all         (n-1)/n * size   in   n-1  steps   (each device keeps 1/n of its tensor)
  send/recv                  size     1 step
"Bytes per device" counts what one device sends (it receives as much); step time depends on it,
not on the n-fold total the network carries. Time follows the alpha-beta model:
  t = steps * alpha + bytes_per_device / bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import bad_value
from plait.planner.hardware import Link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")


def bytes_per_device(op: str, size_bytes: float, n: int) -> float:
    if op not in OPS:
        raise bad_value("collective", op, f"choose one of {', '.join(OPS)}")
    if n < 1:
        raise bad_value("group size", n, "must be a positive integer")
    if op == "send_recv":
        return size_bytes
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * size_bytes
    if op == "broadcast":
        return size_bytes
    return (n - 1) / n * size_bytes


def steps(op: str, n: int) -> int:
    if op == "send_recv":
        return 1
    if n == 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1,
            "broadcast": n - 1, "all_to_all": n - 1}[op]


def collective_time_s(op: str, size_bytes: float, n: int, link: Link) -> float:
    """Time of one collective of `size_bytes` over `n` devices on `link`: measured (a calibrated
    link, interpolated between measured sizes) or else alpha-beta."""
    if link.measured is not None and size_bytes > 0:
        t = link.measured.collective_s(op, size_bytes, n)
        if t is not None:
            return t
    return steps(op, n) * link.latency_s + bytes_per_device(op, size_bytes, n) / link.bytes_per_s


@dataclass(frozen=True)
class Collective:
    """`count` collectives `op` of `size_bytes` each over a group of `n`, per training step."""

    op: str
    size_bytes: float
    n: int
    count: float
    what: str

    @property
    def bytes_per_device(self) -> float:
        return self.count * bytes_per_device(self.op, self.size_bytes, self.n)

    def time_s(self, link: Link) -> float:
        return self.count * collective_time_s(self.op, self.size_bytes, self.n, link)


@dataclass(frozen=True)
class DimTraffic:
    """Everything one mesh dimension sends in a step, and the link it crosses."""

    dim: str
    n: int
    link: Link
    crosses_nodes: bool
    collectives: tuple[Collective, ...]

    @property
    def bytes_per_device(self) -> float:
        return sum(c.bytes_per_device for c in self.collectives)

    @property
    def count(self) -> float:
        return sum(c.count for c in self.collectives)

    @property
    def time_s(self) -> float:
        return sum(c.time_s(self.link) for c in self.collectives)


def fsdp_collectives_per_step(layers: int, microbatches: int) -> int:
    """Per-layer FSDP: all-gather forward, all-gather backward, reduce-scatter backward, per layer
    and micro-batch."""
    return 3 * layers * microbatches
