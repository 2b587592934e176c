"""Which pool slots a forward pass reads, as the copies that move them want them.

A streamed layer's staging buffer must hold, before attention reads it, that layer's rows for
every slot the batch reads besides the ones it writes: each request's prefix,
`req_to_token[row, :prefix_len]`. SGLang's allocators hand a long request mostly contiguous
slots, so the set is kept as sorted runs [start, end) and copied one slice per run; a set that is
too fragmented for that becomes one index (gather and scatter), whichever costs fewer operations.

Runs are host numbers (the copies are host-issued DMAs of contiguous rows), but the slots live
in device memory: `req_to_token` and `out_cache_loc`. `forward_slots` gathers what a forward
reads on the device, with lengths from SGLang's host mirrors (`seq_lens_cpu`,
`extend_prefix_lens_cpu`), and brings it to the host together with what the forward writes in
one copy: the layer stream's one host-device synchronisation per forward (docs/integration.md,
"Host-device synchronisation").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dataplane.pool_rows import to_device

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
    then writes are overwritten after the load), only slower. From SGLang's host mirrors; a
    batch without `seq_lens_cpu` (SGLang sets it for every forward it runs) copies `seq_lens`."""
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


def read_index(forward_batch, req_to_token: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """`req_to_token[row_i, :lengths[i]]` of each request i, concatenated, computed where
    `req_to_token` is: the positions are built on the host from `lengths`, the rows stay
    SGLang's device tensor (`req_pool_indices`), so nothing is read back."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    which = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # request of each position
    pos = torch.arange(int(lens.sum())) - starts[which]
    device = req_to_token.device
    rows = forward_batch.req_pool_indices.to(torch.int64)[to_device(which, device)]
    return req_to_token[rows, to_device(pos, device)]


def forward_slots(forward_batch, req_to_token: torch.Tensor,
                  max_runs: int) -> tuple[SlotSet, SlotSet | None]:
    """(the slots `forward_batch` reads before writing them (`prefix_lengths`), the slots it
    writes (`out_cache_loc`; None when the batch has none)), both brought to the host in one
    copy, the forward's only one."""
    lengths = prefix_lengths(forward_batch)
    if not lengths:
        return SlotSet.empty(), None
    loc = getattr(forward_batch, "out_cache_loc", None)
    parts = [read_index(forward_batch, req_to_token, lengths).reshape(-1).to(torch.int64)]
    if loc is not None:
        parts.append(loc.reshape(-1).to(torch.int64))
    both = torch.cat(parts).to("cpu")  # the forward's one synchronisation (see the docstring)
    read = both[:parts[0].numel()]
    written = SlotSet.of(both[parts[0].numel():], max_runs) if loc is not None else None
    return SlotSet.of(read, max_runs), written


def batch_read_slots(forward_batch, req_to_token: torch.Tensor, max_runs: int) -> SlotSet:
    """The slots `forward_batch` reads before writing them (see `prefix_lengths`)."""
    lengths = prefix_lengths(forward_batch)
    if not lengths:
        return SlotSet.empty()
    return SlotSet.of(read_index(forward_batch, req_to_token, lengths), max_runs)
