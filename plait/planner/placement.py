"""Where each rank of a layout runs: mesh coordinates -> rank -> (node, GPU), and which mesh
dimensions therefore stay inside a node (NVLink) and which cross the network.

Ranks are the digits of a mixed-radix number over the mesh dims, outermost first (plait's order,
the one `plait.parallel.dims` builds its DeviceMesh in):

    pp, dp_replicate, dp_shard, cp, tp          rank = (((pp * R + rep) * S + shard) * C + cp) * T + tp

and launchers number ranks node by node (node = rank // gpus_per_node). The innermost dims are
therefore the most local: tp first, then cp, then the ZeRO shard group, ... A dimension's group
stays in one node when its stride times its size fits a node and lines up with node boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import UserError

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost -> innermost


def _strides(sizes: dict[str, int], order=ORDER) -> dict[str, int]:
    strides, acc = {}, 1
    for name in reversed(order):
        strides[name] = acc
        acc *= sizes.get(name, 1)
    return strides


def world_size(sizes: dict[str, int]) -> int:
    n = 1
    for name in ORDER:
        n *= sizes.get(name, 1)
    return n


def coords(rank: int, sizes: dict[str, int], order=ORDER) -> dict[str, int]:
    st = _strides(sizes, order)
    return {name: (rank // st[name]) % sizes.get(name, 1) for name in order}


def rank_of(c: dict[str, int], sizes: dict[str, int], order=ORDER) -> int:
    st = _strides(sizes, order)
    return sum(c.get(name, 0) * st[name] for name in order)


def groups(dim: str, sizes: dict[str, int], order=ORDER) -> list[list[int]]:
    """Every group of ranks that differ only in their `dim` coordinate."""
    st = _strides(sizes, order)
    n = sizes.get(dim, 1)
    out = []
    for r in range(world_size(sizes)):
        if coords(r, sizes, order)[dim] == 0:
            out.append([r + i * st[dim] for i in range(n)])
    return out


def nodes_spanned(dims: str | tuple[str, ...], sizes: dict[str, int], gpus_per_node: int,
                  order=ORDER) -> int:
    """The most nodes any one group of `dims` touches (1 = all its traffic stays on NVLink).

    `dims` is one mesh dim or several adjacent ones taken together (("dp_shard", "cp") is the
    group ZeRO shards over): a group is then `prod(sizes)` ranks `stride(innermost)` apart."""
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    idx = sorted(order.index(x) for x in dims)
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(f"dims {dims} are not adjacent in the mesh order {order}")
    n = 1
    for x in dims:
        n *= sizes.get(x, 1)
    if n == 1:
        return 1
    st = _strides(sizes, order)[order[idx[-1]]]
    if st >= gpus_per_node:
        return n  # members are at least a node apart
    if gpus_per_node % (st * n) == 0:
        return 1  # groups tile nodes exactly
    worst = 1  # irregular shapes: count the worst group explicitly
    for block in range(0, world_size(sizes), st * n):
        for j in range(st):
            nodes = {(block + j + i * st) // gpus_per_node for i in range(n)}
            worst = max(worst, len(nodes))
    return worst


@dataclass(frozen=True)
class Placement:
    sizes: dict
    gpus_per_node: int
    rows: tuple[tuple[int, int, int, dict], ...]  # (rank, node, local gpu, coordinates)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def spans(self, dim) -> int:
        return nodes_spanned(dim, self.sizes, self.gpus_per_node)

    def table(self, limit: int = 64) -> str:
        head = "rank  node  gpu  " + "  ".join(f"{d:>12}" for d in ORDER)
        lines = [head]
        for rank, node, local, c in self.rows[:limit]:
            lines.append(f"{rank:>4}  {node:>4}  {local:>3}  " + "  ".join(f"{c[d]:>12}" for d in ORDER))
        if len(self.rows) > limit:
            lines.append(f"... {len(self.rows) - limit} more ranks")
        return "\n".join(lines)


def place(sizes: dict[str, int], nodes: int, gpus_per_node: int) -> Placement:
    """Map every rank of a layout onto `nodes` x `gpus_per_node` GPUs; refuse a TP group that
    would straddle two nodes (TP talks twice per layer and needs NVLink)."""
    n = world_size(sizes)
    if n != nodes * gpus_per_node:
        raise UserError(f"layout {' x '.join(f'{k}={sizes.get(k, 1)}' for k in ORDER)} = {n} GPUs but the "
                        f"cluster has {nodes} x {gpus_per_node} = {nodes * gpus_per_node}: make the product "
                        f"equal the number of GPUs")
    tp = sizes.get("tp", 1)
    if tp > gpus_per_node or gpus_per_node % tp:
        raise UserError(f"--tp = {tp}: a tensor-parallel group must fit inside one node of "
                        f"{gpus_per_node} GPUs; use a tp that divides {gpus_per_node}")
    rows = tuple((r, r // gpus_per_node, r % gpus_per_node, coords(r, sizes)) for r in range(n))
    return Placement(dict(sizes), gpus_per_node, rows)
