"""How a pipeline cuts the model into stages, by layer name. The planner prices the same split.

S = pp x v stages of consecutive layers; stage s runs on pipeline rank s mod pp as its chunk
s // pp (Megatron's interleaving: rank r holds stages r, r + pp, r + 2 pp, ...), or for ZB-V on
rank r = s and r = 2 pp - 1 - s (`plait.parallel.schedules.place`). Stage 0 also holds the
embedding, stage S - 1 the final norm, the output projection and the loss. Layers keep their
global names (`layers.17` on whichever rank holds it), so checkpoints do not depend on the split.
"""

from __future__ import annotations

import functools

from plait.errors import bad_value


def stage_layers(layers: int, stages: int) -> list[int]:
    """Layers of each of `stages` consecutive stages: as even as possible, extras to the middle
    stages (the first holds the embedding and the last the output head, so they get no extra)."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), abs(i - (stages - 1) / 2)))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def balanced_counts(layers: int, stages: int, layer_cost: float, head_cost: float, first_cost: float = 0.0) -> list[int]:
    """Layers per stage that make the slowest stage as fast as it can be when the last stage also runs
    the output head and loss (`head_cost`) and the first the embedding (`first_cost`), both in the
    units of `layer_cost`: a contiguous split minimising the largest stage cost, then the spread (sum
    of squares), every stage at least one layer."""
    if stages == 1:
        return [layers]
    return list(_balanced(layers, stages, head_cost / layer_cost, first_cost / layer_cost))


@functools.lru_cache(maxsize=4096)  # the planner's search asks for the same split thousands of times
def _balanced(layers: int, stages: int, ratio: float, first: float) -> tuple[int, ...]:
    best = {0: (0.0, 0.0, [])}  # layers placed -> (max cost, sum of squares, counts)
    for s in range(stages):
        last = s == stages - 1
        nxt: dict = {}
        for used, (worst, sq, counts) in best.items():
            room = layers - used - (stages - 1 - s)  # leave a layer for every later stage
            for n in ([room] if last else range(1, room + 1)):
                if n < 1:
                    continue
                cost = n + (ratio if last else 0.0) + (first if s == 0 else 0.0)
                cand = (max(worst, cost), sq + cost * cost, counts + [n])
                key = used + n
                if key not in nxt or cand[:2] < nxt[key][:2]:
                    nxt[key] = cand
        best = nxt
    return tuple(best[layers][2])


def v_balanced_counts(layers: int, pp: int, layer_cost: float, head_cost: float, first_cost: float = 0.0) -> list[int]:
    """`balanced_counts` for ZB-V's placement: rank r runs stages r and 2 pp - 1 - r, so what must
    be even is each rank's pair, rank 0's carrying the head and the embedding. Each rank's layers
    are chosen by filling the least loaded rank first, then cut into its two stages as evenly as
    possible (the first stage of a pair takes the extra). Every other rank keeps a layer in each
    stage; rank 0's may hold none where the head alone outweighs the others' layers (1b: the head
    weighs 4.3 layers), leaving stage 0 the embedding and the last stage the head."""
    extra = (head_cost + first_cost) / layer_cost
    per_rank = [0] + [2] * (pp - 1)
    for _ in range(layers - 2 * (pp - 1)):
        r = min(range(pp), key=lambda r: (per_rank[r] + (extra if r == 0 else 0.0), -r))
        per_rank[r] += 1
    counts = [0] * (2 * pp)
    for r, n in enumerate(per_rank):
        counts[r], counts[2 * pp - 1 - r] = (n + 1) // 2, n // 2
    return counts


def flops_balanced(d, stages: int, schedule: str = "1f1b") -> list[int]:
    """`balanced_counts` from plait's model arithmetic: a block's matmul and causal attention FLOPs
    against the output projection's (6 FLOPs per weight and token forward and backward for both, so
    forward FLOPs compare). `d` is the planner's ModelDims."""
    from plait.planner import costs

    layer = costs.layer_matmul_flops_per_token(d) + costs.attention_flops_per_token(d, causal=True)
    if schedule == "zbv":
        return v_balanced_counts(d.layers, stages // 2, layer, costs.head_flops_per_token(d))
    return balanced_counts(d.layers, stages, layer, costs.head_flops_per_token(d))


def measured_split(stage_s: list[float], counts: list[int]) -> tuple[list[int], list[float]] | None:
    """A split from a measured run: `stage_s[s]` is stage s's compute seconds per micro-batch (F + B
    + W), `counts[s]` its layers. A layer's cost comes from the stages holding only layers (with two
    stages, from the first, the embedding's cost folded in); what the first and last stages take
    beyond their layers is the embedding's and the head's (the head's fused loss costs more than its
    matmuls' FLOPs say: on 4 x H200, 8b, 3.8 layers' time for 2.4 layers' FLOPs). Returns the
    balanced counts and the stage times they would give, or None when the times cannot say."""
    S = len(counts)
    mids = [s for s in range(1, S - 1) if counts[s] > 0]
    if S < 2 or not (mids or counts[0] > 0):
        return None
    layer = (sum(stage_s[s] for s in mids) / sum(counts[s] for s in mids)) if mids else stage_s[0] / counts[0]
    if layer <= 0:
        return None
    first = max(0.0, stage_s[0] - counts[0] * layer) if mids else 0.0
    head = max(0.0, stage_s[-1] - counts[-1] * layer)
    best = balanced_counts(sum(counts), S, layer, head, first)
    return best, [n * layer + (first if s == 0 else 0.0) + (head if s == S - 1 else 0.0) for s, n in enumerate(best)]


def stage_work(d, counts: list[int] | tuple[int, ...], head_wgrad_in_b: bool = False) -> tuple[tuple[float, float, float], ...]:
    """Relative (F, B, W) time of each stage from plait's model arithmetic, in forwards of a layer:
    a layer's F is its matmuls and causal attention, its B the matmuls' input gradients and the
    attention's backward (twice its forward), its W the matmuls' weight gradients; the last
    stage's B also runs the output head and loss, its forward and input gradient (the executor's
    head slot), and its W the output matrix's gradient, which the fused loss defers there
    (`head_wgrad_in_b`: in B, as plait ran before). What ZB-V's order is found with
    (`plait.parallel.schedule_zbv`); the executor and the planner both build it from this, so they
    run and price the same lists."""
    from plait.planner import costs

    mm, att = costs.layer_matmul_flops_per_token(d), costs.attention_flops_per_token(d, causal=True)
    f, b, w = 1.0, round((mm + 2 * att) / (mm + att), 3), round(mm / (mm + att), 3)
    head = costs.head_flops_per_token(d) / (mm + att)  # one of the head's three matmuls
    hb, hw = (round(3 * head, 3), 0.0) if head_wgrad_in_b else (round(2 * head, 3), round(head, 3))
    last = len(counts) - 1
    return tuple((n * f, n * b + (hb if s == last else 0.0), n * w + (hw if s == last else 0.0))
                 for s, n in enumerate(counts))


def resolve_counts(text: str, cfg, seq: int, stages: int, schedule: str = "1f1b",
                   field: str = "parallel.stage_layers") -> list[int] | None:
    """parallel.stage_layers for a ModelConfig `cfg` at sequence length `seq`: "" (None: as even as
    possible), "balance" (`flops_balanced` for the schedule's placement) or explicit counts."""
    if str(text).strip() == "balance":
        from plait.planner.costs import ModelDims

        if stages > cfg.n_layers:
            raise bad_value(field, text, f"cannot give each of {stages} stages a layer of {cfg.n_layers}")
        return flops_balanced(ModelDims.from_config(cfg, seq), stages, schedule)
    return parse_counts(text, cfg.n_layers, stages, field)


def parse_counts(text: str, layers: int, stages: int, field: str = "parallel.stage_layers") -> list[int] | None:
    """Explicit per-stage layer counts "3,5,5,3" (None when empty); one line for anything wrong."""
    if not str(text).strip():
        return None
    try:
        counts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise bad_value(field, text, "give one layer count per stage, comma-separated, e.g. 3,5,5,3, or "
                        "balance") from None
    if len(counts) != stages:
        raise bad_value(field, text, f"gives {len(counts)} counts for {stages} stages (pp x v)")
    if min(counts) < 0 or sum(counts) != layers:
        raise bad_value(field, text, f"must be counts >= 0 adding up to the {layers} layers")
    if stages > 1 and (counts[0] == 0 and counts[-1] == 0) and layers < stages:
        raise bad_value(field, text, "leaves stages empty; use fewer stages")
    return counts


def check_ranks_hold_parameters(counts: list[int], pp: int, v: int, schedule: str, text: str,
                                field: str = "parallel.stage_layers") -> None:
    """Every pipeline rank must hold something to train: a layer, the embedding (the first stage's
    rank) or the output head (the last stage's). A rank of empty middle stages has no parameters,
    and the data-parallel engine failed on it after launch (an IndexError per rank)."""
    from plait.parallel.schedules import place

    S = pp * v
    holders = {place(schedule, pp, v, 0)[0], place(schedule, pp, v, S - 1)[0]}
    for r in range(pp):
        if r in holders:
            continue
        if not any(counts[s] for s in range(S) if place(schedule, pp, v, s)[0] == r):
            raise bad_value(field, text, f"leaves pipeline rank {r} no layer (nor the embedding or the output "
                            "head): nothing to train there; give every rank's stages at least one layer")


def stage_layer_ids(layers: int, stages: int, counts: list[int] | None = None) -> list[list[int]]:
    """The global layer ids of every stage."""
    counts = counts or stage_layers(layers, stages)
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunks(pp: int, v: int, rank: int, per_stage: list[list[int]], schedule: str = "1f1b") -> list[list[int]]:
    """The layer ids of each chunk (virtual stage) pipeline rank `rank` holds: chunk c is stage
    c * pp + rank (ZB-V: `plait.parallel.schedules.stage_of`)."""
    from plait.parallel.schedules import stage_of

    return [per_stage[stage_of(schedule, pp, rank, c)] for c in range(v)]
