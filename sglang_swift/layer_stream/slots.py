"""Which pool slots a forward pass reads, as the copies that move them want them.

A streamed layer's staging buffer must hold, before attention reads it, that layer's rows for
every slot the batch reads besides the ones it writes: each request's prefix,
`req_to_token[row, :prefix_len]`. SGLang's allocators hand a long request mostly contiguous
slots, so the set is kept as sorted runs [start, end) and copied one slice per run; a set that is
too fragmented for that becomes one index (gather and scatter), whichever costs fewer operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Forward modes whose `extend_prefix_lens` is exactly what each request reads before writing.
PREFIX_EXTEND_MODES = ("EXTEND", "MIXED", "SPLIT_PREFILL")


@dataclass(frozen=True)
class SlotSet:
    """A set of pool slots: sorted disjoint `runs` [start, end), or, when there are more than
    the caller allows, `index` (unique sorted slots, int64 on the CPU; `runs` is then None).
    `count` is the number of slots either way."""

    runs: tuple[tuple[int, int], ...] | None
    index: torch.Tensor | None
    count: int

    @classmethod
    def empty(cls) -> "SlotSet":
        return cls((), None, 0)

    @classmethod
    def of(cls, slots: torch.Tensor, max_runs: int) -> "SlotSet":
        """The set of `slots` (any order, repeats allowed, any device)."""
        flat = torch.unique(slots.reshape(-1).to("cpu", torch.int64))  # sorted
        n = int(flat.numel())
        if n == 0:
            return cls.empty()
        breaks = torch.nonzero(flat[1:] - flat[:-1] != 1).flatten() + 1
        if int(breaks.numel()) + 1 > max_runs:
            return cls(None, flat, n)
        starts = torch.cat([flat[:1], flat[breaks]]).tolist()
        ends = torch.cat([flat[breaks - 1] + 1, flat[-1:] + 1]).tolist()
        return cls(tuple(zip(starts, ends)), None, n)

    def from_slot(self, start: int) -> "SlotSet":
        """The slots at or above `start` (the streamed ones, when `start` is the pool's first
        streamed row); `self` when there are none below it."""
        if start <= 0 or self.count == 0:
            return self
        if self.runs is not None:
            if self.runs[0][0] >= start:
                return self
            runs = tuple((max(a, start), b) for a, b in self.runs if b > start)
            return SlotSet(runs, None, sum(b - a for a, b in runs))
        if int(self.index[0]) >= start:
            return self
        kept = self.index[self.index >= start]
        return SlotSet(None, kept, int(kept.numel())) if kept.numel() else SlotSet.empty()

    def as_index(self) -> torch.Tensor:
        """All slots as one sorted int64 CPU tensor."""
        if self.index is not None:
            return self.index
        if not self.runs:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in self.runs])


def prefix_lengths(forward_batch) -> list[int]:
    """Per request of the batch, how many leading positions of its `req_to_token` row the
    forward reads without writing them (the rest it writes before reading).

    Extend (prefill, chunked prefill, mixed): `extend_prefix_lens`. Decode: all but the last
    position (its new token). Any other mode: the whole sequence, which is always safe (rows it
    then writes are overwritten after the load), only slower."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return []
    seq = forward_batch.seq_lens_cpu
    seq = (seq if seq is not None else forward_batch.seq_lens.cpu()).tolist()
    if mode.is_decode():
        return [max(n - 1, 0) for n in seq]
    if mode.name in PREFIX_EXTEND_MODES and forward_batch.extend_prefix_lens_cpu is not None:
        return list(forward_batch.extend_prefix_lens_cpu)
    return seq


def batch_read_slots(forward_batch, req_to_token: torch.Tensor, max_runs: int) -> SlotSet:
    """The slots `forward_batch` reads before writing them (see `prefix_lengths`)."""
    lengths = prefix_lengths(forward_batch)
    if not lengths:
        return SlotSet.empty()
    rows = forward_batch.req_pool_indices.tolist()
    parts = [req_to_token[r, :n] for r, n in zip(rows, lengths) if n > 0]
    if not parts:
        return SlotSet.empty()
    return SlotSet.of(torch.cat(parts), max_runs)
