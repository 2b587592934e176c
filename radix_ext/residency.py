"""Where one node's KV lives: one small class per tier, all with the same shape.

A residency is an immutable record of indices in one tier for exactly the tokens of one tree node.
Adding a tier means adding a class here (and a tier in `tiers.py`), never a nullable field on nodes.
Every residency can `split` at a page-aligned token offset, because nodes split when a match or
an insert ends inside them.
"""

from __future__ import annotations

from array import array

DEVICE = "device"
DONOR = "donor"
HOST = "host"


class DeviceResidency:
    """Local KV slot indices (token-granular), owned by SGLang's allocator, recorded here."""

    __slots__ = ("indices",)
    tier = DEVICE

    def __init__(self, indices: array):
        self.indices = indices

    def num_tokens(self, page_size: int) -> int:
        return len(self.indices)

    def split(self, at: int, page_size: int) -> tuple["DeviceResidency", "DeviceResidency"]:
        return DeviceResidency(self.indices[:at]), DeviceResidency(self.indices[at:])

    def __repr__(self) -> str:
        return f"DeviceResidency(n={len(self.indices)})"


class HostResidency:
    """Host pool indices (token-granular), allocated from a `HostTier`."""

    __slots__ = ("indices",)
    tier = HOST

    def __init__(self, indices: array):
        self.indices = indices

    def num_tokens(self, page_size: int) -> int:
        return len(self.indices)

    def split(self, at: int, page_size: int) -> tuple["HostResidency", "HostResidency"]:
        return HostResidency(self.indices[:at]), HostResidency(self.indices[at:])

    def __repr__(self) -> str:
        return f"HostResidency(n={len(self.indices)})"


class DonorResidency:
    """Blocks of one lease on one donor; one block holds one page (`page_size` tokens).

    `epoch` is the lease epoch at allocation time: a lease re-granted under a new epoch does not
    make an old residency valid again (revocation drops it first).
    """

    __slots__ = ("donor", "lease", "epoch", "blocks")
    tier = DONOR

    def __init__(self, donor: str, lease: int, epoch: int, blocks: array):
        self.donor = donor
        self.lease = lease
        self.epoch = epoch
        self.blocks = blocks

    def num_tokens(self, page_size: int) -> int:
        return len(self.blocks) * page_size

    def split(self, at: int, page_size: int) -> tuple["DonorResidency", "DonorResidency"]:
        if at % page_size:
            raise ValueError(f"donor residency split at {at} is not a multiple of page {page_size}")
        b = at // page_size
        head = DonorResidency(self.donor, self.lease, self.epoch, self.blocks[:b])
        tail = DonorResidency(self.donor, self.lease, self.epoch, self.blocks[b:])
        return head, tail

    def __repr__(self) -> str:
        return f"DonorResidency({self.donor}/{self.lease}@{self.epoch}, blocks={len(self.blocks)})"
