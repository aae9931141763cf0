"""The communication ledger: bytes each device sends per step, by mesh dim and collective.

Counts follow the ring algorithm (S = message size in bytes, N = group size), the formulas the
seeds and the planner use: all-reduce 2S(N-1)/N; all-gather and reduce-scatter S(N-1)/N of the full
(gathered, resp. unreduced) size; all-to-all S(N-1)/N; broadcast, reduce and send S; recv 0.
`plait.comm.Comm` records every call here; a Ledger holds plain numbers and needs no torch.

Per (dim, op) the ledger adds up only calls and message bytes; bytes sent are derived when asked,
as total_bytes * k / N with an integer k per op. That keeps `record` to a dict lookup and two
additions, and makes the counts exact: a DDP step over P gradient bytes reads 2P(N-1)/N to the last
bit, whatever N and however the gradients were bucketed.
"""

from __future__ import annotations


def ring_factor(op: str, n: int) -> int:
    """k such that one device sends S * k / N bytes for `op` over N ranks."""
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1
    if op in ("broadcast", "reduce", "send"):
        return n if n > 1 else 0
    if op in ("recv", "barrier"):
        return 0
    raise ValueError(f"unknown collective {op!r}")


def ring_bytes(op: str, size: int, n: int) -> float:
    """Bytes one device sends for `op` on a message of `size` bytes over `n` ranks (ring algorithm)."""
    return size * ring_factor(op, n) / n


class Ledger:
    """Communication per step: for each (mesh dim, op) the calls, message bytes and bytes sent."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.steps: list[dict] = []  # closed steps, each {(dim, op): [calls, bytes, n]}
        self._cur: dict = {}

    def record(self, op: str, dim: str, nbytes: int, n: int) -> None:
        """Count one call of `op` on a message of `nbytes` over the `n` ranks of mesh dim `dim`."""
        e = self._cur.get((dim, op))
        if e is None:
            ring_factor(op, n)  # unknown ops fail here, once, not later in summary()
            self._cur[(dim, op)] = [1, nbytes, n]
        else:
            e[0] += 1
            e[1] += nbytes
            if e[2] != n:
                raise ValueError(f"mesh dim {dim!r} recorded with group sizes {e[2]} and {n}; "
                                 f"give differently sized groups different names")

    def step(self) -> dict:
        """Close the current step (call once per optimizer step); returns its summary."""
        self.steps.append(self._cur)
        self._cur = {}
        return self.summary()

    def reset(self) -> None:
        self.steps, self._cur = [], {}

    def summary(self, step: int | None = None) -> dict:
        """{dim: {op: {calls, bytes, sent_bytes, group_size}, "sent_bytes": total}} for one step.

        Default: the last closed step, or the open one if none was closed. Bytes are per device.
        """
        entries = self._cur if step is None and not self.steps else self.steps[-1 if step is None else step]
        return _summarize(entries)

    def totals(self) -> dict:
        """Like summary(), summed over every step so far (closed and open)."""
        merged: dict = {}
        for entries in self.steps + [self._cur]:
            for key, (calls, nbytes, n) in entries.items():
                m = merged.setdefault(key, [0, 0, n])
                m[0] += calls
                m[1] += nbytes
        return _summarize(merged)

    def table(self, step: int | None = None) -> str:
        s = self.summary(step)
        lines = [f"{'dim':<14}{'op':<16}{'calls':>7}{'N':>5}{'message MiB':>14}{'sent MiB/device':>17}"]
        for dim, ops in s.items():
            for op, e in ops.items():
                if op != "sent_bytes":
                    lines.append(f"{dim:<14}{op:<16}{e['calls']:>7}{e['group_size']:>5}"
                                 f"{e['bytes'] / 2**20:>14.3f}{e['sent_bytes'] / 2**20:>17.3f}")
        return "\n".join(lines)


def _summarize(entries: dict) -> dict:
    out: dict = {}
    for (dim, op), (calls, nbytes, n) in sorted(entries.items()):
        d = out.setdefault(dim, {"sent_bytes": 0.0})
        sent = nbytes * ring_factor(op, n) / n  # one rounding, from exact integers
        d[op] = {"calls": calls, "bytes": nbytes, "sent_bytes": sent, "group_size": n}
        d["sent_bytes"] += sent
    return out
