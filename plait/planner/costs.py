"""Model arithmetic: parameter counts and FLOPs for plait's Llama and for a GPT-style decoder.

Notation (Megatron's, which the seeds and papers use): L layers, h hidden size, a attention heads,
q = h / a head size, kv key/value heads, f feed-forward width, V vocabulary, s sequence length,
b micro-batch size, B global batch, N parameters.

Two architectures:
  llama  plait's model: RMSNorm (weight only), RoPE (no position table), grouped-query attention
         without biases, SwiGLU feed-forward (three f x h matrices), untied or tied embeddings.
  gpt    GPT-2/3 and Megatron's benchmarks: LayerNorm (weight + bias), learned position embeddings,
         biased QKV/projection/fc1/fc2 with GeLU, output head tied to the input embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.parallel.rules import RECOMPUTE  # noqa: F401  (re-exported for the planner)
from plait.errors import bad_value

ARCHS = ("llama", "gpt")


@dataclass(frozen=True)
class ModelDims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    arch: str = "llama"
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_value(f"--{name.replace('_', '-')}", v, "must be a positive integer")
        if self.arch not in ARCHS:
            raise bad_value("--arch", self.arch, f"choose one of {', '.join(ARCHS)}")
        if self.hidden % self.heads:
            raise bad_value("--heads", self.heads, f"must divide --hidden = {self.hidden}")
        if self.heads % self.kv_heads:
            raise bad_value("--kv-heads", self.kv_heads, f"must divide --heads = {self.heads}")
        if self.arch == "gpt" and self.kv_heads != self.heads:
            raise bad_value("--kv-heads", self.kv_heads, f"the gpt architecture has no grouped-query "
                            f"attention: use --kv-heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv heads x head size."""
        return self.kv_heads * self.head_dim

    @classmethod
    def gpt(cls, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
            ffn: int | None = None) -> "ModelDims":
        """A GPT-style model as Megatron's papers specify them (f = 4h, V = 51200, s = 2048)."""
        return cls(layers, hidden, heads, heads, ffn or 4 * hidden, vocab, seq, "gpt", True)

    @classmethod
    def from_config(cls, m, seq: int | None = None) -> "ModelDims":
        """From plait's `ModelConfig` (a preset's shape); `seq` defaults to its max_seq_len."""
        return cls(m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size,
                   seq or m.max_seq_len, "llama", bool(m.tie_embeddings))


def layer_params(d: ModelDims) -> int:
    """Parameters of one transformer block."""
    h, f = d.hidden, d.ffn
    if d.arch == "llama":
        attn = h * h + 2 * h * d.kv_dim + h * h  # wq, wk, wv, wo
        return attn + 3 * h * f + 2 * h  # w1, w2, w3; two RMSNorm weights
    # qkv (3h^2 + 3h), proj (h^2 + h), fc1 (hf + f), fc2 (fh + h), two LayerNorms (4h)
    return 4 * h * h + 2 * h * f + f + 9 * h


def embedding_params(d: ModelDims) -> int:
    """Input embedding (and GPT's position table)."""
    return d.vocab * d.hidden + (d.seq * d.hidden if d.arch == "gpt" else 0)


def head_params(d: ModelDims) -> int:
    """Final norm and, unless tied to the embedding, the output projection."""
    norm = d.hidden if d.arch == "llama" else 2 * d.hidden
    return norm + (0 if d.tie_embeddings else d.vocab * d.hidden)


def tp_share(d: ModelDims, tp: int) -> tuple[float, float, float]:
    """(one block's, the embedding's, the head's) parameters on one tensor-parallel rank.

    plait's Llama (plait/parallel/tensor.py): the matrices split over tp, the norm gains whole,
    K and V whole when tp > kv_heads (the heads are replicated), the vocabulary padded to a
    multiple of tp. Other architectures: everything divided by tp (Megatron's GPT)."""
    if tp == 1:
        return float(layer_params(d)), float(embedding_params(d)), float(head_params(d))
    if d.arch != "llama":
        return layer_params(d) / tp, embedding_params(d) / tp, head_params(d) / tp
    h, f = d.hidden, d.ffn
    kv = 2 * h * d.kv_dim / tp if d.kv_heads >= tp else 2 * h * d.kv_dim
    vocab_rows = -(-d.vocab // tp)
    block = 2 * h * h / tp + kv + 3 * h * f / tp + 2 * h
    return block, float(vocab_rows * h), h + (0.0 if d.tie_embeddings else float(vocab_rows * h))


def block_linear_share(d: ModelDims, tp: int) -> float:
    """One block's linear weights on one tensor-parallel rank: `tp_share`'s block less its norm gains
    (and GPT's biases). What FP8 linears quantize and ZeRO-3's FP8 gather sends in one byte."""
    block = tp_share(d, tp)[0]
    if d.arch == "llama":
        return block - 2 * d.hidden
    return block - (d.ffn + 9 * d.hidden) / tp


def output_share(d: ModelDims, tp: int) -> float:
    """The output matrix's parameters on one tensor-parallel rank when it is untied (0 tied): the
    head's share (`tp_share`) less the final norm's."""
    if d.tie_embeddings:
        return 0.0
    if d.arch == "llama" and tp > 1:
        return float(-(-d.vocab // tp) * d.hidden)  # the vocabulary padded to a multiple of tp
    return d.vocab * d.hidden / tp


def param_count(d: ModelDims) -> int:
    """Every parameter of the model, each counted once (a tied matrix once)."""
    return d.layers * layer_params(d) + embedding_params(d) + head_params(d)


def megatron_param_count(d: ModelDims) -> float:
    """Megatron's closed form for a GPT model: 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)).

    It is `param_count` without the final LayerNorm's 2h (Narayanan et al. 2021, sec. 5.1)."""
    l, h = d.layers, d.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (d.vocab + d.seq) / (12 * l * h))


def matmul_params(d: ModelDims) -> int:
    """The N of "6N": parameters that take part in a matrix multiply for every token.

    The input embedding is a table lookup (no FLOPs) and GPT's position table likewise; the output
    projection is a matmul even when it shares its matrix with the embedding, so it counts."""
    return d.layers * layer_params(d) + head_params(d) + (d.vocab * d.hidden if d.tie_embeddings else 0)


def model_flops_per_token(d: ModelDims) -> float:
    """plait's MFU convention (PaLM, Chowdhery et al. 2022, app. B): 6 N + 12 L H Q T.

    6N: forward 2 FLOPs per parameter per token, backward 4. 12 L H Q T: the attention score and
    attention-over-value products, forward + backward, counted over the full (not causal) T x T."""
    return 6 * matmul_params(d) + 12 * d.layers * d.heads * d.head_dim * d.seq


def megatron_model_flops(d: ModelDims, global_batch: int) -> float:
    """Megatron's model FLOPs per iteration, no recomputation: 72 B s l h^2 (1 + s/6h + V/12lh).

    Equals `model_flops_per_token * B * s` for a GPT model with f = 4h, up to biases and norms."""
    l, h, s, V = d.layers, d.hidden, d.seq, d.vocab
    return 72 * global_batch * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_hardware_flops(d: ModelDims, global_batch: int) -> float:
    """The same with full recomputation (one more forward of every layer, not of the head):
    96 B s l h^2 (1 + s/6h + V/16lh) -- Narayanan et al. 2021, eq. (3)."""
    l, h, s, V = d.layers, d.hidden, d.seq, d.vocab
    return 96 * global_batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def layer_matmul_flops_per_token(d: ModelDims) -> float:
    """Forward FLOPs per token of one block's weight matmuls (2 per multiply-add)."""
    h, f = d.hidden, d.ffn
    if d.arch == "llama":
        return 2 * (2 * h * h + 2 * h * d.kv_dim + 3 * h * f)
    return 2 * (4 * h * h + 2 * h * f)


def attention_flops_per_token(d: ModelDims, causal: bool = False) -> float:
    """Forward FLOPs per token of one block's QK^T and AV: 4 s h over the full square, half causal."""
    full = 4 * d.seq * d.heads * d.head_dim
    return full / 2 if causal else full


def head_flops_per_token(d: ModelDims) -> float:
    """Forward FLOPs per token of the output projection."""
    return 2 * d.hidden * d.vocab




def hardware_flops_per_token(d: ModelDims, recompute: str = "none") -> float:
    """FLOPs the GPU actually executes per token, recomputation included (for HFU).

    full: every block's forward runs twice (the head's does not). selective (Korthikanti et al.
    2022): only the attention core (QK^T, softmax, AV) is recomputed. Model FLOPs use the same
    full-square attention convention as `model_flops_per_token`."""
    if recompute not in RECOMPUTE:
        raise bad_value("--recompute", recompute, f"choose one of {', '.join(RECOMPUTE)}")
    base = model_flops_per_token(d)
    if recompute == "full":
        return base + d.layers * (layer_matmul_flops_per_token(d) + attention_flops_per_token(d))
    if recompute == "selective":
        return base + d.layers * attention_flops_per_token(d)
    return base


def training_days(tokens: float, params: float, n_gpus: int, flops_per_gpu: float) -> float:
    """Narayanan et al.'s end-to-end estimate 8 T P / (n X) in days (6 T P without recompute,
    plus 2 T P for the recomputed forward)."""
    return 8 * tokens * params / (n_gpus * flops_per_gpu) / 86400
