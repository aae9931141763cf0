"""How a pipeline cuts the model into stages, by layer name. The planner prices the same split.

S = pp x v stages of consecutive layers; stage s runs on pipeline rank s mod pp as its chunk
s // pp (Megatron's interleaving: rank r holds stages r, r + pp, r + 2 pp, ...). Stage 0 also holds
the embedding, stage S - 1 the final norm, the output projection and the loss. Layers keep their
global names (`layers.17` on whichever rank holds it), so checkpoints do not depend on the split.
"""

from __future__ import annotations

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


def parse_counts(text: str, layers: int, stages: int, field: str = "parallel.stage_layers") -> list[int] | None:
    """Explicit per-stage layer counts "3,5,5,3" (None when empty); one line for anything wrong."""
    if not str(text).strip():
        return None
    try:
        counts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise bad_value(field, text, "give one layer count per stage, comma-separated, e.g. 3,5,5,3") from None
    if len(counts) != stages:
        raise bad_value(field, text, f"gives {len(counts)} counts for {stages} stages (pp x v)")
    if min(counts) < 0 or sum(counts) != layers:
        raise bad_value(field, text, f"must be counts >= 0 adding up to the {layers} layers")
    if stages > 1 and (counts[0] == 0 and counts[-1] == 0) and layers < stages:
        raise bad_value(field, text, "leaves stages empty; use fewer stages")
    return counts


def stage_layer_ids(layers: int, stages: int, counts: list[int] | None = None) -> list[list[int]]:
    """The global layer ids of every stage."""
    counts = counts or stage_layers(layers, stages)
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunks(pp: int, v: int, rank: int, per_stage: list[list[int]]) -> list[list[int]]:
    """The layer ids of each chunk (virtual stage) pipeline rank `rank` holds: chunk c is stage
    c * pp + rank."""
    return [per_stage[c * pp + rank] for c in range(v)]
