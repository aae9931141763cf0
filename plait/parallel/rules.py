"""The one set of rules a parallel layout must follow for a model, shared by `plait train` (before
any process starts) and the planner (before it prices a layout).

Each rule raises one `UserError` line naming the knob, its value and the fix. `field(knob)` turns
a knob name ("tp", "sp", ...) into what the user typed: `parallel.tp` for a run, `--tp` for the
planner.
"""

from __future__ import annotations

from typing import Callable

from plait.errors import bad_value

RECOMPUTE = ("none", "selective", "full")
CP_IMPLS = ("ring", "ulysses")
LOSS_CHUNK_ELEMENTS = 1 << 29
"""Logits the fused output projection + cross-entropy forms at a time (plait/loss.py; the planner
prices its memory with the same number): 1 GiB in bf16; fewer chunks = fewer passes over grad_w."""
SP_MODES = ("auto", "on", "off")


EMBEDDING_ROWS = ("auto", "on", "off")


def embedding_rows(mode: str, ranks: int, tokens: int, vocab: int, tied: bool) -> bool:
    """Whether DDP sends the embedding's gradient as the rows a step touched
    (`plait.parallel.embedding_rows`): `on`; on `auto`, for an untied embedding where all-gathering
    the `tokens` rows a rank (and their ids) over `ranks` sends fewer bytes than all-reducing the
    dense (vocab, dim) matrix: (N-1) T against 2 (N-1)/N V elements a row of dim (an int64 id a row
    is under 1% of any real model's row). A tied matrix's dense part is all-reduced either way: the
    rows only move it from after the backward to beside it, where it slows the backward's matmuls
    about as much as it saved (4 x H200, 1b: 93.5-94.4% weak scaling either way; untied, 8b's shape
    with 8 layers: +1.6%), so `auto` leaves it dense. The caller decides whether the layout allows
    it (DDP, no tp/pp/cp split)."""
    if ranks < 2 or mode == "off":
        return False
    return mode == "on" or (not tied and ranks * tokens < 2 * vocab)


def run_field(knob: str) -> str:
    return f"parallel.{knob}"


def flag_field(knob: str) -> str:
    """A knob as `plait plan` and `plait schedule` take it: --tp, --cp-impl."""
    return f"--{knob.replace('_', '-')}"


MODEL_FIELDS = {"hidden": "model.dim", "heads": "model.n_heads", "kv_heads": "model.n_kv_heads",
                "layers": "model.n_layers", "ffn": "model.ffn_dim", "vocab": "model.vocab_size"}


def model_field(knob: str) -> str:
    """A model knob as a run's config names it (`plait train`): hidden -> model.dim."""
    return MODEL_FIELDS.get(knob, f"model.{knob}")


def check_heads(*, hidden: int, heads: int, rope: bool = True, blame: str = "heads",
                field: Callable[[str], str] = model_field) -> None:
    """Do the heads cut the hidden size into equal heads, each of an even size? RoPE rotates a
    head's dimensions in pairs (plait/model.py), so an odd head size has a dimension left over; a
    model with learned positions (`rope` False: GPT) takes any size. `blame` names the knob the user
    changed (a planner preset with --hidden over it blames --hidden), and the fix changes that one."""
    if hidden % heads == 0 and (not rope or (hidden // heads) % 2 == 0):
        return
    step = 2 * heads if rope else heads
    if blame == "hidden":
        near = max(step, round(hidden / step) * step)
        why = f"must be a multiple of {field('heads')} = {heads}" if hidden % heads else (
            f"gives {heads} heads of an odd size {hidden // heads}; RoPE needs an even head size")
        raise bad_value(field("hidden"), hidden, f"{why}: use a multiple of {step} (e.g. {near})")
    near = min((d for d in range(1, hidden + 1) if hidden % d == 0 and (not rope or (hidden // d) % 2 == 0)),
               key=lambda d: (abs(d - heads), d), default=None)
    fix = (f"e.g. {near}" if near else f"no head count cuts an odd {field('hidden')} into even heads: "
           f"make it even")  # `near` is None only for an odd hidden size under RoPE
    if hidden % heads:
        raise bad_value(field("heads"), heads, f"must divide {field('hidden')} = {hidden} ({fix})")
    raise bad_value(field("heads"), heads, f"gives an odd head size {hidden // heads} of {field('hidden')} = "
                    f"{hidden}; RoPE needs an even head size: use heads that leave one ({fix})")


def sequence_parallel(sp: str | bool, tp: int) -> bool:
    """Whether a layout shards norms and residuals along the sequence: `auto` (the default) and
    `on` whenever tp > 1 - it moves the same bytes as plain TP (an all-gather and a reduce-scatter
    instead of an all-reduce) and divides the activations outside the TP regions by tp."""
    if isinstance(sp, bool):
        sp = "on" if sp else "off"
    return tp > 1 and sp != "off"


def check_split(*, heads: int, kv_heads: int, ffn: int, layers: int, seq: int, tp: int = 1, pp: int = 1,
                v: int = 1, cp: int = 1, sp: str | bool = "auto", cp_impl: str = "ring", micro_batch: int = 1,
                field: Callable[[str], str] = run_field, world: int | None = None) -> None:
    """Can the model be cut this way? Heads and the MLP split over tp; key/value heads split when
    there are at least tp of them and are replicated (tp a multiple of them) otherwise; stages need a
    layer each; causal load balancing cuts a sequence into 2 x cp chunks; sequence parallelism cuts
    a micro-batch's tokens (on this cp rank) into tp equal parts. `world`: the processes a run has
    (a tp to suggest must divide them too)."""
    if isinstance(sp, str) and sp not in SP_MODES:
        raise bad_value(field("sp"), sp, f"choose {', '.join(SP_MODES)}")
    if sp in (True, "on") and tp == 1:
        raise bad_value(field("sp"), sp, "sequence parallelism shards what tensor parallelism replicates; "
                        "it needs tp > 1: add --tp T (with --nproc) or drop --sp")
    if heads % tp:
        raise bad_value(field("tp"), tp, f"must divide the {heads} attention heads; choose one of "
                        f"{_divisors(heads, world)}" + (f" (dividing the {world} processes too)" if world else ""))
    if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
        fits = [d for d in range(1, min(heads, 64) + 1) if heads % d == 0 and ffn % d == 0
                and (kv_heads % d == 0 if kv_heads >= d else d % kv_heads == 0) and (not world or world % d == 0)]
        raise bad_value(field("tp"), tp, f"and the {kv_heads} key/value heads must divide one another "
                        f"(each rank holds kv_heads/tp heads, or tp/kv_heads ranks share one); choose one of "
                        f"{', '.join(map(str, fits[:8]))}")
    if ffn % tp:
        raise bad_value(field("tp"), tp, f"must divide the MLP width {ffn}; choose one of {_divisors(ffn, heads, world)}")
    if pp * v > layers:
        raise bad_value(field("pp"), pp, f"pp x v = {pp * v} stages exceed the model's {layers} layer(s) (more stages than "
                        f"layers leave whole ranks without a layer): use pp x v <= {layers}, or a model with more "
                        "layers")
    if cp > 1 and seq % (2 * cp):
        raise bad_value(field("cp"), cp, f"the causal load balance splits each sequence into 2 x cp chunks: "
                        f"the sequence length {seq} must be a multiple of {2 * cp}")
    tokens = micro_batch * seq // cp
    if sequence_parallel(sp, tp) and tokens % tp:  # (cp's own split was checked just above)
        why = (f"sequence parallelism splits a micro-batch's {micro_batch} x {seq // cp} = {tokens} tokens"
               f"{' (on each cp rank)' if cp > 1 else ''} over tp = {tp} ranks, which does not divide them: make "
               f"that a multiple of {tp} (the sequence length or the micro-batch), or ")
        if field("sp") == "--sp":  # plan and schedule take it as --no-sp
            raise bad_value(field("tp"), tp, why + "add --no-sp")
        raise bad_value(field("sp"), sp, why + f"use {field('sp').replace('parallel.', '--')} off")
    if cp_impl not in CP_IMPLS:
        raise bad_value(field("cp_impl"), cp_impl, f"choose {' or '.join(CP_IMPLS)}")
    if cp_impl == "ulysses" and cp > 1:
        q, kv = heads // tp, max(1, kv_heads // tp)
        if q % cp or (kv % cp and cp % kv):
            raise bad_value(field("cp_impl"), cp_impl, f"the all-to-all gives each of the {cp} cp ranks an equal "
                            f"share of the {q} query and {kv} key/value heads per tensor-parallel rank, which "
                            f"{cp} does not split evenly: use cp_impl ring, or a cp that divides {q} and divides "
                            f"or is a multiple of {kv}")


def check_tp_in_node(tp: int, gpus_per_node: int, field: Callable[[str], str] = run_field) -> None:
    """TP talks twice per layer and needs the links inside a node."""
    if tp > gpus_per_node or gpus_per_node % tp:
        raise bad_value(field("tp"), tp, f"a tensor-parallel group must fit inside a node of {gpus_per_node} "
                        f"GPUs; use a divisor of {gpus_per_node}")


def _divisors(n: int, *also: int | None) -> str:
    """Divisors of n (up to 64) that divide every `also` given too (None: no constraint)."""
    ds = [d for d in range(1, min(n, 64) + 1) if n % d == 0 and all(a is None or a % d == 0 for a in also)]
    return ", ".join(map(str, ds[:8]))
