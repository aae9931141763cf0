"""A parallel layout: the degree of every mesh dimension and the per-step knobs, validated against
a model, a cluster and a global batch before anything is costed.

Data-parallel ranks split into dp_replicate x dp_shard (HSDP). ZeRO stage `zero` shards over the
ranks that hold the same parameters: dp_shard x cp (context-parallel ranks hold the same weights,
as in `plait.parallel.dims`' dp_shard_cp). Gradients are summed over dp_replicate x dp_shard x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import UserError, bad_value
from plait.parallel import rules
from plait.parallel.stages import stage_layers  # noqa: F401  (the split the runtime uses)
from plait.parallel.schedules import SCHEDULES, SPLIT_BACKWARD, check_args, check_no_pipeline
from plait.planner.costs import RECOMPUTE, ModelDims
from plait.planner.hardware import GPUS, Cluster

FP8_RECIPES = ("off", "tensorwise", "rowwise")  # plait.fp8.RECIPES, and off


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    zero: int = 0
    v: int = 1
    schedule: str = "1f1b"
    micro_batch: int = 1
    recompute: str = "none"
    sp: bool = True
    """Sequence parallelism inside TP regions whenever tp > 1: `plait train`'s parallel.sp = auto
    (`plait.parallel.rules.sequence_parallel`); False = off."""
    stage_split: str = ""
    """Layers per pipeline stage as `parallel.stage_layers` gives them: "" even, "balance" (the last
    stage lighter by its output head), or explicit counts "9,7"."""
    cp_impl: str = "ring"
    """Context parallelism by ring (K/V blocks around the cp ranks) or ulysses (all-to-all of heads)."""
    compile: bool = True
    """Blocks and loss under torch.compile (`train.compile`, on by default on GPUs): it decides what a
    block keeps for its backward and what the loss holds."""
    recompute_matmuls: float = 0.0
    """Share of each block's forward matmul FLOPs recomputed in its backward on top of `recompute`:
    0 for every policy plait runs; another system's per-op policy (torchtitan's "selective op"
    recomputes every second matmul of a block) when the planner prices that system's published runs."""
    head_in_forward: bool = False
    """The last pipeline stage ran its output head and fused loss in its forward slot, as plait did
    before it moved them to the backward slot (recorded runs: `plait.planner.recorded`)."""
    zero3_whole_root: bool = False
    """ZeRO-3 without a pipeline gathered an untied output matrix with the embedding, in one root
    unit at the forward's start, and reduce-scattered it after the backward, as plait did before the
    output matrix became a unit of its own (recorded runs: `plait.planner.recorded`)."""

    head_wgrad_in_b: bool = False
    """A zero-bubble pipeline's last stage formed the output matrix's gradient in its B, as plait did
    before the fused loss deferred it to the stage's W (recorded runs: `plait.planner.recorded`)."""

    @property
    def head_wgrad_in_w(self) -> bool:
        """The last stage's W forms the output matrix's gradient (plait/loss.py's `defer`): a
        zero-bubble pipeline with the head in its B slot, as plait runs it now."""
        return (self.schedule in SPLIT_BACKWARD and self.pp > 1
                and not (self.head_wgrad_in_b or self.head_in_forward))

    eager_head: bool = False
    """The final norm ran eager and the fused loss scaled its gradients by 1/count in passes of their
    own (and through an fp32 buffer even in one chunk), as plait did before its final norm was
    compiled with the blocks (recorded runs: `plait.planner.recorded`)."""

    loss_logits_held: bool = False
    """The fused loss kept a chunk's logits (vocab-parallel: its fp32 logits) beside the output
    matrix's gradient GEMM, as plait did before it freed them once the chunk's gradient was formed
    (`plait.loss`; recorded runs: `plait.planner.recorded`)."""

    grads_whole: bool = False
    """One device held its whole gradient buffer through the step, beside the forward's activations,
    as plait did before one device's gradients came in pieces that backward allocates (`plait.flat`;
    recorded runs: `plait.planner.recorded`)."""

    embed_copy: bool = False
    """An engine without data-parallel peers held a 16-bit copy of an untied embedding beside its
    master, as plait did before it looked the rows up from the master (`plait.parallel.embedding_master`;
    recorded runs: `plait.planner.recorded`)."""

    wgrad_batched: bool = False
    """A zero-bubble W formed all of a chunk's weight gradients before adding any, as plait did before
    it added each as formed (`plait.parallel.wgrad`; recorded runs: `plait.planner.recorded`)."""

    zero3_cast_once: bool = False
    """ZeRO-3 keeps each unit's 16-bit chunk from its first gather of a step to the update
    (`parallel.zero3_cast_once`): one cast a unit a step instead of one a gather, and 2 bytes a
    parameter over the shard group more memory."""

    recompute_whole: bool = False
    """Full recomputation replays each layer's whole forward, its last TP collective too (a reentrant
    checkpoint, as Megatron-LM ran in 2021); plait's non-reentrant checkpoint stops at the last
    tensor its backward needs (published runs: `plait.planner.published`)."""

    grad_overlap: bool = True
    """DDP all-reduces gradient buckets as the backward frees them (plait's DDP, torch's); False: one
    all-reduce after the whole backward, as Megatron-LM's "local" DDP ran its 2021 pipelined runs
    (published runs: `plait.planner.published`)."""

    embedding_rows: str = "auto"
    """DDP sends the embedding's gradient as the rows a step touched (`parallel.embedding_rows`:
    auto, on, off, decided as `plait.parallel.rules.embedding_rows` decides; auto: untied only):
    the rows' all-gather after the backward replaces the dense embedding's all-reduce there, and a
    tied matrix's dense part (the output layer's gradient) reduces beside the backward."""

    fp8: str = "off"
    """The blocks' linears run as FP8 GEMMs with this scaling (`train.fp8`: off, tensorwise, rowwise)."""

    zero3_fp8_gather: bool = False
    """ZeRO-3 all-gathers the blocks' linear weights in FP8 (`parallel.zero3_fp8_gather`; tensorwise):
    a byte a parameter on the wire and in a gathered block, and no weight quantized in the block."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "v", "micro_batch"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise bad_value(f"--{name.replace('_', '-')}", val, "must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise bad_value("--zero", self.zero, "choose 0 (DDP), 1, 2 or 3 (FSDP)")
        if self.schedule not in SCHEDULES:
            raise bad_value("--schedule", self.schedule, f"choose one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise bad_value("--recompute", self.recompute, f"choose one of {', '.join(RECOMPUTE)}")
        if self.zero3_cast_once and self.zero != 3:
            raise bad_value("zero3_cast_once", True, f"it keeps ZeRO-3's casts (zero 3, not {self.zero})")
        if self.fp8 not in FP8_RECIPES:
            raise bad_value("--fp8", self.fp8, f"choose one of {', '.join(FP8_RECIPES)}")
        if self.zero3_fp8_gather and (self.zero != 3 or self.fp8 != "tensorwise"):
            raise bad_value("zero3_fp8_gather", True, f"it gathers tensorwise FP8 weights under ZeRO-3 "
                            f"(zero 3 and fp8 tensorwise, not zero {self.zero} and fp8 {self.fp8})")
        if not 0.0 <= self.recompute_matmuls <= 1.0:
            raise bad_value("recompute_matmuls", self.recompute_matmuls, "give a share of the forward matmuls, 0 to 1")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks a ZeRO stage shards over."""
        return self.dp_shard * self.cp

    @property
    def grad_group(self) -> int:
        return self.dp * self.cp

    @property
    def n_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def seq_parallel(self) -> bool:
        return rules.sequence_parallel(self.sp, self.tp)

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "cp": self.cp, "tp": self.tp}

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        dp = f"dp{self.dp}" if self.dp_replicate == 1 else f"dp{self.dp_replicate}x{self.dp_shard}"
        parts = [f"tp{self.tp}{'+sp' if self.seq_parallel else ''}", f"pp{self.pp}", dp,
                 f"zero{self.zero}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("/ulysses" if self.cp_impl == "ulysses" else ""))
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.v}" if self.v > 1 else "")
                         + (f" stages:{self.stage_split}" if self.stage_split else ""))
        parts += [f"mb{self.micro_batch}", f"rc:{self.recompute}"]
        if self.fp8 != "off":
            parts.append(f"fp8:{self.fp8}" + ("+gather" if self.zero3_fp8_gather else ""))
        return " ".join(parts)


def check_fp8(fp8: str, c: Cluster) -> None:
    """FP8 linears need FP8 tensor cores: a card without them (A100, V100) has no FP8 rate to price."""
    if fp8 != "off" and "fp8" not in c.gpu.tflops:
        with_fp8 = ", ".join(dict.fromkeys(g.name.split()[0] for g in GPUS.values() if "fp8" in g.tflops))
        raise bad_value("--fp8", fp8, f"the {c.gpu.name} has no FP8 tensor cores ({with_fp8} do): use --fp8 off")


def check_layout(d: ModelDims, lay: Layout, c: Cluster, global_batch: int) -> int:
    """Raise one UserError line for the first thing that makes `lay` impossible; return the number
    of micro-batches each pipeline runs per step."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise bad_value("--global-batch", global_batch, "must be a positive number of sequences")
    check_fp8(lay.fp8, c)
    if lay.n_gpus != c.n_gpus:
        raise UserError(f"layout tp {lay.tp} x pp {lay.pp} x dp {lay.dp} x cp {lay.cp} = {lay.n_gpus} GPUs "
                        f"but the cluster has {c.nodes} x {c.gpus_per_node} = {c.n_gpus}: make the product "
                        f"equal the number of GPUs")
    rules.check_split(heads=d.heads, kv_heads=d.kv_heads, ffn=d.ffn, layers=d.layers, seq=d.seq, tp=lay.tp,
                      pp=lay.pp, v=lay.v, cp=lay.cp, sp="auto" if lay.sp else "off", cp_impl=lay.cp_impl,
                      micro_batch=lay.micro_batch, field=rules.flag_field)
    rules.check_tp_in_node(lay.tp, c.gpus_per_node, field=rules.flag_field)
    if lay.micro_batch > 1 and lay.dp * lay.micro_batch > global_batch:
        # the micro-batch is what is too large: --global-batch's default of 512 was never given
        raise bad_value("--micro-batch", lay.micro_batch, f"dp {lay.dp} x micro-batch {lay.micro_batch} = "
                        f"{lay.dp * lay.micro_batch} sequences is more than --global-batch {global_batch}: " + (
                            f"use --micro-batch {global_batch // lay.dp} or less, or a larger --global-batch"
                            if global_batch >= lay.dp else f"give --global-batch {lay.dp * lay.micro_batch} or more"))
    if global_batch % (lay.dp * lay.micro_batch):
        raise bad_value("--global-batch", global_batch, f"must be a multiple of dp x micro-batch = "
                        f"{lay.dp} x {lay.micro_batch} = {lay.dp * lay.micro_batch}")
    m = lay.microbatches(global_batch)
    # the rules `plait train` applies, named by this command's flags; its micro-batch count is no
    # flag here but what --global-batch and --micro-batch make of it
    if lay.pp == 1:
        check_no_pipeline(lay.schedule, lay.v)
        if lay.stage_split:  # "balance" too: counts for one stage were refused, balance was not
            raise bad_value("--stage-layers", lay.stage_split, "splits a pipeline's layers: it needs --pp > 1 "
                            "(without a pipeline, drop --stage-layers)")
    else:
        check_args(lay.schedule, lay.pp, m, lay.v, field=_plan_field)
        if lay.stage_split:
            from plait.parallel.stages import check_ranks_hold_parameters
            from plait.planner.stage_costs import split_layers

            check_ranks_hold_parameters(split_layers(d, lay.pp * lay.v, lay.stage_split, lay.schedule), lay.pp,
                                        lay.v, lay.schedule, lay.stage_split, "--stage-layers")
    return m


def _plan_field(knob: str) -> str:
    if knob == "microbatches":
        return "micro-batches a step (--global-batch / (dp x --micro-batch))"
    return rules.flag_field(knob)
