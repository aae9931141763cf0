"""Memory per GPU, component by component: model state (under each ZeRO stage and precision
convention), activations (Korthikanti et al. 2022, and plait's Llama), temporary buffers.

Model state. A precision convention says how many bytes each parameter costs in each role:
                                  param  grad  master  optimizer  total   K (ZeRO's name)
  mixed   (ZeRO paper, plait)       2     2      4       4 + 4      16      12
  lecture (the seeds' 12 B/param)   2     2      4       2 + 2      12       8
  fp32    (CPU runs)                4     4      0       4 + 4      16       8
K is everything the optimizer owns (master + moments). ZeRO stage z shards, over the N_d ranks of
the data-parallel shard group: z >= 1 the optimizer's K, z >= 2 the gradients, z = 3 the
parameters. Per GPU, in bytes per parameter:
  stage 0: 2 + 2 + K      stage 1: 2 + 2 + K/N_d      stage 2: 2 + (2 + K)/N_d      stage 3: (2 + 2 + K)/N_d
(the 2s are param and grad bytes of the convention).

Activations are in bytes per transformer layer per micro-batch; 16-bit activations, 1-byte dropout
masks (GPT only).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import bad_value
from plait.planner.costs import ModelDims


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: float
    grad_bytes: float
    master_bytes: float
    optim_bytes: float
    """Optimizer moments together (Adam: first + second moment)."""
    act_bytes: float = 2.0
    """Bytes per activation element (the compute dtype)."""
    grad_comm_bytes: float | None = None
    """Bytes per gradient element on the wire (default: grad_bytes)."""

    @property
    def k(self) -> float:
        """ZeRO's K: bytes per parameter the optimizer owns (master weights + moments)."""
        return self.master_bytes + self.optim_bytes

    @property
    def total(self) -> float:
        return self.param_bytes + self.grad_bytes + self.k

    @property
    def wire_grad_bytes(self) -> float:
        return self.grad_bytes if self.grad_comm_bytes is None else self.grad_comm_bytes


PRECISIONS = {
    "mixed": Precision("mixed", 2, 2, 4, 8),
    "lecture": Precision("lecture", 2, 2, 4, 4),
    "fp32": Precision("fp32", 4, 4, 0, 8, act_bytes=4),
    # FSDP2 with reduce_dtype fp32 (torchtitan's default): 16-bit gradients reduced as fp32 on the wire
    "mixed-fp32-reduce": Precision("mixed-fp32-reduce", 2, 2, 4, 8, grad_comm_bytes=4),
}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise bad_value("--precision", name, f"choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer


def state_bytes(n_params: float, zero: int, n_shard: int, prec: Precision,
                shard_is_master: bool = False) -> StateBytes:
    """Model-state bytes on one GPU holding `n_params` parameters, ZeRO stage `zero` over `n_shard`.

    shard_is_master: ZeRO-3 as plait (and FSDP2) run it - the sharded parameters are the fp32 master
    weights, cast to the compute dtype as they are gathered, so the paper's separate low-precision
    copy of the shard (2 bytes per parameter over N) is not kept."""
    if zero not in (0, 1, 2, 3):
        raise bad_value("--zero", zero, "choose 0, 1, 2 or 3")
    if n_shard < 1:
        raise bad_value("dp_shard", n_shard, "must be a positive integer")
    p, g, m, o = prec.param_bytes, prec.grad_bytes, prec.master_bytes, prec.optim_bytes
    n = float(n_shard)
    if zero == 3 and shard_is_master and m > 0:
        return StateBytes(params=n_params * m / n, grads=n_params * g / n, master=0.0, optimizer=n_params * o / n)
    return StateBytes(params=n_params * p / (n if zero >= 3 else 1),
                      grads=n_params * g / (n if zero >= 2 else 1),
                      master=n_params * m / (n if zero >= 1 else 1),
                      optimizer=n_params * o / (n if zero >= 1 else 1))


def bytes_per_param(zero: int, n_shard: int, prec: Precision, shard_is_master: bool = False) -> float:
    return state_bytes(1.0, zero, n_shard, prec, shard_is_master).total


def max_params_that_fit(capacity_bytes: float, zero: int, n_shard: int, prec: Precision) -> float:
    """The largest model whose state alone fits `capacity_bytes` per GPU (activations ignored)."""
    return capacity_bytes / bytes_per_param(zero, n_shard, prec)


# ---------------------------------------------------------------------------------------------
# Activations (bytes per layer per micro-batch on one GPU)
# ---------------------------------------------------------------------------------------------

def gpt_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str = "none", f: int | None = None) -> float:
    """Korthikanti et al. 2022, Table 2, for a GPT layer with f = 4h (other f generalise the 24):

      no parallelism        s b h (34 + 5 a s / h)
      tensor parallel t     s b h (10 + 24/t + 5 a s / (h t))
      + sequence parallel   s b h (34/t + 5 a s / (h t))
      + selective recompute drops the 5 a s / h term (softmax, its dropout, attention over V)
      full recompute        2 s b h (the layer's input; / t with sequence parallelism)

    The 10 that TP alone leaves whole: two LayerNorm inputs (4), the inputs of QKV and fc1 (4),
    two dropout masks (2). The 24 it splits: Q, K (4), V (2), projection input (2), GeLU input
    (2f/h = 8), fc2 input (2f/h = 8)."""
    f = f or 4 * h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    split = 8 + 4 * f / h
    core = 5 * a * s / h if recompute == "none" else 0.0
    if sp:
        return s * b * h * ((10 + split) / t + core / t)
    return s * b * h * (10 + split / t + core / t)


def llama_layer_activation_bytes(d: ModelDims, s: int, b: int, t: int = 1, sp: bool = False,
                                 recompute: str = "none", act_bytes: float = 2.0, compiled: bool = True,
                                 cp: int = 1, ulysses: bool = False, fp8: str = "off") -> float:
    """What plait's Llama block keeps for its backward, compiled (plait's GPU default) or eager: the
    runtime's own formula (`plait.parallel.activations.layer_bytes`, checked there against what a
    block keeps, measured both ways)."""
    from plait.parallel.activations import layer_bytes

    return layer_bytes(b, s, d.hidden, d.heads, d.kv_heads, d.ffn, t, sp, recompute, act_bytes, compiled, cp, ulysses,
                       fp8)


def layer_activation_bytes(d: ModelDims, s: int, b: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", act_bytes: float = 2.0, compiled: bool = True,
                           cp: int = 1, ulysses: bool = False, fp8: str = "off") -> float:
    """Per-layer activation bytes of either architecture (`s` is the sequence slice on this GPU,
    `cp` the context-parallel degree, `ulysses` its all-to-all variant, `fp8` the linears' FP8 scaling).
    GPT layers follow Korthikanti et al. (Megatron's fused kernels), compiled or not."""
    if recompute not in ("none", "selective", "full"):
        raise bad_value("--recompute", recompute, "choose none, selective or full")
    if d.arch == "gpt":
        return gpt_layer_activation_bytes(s, b, d.hidden, d.heads, t, sp, recompute, d.ffn) * act_bytes / 2
    return llama_layer_activation_bytes(d, s, b, t, sp, recompute, act_bytes, compiled, cp, ulysses, fp8)


def wgrad_fraction(d: ModelDims) -> float:
    """Share of a layer's activations a deferred weight-gradient pass (ZB's W) still needs: the
    inputs of its matmuls plus the gradients of their outputs, relative to the full set."""
    h, kv, f = d.hidden, d.kv_dim, d.ffn
    if d.arch == "gpt":  # in elements: QKV, projection, fc1, fc2
        inputs, out_grads, full = 3 * h + f, 5 * h + f, 9 * h + 2 * f
    else:
        inputs, out_grads = 3 * h + f, 3 * h + 2 * kv + 2 * f
        full = 6 * h + 2 * kv + 3 * f
    return min(1.0, (inputs + out_grads) / full)


def interleaved_memory_factor(pp: int, v: int) -> float:
    """Korthikanti et al. 2022, sec. 4.2.3: interleaving multiplies the first stage's activation
    memory by (1 + (p - 1) / (p v)) over 1F1B's L layers' worth (for m >= p micro-batches)."""
    return 1 + (pp - 1) / (pp * v) if v > 1 else 1.0


def loss_chunk_bytes(d: ModelDims, tokens: int, t: int = 1, compiled: bool = True, act_bytes: float = 2.0,
                     eager_head: bool = False, logits_held: bool = False) -> float:
    """Temporary memory of plait's fused output projection + cross-entropy on the last stage.

    plait/loss.py forms the logits of as many tokens at a time as fit LOSS_CHUNK_ELEMENTS logits of
    this rank's vocabulary rows (padded to a multiple of tp). Compiled, while a chunk's gradient is
    formed it holds its logits and that gradient (2 e bytes per logit: the fp32 softmax never
    materialises) or, vocab-parallel, the fp32 logits kept between the statistics' all-gather and the
    gradient and the gradient (e + 4); then only the gradient (e) is left for the output matrix's
    gradient GEMM. That gradient is, in one chunk, the GEMM's own 16-bit output; over several, an
    fp32 sum, cast to the parameters' dtype after the loop. Eager a chunk also holds fp32 copies and
    the one-hot target (about 12 bytes per logit, an estimate). `logits_held`: as plait ran before
    (`Layout.loss_logits_held`), the logits (and fp32 logits) kept beside the weight-gradient GEMM;
    `eager_head`: as before that (`Layout.eager_head`), an fp32 sum even in one chunk."""
    from plait.parallel.rules import LOSS_CHUNK_ELEMENTS

    rows = -(-d.vocab // t)
    per_chunk = max(1, LOSS_CHUNK_ELEMENTS // rows)
    logits = min(tokens, per_chunk) * rows  # a chunk's logits
    one = tokens <= per_chunk and not eager_head
    wgrad = act_bytes * rows * d.hidden  # the output matrix's 16-bit gradient
    fp32_sum = 4.0 * rows * d.hidden
    if not compiled or logits_held:
        held = logits * ((2 * act_bytes + (4.0 if t > 1 else 0.0)) if compiled else 12.0)
        return held + wgrad if one else max(held, wgrad) + fp32_sum
    forming = logits * (act_bytes + (4.0 if t > 1 else act_bytes))
    if one:
        return max(forming, logits * act_bytes + wgrad)
    # one chunk at a time; after the loop the fp32 weight gradient is cast to the parameters' dtype
    return max(forming, wgrad) + fp32_sum
