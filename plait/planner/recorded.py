"""plait's recorded GPU runs (`bench/results/*.json`) as planner inputs: for every plait row the
model, the layout, the cluster it ran on and what was measured, so each prediction can be set
beside its measurement (`plait plan --check bench/results`, tests/test_planner_recorded.py).

The benches name their layouts in the variant (`plait-zero3`, `plait-tp4-sp-sel`, `plait-1f1b`);
`_layout` reads those names the way plait.benchmarks.train_step, bench/data_parallel.py, bench/tensor_parallel.py,
bench/pipeline.py and bench/context_parallel.py build their runs. Rows of other systems (fsdp2, torch-*, hf) are peers, not
plait, and are skipped; so are runs whose shape the planner cannot express (uneven pipeline stages).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from plait.errors import UserError

from plait.planner.hardware import card_key

# Recorded runs that plait's runtime has since changed under (bench/README.md tells the history);
# they stay in bench/results as the record of what was measured then, but predicting today's code
# against them would measure the change, not the planner.
SUPERSEDED = {
    "dp-h100-4gpu-before-zero3-memory.json": "ZeRO-3 memory changed after it (the root unit, gradient chunks)",
    "dp-8b-h100-4gpu-before-zero3-memory.json": "ZeRO-3 memory changed after it",
    "dp-h100-2gpu.json": "made with the same code as the *-before-zero3-memory runs",
    "dp-h200-2gpu.json": "made before the ZeRO-3 memory change",
    "dp-8b-h200-2gpu.json": "made before the ZeRO-3 memory change",
    "cp-h100-2gpu-before-ring-ops.json": "ring attention was an autograd.Function then (re-run by selective recompute)",
    "train-step-h200-2026-11-26.json": "made with a per-tensor optimizer and an fp32 weight-gradient pass in the loss",
}
HEAD_RUNTIME = "compiled-norm"
"""What a benchmark's result file says of the head it ran (its "head"; the benches write this). A
file without it ran the head as plait did before: the final norm eager, the loss's 1/count applied
in passes of its own, an fp32 weight-gradient buffer even in one chunk (`Layout.eager_head`)."""
HEAD_WGRAD = "deferred"
"""What a pipeline result file's config says ("head_wgrad") once a zero-bubble last stage deferred the
output matrix's gradient to its W (plait/loss.py); a file without it formed it in B
(`Layout.head_wgrad_in_b`)."""
GRADS_RUNTIME = "pieces"
"""What a benchmark's result file says of one device's gradients (its "grads"): in pieces allocated
by the backward (`plait.flat`). A file without it held them in one buffer through the step
(`Layout.grads_whole`)."""
LOSS_RUNTIME = "logits-freed"
"""What a benchmark's result file says of the fused loss (its "loss"): a chunk's logits freed once its
gradient is formed (`plait.loss`). A file without it kept them beside the output matrix's gradient
GEMM (`Layout.loss_logits_held`)."""
EMBED_RUNTIME = "master-rows"
"""What a benchmark's result file says of an untied embedding on an engine without data-parallel
peers (its "embed"): looked up from its fp32 master, no 16-bit copy (`plait.parallel.embedding_master`).
A file without it held the copy (`Layout.embed_copy`)."""
RUNTIME_MARKS = {"head": HEAD_RUNTIME, "grads": GRADS_RUNTIME, "loss": LOSS_RUNTIME, "embed": EMBED_RUNTIME}
"""What every benchmark writes into its result file, so that the planner prices it as it ran."""
WGRAD_RUNTIME = "one-at-a-time"
"""What a pipeline result file says of a zero-bubble W (its "wgrad"): each weight gradient added as it
is formed (`plait.parallel.wgrad`). A file without it formed a micro-batch's chunk of them all before
adding any (`Layout.wgrad_batched`)."""
BENCHES = ("train_step", "data_parallel", "tensor_parallel", "pipeline", "context_parallel", "layouts")
# Runs made before the fused loss dropped each chunk before forming the next (plait/loss.py): they
# held a finished chunk while forming the next one and while casting the weight gradient.
LOSS_HELD_THIRD_CHUNK = {"train-step-h200-2026-11-26b.json", "dp-h100-4gpu.json", "dp-h100-4gpu-fsdp2-fused.json",
                         "dp-8b-6layers-h100-4gpu.json", "dp-8b-h100-4gpu.json", "dp-8b-h200-2gpu-zero3.json", "tp-h100-4gpu.json",
                         "pp-h100-2gpu.json"}
# Sweeps run before `Engine.close` (plait/parallel/engine.py): each variant's later sequence lengths
# ran with the earlier length's model, engine and optimizer state still allocated (its hooks kept
# them alive), so only the first length a variant ran is a clean measurement.
FIRST_ROW_ONLY = {"cp-h100-2gpu.json"}
# Pipeline runs made while the last stage ran its output head and fused loss in its forward slot
# (plait/parallel/pipeline.py has run them in its backward slot since): priced that way. Later
# runs say where in their config ("head_slot").
HEAD_IN_FORWARD = {"pp-h100-2gpu.json", "pp-h100-4gpu-1b.json", "pp-h100-4gpu-1b-host-share.json",
                   "pp-h100-4gpu-1b-peers.json", "pp-h100-4gpu-1b-zb-compiled.json", "pp-h100-4gpu-1b-zb-host.json",
                   "pp-h100-4gpu-8b-m8.json", "pp-h200-4gpu.json", "pp-h200-4gpu-1b.json",
                   "pp-h200-4gpu-1b-zb-compiled.json", "pp-h200-4gpu-8b-zb-compiled.json"}
# ZeRO-3 runs without a pipeline (shard group > 1) made while an untied output matrix was in the
# root unit with the embedding (plait/parallel/fsdp.py has made it a unit of its own since): both
# gathered before the first block and reduce-scattered after the backward, exposed. Priced that way.
ZERO3_WHOLE_ROOT = {
    "cp-h100-2gpu-after-close.json", "cp-h100-2gpu-before-ring-ops.json", "cp-h100-2gpu.json",
    "cp-h100-4gpu-s32k-mb1-before.json", "cp-h100-4gpu-s32k-mb1.json", "cp-h100-4gpu-s32k-mb4-before.json",
    "cp-h100-4gpu-s32k-mb4.json", "cp-h200-2gpu-s32k.json", "cp-h200-4gpu-s32k-mb1.json", "cp-h200-4gpu-s32k-mb4.json",
    "cp-h200-4gpu.json", "dp-8b-h100-4gpu-before-zero3-memory.json", "dp-8b-h100-4gpu-profiled.json",
    "dp-8b-h100-4gpu-s8192-selective.json", "dp-8b-h100-4gpu.json", "dp-8b-h200-2gpu-zero3.json", "dp-8b-h200-2gpu.json",
    "dp-h100-2gpu.json", "dp-h100-4gpu-before-zero3-memory.json", "dp-h100-4gpu-fsdp2-fused.json", "dp-h100-4gpu.json",
    "dp-h200-2gpu-1b-mb2-profiled.json", "dp-h200-2gpu.json", "dp-h200-4gpu-profiled.json",
    "layouts-h200-4gpu-8b-s2048.json", "pp-h100-2gpu.json", "pp-h100-4gpu-1b.json", "pp-h200-4gpu.json",
    "tp-h100-4gpu.json"}
HOST_BOUND = 1.0  # host_share at which a rank's GPU starts to wait on its CPU


@dataclass(frozen=True)
class Run:
    """One recorded plait run."""

    source: str
    """file:variant"""
    gpu: str
    n_gpus: int
    preset: str
    shape: dict
    """ModelDims fields that differ from the preset (e.g. layers=16)."""
    seq: int
    global_batch: int
    layout: dict
    """plait.planner.inputs.make_layout arguments."""
    step_s: float
    peak_gb: float
    """Peak allocated memory of the fullest rank, GB (torch.cuda.max_memory_allocated)."""
    bubble: float | None = None
    """A pipeline's measured bubble (idle share of every rank's step, from its action timeline)."""
    host_share: float | None = None
    """A pipeline's busiest host: seconds issuing its actions over the GPU's seconds running them."""
    untimed: str = ""
    """Why the row's step time is not one the planner answers for (a run made to find what fits, its
    first length timed right after one warm-up step; a diagnostic run on a host whose links ran the
    same layout far slower than the profiled host's), else empty: its memory is priced, its time
    shown and left out of the step statistics."""

    @property
    def host_bound(self) -> bool:
        """The GPU waited on the host (plait.timeline.host_share >= 1 on some rank): the step time
        measured the CPU, which the planner, a model of GPU time, does not price."""
        return self.host_share is not None and self.host_share >= HOST_BOUND


def _model_overrides(config: dict) -> dict:
    keys = {"n_layers": "layers", "dim": "hidden", "n_heads": "heads", "n_kv_heads": "kv_heads",
            "ffn_dim": "ffn", "vocab_size": "vocab"}
    out = {}
    for kv in config.get("model") or []:
        k, _, v = kv.partition("=")
        if k not in keys:
            raise UserError(f"recorded run overrides model.{k}, which the planner's shape has no field for")
        out[keys[k]] = int(v)
    return out


def _flag(commands, flag: str) -> str | None:
    """The value of `flag` in the recorded command line(s), or None."""
    for cmd in [commands] if isinstance(commands, str) else (commands or []):
        words = cmd.split()
        if flag in words[:-1]:
            return words[words.index(flag) + 1]
    return None


def _layout(bench: str, variant: str, row: dict, config: dict, n_gpus: int, commands=None) -> tuple[dict, int] | None:
    """(layout arguments, global batch) of a plait row, or None for peers and unexpressible runs."""
    if bench == "layouts":  # bench/layouts.py: plait's trainer on the layout the row names
        return dict(row["layout"]), config["global_batch"]
    if not variant.startswith("plait"):
        return None
    if bench == "train_step":  # one GPU; eager variants and torchao's FP8 are not priced by the planner
        fp8 = variant[len("plait-fp8-"):] if variant.startswith("plait-fp8-") else "off"
        rc = "none" if fp8 in ("tensorwise", "rowwise") else \
            {"plait": "none", "plait-selective": "selective", "plait-full": "full"}.get(variant)
        if rc is None:
            return None
        return dict(dp=1, zero=0, micro_batch=row["micro_batch"], recompute=rc, fp8=fp8), row["micro_batch"]
    if bench == "data_parallel":
        fp8 = config.get("fp8", "off")  # FP8 linears in every variant (bench/data_parallel.py --fp8)
        mb, rc = config["micro_batch"], config.get("recompute", "none")
        accum = config.get("accum", 1)  # micro-batches a GPU runs a step (runs before --accum ran one)
        if variant == "plait-1gpu":
            return dict(dp=1, zero=0, micro_batch=mb, recompute=rc, fp8=fp8), mb * accum
        zero = {"plait-ddp": 0, "plait-ddp-dense": 0, "plait-zero1": 1, "plait-zero2": 2, "plait-zero3": 3, "plait-zero3-cast-once": 3,
                "plait-zero3-fp8-gather": 3}.get(variant)
        if zero is None:
            raise UserError(f"recorded run {variant!r}: plait.planner.recorded does not know this data-parallel "
                            f"variant; teach _layout its layout")
        once = {"zero3_cast_once": True} if variant == "plait-zero3-cast-once" else {}
        gather = {"zero3_fp8_gather": True} if variant == "plait-zero3-fp8-gather" else {}
        rows = {"embedding_rows": "on" if row["embedding_rows"] else "off"} if "embedding_rows" in row else {}
        return (dict(dp=n_gpus, zero=zero, micro_batch=mb, recompute=rc, fp8=fp8, **once, **gather, **rows),
                mb * n_gpus * accum)
    if bench == "tensor_parallel":  # one micro-batch of global_batch / dp sequences per rank
        tp, dp, gb = row["tp"], row["dp"], config["global_batch"]
        # FP8 linears in plait's variants (bench/tensor_parallel.py --fp8), or per row where a file alternates
        fp8 = row.get("fp8", config.get("fp8", "off")) if variant.startswith("plait") else "off"
        return dict(tp=tp, dp=dp, zero=row["zero"], micro_batch=gb // dp, recompute=row["recompute"],
                    sp=row["sp"], fp8=fp8), gb
    if bench == "pipeline":
        m, mb = row["microbatches"], config["micro_batch"]
        sched = variant.split("-")[1]
        split = str(row.get("stage_layers") or "")  # a row that names its split ran it
        split = "balance" if split.startswith("balance") else split
        ran = (row.get("split") or {}).get("stage_layers")  # the counts each stage ran (bench/pipeline.py;
        if ran:  # per virtual stage where v > 1), whatever the command asked for ("balance" or none)
            split = ran
        if variant.endswith("balanced"):  # hand-set stage sizes, as the command gave them
            split = config.get("stage_layers") or _flag(commands, "--stage-layers")
            if not split:
                return None
        if sched == "zero3":
            return dict(dp=n_gpus, zero=3, micro_batch=mb), m * mb
        return dict(pp=n_gpus, dp=1, zero=1, micro_batch=mb, schedule=sched, v=2 if sched in ("interleaved", "zbv") else 1,
                    stage_split=split), m * mb
    if bench == "context_parallel":  # ZeRO-3 over every GPU; N sequences per data-parallel rank
        cp, mb = row["cp"], config.get("micro_batch", 1)  # runs made before --micro-batch trained one
        impl = variant.split("-")[-1] if cp > 1 else "ring"
        return dict(cp=cp, dp=n_gpus // cp, zero=3, micro_batch=mb, recompute=config["recompute"],
                    cp_impl=impl), mb * n_gpus // cp
    return None


def variant_spans_all(lay: dict) -> bool:
    """plait-1gpu runs on one GPU of the machine; every other row on all of them."""
    return lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1) * lay.get("cp", 1) > 1


def _read(path: Path, folder: Path) -> dict:
    """A result file's JSON object; one line naming the file where it is none (a benchmark stopped
    while writing it, a file of something else)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"--check {folder}: {path.name} is not a readable JSON result ({str(e).splitlines()[0]}); "
                        "fix it or move it out of the folder") from None
    if not isinstance(data, dict):
        raise UserError(f"--check {folder}: {path.name} holds a JSON {type(data).__name__}, not a benchmark's "
                        "result object; move it out of the folder")
    return data


def load(folder: str | Path) -> list[Run]:
    """Every plait row of every recorded training benchmark in `folder`, one Run per (file, variant);
    a variant measured in more than one call keeps the median of its step times."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--check {folder}: not a folder; point it at plait's bench/results")
    runs: dict[str, list[Run]] = {}
    for path in sorted(folder.glob("*.json")):
        data = _read(path, folder)
        bench, config = data.get("benchmark"), data.get("config") or {}
        card = data.get("card")
        if bench not in BENCHES or card_key(card) is None:
            continue
        if path.name in SUPERSEDED:
            continue
        n = int(data.get("gpus", 1))
        seen = set()
        for row in data.get("rows", []):
            first = row["variant"] not in seen
            seen.add(row["variant"])
            if "step_s_median" not in row:
                continue  # the variant failed (out of memory, timed out): nothing was measured
            if row.get("superseded"):
                continue  # measured code that has changed since (the row says how)
            if path.name in FIRST_ROW_ONLY and not first:
                continue
            if row.get("nccl_max_ctas") or row.get("overlap_ctas"):
                continue  # NCCL's thread blocks capped (the whole run, or the overlapped buckets'): not what the profile measured
            if bench == "train_step":  # each row its own model and batch
                config = {"preset": row["preset"], "seq": row["seq_len"],
                          "model": [f"n_layers={row['n_layers']}"] if "n_layers" in row else []}
            got = _layout(bench, row["variant"], row, config, n, data.get("command"))
            if got is None:
                continue
            lay, gb = got
            head_slot = config.get("head_slot", "forward" if path.name in HEAD_IN_FORWARD else "backward")
            if bench == "pipeline" and lay.get("pp", 1) > 1 and head_slot == "forward":
                lay = {**lay, "head_in_forward": True}
            if bench == "pipeline" and config.get("head_wgrad") != HEAD_WGRAD:
                lay = {**lay, "head_wgrad_in_b": True}  # ran before the loss deferred it (HEAD_WGRAD)
            if data.get("head") != HEAD_RUNTIME:
                lay = {**lay, "eager_head": True}
            if data.get("grads") != GRADS_RUNTIME:
                lay = {**lay, "grads_whole": True}
            if data.get("loss") != LOSS_RUNTIME:
                lay = {**lay, "loss_logits_held": True}
            if data.get("embed") != EMBED_RUNTIME:
                lay = {**lay, "embed_copy": True}
            if bench == "pipeline" and data.get("wgrad") != WGRAD_RUNTIME:
                lay = {**lay, "wgrad_batched": True}
            if "embedding_rows" not in lay and config.get("embedding_rows") != "auto":
                lay = {**lay, "embedding_rows": "off"}  # recorded before DDP could send the embedding as rows
            if path.name in ZERO3_WHOLE_ROOT and lay.get("zero") == 3:
                lay = {**lay, "zero3_whole_root": True}
            used = n if variant_spans_all(lay) else 1
            seq = row.get("seq", config.get("seq"))  # a sweep over sequence lengths records it per row
            key = f"{path.name}:{row['variant']}" + (f"@{seq}" if "seq" in row else "")
            if bench == "pipeline" and ("stage_layers" in row or isinstance(config.get("microbatches"), list)):
                # a file of several micro-batch counts (and splits)
                key += f"@m{row['microbatches']}" + (f"/{lay['stage_split']}" if lay.get("stage_split") else "")
            if bench == "train_step":
                key += f"@{row['preset']}" + (f"/{row['n_layers']}L" if "n_layers" in row else "") + \
                       f"-mb{row['micro_batch']}-s{seq}"
            runs.setdefault(key, []).append(Run(
                key, card_key(card), used, config["preset"], _model_overrides(config), seq, gb, lay,
                row["step_s_median"], row.get("peak_mem_gb_max_rank", row["peak_mem_gb"]), row.get("measured_bubble"),
                max(row["host_share"]) if row.get("host_share") else None, row.get("untimed", "")))
    return [_merge(rs) for rs in runs.values()]


def _merge(rs: list[Run]) -> Run:
    if len(rs) == 1:
        return rs[0]
    from dataclasses import replace

    bubbles = [r.bubble for r in rs if r.bubble is not None]
    hosts = [r.host_share for r in rs if r.host_share is not None]
    return replace(rs[0], step_s=statistics.median(r.step_s for r in rs), peak_gb=max(r.peak_gb for r in rs),
                   bubble=statistics.median(bubbles) if bubbles else None, host_share=max(hosts) if hosts else None)


@dataclass(frozen=True)
class Check:
    run: Run
    predicted_step_s: float
    predicted_peak_gb: float
    predicted_bubble: float = 0.0
    """The bubble the planner simulates for the split that ran (stage costs from the profile)."""
    unmeasured: str = ""
    """What the card's profile did not measure that the run's step needs (FP8 linears), else empty:
    the planner then prices it from the card's data sheet, which it does not answer for."""

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured: positive = the planner thinks it slower."""
        return self.predicted_step_s / self.run.step_s - 1

    @property
    def memory_error(self) -> float:
        return self.predicted_peak_gb / self.run.peak_gb - 1


def check(runs: list[Run], hardware: dict[str, object] | None = None) -> list[Check]:
    """Predict every run on its card (`hardware`: catalog key -> HardwareProfile measured there)."""
    from plait.planner import inputs
    from plait.planner.hardware import cluster
    from plait.planner.predict import predict
    from plait.planner.profile import apply_profile

    out = []
    for r in runs:
        d = inputs.model_dims(r.preset, seq=r.seq, **r.shape)
        c = cluster(r.gpu, 1, r.n_gpus)
        prof = (hardware or {}).get(r.gpu)
        if prof is not None:
            c = apply_profile(c, prof)
        lay = inputs.make_layout(c, **r.layout)
        p = predict(d, lay, c, r.global_batch, "mixed")
        # measured peaks are what the allocator handed out; the CUDA context and NCCL's buffers
        # (the prediction's `reserved`) never show there
        peak = p.memory_total_bytes - p.memory_bytes["reserved"]
        if r.source.split(":")[0] in LOSS_HELD_THIRD_CHUNK:
            peak += _old_loss_extra(d, lay)
        fp8 = r.layout.get("fp8", "off") != "off" and prof is not None and not prof.fp8_linear
        out.append(Check(r, p.step_time_s, peak / 1e9, p.bubble, "FP8 linears" if fp8 else ""))
    return out


def _old_loss_extra(d, lay) -> float:
    """What the fused loss held on top before it dropped each chunk before forming the next: the
    previous chunk's logits and gradient stayed referenced while the next chunk was formed, and the
    last chunk's while the weight gradient was cast (bf16: e = 2; fp32 logits kept vocab-parallel)."""
    from plait.parallel.rules import LOSS_CHUNK_ELEMENTS

    e, tp = 2.0, lay.tp
    rows = -(-d.vocab // tp)
    per_chunk = max(1, LOSS_CHUNK_ELEMENTS // rows)
    tokens = lay.micro_batch * d.seq // lay.cp
    chunk, chunks = min(tokens, per_chunk), -(-tokens // per_chunk)
    last = tokens - (chunks - 1) * per_chunk
    held = e + 4 if tp > 1 else 2 * e  # per logit of a finished chunk still referenced
    live = 2 * e + (4 if tp > 1 else 0)  # per logit of the chunk being worked on
    old_loop = (chunk * rows * (max(live, e + held) if chunks > 1 else live))
    old = max(old_loop, last * rows * held + e * rows * d.hidden)
    new = max(chunk * rows * live, e * rows * d.hidden)
    return old - new


def priced(checks: list[Check]) -> list[Check]:
    """The checks whose step time the planner answers for: not those whose GPUs waited on the host,
    nor rows that did not time a steady step, nor runs of what their card's profile did not measure."""
    return [c for c in checks if not c.run.host_bound and not c.run.untimed and not c.unmeasured]


def table(checks: list[Check]) -> str:
    """The error table, every run, then mean |error| and worst |error|; a host-bound run's step
    error is shown, marked, and left out of the step statistics (its memory error counts)."""
    lines = [f"{'run':<58} {'step ms pred/meas':>19} {'err':>7} {'peak GB pred/meas':>19} {'err':>7}"]
    for c in checks:
        mark = f"  host-bound ({c.run.host_share:.2f})" if c.run.host_bound else ("  untimed" if c.run.untimed else "")
        mark = mark or (f"  {c.unmeasured} unmeasured on this card" if c.unmeasured else "")
        lines.append(f"{c.run.source:<58} {c.predicted_step_s * 1e3:>8.1f} / {c.run.step_s * 1e3:<8.1f} "
                     f"{c.step_error:>+7.1%} {c.predicted_peak_gb:>8.2f} / {c.run.peak_gb:<8.2f} {c.memory_error:>+7.1%}{mark}")
    if checks:
        se, me = [abs(c.step_error) for c in priced(checks)] or [0.0], [abs(c.memory_error) for c in checks]
        lines.append(f"{'mean |error|':<58} {'':>19} {statistics.mean(se):>7.1%} {'':>19} {statistics.mean(me):>7.1%}")
        lines.append(f"{'worst |error|':<58} {'':>19} {max(se):>7.1%} {'':>19} {max(me):>7.1%}")
        left = len(checks) - len(priced(checks))
        bound = sum(c.run.host_bound for c in checks)
        if bound:
            lines.append(f"step statistics leave out {bound} host-bound run(s): a rank's host took longer to issue "
                         f"its work than its GPU to run it, a CPU cost the planner does not model")
        unmeasured = sum(bool(c.unmeasured) and not c.run.host_bound and not c.run.untimed for c in checks)
        if left - bound - unmeasured:
            lines.append(f"and {left - bound - unmeasured} untimed run(s): a step time the planner does not answer "
                         "for (the row says why: no steady step timed, a host unlike the profiled one, FP8 "
                         "linears at shapes the profile did not time)")
        if unmeasured:
            lines.append(f"and {unmeasured} run(s) of FP8 linears on a card whose profile has none measured: priced "
                         f"from its data sheet (`plait bench calibrate --only fp8` there measures them)")
    return "\n".join(lines)


def rows(checks: list[Check]) -> dict:
    """The table as data (`plait plan --check DIR --json`): every run with its predicted and measured
    step time, peak memory and (pipelines) bubble, and whether the step statistics count it."""
    counted = {id(c) for c in priced(checks)}
    out = []
    for c in checks:
        r = c.run
        out.append({"run": r.source, "gpu": r.gpu, "step_s": {"predicted": c.predicted_step_s, "measured": r.step_s,
                                                             "error": c.step_error},
                    "peak_gb": {"predicted": c.predicted_peak_gb, "measured": r.peak_gb, "error": c.memory_error},
                    "bubble": None if r.bubble is None else {"predicted": c.predicted_bubble, "measured": r.bubble},
                    "host_share": r.host_share, "counted": id(c) in counted,
                    "left_out": "host-bound" if r.host_bound else ("untimed" if r.untimed else c.unmeasured)})
    se, me = [abs(c.step_error) for c in priced(checks)], [abs(c.memory_error) for c in checks]
    return {"runs": out, "step_error": {"mean": statistics.mean(se) if se else None, "worst": max(se) if se else None,
                                        "runs": len(se)},
            "memory_error": {"mean": statistics.mean(me) if me else None, "worst": max(me) if me else None,
                             "runs": len(me)}}


def bubble_table(checks: list[Check]) -> str:
    """Pipeline runs: the bubble measured on the run beside the planner's simulation of the same
    schedule with the stage costs it prices for the split that ran, and the textbook formula's
    (equal stages), in points; then the mean |difference| of each."""
    from plait.parallel.schedules import check_args
    from plait.timeline import textbook

    rows = [c for c in checks if c.run.bubble is not None]
    lines = [f"{'run':<58} {'measured':>9} {'planner':>8} {'diff':>6} {'textbook':>9} {'diff':>6}"]
    dp, dt = [], []
    for c in rows:
        lay, m = c.run.layout, c.run.global_batch // c.run.layout.get("micro_batch", 1)
        pp, v = lay["pp"], lay.get("v", 1)
        name = check_args(lay.get("schedule", "1f1b"), pp, m, v)
        text = textbook(name, pp, m, v)  # None for ZB-H1
        a, b = 100 * c.run.bubble, 100 * c.predicted_bubble
        dp.append(abs(b - a))
        tb = f"{100 * text:8.1f}% {100 * text - a:>+6.1f}" if text is not None else f"{'':9} {'':>6}"
        if text is not None:
            dt.append(abs(100 * text - a))
        lines.append(f"{c.run.source:<58} {a:8.1f}% {b:7.1f}% {b - a:>+6.1f} {tb}")
    if rows:
        lines.append(f"{'mean |difference|, points':<58} {'':>9} {'':>8} {statistics.mean(dp):>6.1f} {'':>9} "
                     f"{statistics.mean(dt) if dt else 0.0:>6.1f}")
    return "\n".join(lines)
