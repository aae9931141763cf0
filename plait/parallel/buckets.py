"""Gradient buckets: which parameters reduce together, when a bucket is ready, and what is in flight.

A bucket is a run of consecutive parameters in the flat order (`plait.flat.flat_order`), closed as
soon as it holds `cap` elements; a parameter larger than the cap is a bucket of its own. The flat
order is reverse registration order, roughly the order in which backward produces gradients, so
the first buckets fill first and their reduction overlaps the rest of backward.

Every rank must issue its collectives in the same order (NCCL matches them by position, not by
name), so `Ready` launches buckets strictly in one fixed order (index order unless told otherwise):
a bucket that fills early waits for its predecessors. Backward is deterministic, so in practice
they fill in order anyway.
"""

from __future__ import annotations

from typing import Callable


def group_by_size(sizes: list[int], cap: int) -> list[list[int]]:
    """Split indices 0..len(sizes)-1 into consecutive groups of about `cap` elements each."""
    groups: list[list[int]] = [[]]
    filled = 0
    for i, n in enumerate(sizes):
        if groups[-1] and filled + n > cap:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += n
    return groups


def bucket_cap(bucket_mb: float, element_size: int) -> int:
    """Elements per bucket for `parallel.bucket_mb` MiB of gradients of this element size."""
    return max(1, int(bucket_mb * 2**20) // element_size)


class Ready:
    """Counts the gradients each bucket still waits for; launches full buckets in `order` (default
    index order), each once it is full and every bucket before it in that order is launched.

    members[b]: how many hook calls bucket b needs; owners[key]: the buckets a hook call counts for.
    """

    def __init__(self, members: list[int], owners: dict, launch: Callable[[int], None],
                 order: list[int] | None = None):
        self.members, self.owners, self.launch = members, owners, launch
        self.order = list(range(len(members))) if order is None else list(order)
        assert sorted(self.order) == list(range(len(members))), "order must list every bucket once"
        self.reset()

    def reset(self) -> None:
        self.pending = list(self.members)
        self.next = 0

    def arrived(self, key) -> None:
        for b in self.owners[key]:
            self.pending[b] -= 1
        while self.next < len(self.order) and self.pending[self.order[self.next]] == 0:
            self.next += 1
            self.launch(self.order[self.next - 1])

    def flush(self) -> None:
        """Launch what is left: buckets whose parameters received no gradient this backward."""
        while self.next < len(self.order):
            self.next += 1
            self.launch(self.order[self.next - 1])

    @property
    def done(self) -> bool:
        return self.next == len(self.order)


class InFlight:
    """Async collectives not yet waited for, each with what to do once it completes and the
    buffers it reads (kept alive until then)."""

    def __init__(self):
        self.items: list[tuple] = []

    def add(self, handle, then: Callable[[], None] | None = None, keep: tuple = ()) -> None:
        self.items.append((handle, then, keep))

    def wait_all(self, keep_last: int = 0) -> None:
        """Complete all but the newest `keep_last` (bounds the memory of queued buffers)."""
        while len(self.items) > keep_last:
            handle, then, _ = self.items.pop(0)
            handle.wait()
            if then is not None:
                then()

