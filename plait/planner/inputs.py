"""Turn command-line values into the planner's objects: model dims, cluster, layout, search space.

Kept out of `plait/commands/plan.py` so the command only parses and prints, and so other callers
(a later `plan --validate`, notebooks) build the same objects the same way.
"""

from __future__ import annotations

from plait.config import PRESETS, ModelConfig, dotted_pairs
from plait.errors import UserError, bad_value
from plait.parallel import rules
from plait.parallel.schedules import default_v
from plait.planner.costs import ModelDims
from plait.planner.hardware import Cluster, apply_overrides, cluster
from plait.planner.layout import Layout
from plait.planner.search import Space

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")
LAYOUT_FLAGS = ("tp", "pp", "dp", "cp")


def model_dims(preset: str | None, arch: str = "llama", tie: bool | None = None, **shape) -> ModelDims:
    """A preset's shape with explicit values over it, or a shape given in full."""
    given = {k: v for k, v in shape.items() if v is not None}
    for k, v in given.items():
        if v < 1:
            raise bad_value(f"--{k.replace('_', '-')}", v, "must be a positive integer")
    if preset:
        if preset not in PRESETS:
            raise bad_value("--model", preset, f"choose one of {', '.join(PRESETS)} or give the shape "
                            f"(--layers --hidden --heads --vocab --seq ...)")
        base = ModelDims.from_config(ModelConfig(preset=preset, **PRESETS[preset]))
        vals = {k: getattr(base, k) for k in SHAPE_FLAGS}
        vals.update(given)
        _check_heads(vals["hidden"], vals["heads"], arch, given)
        return ModelDims(**vals, arch=arch, tie_embeddings=base.tie_embeddings if tie is None else tie)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in given]
    if missing:
        raise UserError(f"--model is not set and the shape misses --{' --'.join(m.replace('_', '-') for m in missing)}: "
                        f"give --model PRESET ({', '.join(PRESETS)}) or the whole shape")
    heads = given["heads"]
    given.setdefault("kv_heads", heads)
    _check_heads(given["hidden"], heads, arch, given)
    if "ffn" not in given:
        given["ffn"] = 4 * given["hidden"] if arch == "gpt" else _swiglu_ffn(given["hidden"])
    return ModelDims(**given, arch=arch, tie_embeddings=(arch == "gpt") if tie is None else tie)


def _check_heads(hidden: int, heads: int, arch: str, given: dict) -> None:
    """The head-size rule `plait train` applies (`rules.check_heads`; llama's RoPE wants an even head
    size, GPT's learned positions do not), blaming the flag the user gave: --hidden over a preset's
    heads, else --heads."""
    blame = "hidden" if "hidden" in given and "heads" not in given else "heads"
    rules.check_heads(hidden=hidden, heads=heads, rope=arch == "llama", blame=blame, field=rules.flag_field)


def _swiglu_ffn(h: int) -> int:
    """Llama's default SwiGLU width: 8h/3 rounded up to a multiple of 256."""
    return -(-int(8 * h / 3) // 256) * 256


def parse_overrides(extra: list[str]) -> dict[str, str]:
    """`--link.nvlink-gbps 370 --gpu.tflops=900` -> {"link.nvlink-gbps": "370", "gpu.tflops": "900"}."""
    return dict(dotted_pairs(extra, "--link.nvlink-gbps 370 or --gpu.tflops 900 (see plait plan --help)"))


def make_cluster(gpu: str, nodes: int, gpus_per_node: int, overrides: dict[str, str]) -> Cluster:
    return apply_overrides(cluster(gpu, nodes, gpus_per_node), overrides)


def check_positive(**counts) -> None:
    """Reject a degree or count given as 0 or less. None means not given; 0 must not read as that
    (it is falsy, so `tp or 1` used to turn --tp 0 into tp 1), nor reach the search as a pin that
    divides by zero."""
    for name, val in counts.items():
        if val is not None and val < 1:
            raise bad_value(f"--{name.replace('_', '-')}", val, "must be a positive integer")


def _given(val) -> int:
    """The value given, else 1 (`val or 1` would also turn a 0 into 1)."""
    return 1 if val is None else val


def make_layout(c: Cluster, tp=None, pp=None, dp=None, cp=None, dp_replicate=None, zero=None, v=None,
                schedule=None, micro_batch=None, recompute=None, sp=True, compile=True, cp_impl=None,
                stage_split="", head_in_forward=False, recompute_matmuls=0.0, zero3_whole_root=False,
                zero3_cast_once=False, eager_head=False, fp8="off", zero3_fp8_gather=False,
                head_wgrad_in_b=False, grad_overlap=True, recompute_whole=False, embedding_rows="auto",
                grads_whole=False, loss_logits_held=False, wgrad_batched=False, embed_copy=False) -> Layout:
    """A full layout from the degrees given; dp defaults to what the others leave."""
    check_positive(tp=tp, pp=pp, dp=dp, cp=cp, dp_replicate=dp_replicate, v=v, micro_batch=micro_batch)
    tp, pp, cp = _given(tp), _given(pp), _given(cp)
    if dp is None:
        if c.n_gpus % (tp * pp * cp):
            raise UserError(f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide the {c.n_gpus} GPUs "
                            f"({c.nodes} x {c.gpus_per_node}): choose degrees whose product divides it")
        dp = c.n_gpus // (tp * pp * cp)
    elif tp * pp * dp * cp != c.n_gpus:
        # the flag given is what is off (the degrees' product is checked later without knowing which)
        fix = (f"use --dp {c.n_gpus // (tp * pp * cp)} or leave --dp out" if c.n_gpus % (tp * pp * cp) == 0
               else f"tp x pp x cp = {tp * pp * cp} does not divide them either")
        if _given(dp_replicate) > 1:  # train's --dp is the shard group; plan's counts the replicas too
            fix += f" (plan's --dp counts every data-parallel rank, dp_shard x dp_replicate {_given(dp_replicate)})"
        raise bad_value("--dp", dp, f"tp {tp} x pp {pp} x dp {dp} x cp {cp} = {tp * pp * dp * cp} GPUs, but the "
                        f"cluster has --nodes {c.nodes} x --gpus-per-node {c.gpus_per_node} = {c.n_gpus}: {fix}")
    rep = _given(dp_replicate)
    if dp % rep:
        raise bad_value("--dp-replicate", rep, f"must divide --dp = {dp}")
    if rep > 1 and not zero:  # priced as plain DDP over all of --dp, labelled as HSDP
        raise bad_value("--dp-replicate", rep, "replicates ZeRO's shard groups (HSDP): it needs --zero 1, 2 or 3 "
                        "(DDP, --zero 0, replicates over all of --dp already)")
    if rep > 1 and rep == dp:
        raise bad_value("--dp-replicate", rep, "equal to --dp leaves ZeRO a shard group of one GPU (plain "
                        "replicas): give a --dp-replicate that leaves a group to shard over, or --zero 0 without it")
    return Layout(tp=tp, pp=pp, dp_replicate=rep, dp_shard=dp // rep, cp=cp, zero=0 if zero is None else zero,
                  v=default_v(schedule or "1f1b") if v is None else v, schedule=schedule or "1f1b", micro_batch=_given(micro_batch),
                  recompute=recompute or "none", sp=sp, compile=compile, cp_impl=cp_impl or "ring",
                  stage_split=stage_split or "", head_in_forward=head_in_forward, recompute_matmuls=recompute_matmuls,
                  zero3_whole_root=zero3_whole_root, zero3_cast_once=zero3_cast_once, eager_head=eager_head, fp8=fp8,
                  zero3_fp8_gather=zero3_fp8_gather, head_wgrad_in_b=head_wgrad_in_b, grad_overlap=grad_overlap,
                  recompute_whole=recompute_whole, embedding_rows=embedding_rows, grads_whole=grads_whole,
                  loss_logits_held=loss_logits_held, wgrad_batched=wgrad_batched, embed_copy=embed_copy)


def make_space(tp=None, pp=None, cp=None, dp_replicate=None, zero=None, v=None, schedule=None,
               micro_batch=None, recompute=None, sp=True, compile=True, cp_impl=None, stage_split=None,
               fp8="off", dp=None) -> Space:
    """The search space with every flag the user gave pinned."""
    check_positive(tp=tp, pp=pp, cp=cp, dp=dp, dp_replicate=dp_replicate, v=v, micro_batch=micro_batch)
    s = Space(sp=sp, compile=compile, fp8=fp8)
    pins = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "dp_replicate": dp_replicate, "zero": zero, "v": v,
            "schedule": schedule, "micro_batch": micro_batch, "recompute": recompute, "stage_split": stage_split,
            "cp_impl": cp_impl}
    from dataclasses import replace
    return replace(s, **{k: (val,) for k, val in pins.items() if val is not None})
