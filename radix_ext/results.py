"""What tree operations return: frozen records that say what to copy and what to free.

The tree never copies or frees memory itself; it hands these to the caller (the data plane).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from radix_ext.slot_runs import join

EMPTY = array("q")


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """One node of a match that is not on the device: copy `source` (in tier `tier`) back."""

    node: Any
    tier: str
    source: Any

    @property
    def num_tokens(self) -> int:
        return len(self.node.key)


@dataclass(frozen=True, slots=True)
class Match:
    """The longest page-aligned cached prefix of a key.

    `device_len` tokens are on the device along the path to `last_device_node`; the rest of
    `prefix_len` is in `loads`, in path order, each to be loaded from its cheapest tier.
    `last_node` is the deepest matched node (== `last_device_node` when `loads` is empty).
    """

    prefix_len: int
    device_len: int
    last_device_node: Any
    last_node: Any
    loads: tuple = ()

    @property
    def load_len(self) -> int:
        return self.prefix_len - self.device_len

    def tokens_from(self, tier: str) -> int:
        return sum(len(s.node.key) for s in self.loads if s.tier == tier)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`prefix_len`: tokens of the key already in the tree (any tier) before this insert.
    `duplicate_len`: the leading tokens already on the device; the caller's indices
    `[0, duplicate_len)` are duplicates it must free (minus what it already owned through the tree).
    Everything past `duplicate_len` now belongs to the tree, ending at `last_node`."""

    prefix_len: int
    duplicate_len: int
    last_node: Any


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy the KV of `src` (tier `src_tier`) into `dst` (tier `dst_tier`), same token order.
    `node`: the tree node whose copy moves, where the mover says (a cascade), else None."""

    src_tier: str
    src: Any
    dst_tier: str
    dst: Any
    node: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Released:
    """A residency the tree no longer references. Device ones are the caller's to free (after the
    copies); donor and host ones were already returned to their tier's free set."""

    tier: str
    residency: Any


@dataclass(frozen=True, slots=True)
class ExchangeResult:
    """What `exchange` did. `ok`: the hit is on the device, its path ending at `last_node` (not
    locked), the victims hold its old donor blocks. Not `ok`: the swap failed and both sides were
    dropped; `last_node` is the device prefix the match started from, and the caller frees
    `device_indices_to_free` (the victims' slots). `num_tokens`: the hit's tokens."""

    ok: bool
    last_node: Any
    num_tokens: int
    device_indices_to_free: array = field(default_factory=lambda: array("q"))


@dataclass(slots=True, eq=False)
class ExchangeTicket:
    """An exchange in flight (two-phase, like `LoadTicket`): `begin_exchange` has recorded the
    swap (the `hit` nodes on the device at `slots`, the victims' former slots; the `victims`
    donor-resident on `blocks`, the hit's former blocks of lease `lease` = (donor, lease,
    epoch)), and the caller copies, then calls `complete_exchange` or `abort_exchange`.

    Until then both sides are pinned and no match reaches them (a match ends before the first
    of them): neither the hit's device copy nor the victims' donor copy is trusted by anyone
    but the caller. `anchor` is the hit's device parent, `last_node` its deepest node."""

    ticket_id: int
    anchor: Any
    last_node: Any
    hit: tuple
    victims: tuple
    lease: tuple
    slots: Any
    blocks: array
    num_tokens: int


@dataclass(slots=True, eq=False)
class StoreTicket:
    """A demotion in flight (two-phase, like `LoadTicket`): copy the device slots `src` into
    `dst` (tier `dst_tier`), then call `complete_store` or `abort_store`.

    Until then the nodes keep `src` on the device, pinned: they are neither evicted again nor
    freed, and a match still uses them as device KV. `dst` is allocated in its tier but holds
    nothing the tree will read. `node` is the deepest node the ticket covers (a match may split
    it; the ticket then covers `num_tokens` tokens on the path up from `node`). Mutable only by
    the tree: `stale` when a revoke took `dst`'s blocks back, so completing it must fail; `dst`
    then keeps only the blocks the lease still owns (None when the lease is gone)."""

    ticket_id: int
    node: Any
    num_tokens: int
    src: Any
    dst_tier: str
    dst: Any
    stale: bool = False
    transfer: Any = None  # the copy to run, fixed at begin: Transfer(device, src, dst_tier, dst)


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """`ok`: the lower copy is real now. Either way, `released` lists what the tree let go as a
    consequence, in order: device slots the caller frees now (this ticket's, and those of
    ancestors whose departure waited on it) and lower-tier residencies of dropped nodes (already
    back in their tier's free set)."""

    ok: bool
    released: tuple = ()

    def device_indices_to_free(self) -> array:
        return _device_indices(self.released)


def _device_indices(steps) -> Any:
    return join([r.residency.indices for r in steps
                 if type(r) is Released and r.tier == "device"])


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """Result of `evict_device`. `steps`, in order: `Released` (device ones: the caller frees
    them now, nothing reads them; lower ones are already back in their tier), `Transfer`
    (a copy between two lower tiers: run it before any later step reuses its source), and
    `StoreTicket` (a demotion: copy, then `complete_store` or `abort_store`; its device slots
    come back in the `StoreOutcome`). `num_evicted` counts device tokens given up once every
    store has settled; `demoted`/`dropped` split them as planned. `dropped_donor`: with
    `TreeConfig.name_donor_drops`, an `Unrescued` per donor copy this eviction pushed out of a
    full lease and dropped (its path's tokens and donor blocks, whose bytes stay as they are
    until a later step of the plan reuses the blocks), for a caller that keeps them below the
    tree (L3)."""

    num_evicted: int = 0
    demoted: int = 0
    dropped: int = 0
    steps: tuple = ()
    dropped_donor: tuple = ()

    @property
    def copies(self) -> tuple:
        """Every copy of the plan in order: lower-tier moves and the stores' transfers."""
        return tuple(s if type(s) is Transfer else s.transfer
                     for s in self.steps if type(s) is not Released)

    @property
    def stores(self) -> tuple:
        return tuple(s for s in self.steps if type(s) is StoreTicket)

    @property
    def released(self) -> tuple:
        return tuple(s for s in self.steps if type(s) is Released)

    def device_indices_to_free(self) -> array:
        """Device slots free at once (nodes dropped or released without a copy)."""
        return _device_indices(self.steps)


@dataclass(slots=True)
class LoadTicket:
    """An in-flight load-back. Mutable only by the tree (`stale` when a revoke or an insert
    overtook it, so completing it must fail)."""

    ticket_id: int
    anchor: Any
    last_node: Any
    device_indices: array
    copies: tuple
    stale: bool = False


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """`ok`: the nodes are on the device now and the caller holds a lock on `last_node`
    (release it with `unlock`). Not ok: nothing changed; free `device_indices_to_free`."""

    ok: bool
    last_node: Any
    device_indices_to_free: array = field(default_factory=lambda: EMPTY)


@dataclass(frozen=True, slots=True)
class LostPrefix:
    """`tokens[:still_cached]` is still cached; every longer prefix of `tokens` (and everything
    that extended it) lost its last copy."""

    namespace: Any
    tokens: array
    still_cached: int


@dataclass(frozen=True, slots=True)
class Unrescued:
    """A donor copy the tree dropped (a rescue found no host room for it, or an eviction pushed
    it out of a full lease and no tier below took it): its node's tokens are `tokens[start:]`,
    below the path `tokens[:start]`, and were in `src` (a `DonorResidency`) until then; the
    caller may still write them elsewhere (L3) from the bytes it read or can read before the
    blocks are reused."""

    namespace: Any
    tokens: array
    start: int
    src: Any


@dataclass(frozen=True, slots=True)
class RevokeResult:
    """`lost`: a `LostPrefix` per subtree that lost its last copy; `released`: residencies
    dropped (donor ones as revoked, others freed in their tier); `stale_tickets`: ids of
    in-flight loads and stores that must now fail; `moved`: `Transfer`s donor -> host of the
    copies a rescue kept (the caller copies them from the bytes it read before the revoke);
    `lost_paths`: a `LostPrefix` per path from the root to a leaf of a lost subtree (what a
    request would have to prefill again); `moved_nodes`: the nodes of `moved`, in order;
    `unrescued`: an `Unrescued` per donor copy a rescue found no host room for."""

    lost: tuple = ()
    released: tuple = ()
    stale_tickets: tuple = ()
    num_tokens_lost: int = 0
    moved: tuple = ()
    lost_paths: tuple = ()
    moved_nodes: tuple = ()
    unrescued: tuple = ()


@dataclass(frozen=True, slots=True)
class MakeRoomResult:
    """`steps`: ordered `Transfer`s and `Released`s, as in `EvictionPlan`."""

    steps: tuple = ()
    freed_tokens: int = 0
