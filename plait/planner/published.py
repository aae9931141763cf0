"""Published measurements of other systems, for checking the planner's absolute numbers on
clusters plait has not run on (`plait plan --published`).

Each run is what its authors measured and wrote down with enough of the setup to rebuild it: the
model's shape, the GPUs and nodes, the layout, the batch and sequence, and tokens per second per
GPU. The planner predicts each with its default hardware for that GPU (catalog peak x efficiency,
the catalog's links: no profile was measured on those clusters) and the error is reported as it
comes out. Nothing here is fitted: a constant tuned to make these rows agree would only move the
error to the next cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
MEGATRON_2021 = "https://arxiv.org/abs/2104.04473"  # Narayanan et al., Table 1
# Llama 2 shapes (the presets are Llama 3's); vocabulary 32,000, sequence 4,096
LLAMA2_13B = dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000, seq=4096)
LLAMA2_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=4096)


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    gpu: str
    nodes: int
    gpus_per_node: int
    layout: dict
    """plait.planner.inputs.make_layout arguments"""
    global_batch: int
    tokens_per_s_per_gpu: float
    preset: str | None = None
    shape: dict = field(default_factory=dict)
    precision: str = "mixed"
    """`plait.planner.memory.PRECISIONS`: what its parameters, gradients and their reduction took."""




def torchtitan_op_sac(hidden: int, kv_dim: int, ffn: int) -> float:
    """Share of a Llama block's forward matmul FLOPs that torchtitan's "selective op" checkpointing
    recomputes. Its policy (torchtitan/distributed/activation_checkpoint.py) counts a block's matmuls
    in the order they run - wq, wk, wv, wo, then w1, w3, w2 (`w2(silu(w1(x)) * w3(x))`) - keeps the
    output of every odd one and recomputes every even one, wk, wo and w3, with the element-wise work
    between them (what plait's selective recomputes); attention's output is kept."""
    h = hidden
    recomputed = h * kv_dim + h * h + h * ffn
    return recomputed / (2 * h * h + 2 * h * kv_dim + 3 * h * ffn)


def _op_sac(preset: str | None, shape: dict) -> dict:
    from plait.planner import inputs

    d = inputs.model_dims(preset, **shape)
    return dict(recompute="selective", recompute_matmuls=torchtitan_op_sac(d.hidden, d.kv_dim, d.ffn))


# torchtitan, FSDP2 on 64 A100 80GB (8 nodes x 8), bf16 compute and all-gathers, fp32 gradient
# reduce-scatters (its default mixed_precision_reduce), local batch 1-2 sequences. Its
# "selective op" checkpointing is plait's selective plus a third of the block's matmuls again
# (`torchtitan_op_sac`: 36-39% of their forward FLOPs for these shapes).
TT_PRECISION = "mixed-fp32-reduce"
RUNS: tuple[Published, ...] = (
    Published("torchtitan Llama 3 8B, FSDP2, selective op AC", TORCHTITAN, "a100-80gb", 8, 8,
              dict(dp=64, zero=3, micro_batch=1, **_op_sac("8b", dict(seq=8192))), 64, 2973, "8b", dict(seq=8192), precision=TT_PRECISION),
    Published("torchtitan Llama 3 70B, FSDP2, full AC", TORCHTITAN, "a100-80gb", 8, 8,
              dict(dp=64, zero=3, micro_batch=1, recompute="full"), 64, 331, "70b", dict(seq=8192), precision=TT_PRECISION),
    Published("torchtitan Llama 2 13B, FSDP2, no AC", TORCHTITAN, "a100-80gb", 8, 8,
              dict(dp=64, zero=3, micro_batch=2, recompute="none"), 128, 2162, None, LLAMA2_13B, precision=TT_PRECISION),
    Published("torchtitan Llama 2 13B, FSDP2, selective op AC", TORCHTITAN, "a100-80gb", 8, 8,
              dict(dp=64, zero=3, micro_batch=2, **_op_sac(None, LLAMA2_13B)), 128, 1904, None, LLAMA2_13B, precision=TT_PRECISION),
    Published("torchtitan Llama 2 70B, FSDP2, selective op AC", TORCHTITAN, "a100-80gb", 8, 8,
              dict(dp=64, zero=3, micro_batch=1, **_op_sac(None, LLAMA2_70B)), 64, 355, None, LLAMA2_70B, precision=TT_PRECISION),
    Published("torchtitan Llama 2 70B, FSDP2, full AC", TORCHTITAN, "a100-80gb", 8, 8,
              dict(dp=64, zero=3, micro_batch=2, recompute="full"), 128, 353, None, LLAMA2_70B, precision=TT_PRECISION),
)


def megatron_tokens_per_s(tflops: float, layers: int, hidden: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Tokens/s a GPU of Narayanan et al. 2021 ran at, from the teraFLOP/s they report and their
    count of a token's FLOPs with full recomputation, 96 l h^2 (1 + s / 6h + V / 16lh) (their eq. 3
    per token)."""
    per_token = 96 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tflops * 1e12 / per_token


MEGATRON_SC21 = "https://github.com/NVIDIA/Megatron-LM/blob/main/examples/sc21/run_table_1.sh"


def _megatron(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
              tflops: float, micro_batch: int, layers_per_chunk: int | None) -> Published:
    """A row of Narayanan et al. 2021's Table 1: GPT on A100 80GB (DGX A100, 8 a node, InfiniBand
    HDR between), fp16 with fp32 masters, full recomputation, V = 51,200, s = 2,048, tensor
    parallelism without sequence parallelism (which Korthikanti et al. added in 2022: every TP rank
    ran the norms and dropouts on the whole micro-batch), each layer recomputed by a reentrant
    checkpoint that replays its forward to the end, both all-reduces included. The paper gives no micro-batch or
    schedule; Megatron-LM's script for the table (`MEGATRON_SC21`) does: the micro-batch, the
    interleaved schedule where it sets layers per virtual stage, and torch's DDP (all-reduce beside
    the backward) without a pipeline, its own "local" DDP (all-reduce after it) with one."""
    shape = dict(arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)
    v = layers // pp // layers_per_chunk if layers_per_chunk else 1
    layout = dict(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, recompute="full", recompute_whole=True, sp=False,
                  micro_batch=micro_batch,
                  schedule="interleaved" if v > 1 else "1f1b", v=v, grad_overlap=pp == 1)
    return Published(f"Megatron-LM GPT {params}B, TP {tp} PP {pp}, full recompute", MEGATRON_2021, "a100-80gb",
                     gpus // 8, 8, layout, batch, megatron_tokens_per_s(tflops, layers, hidden), None, shape)


# Narayanan et al. 2021, Table 1 (weak scaling on Selene): params, heads, hidden, layers, TP, PP,
# GPUs, batch, achieved teraFLOP/s per GPU; then from `MEGATRON_SC21`: micro-batch, layers per
# virtual pipeline stage (None: one chunk a rank)
MEGATRON_RUNS = tuple(_megatron(*row) for row in (
    ("1.7", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None), ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138, 16, None),
    ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142, 16, None), ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None),
    ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None), ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5), ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1), ("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None)))
RUNS = RUNS + MEGATRON_RUNS


def inputs_dims(r: Published):
    """The model a published run trained, as the planner builds it."""
    from plait.planner import inputs

    return inputs.model_dims(r.preset, **r.shape)


@dataclass(frozen=True)
class Checked:
    run: Published
    predicted: float
    """tokens per second per GPU"""
    fits: bool

    @property
    def error(self) -> float:
        """(predicted - measured) / measured: positive = the planner thinks it faster."""
        return self.predicted / self.run.tokens_per_s_per_gpu - 1


def check(runs: tuple[Published, ...] = RUNS) -> list[Checked]:
    from plait.planner import inputs
    from plait.planner.hardware import cluster
    from plait.planner.predict import predict

    out = []
    for r in runs:
        c = cluster(r.gpu, r.nodes, r.gpus_per_node)
        p = predict(inputs_dims(r), inputs.make_layout(c, **r.layout), c, r.global_batch, r.precision)
        out.append(Checked(r, p.tokens_per_s / c.n_gpus, p.fits))
    return out


def rows(checks: list[Checked]) -> dict:
    """The table as data (`plait plan --published --json`)."""
    errs = [abs(c.error) for c in checks]
    return {"runs": [{"run": c.run.name, "source": c.run.source, "gpu": c.run.gpu,
                      "gpus": c.run.nodes * c.run.gpus_per_node, "fits": c.fits,
                      "tokens_per_s_per_gpu": {"predicted": c.predicted, "measured": c.run.tokens_per_s_per_gpu,
                                               "error": c.error}} for c in checks],
            "error": {"mean": statistics.mean(errs), "worst": max(errs)}}


def table(checks: list[Checked]) -> str:
    lines = [f"{'published run':<52} {'GPUs':>5} {'tok/s/GPU pred/meas':>21} {'err':>7}"]
    for c in checks:
        r = c.run
        fit = "" if c.fits else "  (predicted not to fit)"
        lines.append(f"{r.name:<52} {r.nodes * r.gpus_per_node:>5} {c.predicted:>10.0f} / {r.tokens_per_s_per_gpu:<8.0f} "
                     f"{c.error:>+7.1%}{fit}")
    errs = [abs(c.error) for c in checks]
    lines.append(f"{'mean |error|':<52} {'':>5} {'':>21} {statistics.mean(errs):>7.1%}")
    lines.append(f"{'worst |error|':<52} {'':>5} {'':>21} {max(errs):>7.1%}")
    sources = {c.run.source for c in checks}
    if MEGATRON_2021 in sources:  # where those rows' micro-batches and schedules come from
        sources.add(MEGATRON_SC21)
    lines.append("sources: " + ", ".join(sorted(sources)))
    return "\n".join(lines)
