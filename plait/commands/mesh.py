"""`plait mesh`: print where each rank sits (node, GPU, mesh coordinates) and the groups per dim."""

from __future__ import annotations

NAME = "mesh"
HELP = "show the device mesh of a parallel layout: rank -> (node, gpu, coords) and the groups"


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, help="world size (default: the product of the degrees given)")
    p.add_argument("--dp", type=int, help="data-parallel degree (parallel.dp_shard; DDP or ZeRO)")
    p.add_argument("--dp-shard", type=int, dest="dp_shard", help="same as --dp")
    p.add_argument("--dp-replicate", type=int, default=1, dest="dp_replicate", help="HSDP replicas")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    p.add_argument("--gpus-per-node", type=int, default=8, dest="gpus_per_node", help="GPUs per node (default 8)")
    p.add_argument("--allow-cross-node-tp", action="store_true", dest="allow_cross_node_tp",
                   help="warn instead of refusing when a TP group spans nodes")
    p.add_argument("--all", action="store_true", help="list every rank, even for large worlds")


def run(args, extra) -> int:
    from plait.errors import UserError
    from plait.parallel.dims import ParallelDims

    if args.dp is not None and args.dp_shard is not None and args.dp != args.dp_shard:
        raise UserError(f"--dp {args.dp} and --dp-shard {args.dp_shard} disagree: give one of them")
    dp_shard = args.dp if args.dp is not None else args.dp_shard
    if args.nproc is None:
        dp_shard = 1 if dp_shard is None else dp_shard
        world = dp_shard * args.dp_replicate * args.tp * args.pp * args.cp
    else:
        world, dp_shard = args.nproc, -1 if dp_shard is None else dp_shard
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=dp_shard, cp=args.cp, tp=args.tp, pp=args.pp,
                        world_size=world)
    warning = dims.check_placement(args.gpus_per_node, args.allow_cross_node_tp)
    print(dims.describe(args.gpus_per_node, max_rows=10**9 if args.all else 64))
    if warning:
        print(f"\n{warning}")
    return 0
