"""`plait plan`: predict memory, traffic, step time and MFU of a layout, or search for the best one."""

from __future__ import annotations

import sys

from plait.parallel.schedules import SCHEDULES
from plait.planner.memory import PRECISIONS

NAME = "plan"
HELP = ("Predict memory per GPU, traffic per mesh dim, step time and MFU of a parallel layout, or "
        "search for the fastest layout that fits")
TAKES_OVERRIDES = True  # --link.<kind>-gbps / --gpu.<field> hardware overrides
FLAG_HINTS = {"--gpus": "a cluster is --nodes N --gpus-per-node G (64 GPUs: --nodes 8 --gpus-per-node 8)"}


def add_arguments(p) -> None:
    m = p.add_argument_group("model (a preset, or the shape; explicit values override the preset)")
    m.add_argument("--model", help="preset: tiny, small, 125m, 1b, 8b, 70b, 405b")
    m.add_argument("--arch", default="llama", choices=("llama", "gpt"),
                   help="llama (plait's model) or gpt (GPT-2/3, Megatron's benchmarks)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        m.add_argument(f"--{flag}", type=int)
    m.add_argument("--tie-embeddings", choices=("on", "off"),
                   help="the output head shares the embedding's matrix (model.tie_embeddings; default: the "
                        "preset's; a shape given in full: off for llama, as Llama 3 8B-405B, on for gpt)")
    h = p.add_argument_group("cluster (override the catalog with --link.<kind>-gbps X, --link.<kind>-latency-us X, "
                             "--link.intra/inter KIND, --gpu.tflops X, --gpu.hbm-gib X, --gpu.efficiency X, ...)")
    h.add_argument("--gpu", default="h100", help="v100, a100-40gb, a100-80gb, h100, h100-pcie, h200, b200")
    h.add_argument("--hardware", metavar="FILE",
                   help="a profile measured by `plait bench calibrate`: matmuls, attention, collectives and "
                        "the optimizer cost what that machine measured (default: data-sheet peaks x efficiency); "
                        "several, comma-separated, one a card: the plan takes --gpu's, --check each run's")
    h.add_argument("--nodes", type=int, default=1)
    h.add_argument("--gpus-per-node", type=int, default=8)
    t = p.add_argument_group("training step")
    t.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    t.add_argument("--micro-batch", type=int, help="sequences per micro-batch per data-parallel rank")
    t.add_argument("--precision", default="mixed", choices=tuple(PRECISIONS),
                   help="bytes per parameter: mixed = ZeRO paper and plait (2+2+12), lecture = 2+2+8, fp32; "
                        "mixed-fp32-reduce = mixed with gradients reduced in fp32 (FSDP2's reduce_dtype)")
    lay = p.add_argument_group("layout (giving any of --tp --pp --dp --cp predicts that layout; dp defaults "
                               "to what the others leave; without them, or with --search, plan searches)")
    helps = {"dp": "every data-parallel rank: dp_shard x dp_replicate (train's --dp is parallel.dp_shard: "
                   "train --dp 4 --parallel.dp_replicate 2 is plan --dp 8 --dp-replicate 2)",
             "dp-replicate": "HSDP: replicas of the ZeRO shard group; divides --dp"}
    for flag in ("tp", "pp", "dp", "cp", "dp-replicate", "v"):
        lay.add_argument(f"--{flag}", type=int, help=helps.get(flag))
    lay.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    lay.add_argument("--zero3-cast-once", action="store_true",
                     help="ZeRO-3 keeps each unit's 16-bit chunk from its first gather of a step to the update "
                          "(parallel.zero3_cast_once): one cast a step, 2 bytes a parameter over N more memory")
    lay.add_argument("--fp8", choices=("off", "tensorwise", "rowwise"), default="off",
                     help="the blocks' linears as FP8 GEMMs with this scaling (train.fp8); priced from the "
                          "profile's measured FP8 linears (`plait bench calibrate --only fp8`), else the card's FP8 peak")
    lay.add_argument("--zero3-fp8-gather", action="store_true",
                     help="ZeRO-3 gathers the blocks' weights in FP8 (parallel.zero3_fp8_gather; --fp8 tensorwise)")
    lay.add_argument("--schedule", choices=SCHEDULES)
    lay.add_argument("--recompute", choices=("none", "selective", "full"))
    lay.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    lay.add_argument("--stage-layers", default="", metavar="SPLIT",
                     help="layers per pipeline stage: balance (the last stage lighter by its output head) or "
                          "counts like 9,7 (default: as even as possible)")
    lay.add_argument("--cp-impl", choices=("ring", "ulysses"), default=None,
                     help="context parallelism by ring (K/V around the ranks) or ulysses (all-to-all of heads); "
                          "a layout given without it is priced with the ring, a search tries both")
    lay.add_argument("--no-compile", action="store_true",
                     help="price eager blocks (train.compile off): the activations they keep (their time is priced as compiled)")
    o = p.add_argument_group("output")
    o.add_argument("--search", action="store_true", help="search even when layout flags are given (they pin it)")
    o.add_argument("--top", type=int, default=10, help="layouts to list when searching (at least 1)")
    o.add_argument("--json", action="store_true", help="machine-readable output (stable keys, schema plait.plan/1)")
    o.add_argument("--explain", action="store_true",
                   help="show every formula with its numbers (a search: the best layout's; --json: under \"explain\")")
    o.add_argument("--placement", action="store_true",
                   help="also print which node and GPU each rank gets (a search: the best layout's; "
                        "--json: under \"placement\")")
    o.add_argument("--validate", action="store_true",
                   help="run the layout here for a few steps and print predicted vs measured (data-parallel layouts)")
    o.add_argument("--validate-steps", type=int, default=None, help="steps of the --validate run (default 6)")
    o.add_argument("--validate-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the --validate run trains (auto: the GPUs if there are any)")
    o.add_argument("--check", metavar="DIR",
                   help="instead: predict every plait run recorded in DIR (bench/results) and print predicted vs "
                        "measured step time and peak memory with the errors (with --hardware: for runs on its GPU)")
    o.add_argument("--published", action="store_true",
                   help="instead: predict the published runs of other systems (plait/planner/published.py) and "
                        "print predicted vs measured tokens/s/GPU with the errors")
    o.add_argument("--fleet-jobs", type=int, default=0,
                   help="instead: place N random jobs on the cluster with each placement policy and compare")
    o.add_argument("--seed", type=int, default=0, help="seed of the --fleet-jobs trace")


def run(args, extra) -> int:
    from plait.errors import UserError, bad_value
    from plait.planner import inputs, report
    from plait.planner.layout import check_fp8
    from plait.planner.placement import place
    from plait.planner.predict import predict
    from plait.planner.search import search

    _check_counts(args)
    _check_modes(args)
    profiles, profile, path = {}, None, None
    for flag, value in (("--hardware", args.hardware), ("--check", args.check)):
        if value is not None and not value.strip(", "):  # an unset variable planned with data-sheet figures, unsaid
            raise bad_value(flag, value, "is empty; give a file or folder")
    if args.hardware:
        from plait.planner.profile import load

        for f in (x for x in args.hardware.split(",") if x):
            prof = load(f)
            if prof.gpu in profiles:
                raise bad_value("--hardware", args.hardware, f"two profiles of one card ({prof.gpu}): give one a card")
            profiles[prof.gpu] = (prof, f)
    if args.check:
        from plait.planner import recorded

        runs = recorded.load(args.check)
        if not runs:  # else empty tables and exit 0, as if every prediction had matched
            raise UserError(f"--check {args.check}: no recorded plait runs in {args.check} (the *.json results of "
                            f"{', '.join(recorded.BENCHES)} on a card the planner knows); point it at plait's "
                            f"bench/results")
        checks = recorded.check(runs, {g: prof for g, (prof, _) in profiles.items()} or None)
        if args.json:
            print(report.to_json({"schema": report.SCHEMA, "mode": "check", "check": recorded.rows(checks)}))
            return 0
        print(recorded.table(checks))
        print("\npipeline bubbles: measured on the run, the planner's for the split that ran, the textbook's\n"
              + recorded.bubble_table(checks))
        return 0
    if profiles:
        if len(profiles) == 1:
            profile, path = next(iter(profiles.values()))
        elif args.gpu in profiles:
            profile, path = profiles[args.gpu]
        else:
            raise bad_value("--hardware", args.hardware, f"none of these profiles is of --gpu {args.gpu}: "
                            f"plan with --gpu {' or '.join(sorted(profiles))}")
    if args.published:
        from plait.planner import published

        checks = published.check()
        print(report.to_json({"schema": report.SCHEMA, "mode": "published", "published": published.rows(checks)}) if args.json
              else published.table(checks))
        return 0
    c = inputs.make_cluster(args.gpu, args.nodes, args.gpus_per_node, inputs.parse_overrides(extra))
    if args.precision == "fp32":  # fp32 matmuls run at the card's fp32 rate, not its bf16 tensor cores'
        if args.fp8 != "off":  # priced FP8 GEMMs over the fp32 peak: an MFU of 192%
            raise bad_value("--fp8", args.fp8, "FP8 linears train under mixed precision (bf16 around them, fp32 "
                            "masters): drop --precision fp32")
        if profile is not None:
            raise bad_value("--precision", "fp32", f"{path} measured 16-bit matmuls; plan fp32 without --hardware "
                            "(priced from the card's fp32 peak)")
        import dataclasses

        c = dataclasses.replace(c, dtype="fp32")
    if profile is not None:
        from plait.planner.profile import apply_profile

        c = apply_profile(c, profile, path)
    if args.fleet_jobs:
        return _fleet(args, c)
    tie = None if args.tie_embeddings is None else args.tie_embeddings == "on"
    d = inputs.model_dims(args.model, args.arch, tie, layers=args.layers, hidden=args.hidden,
                          heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab, seq=args.seq)
    knobs = dict(zero=args.zero, v=args.v, schedule=args.schedule, micro_batch=args.micro_batch,
                 recompute=args.recompute, sp=not args.no_sp, compile=not args.no_compile,
                 cp_impl=args.cp_impl, fp8=args.fp8)
    if args.zero3_fp8_gather:
        # ask only for what is missing: a flag already given read as if it had been left out
        missing = [f for f, ok in (("--zero 3", args.zero == 3), ("--fp8 tensorwise", args.fp8 == "tensorwise"))
                   if not ok]
        if missing:
            raise bad_value("--zero3-fp8-gather", True, f"it gathers tensorwise FP8 weights under ZeRO-3: "
                            f"set {' '.join(missing)}")
        knobs["zero3_fp8_gather"] = True
    if args.stage_layers:
        knobs["stage_split"] = args.stage_layers
    if args.zero3_cast_once:
        if args.zero != 3:
            raise bad_value("--zero3-cast-once", True, "it prices ZeRO-3's kept casts: add --zero 3")
        knobs["zero3_cast_once"] = True
    check_fp8(args.fp8, c)  # before the search, which would otherwise reject every layout for it
    head = report.header_dict(d, c, args.global_batch, args.precision)
    given = any(getattr(args, k) is not None for k in ("tp", "pp", "dp", "cp"))
    if args.schedule is not None and given and (args.pp or 1) == 1:  # 1f1b too: asked for, it is not the default
        raise bad_value("--schedule", args.schedule, "orders a pipeline's stages: it needs --pp > 1 (without a "
                        "pipeline, drop --schedule)")
    if args.cp_impl is not None and given and (args.cp or 1) == 1 and not args.search:  # priced as if never given
        raise bad_value("--cp-impl", args.cp_impl, "chooses how context parallelism splits attention: it needs "
                        "--cp > 1 (without it, drop --cp-impl)")
    if args.validate_steps is not None and not args.validate:
        raise bad_value("--validate-steps", args.validate_steps, "counts the steps of a --validate run: add "
                        "--validate, or drop --validate-steps")
    if args.validate:
        return _validate(args, d, c, knobs, head)
    if given and not args.search:
        lay = inputs.make_layout(c, tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp,
                                 dp_replicate=args.dp_replicate, **knobs)
        p = predict(d, lay, c, args.global_batch, args.precision)
        if args.json:
            doc = {**head, "mode": "breakdown", "prediction": report.prediction_dict(p)}
            print(report.to_json(_details(doc, args, p, c)))
            return 0
        print(report.title(d, c, args.global_batch, args.precision))
        print(report.breakdown_text(p, args.explain))
        if args.placement:
            print("\n" + place(lay.sizes(), c.nodes, c.gpus_per_node).table())
        return 0
    _check_degrees(args, c.n_gpus)  # --dp pins the search like the others
    _check_pins(args, d, c)
    for knob in ("zero3_cast_once", "zero3_fp8_gather"):
        if knobs.pop(knob, False):
            raise bad_value(f"--{knob.replace('_', '-')}", True, "it prices a given layout, the search does not try "
                            "it: give the layout (--dp, --tp, ...) without --search")
    space = inputs.make_space(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, dp_replicate=args.dp_replicate, **knobs)
    if args.schedule is not None or (args.v or 1) > 1:  # they order a pipeline: pp = 1 has neither (v 1: no chunks)
        import dataclasses

        with_v = ("interleaved", "zbv") if args.v == 2 else ("interleaved",)  # the schedules with virtual stages
        space = dataclasses.replace(space, pipeline_only=True,
                                    schedule=space.schedule if args.schedule is not None or args.v is None else with_v)
    res = search(d, c, args.global_batch, args.precision, space, top=args.top, progress=_search_progress())
    best = res.best if res.ranked else None
    if args.json:
        doc = {**head, "mode": "search", "considered": res.considered, "rejected": dict(res.rejected),
               "ranked": [report.prediction_dict(p) for p in res.ranked],
               # the text shows it ("fastest layout that does not fit"): the one answer when nothing fits
               "fastest_not_fitting": (report.prediction_dict(res.example_oom) if res.example_oom is not None
                                       else None)}
        print(report.to_json(_details(doc, args, best, c)))
        return 0 if res.ranked else 1
    print(report.title(d, c, args.global_batch, args.precision))
    print(report.ranking_text(res))
    if args.explain and best:
        print("\nbest layout in detail:\n" + report.breakdown_text(best, explain=True))
    if args.placement and best:
        print("\nbest layout's placement:\n" + place(best.layout.sizes(), c.nodes, c.gpus_per_node).table())
    return 0 if res.ranked else 1


def _check_pins(args, d, c) -> None:
    """The model must split at the degrees a search pins, as a priced layout must: one line (a
    pipeline pinned deeper than the layers ended in a traceback of the stage split)."""
    from plait.errors import bad_value
    from plait.parallel import rules

    if args.v is not None and args.schedule is not None:  # (zbv --v 3 was searched at v 2, unsaid)
        from plait.parallel.schedules import check_args

        check_args(args.schedule, max(2, args.pp or 2), max(2, args.pp or 2), args.v, field=rules.flag_field)
    if (args.micro_batch or 0) > 0 and args.global_batch % args.micro_batch:  # no data-parallel degree takes it
        raise bad_value("--micro-batch", args.micro_batch, f"must divide --global-batch {args.global_batch}: every "
                        "data-parallel rank runs whole micro-batches of it")
    rules.check_split(heads=d.heads, kv_heads=d.kv_heads, ffn=d.ffn, layers=d.layers, seq=d.seq, tp=args.tp or 1,
                      pp=args.pp or 1, v=args.v or 1, cp=args.cp or 1, sp="off", cp_impl=args.cp_impl or "ring",
                      field=rules.flag_field)
    if args.tp is not None:  # every candidate would be rejected for it: "126 rejected: --tp constraint"
        rules.check_tp_in_node(args.tp, c.gpus_per_node, field=rules.flag_field)


def _check_modes(args) -> None:
    """--check, --published, --fleet-jobs and --validate each do one thing of their own: given
    together, or with a layout they do not read, all but one were silently ignored."""
    from plait.errors import UserError, bad_value

    modes = [f for f, on in (("--check", args.check), ("--published", args.published),
                             ("--fleet-jobs", args.fleet_jobs), ("--validate", args.validate)) if on]
    if len(modes) > 1:
        raise UserError(f"{modes[0]} and {modes[1]} are modes of their own: give one of them")
    layout = [f"--{k}" for k in ("tp", "pp", "dp", "cp") if getattr(args, k) is not None]
    layout += ["--search"] if args.search else []
    if modes and modes[0] != "--validate" and layout:
        what = {"--check": "the recorded runs' own layouts", "--published": "the published runs' own layouts",
                "--fleet-jobs": "random jobs"}[modes[0]]
        raise bad_value(modes[0], getattr(args, modes[0][2:].replace("-", "_")), f"prices {what} and reads no "
                        f"layout: drop {' '.join(layout)}")
    if args.validate and args.search:
        raise bad_value("--validate", True, "runs the one layout given: drop --search (search first, then "
                        "--validate the layout it ranks first)")


def _check_degrees(args, n: int) -> None:
    """The degrees a search pins must fit the cluster together: one line, before searching for none."""
    from plait.errors import UserError
    from plait.planner.inputs import check_positive

    given = {k: getattr(args, k) for k in ("tp", "pp", "cp", "dp") if getattr(args, k) is not None}
    check_positive(**given)
    used = 1
    for v in given.values():
        used *= v
    flags = " ".join(f"--{k} {v}" for k, v in given.items())
    if n % used:
        raise UserError(f"{flags}: their product, {used}, does not divide the cluster's {n} GPUs: pick degrees "
                        f"whose product divides {n}, or leave one out for the search to choose")
    if len(given) == 4 and used != n:
        raise UserError(f"{flags}: their product is {used}, but the cluster has {n} GPUs: give --dp "
                        f"{n * given['dp'] // used} or leave --dp out")


def _check_counts(args) -> None:
    """The counts argparse takes as any integer: 0 or a negative means nothing, and would otherwise
    print an empty search, slice the ranking (--top -1 drops its last row) or compare no jobs."""
    from plait.errors import bad_value

    if args.global_batch < 1:
        raise bad_value("--global-batch", args.global_batch, "must be a positive number of sequences")
    if args.top < 1:
        raise bad_value("--top", args.top, "must be at least 1 (the layouts a search lists)")
    if args.fleet_jobs < 0:
        raise bad_value("--fleet-jobs", args.fleet_jobs, "must be 0 (no fleet comparison) or a positive number of jobs")


def _details(doc: dict, args, p, c) -> dict:
    """--explain and --placement in the JSON (of the prediction `p`, a search's best), under keys of
    their own: absent without the flags, so the default document keeps its shape."""
    from plait.planner.placement import place

    if p is None:
        return doc
    if args.explain:
        doc["explain"] = [{"quantity": k, "formula": v} for k, v in p.explain]
    if args.placement:
        doc["placement"] = [{"rank": r, "node": n, "gpu": g, "coords": dict(xy)}
                            for r, n, g, xy in place(p.layout.sizes(), c.nodes, c.gpus_per_node).rows]
    return doc


def _fleet(args, c) -> int:
    """--fleet-jobs: the same random jobs placed by each policy, as text or (--json) a document."""
    from plait.planner import fleet, report

    jobs = fleet.random_jobs(args.fleet_jobs, c.nodes, c.gpus_per_node, args.seed)
    runs = [fleet.run(jobs, c.nodes, c.gpus_per_node, policy) for policy in fleet.POLICIES]
    if args.json:
        rows = [{"policy": r.policy, "placed": len(r.placed), "refused": len(r.unplaceable),
                 "split_jobs": len(r.split_jobs), "mean_fragmentation": r.mean_fragmentation} for r in runs]
        print(report.to_json({"schema": report.SCHEMA, "mode": "fleet", "jobs": args.fleet_jobs, "seed": args.seed,
                              "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "fleet": rows}))
        return 0
    for r in runs:
        print(f"{r.policy:>9}: placed {len(r.placed)}, refused {len(r.unplaceable)}, placed with a TP group "
              f"cut across nodes {len(r.split_jobs)}, mean fragmentation {r.mean_fragmentation:.1%}")
    return 0


def _validate(args, d, c, knobs, head) -> int:
    """Predict the given layout, run it with plait's trainer, print both side by side."""
    import torch

    from plait.errors import UserError, bad_value
    from plait.planner import inputs, report
    from plait.planner import validate as v
    from plait.planner.predict import predict

    if args.arch != "llama":
        raise bad_value("--arch", args.arch, "--validate runs plait's own (llama) model; use --arch llama")
    if args.validate_steps is None:
        args.validate_steps = 6
    if args.validate_steps < 1:
        raise bad_value("--validate-steps", args.validate_steps, "must be at least 1")
    if not any(getattr(args, k) is not None for k in ("tp", "pp", "dp", "cp")):
        raise UserError("--validate needs a layout to run: give --dp (and --zero, --micro-batch)")
    cuda = torch.cuda.is_available() if args.validate_device == "auto" else args.validate_device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise bad_value("--validate-device", "cuda", "no GPU is visible; use --validate-device cpu")
    # the run compiles as `train.compile = auto` does: on a GPU, not on a CPU
    knobs = dict(knobs, compile=knobs["compile"] and cuda)
    lay = inputs.make_layout(c, tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp,
                             dp_replicate=args.dp_replicate, **knobs)
    precision = v.cpu_prediction_args(args.precision, cuda)
    p = predict(d, lay, c, args.global_batch, precision)
    from plait.launch import SpawnError, Stopped

    try:
        measured = v.measure(args.model, d, lay, args.global_batch, args.validate_steps, cuda)
    except Stopped as e:  # SIGTERM (a `timeout`, a scheduler): the workers were ended; was the launcher's traceback
        print(f"plait {NAME}: --validate run stopped by {e.signame}; nothing was measured", file=sys.stderr)
        return 143
    except SpawnError as e:  # a worker died or raised: one report, as `plait train` gives it
        if e.traceback:
            print(e.traceback.rstrip(), file=sys.stderr)
        print(f"plait {NAME}: error: --validate run failed: {e}", file=sys.stderr)
        return 1
    if args.json:
        rows = [{"quantity": n, "predicted": a, "measured": b, "comparable": ok} for n, a, b, ok in v.compare(p, measured)]
        print(report.to_json({**head, "mode": "validate", "prediction": report.prediction_dict(p),
                              "measured": measured, "comparison": rows}))
        return 0
    print(report.title(d, c, args.global_batch, precision))
    print(v.report(p, measured))
    return 0


def _search_progress():
    """On a terminal, a line on stderr that counts the layouts screened (erased when done); None
    where stderr is a file or pipe, whose reader wants the result alone."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\r\033[K" if done >= total - total % 1000 else "\r"
        print(f"\rsearching: {done:,} of {total:,} layouts screened", end=end, file=sys.stderr, flush=True)

    return show
