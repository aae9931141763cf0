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
    from plait.errors import UserError, bad_value
    from plait.parallel.dims import ParallelDims

    if args.dp is not None and args.dp_shard is not None and args.dp != args.dp_shard:
        raise UserError(f"--dp {args.dp} and --dp-shard {args.dp_shard} disagree: give one of them")
    dp_flag = "--dp" if args.dp is not None else "--dp-shard"
    dp_shard = args.dp if args.dp is not None else args.dp_shard
    # each flag is checked here: ParallelDims would blame their product ("world size = 0") or the
    # config's names (parallel.tp), which this command does not take
    for flag, val in (("--nproc", args.nproc), ("--dp-replicate", args.dp_replicate), ("--tp", args.tp),
                      ("--pp", args.pp), ("--cp", args.cp), ("--gpus-per-node", args.gpus_per_node)):
        if val is not None and val < 1:
            raise bad_value(flag, val, "must be a positive integer")
    if dp_shard is not None and dp_shard < 1 and not (dp_shard == -1 and args.nproc is not None):
        raise bad_value(dp_flag, dp_shard, "must be a positive integer (or leave it out and give --nproc to infer it)")
    others = args.dp_replicate * args.tp * args.pp * args.cp
    degrees = f"--dp-replicate {args.dp_replicate} x --tp {args.tp} x --pp {args.pp} x --cp {args.cp}"
    if args.nproc is None:
        dp_shard = 1 if dp_shard is None else dp_shard
        world = dp_shard * others
    elif dp_shard is None or dp_shard == -1:
        world, dp_shard = args.nproc, -1
        if args.nproc % others:
            raise bad_value("--nproc", args.nproc, f"is not divisible by {degrees} = {others}, so --dp cannot be "
                            f"inferred; give degrees whose product divides {args.nproc}")
    else:
        world = args.nproc
        if dp_shard * others != world:
            product = dp_shard * others
            raise bad_value("--nproc", args.nproc, f"differs from {dp_flag} {dp_shard} x {degrees} = {product}; "
                            f"give --nproc {product}, or leave {dp_flag} out to infer it")
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=dp_shard, cp=args.cp, tp=args.tp, pp=args.pp,
                        world_size=world)
    G = args.gpus_per_node
    warning = dims.check_placement(G, allow_cross_node_tp=True)  # the policy is dims'; the words are mesh's
    if warning:
        spanning = dims.cross_node_groups("tp", G)
        problem = (f"--tp = {dims.tp}: {len(spanning)} tensor-parallel group(s) span nodes of {G} GPUs (e.g. ranks "
                   f"{spanning[0]}), and TP needs the links inside a node; use a --tp that divides --gpus-per-node {G}")
        if not args.allow_cross_node_tp:
            raise UserError(f"{problem}, or pass --allow-cross-node-tp to show the layout anyway")
        warning = f"warning: {problem}"
    print(dims.describe(G, max_rows=10**9 if args.all else 64))
    if warning:
        print(f"\n{warning}")
    return 0
