"""Silent divergence between data-parallel replicas: a bit flipped in one rank's memory, a faulty
GPU, a missed update. Every replica of a parameter must hold the same bits after each step, so
every `train.replica_check_every` steps (and before each checkpoint, so none is written from a
corrupted replica) the replicas compare a checksum of their state with one all-gather of one number.
A mismatch stops the run with `ReplicaMismatch`, naming the ranks that differ from the majority.

The checksum is the sum of the state's 32-bit (or 16-bit) words read as integers, in int64: it sees
every single-bit flip (one word changes by a power of two), costs one read of the state, and does
not depend on float rounding. Which state and which group the engine says (`Engine.replicated`):
fp32 masters over the data-parallel group under DDP, a ZeRO shard over its HSDP replicas.
"""

from __future__ import annotations

from collections import Counter

import torch

_WORDS = {4: torch.int32, 2: torch.int16, 8: torch.int64}
_CHUNK = 1 << 24  # words per int64 upcast: bounds the temporary copy


class ReplicaMismatch(RuntimeError):
    """Data-parallel replicas hold different parameters; the message names the ranks."""


def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 sum of the tensors' words (their bit patterns), as a 1-element tensor on their device."""
    total = torch.zeros(1, dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        words = t.detach().contiguous().view(-1).view(_WORDS[t.element_size()])
        for i in range(0, words.numel(), _CHUNK):
            total += words[i:i + _CHUNK].to(torch.int64).sum()
    return total


class ReplicaCheck:
    def __init__(self, engine, comm, every: int):
        self.engine, self.comm, self.every = engine, comm, every

    def due(self, done: int, saving: bool) -> bool:
        return bool(self.every) and self.comm is not None and (done % self.every == 0 or saving)

    def check(self, step: int, before_raise=lambda: None) -> None:
        """Compare over the replica group; raises ReplicaMismatch (the same on every rank), after
        `before_raise()` (waiting for a checkpoint still being written, say)."""
        tensors, group = self.engine.replicated()
        if self.comm.size(group) < 2:
            return
        sums = self.comm.all_gather(checksum(tensors), group).tolist()
        if len(set(sums)) == 1:
            return
        ranks = self.comm.group(group).ranks
        common, n = Counter(sums).most_common(1)[0]
        if n * 2 > len(sums):  # a majority agrees: name the others
            bad = [r for r, s in zip(ranks, sums) if s != common]
            good = [r for r, s in zip(ranks, sums) if s == common]
            who = f"rank(s) {bad} hold parameters that differ from ranks {good}"
        else:
            who = f"ranks {ranks} hold parameters that differ, with no majority"
        before_raise()
        raise ReplicaMismatch(f"replica check at step {step}: {who} (checksums {sums} over mesh dim {group!r}); "
                              "stopped before any checkpoint was written from them - check the hardware of "
                              "those ranks, then --resume from the last checkpoint")
