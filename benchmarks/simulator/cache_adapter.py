"""The narrow seam between the simulator and the project's real prefix tree (`radix_ext`).

One radix key is one KV page (params.SGLANG page_size tokens), so trees stay small while match,
insert, eviction, demotion, two-phase load-back and revocation are all decided by
`radix_ext.RadixTree` itself. The device page allocator (SGLang's job) lives here: a free list
of page indices the tree records but never frees.
"""

from __future__ import annotations

from array import array

from radix_ext import DEVICE, DONOR, HOST, RadixTree, TreeConfig

TIERS = (DEVICE, DONOR, HOST)


class CountingTree(RadixTree):
    """A `RadixTree` that counts the calls the simulator reports (`calls`)."""

    def __init__(self, config: TreeConfig) -> None:
        self.calls = {"match": 0, "insert": 0, "evict": 0, "load": 0, "revoke": 0}
        super().__init__(config)

    def match(self, key, namespace=None):
        self.calls["match"] += 1
        return super().match(key, namespace)

    def insert(self, key, device_indices, namespace=None):
        self.calls["insert"] += 1
        return super().insert(key, device_indices, namespace)

    def evict_device(self, num_tokens):
        self.calls["evict"] += 1
        return super().evict_device(num_tokens)

    def begin_load_back(self, last_node, device_indices):
        self.calls["load"] += 1
        return super().begin_load_back(last_node, device_indices)

    def revoke(self, donor, lease_id=None, blocks=None, rescue=False):
        self.calls["revoke"] += 1
        return super().revoke(donor, lease_id, blocks, rescue)


class TreeCache:
    """A device page pool plus one `RadixTree` (with optional host and donor tiers). Admission
    and eviction run through `radix_ext.admission` (see `server.py`)."""

    def __init__(self, device_pages: int, host_pages: int = 0, donor: bool = False,
                 eviction: str = "lru", demotion: str = "tiered",
                 write_through: bool = False, donor_to_host: bool = False) -> None:
        """The live server's tree (`SwiftConfig.tree_config`): with `donor_to_host` (the live
        CPU server; its GPU server has no donor -> host copy yet) and both lower tiers, a copy
        pushed out of a full lease moves down into host (cascade "down"), else it is dropped
        (cascade "off"); with `write_through` (HiCache's
        --hicache-write-policy write_through, needs a host tier) every prefix the tree takes gets
        its host copy at once (`RadixTree.back_up`, copied through `copier`) and a borrower's
        victim also goes to donor pages while a lease has room (`donor_over_host`)."""
        if device_pages <= 0:
            raise ValueError(f"device_pages must be positive, got {device_pages}")
        if write_through and host_pages <= 0:
            raise ValueError("write_through needs a host tier (host_pages > 0)")
        self.tree = CountingTree(TreeConfig(page_size=1, host_capacity=host_pages, donor=donor,
                                            eviction=eviction, demotion=demotion,
                                            cascade="down" if donor_to_host and donor
                                            and host_pages > 0 else "off",
                                            donor_over_host=write_through and donor))
        self.write_through = write_through
        # copier(transfers): starts the copies of write-through and rescue transfers (the
        # server's links); None: they are booked in the tree and cost nothing
        self.copier = None
        self.device_pages = device_pages
        self._free = array("q", range(device_pages - 1, -1, -1))

    @property
    def calls(self) -> dict:
        return self.tree.calls

    # -- device pool -------------------------------------------------------------------------------
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> array | None:
        if n > len(self._free):
            return None
        out = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return out

    def free(self, idx) -> None:
        self._free.extend(idx)

    def evictable(self) -> int:
        return self.tree.evictable_size()

    # -- tree operations ---------------------------------------------------------------------------
    def lock(self, node) -> None:
        self.tree.lock(node)

    def unlock(self, node) -> None:
        self.tree.unlock(node)

    def path_indices(self, node) -> array:
        return array("q") if self.tree.is_root(node) else self.tree.device_indices(node)

    def complete_load(self, ticket):
        out = self.tree.complete_load_back(ticket)
        if not out.ok:
            self.free(out.device_indices_to_free)
        return out

    def insert(self, key, idx):
        res = self.tree.insert(key, idx)
        if self.write_through:
            transfers, _ = self.tree.back_up(res.last_node, HOST)
            if transfers and self.copier is not None:
                self.copier(transfers)
        return res

    def add_lease(self, donor: str, lease_id: int, epoch: int, blocks: int) -> None:
        self.tree.donor.add_lease(donor, lease_id, epoch, blocks)

    def revoke(self, donor: str, lease_id: int, blocks):
        """A reclaim, as the live borrower runs it with a host tier: the revoked blocks' rows
        are read before the ack and each donor copy without a host copy moves to host where
        room can be made (`rescue`); only the rest is lost."""
        res = self.tree.revoke(donor, lease_id, blocks, rescue=self.tree.host is not None)
        if res.moved and self.copier is not None:
            self.copier(res.moved)
        return res

    def tier_pages(self, tier: str) -> int:
        return self.tree.device_size() if tier == DEVICE else self.tree.tier_size(tier)

    def check_integrity(self) -> None:
        self.tree.check_integrity()
