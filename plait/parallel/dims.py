"""`ParallelDims`: the five parallel degrees, validated, and the named device mesh built from them.

Rank order, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp. A rank's coordinates are the
digits of its rank in that mixed radix, so the tp ranks of a group are consecutive. Launchers number
ranks node by node (torchrun: node_rank * nproc_per_node + local_rank; srun's block distribution
likewise), so with tp dividing the GPUs per node a TP group never leaves its node: TP talks twice per
layer and needs NVLink, while PP (one send per micro-batch) and DP (one reduction per step, hidden
under backward) tolerate the slower network between nodes.

Besides the five mesh dims there are flattened ones, each the product of adjacent dims:
  dp           dp_replicate x dp_shard         ranks that see different data (batch split, loader rank)
  dp_shard_cp  dp_shard x cp                   ranks that hold the same parameters shard-wise (FSDP)
  dp_cp        dp_replicate x dp_shard x cp    ranks whose gradients are summed (DDP with CP), loss mean

The arithmetic (sizes, coordinates, groups, placement) needs no process group, so `plait mesh` and the
config check run before any process starts; `build_mesh` is the only part that talks to
torch.distributed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

from plait.errors import UserError, bad_value

NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost -> innermost
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    """Degrees of each parallelism; one of them may be -1, meaning "whatever the others leave"."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    device: object = field(default=None, init=False, repr=False, compare=False)
    """This process's torch.device once `plait.launch.init_distributed` has run."""
    timeout_s: float | None = field(default=None, init=False, repr=False, compare=False)
    """The collective timeout the groups were given (named in timeout errors)."""
    _mesh: object = field(default=None, init=False, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _ends: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise bad_value("world size", self.world_size, "must be a positive number of processes")
        inferred = [n for n in NAMES if getattr(self, n) == -1]
        for n in NAMES:
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
                raise bad_value(f"parallel.{n}", v, "must be a positive integer (or -1 to infer it)")
        if len(inferred) > 1:
            raise UserError(f"parallel.{inferred[0]} and parallel.{inferred[1]} are both -1: only one "
                            f"degree can be inferred from the world size; set the others explicitly")
        known = math.prod(getattr(self, n) for n in NAMES if n not in inferred)
        if inferred:
            name = inferred[0]
            if self.world_size % known:
                raise UserError(f"cannot infer parallel.{name}: {self.world_size} processes are not "
                                f"divisible by {self._formula(skip=name)} = {known}; choose degrees whose "
                                f"product divides {self.world_size}, or change the number of processes")
            setattr(self, name, self.world_size // known)
        elif known != self.world_size:
            raise UserError(f"{self._formula()} = {known} but {self.world_size} processes run: make the "
                            f"product equal the number of processes (--nproc {known}; started by torchrun or srun: "
                            f"{known} processes in all from their --nproc_per_node and --nnodes, or --ntasks), or set "
                            f"parallel.dp_shard = -1 to infer it")

    @classmethod
    def from_config(cls, p, world_size: int) -> "ParallelDims":
        """Build from a `ParallelConfig` (plait.config) for a run of `world_size` processes."""
        return cls(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                   world_size=world_size)

    def _formula(self, skip: str = "") -> str:
        return " x ".join(f"{n}={getattr(self, n)}" for n in NAMES if n != skip)

    # ---- sizes and coordinates (pure arithmetic) ---------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in rank order (pp, dp_replicate, dp_shard, cp, tp)."""
        return tuple(getattr(self, n) for n in NAMES)

    def size(self, name: str) -> int:
        """Group size of a mesh dim or a flattened dim ("dp", "dp_shard_cp", "dp_cp", "world")."""
        return math.prod(getattr(self, n) for n in self._parts(name))

    def enabled(self, name: str) -> bool:
        return self.size(name) > 1

    def _parts(self, name: str) -> tuple[str, ...]:
        if name in NAMES:
            return (name,)
        if name in FLATTENED:
            return FLATTENED[name]
        if name == "world":
            return NAMES
        raise ValueError(f"unknown mesh dim {name!r}; choose from {', '.join(NAMES + tuple(FLATTENED))}, world")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank, e.g. {'pp': 1, 'dp_replicate': 0, ..., 'tp': 1}."""
        out = {}
        for n in reversed(NAMES):
            size = getattr(self, n)
            out[n] = rank % size
            rank //= size
        return {n: out[n] for n in NAMES}

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for n in NAMES:
            rank = rank * getattr(self, n) + coords.get(n, 0)
        return rank

    def local_rank(self, name: str, rank: int) -> int:
        """Index of `rank` inside its group of dim `name` (row-major over the flattened parts)."""
        c = self.coords(rank)
        idx = 0
        for n in self._parts(name):
            idx = idx * getattr(self, n) + c[n]
        return idx

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """The global ranks in `rank`'s group of dim `name`, ordered by their index in the group."""
        parts = self._parts(name)
        base = self.coords(rank)
        ranks = []
        for i in range(self.size(name)):
            c = dict(base)
            for n in reversed(parts):
                c[n] = i % getattr(self, n)
                i //= getattr(self, n)
            ranks.append(self.rank_at(c))
        return ranks

    def groups(self, name: str) -> list[list[int]]:
        """Every group of dim `name`, each a list of global ranks; ordered by their first rank."""
        seen, out = set(), []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group_ranks(name, r)
                seen.update(g)
                out.append(g)
        return out

    # ---- placement on nodes ------------------------------------------------------------------------

    def placement(self, gpus_per_node: int) -> list[tuple[int, int, int, dict[str, int]]]:
        """(rank, node, gpu, coords) per rank, assuming ranks are numbered node by node."""
        return [(r, r // gpus_per_node, r % gpus_per_node, self.coords(r)) for r in range(self.world_size)]

    def cross_node_groups(self, name: str, gpus_per_node: int) -> list[list[int]]:
        return [g for g in self.groups(name) if len({r // gpus_per_node for r in g}) > 1]

    def check_placement(self, gpus_per_node: int, allow_cross_node_tp: bool = False) -> str | None:
        """Refuse a layout whose TP group spans nodes; with the flag, return a warning instead."""
        if gpus_per_node < 1:
            raise bad_value("parallel.gpus_per_node", gpus_per_node, "must be a positive integer")
        if self.tp == 1:
            return None
        bad = self.cross_node_groups("tp", gpus_per_node)
        if not bad:
            return None
        fix = (f"use tp <= {gpus_per_node} dividing {gpus_per_node}" if self.tp > gpus_per_node or gpus_per_node % self.tp
               else "check parallel.gpus_per_node")
        msg = (f"parallel.tp = {self.tp}: {len(bad)} tensor-parallel group(s) span nodes of "
               f"{gpus_per_node} GPUs (e.g. ranks {bad[0]}), and TP needs the links inside a node; {fix}, "
               f"or set parallel.allow_cross_node_tp = true to run anyway")
        if not allow_cross_node_tp:
            raise UserError(msg)
        return "warning: " + msg.split(", or set")[0]

    def describe(self, gpus_per_node: int, max_rows: int = 64) -> str:
        """The rank -> (node, gpu, coords) map and the groups of every dim, for `plait mesh`."""
        G = gpus_per_node
        nodes = -(-self.world_size // G)
        lines = [f"world {self.world_size} = " + " x ".join(f"{n} {getattr(self, n)}" for n in NAMES)
                 + "  (rank order: pp outermost, tp innermost)",
                 f"{nodes} node(s) x {G} GPUs per node" + (f" ({self.world_size % G} on the last)"
                                                            if self.world_size % G else ""), ""]
        w = [max(len(n), 2) for n in NAMES]
        lines.append("rank  node  gpu   " + "  ".join(n.rjust(k) for n, k in zip(NAMES, w)))
        rows = self.placement(G)
        shown = rows if len(rows) <= max_rows else rows[: max_rows // 2] + [None] + rows[-max_rows // 2:]
        for row in shown:
            if row is None:
                lines.append("  ...")
                continue
            r, node, gpu, c = row
            lines.append(f"{r:4d}  {node:4d}  {gpu:3d}   " + "  ".join(str(c[n]).rjust(k) for n, k in zip(NAMES, w)))
        lines += ["", "groups (ranks that communicate along each dim):"]
        for name in NAMES + tuple(FLATTENED):
            size = self.size(name)
            label = name if name in NAMES else f"{name} ({' x '.join(FLATTENED[name])})"
            if size == 1:
                lines.append(f"  {label}: size 1, off")
                continue
            groups = self.groups(name)
            crossing = len(self.cross_node_groups(name, G))
            where = ("inside a node" if crossing == 0 else
                     "every group spans nodes" if crossing == len(groups) else f"{crossing} group(s) span nodes")
            cap = max_rows // 4  # a group of 512 ranks is one rank list of ~2,000 characters
            listed = " ".join("[" + ",".join(map(str, g) if len(g) <= cap else [*map(str, g[:cap // 2]), "...",
                                                                                *map(str, g[-2:])])
                              + "]" + (f" ({len(g)} ranks)" if len(g) > cap else "") for g in groups[:8])
            more = f" ... ({len(groups)} groups)" if len(groups) > 8 else ""
            lines.append(f"  {label}: size {size}, {where}: {listed}{more}")
        return "\n".join(lines)

    # ---- the torch DeviceMesh ------------------------------------------------------------------------

    def build_mesh(self, device_type: str, timeout_s: float | None = None):
        """Build the named DeviceMesh (and the flattened dims) over the initialised default group.

        Every rank must call this (group creation is collective). Sub-groups made by DeviceMesh take
        torch's default timeout (30 min gloo, 10 min NCCL), not the one given to init_process_group,
        so the configured timeout is set on each of them here: a stuck collective must fail in
        `timeout_s` on every dim, not only on the world group.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"ParallelDims was made for {self.world_size} processes but the process "
                               f"group has {dist.get_world_size()}")
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=NAMES)
        flat = {}
        for name, parts in FLATTENED.items():
            used = [p for p in parts if getattr(self, p) > 1]
            if len(used) >= 2:
                flat[name] = mesh[parts]._flatten(name)
            else:
                # One (or no) part is > 1: the flattened group equals that dim's group. Reusing it saves
                # world_size / size new process groups, which is most of the build time at scale.
                flat[name] = mesh[used[0] if used else parts[-1]]
        self._mesh, self._flat, self.timeout_s = mesh, flat, timeout_s
        self._ends = self._pipeline_ends(dist, timeout_s)
        if timeout_s is not None:
            set_timeout(self.all_groups(), timeout_s)
        return mesh

    def _pipeline_ends(self, dist, timeout_s):
        """The group of the first and the last pipeline rank that share every other coordinate
        (they hold the two copies of tied embeddings). Every rank creates every such group."""
        if self.pp == 1:
            return None
        mine = None
        for r in range(self.world_size):
            c = self.coords(r)
            if c["pp"] != 0:
                continue
            pair = [r, self.rank_at({**c, "pp": self.pp - 1})]
            kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
            g = dist.new_group(pair, **kw)
            if self.rank in pair:
                mine = g
        return mine

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("the device mesh is not built yet: call plait.launch.init_distributed() "
                               "or ParallelDims.build_mesh() first")
        return self._mesh

    def submesh(self, *names: str):
        """The DeviceMesh over one dim (mesh dim or flattened) or several adjacent mesh dims.

        `submesh("tp")`, `submesh("dp_shard_cp")`, `submesh("dp_replicate", "dp_shard")` (HSDP).
        """
        if len(names) == 1:
            if names[0] == "world":
                return self.mesh
            if names[0] in FLATTENED:
                self.mesh  # noqa: B018  (raises the helpful error if not built)
                return self._flat[names[0]]
            return self.mesh[names[0]]
        if any(n in FLATTENED for n in names):
            # Slicing a flattened dim out of the root works on torch 2.11-2.13 but warns of a future
            # deprecation; the warning is no news to the caller, who asked for exactly this mesh.
            names = tuple(n if n not in FLATTENED or self._flat[n].mesh_dim_names[0] == n
                          else self._flat[n].mesh_dim_names[0] for n in names)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return self.mesh[names]
        return self.mesh[names]

    def group(self, name: str):
        """The ProcessGroup of this rank along dim `name` (mesh dim, flattened dim or "world")."""
        import torch.distributed as dist

        if name == "world":
            self.mesh  # noqa: B018
            return dist.group.WORLD
        if name == "pp_ends":
            self.mesh  # noqa: B018
            if self._ends is None:
                raise ValueError("pp_ends exists only with pp > 1")
            return self._ends
        return self.submesh(name).get_group()

    def lean_group(self, name: str, max_ctas: int):
        """This rank's group along dim `name` on a second communicator whose collectives take at
        most `max_ctas` thread blocks (NCCL runs one per SM): communication that overlaps compute
        then leaves the compute more of the GPU. The same ranks as `group(name)`; that group itself
        where the backend is not NCCL or the dim has one rank. Every rank must call it (creating a
        group is collective), in the same order."""
        import torch.distributed as dist

        if self.size(name) == 1 or "nccl" not in str(dist.get_backend()).lower():
            return self.group(name)
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max_ctas
        opts.config.min_ctas = 1
        kw = {"timeout": timedelta(seconds=self.timeout_s)} if self.timeout_s is not None else {}
        mine = None
        for ranks in self.groups(name):
            g = dist.new_group(ranks, pg_options=opts, **kw)
            if self.rank in ranks:
                mine = g
        return mine

    def all_groups(self) -> list:
        import torch.distributed as dist

        groups = [dist.group.WORLD] + list(self.mesh.get_all_groups())
        groups += [m.get_group() for m in self._flat.values()]
        if self._ends is not None:
            groups.append(self._ends)
        unique = {id(g): g for g in groups}
        return list(unique.values())

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def my_coords(self) -> dict[str, int]:
        return self.coords(self.rank)


def set_timeout(groups, timeout_s: float) -> None:
    """Set the collective timeout of each group (gloo: the op raises; NCCL: the watchdog aborts)."""
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:  # very old torch: sub-groups keep the default timeout
        warnings.warn("this torch cannot set sub-group timeouts; parallel.timeout_s applies to the world group only",
                      stacklevel=2)
        return
    for g in groups:
        setter(timedelta(seconds=timeout_s), g)
