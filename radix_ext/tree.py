"""`RadixTree`: a page-aligned radix prefix tree whose nodes live in tiers (bookkeeping only).

The tree holds named collaborators, each with its own state, built at construction (and again
on `reset`) and sharing the nodes' books through `Structure`:

* `Structure`: the nodes, residencies and books (device sizes, evictable leaves, departure
  marks, tier membership); the tiers, and the clock the policies price against;
* `Departures`: locks, and when a leaving node leaves; `Store`: two-phase demotions;
* `Room`: room made in a lower tier; `Eviction`: device victims demoted or dropped;
* `LoadBack`, `Exchange`: lower-tier nodes brought (or swapped) onto the device;
* `Revoke`, `Backup`, `Fetched`: donors taking memory back, write-through copies, content
  fetched from below the tree; `Integrity`: `check_integrity`.

Match and insert, the hot path, live here. `admission.py` runs match, lock, evict, re-match and
load-back for callers.

Invariants (checked by `check_integrity`):
* every non-root node is resident in at least one tier; a node that loses its last copy is
  removed with its subtree (a prefix with a hole in it is useless);
* device residency is prefix-closed: a device-resident node's parent is the root or on the device,
  so a match is "device part, then load part" along the path;
* `lock_ref` counts the locks held on a node or below it; a locked node is on the device;
* pinned nodes (in-flight load-backs, stores in flight, leaving nodes, both sides of an exchange
  in flight) are never evicted, demoted or dropped; revoke and insert may overtake a load, which
  then fails on `complete_load_back`, and revoke may overtake a store, which then fails on
  `complete_store`.
"""

from __future__ import annotations

from array import array
from itertools import count
from typing import Any, Iterable, Optional, Sequence

from radix_ext.backup import Backup
from radix_ext.departures import Departures
from radix_ext.eviction import Eviction
from radix_ext.exchange import Exchange, Swap
from radix_ext.fetched import Fetched
from radix_ext.integrity import Integrity
from radix_ext.keys import as_array, common_len
from radix_ext.loadback import LoadBack
from radix_ext.node import Node
from radix_ext.placement import make_demotion, make_eviction
from radix_ext.residency import DEVICE, DONOR, HOST, DeviceResidency
from radix_ext.results import (
    EvictionPlan,
    ExchangeResult,
    ExchangeTicket,
    InsertResult,
    LoadOutcome,
    LoadTicket,
    MakeRoomResult,
    Match,
    RevokeResult,
    StoreOutcome,
    StoreTicket,
    Transfer,
)
from radix_ext.revoke import Revoke
from radix_ext.room import Room
from radix_ext.slot_runs import as_run
from radix_ext.store import Store
from radix_ext.structure import Structure
from radix_ext.tiers import DonorTier, HostTier
from radix_ext.tree_config import TreeConfig

DEFAULT_CONFIG = TreeConfig()


class RadixTree:
    """Radix prefix tree with tiered residency. Never frees or copies memory: every operation
    returns what the caller must copy and free."""

    def __init__(self, config: TreeConfig = DEFAULT_CONFIG):
        self.config = config
        self.page_size = config.page_size
        self.cost = config.cost
        self.demotion = make_demotion(config.demotion, config.cost)
        self.eviction = make_eviction(config.eviction, config.cost, self.demotion)
        self.donor: Optional[DonorTier] = DonorTier(config.page_size) if config.donor else None
        self.host: Optional[HostTier] = (HostTier(config.host_capacity, config.page_size)
                                         if config.host_capacity else None)
        self.tiers: dict[str, Any] = {}
        if self.donor is not None:
            self.tiers[DONOR] = self.donor
        if self.host is not None:
            self.tiers[HOST] = self.host
        self._nodes: Optional[Structure] = None
        self.reset()

    def reset(self) -> None:
        """Forget every cached prefix; lower-tier indices go back to their free sets (leases stay).
        Tickets in flight are forgotten too: settling one afterwards raises."""
        if self._nodes is not None:
            self._stores.release_all()
            self._fetched.release_all()
            self._nodes.release_all()
        config = self.config
        ids = count(1)  # one ticket id sequence for loads, stores, exchanges and fetches
        nodes = Structure(self.page_size, self.cost, self.tiers, self.donor, self.host)
        departures = Departures(nodes)
        stores = Store(nodes, departures, self.demotion, ids)
        room = Room(nodes, stores, self.eviction, self.demotion, config.cascade)
        eviction = Eviction(config, nodes, departures, stores, room, self.eviction,
                            self.demotion)
        loads = LoadBack(nodes, departures, ids)
        exchanges = Exchange(nodes, loads, eviction, ids)
        self._nodes, self._departures, self._stores, self._room = nodes, departures, stores, room
        self._evictor, self._loads, self._exchanges = eviction, loads, exchanges
        self._sides = exchanges.sides  # read by every match
        self._revoke = Revoke(nodes, stores, loads, room)
        self._backup = Backup(nodes, room)
        self._fetched = Fetched(nodes, room, ids, self.match)
        self._integrity = Integrity(nodes, loads, stores, exchanges, self._fetched)

    @property
    def root(self) -> Node:
        return self._nodes.root

    @property
    def clock(self) -> int:  # bumped by every match and insert: access times
        return self._nodes.clock

    # the evictable device leaves and the tier membership sets, for tests that inspect them
    _dev_leaves = property(lambda self: self._nodes.leaves)
    _in_tier = property(lambda self: self._nodes.in_tier)

    # ---- match, insert, locks -------------------------------------------------------------------

    def match(self, key: Sequence[int], namespace: Any = None) -> Match:
        """Longest page-aligned prefix of `key` cached in any tier, within `namespace`.

        Contract: the result splits the prefix into the device part (`device_len`, ending at
        `last_device_node`) and `loads`, the nodes to bring back in path order, each from its
        cheapest tier. Splits a node when the match ends inside it; refreshes access time and
        hit counts along the path. Frees, copies and locks nothing. A match ends before a side
        of an exchange in flight (`begin_exchange`): nobody but its caller may read it yet.
        """
        key = as_array(key)
        s = self._nodes
        page = s.page_size
        n = len(key) - len(key) % page
        s.clock += 1
        tick = s.clock
        root = s.root
        if n == 0:
            return Match(0, 0, root, root)
        ck = (namespace, key[0] if page == 1 else tuple(key[:page]))
        node, pos, dev_len, last_dev, loads = root, 0, 0, root, None
        children = root.children
        exchanging = self._sides
        while True:
            child = children.get(ck)
            if child is None or (exchanging and child in exchanging):
                break
            ckey = child.key
            kl = len(ckey)
            m = (kl if (pos + kl <= n and ckey == key[pos : pos + kl])
                 else common_len(ckey, key, pos, n, page))
            if m < kl:
                child.last_access = tick  # a partial match touches the node (as SGLang does)
                child = s.split(child, m)
            child.last_access = tick
            child.hits += 1
            if loads is None and DEVICE in child.res:
                dev_len += m
                last_dev = child
            else:
                if loads is None:
                    loads = []
                loads.append(s.cheapest(child))
            node = child
            pos += m
            if m < kl or pos >= n:
                break
            children = child.children
            ck = key[pos] if page == 1 else tuple(key[pos : pos + page])
        return Match(pos, dev_len, last_dev, node, tuple(loads) if loads else ())

    def insert(self, key: Sequence[int], device_indices: Sequence[int],
               namespace: Any = None) -> InsertResult:
        """Record that device slots `device_indices[i]` hold the KV of `key[i]` (page-aligned part).

        Contract: tokens already on the device are duplicates (`[0, duplicate_len)`): the caller
        frees its own slots there. Matched nodes that were only in a lower tier adopt the
        caller's slots (a write-through copy now exists on the device); an in-flight load-back
        through such a node becomes stale. New tokens become a leaf. Frees nothing.
        """
        key = as_array(key)
        idx = as_run(device_indices)  # SGLang's device tensor stays one (never read here)
        s = self._nodes
        page = s.page_size
        n = len(key) - len(key) % page
        if len(idx) < n:
            raise ValueError(f"insert needs {n} device indices, got {len(idx)}")
        s.clock += 1
        tick = s.clock
        node, pos, dup = s.root, 0, 0
        if n == 0:
            return InsertResult(0, 0, node)
        keep, add_res, refresh_leaf = self._departures.keep, s.add_res, s.refresh_leaf
        ck = (namespace, key[0] if page == 1 else tuple(key[:page]))
        while True:
            child = node.children.get(ck)
            if child is None:
                break
            ckey = child.key
            kl = len(ckey)
            m = (kl if (pos + kl <= n and ckey == key[pos : pos + kl])
                 else common_len(ckey, key, pos, n, page))
            if m < kl:
                child.last_access = tick
                child = s.split(child, m)
            child.last_access = tick
            if DEVICE in child.res:
                dup = pos + m
            else:
                if child.pins:
                    self._loads.mark_stale(child)
                keep(node)  # its parent must stay on the device now
                add_res(child, DeviceResidency(idx[pos : pos + m]))
                refresh_leaf(child)
                refresh_leaf(node)
            node = child
            pos += m
            if m < kl or pos >= n:
                break
            ck = key[pos] if page == 1 else tuple(key[pos : pos + page])
        prefix_len = pos
        if pos < n:
            ck = s.child_key(key, pos, node, namespace)
            leaf = s.new_node(node, key[pos:n], ck)
            node.children[ck] = leaf
            keep(node)
            add_res(leaf, DeviceResidency(idx[pos:n]))
            refresh_leaf(leaf)
            refresh_leaf(node)
            node = leaf
        return InsertResult(prefix_len, dup, node)

    def lock(self, node: Node) -> None:
        """Mark `node` (and so its path) in use: never evicted, demoted or dropped until the
        matching `unlock`. The node must be on the device (or be the root, a no-op); a leaving
        node on the path stays on the device (its store, if any, still completes)."""
        if DEVICE in node.res:  # never the root; `Departures.lock`'s checks, one call fewer
            self._departures.hold(node)
        else:
            self._departures.lock(node)  # the root: a no-op; else it raises

    def unlock(self, node: Node) -> None:
        """Release one `lock(node)`; raises if `node` holds no lock (an unbalanced unlock)."""
        if node.direct_locks > 0:  # never the root (locking it is a no-op)
            self._departures.release(node)
        else:
            self._departures.unlock(node)  # the root: a no-op; else it raises

    # ---- eviction and two-phase stores ----------------------------------------------------------

    def evict_device(self, num_tokens: int) -> EvictionPlan:
        """Give up `num_tokens` device tokens or more (contract: `Eviction.evict_device`)."""
        return self._evictor.evict_device(num_tokens)

    def complete_store(self, ticket: StoreTicket) -> StoreOutcome:
        """Settle a store whose copy finished (contract: `Store.complete`)."""
        return self._stores.complete(ticket)

    def abort_store(self, ticket: StoreTicket) -> StoreOutcome:
        """Settle a store whose copy failed or is cancelled (contract: `Store.abort`)."""
        return self._stores.abort(ticket)

    def stores_in_flight(self) -> int:
        return self._stores.in_flight()

    def make_room(self, tier: str, num_tokens: int) -> MakeRoomResult:
        """Free `num_tokens` of `tier` or more if it can (contract: `Room.make_room`)."""
        return self._room.make_room(tier, num_tokens)

    def demotion_volume(self, num_tokens: int) -> int:
        """Tokens `evict_device(num_tokens)` would demote now (`Eviction.demotion_volume`)."""
        return self._evictor.demotion_volume(num_tokens)

    # ---- load-back and exchange -----------------------------------------------------------------

    def begin_load_back(self, last_node: Node, device_indices: array) -> Optional[LoadTicket]:
        """Start loading the path to `last_node` back (contract: `LoadBack.begin`)."""
        return self._loads.begin(last_node, device_indices)

    def complete_load_back(self, ticket: LoadTicket) -> LoadOutcome:
        """Settle a load-back whose copies finished (contract: `LoadBack.complete`)."""
        return self._loads.complete(ticket)

    def abort_load_back(self, ticket: LoadTicket) -> LoadOutcome:
        """Settle a load-back whose fetch failed or is cancelled (contract: `LoadBack.abort`)."""
        return self._loads.abort(ticket)

    def in_flight(self) -> int:
        return self._loads.in_flight()

    def exchangeable(self, m: Match) -> Optional[tuple]:
        """The donor part of `m` as one exchange can take it (`Exchange.exchangeable`)."""
        return self._exchanges.exchangeable(m)

    def exchange(self, m: Match, swap: Swap) -> Optional[ExchangeResult]:
        """Both phases of an exchange around `swap` (contract: `Exchange.exchange`)."""
        return self._exchanges.exchange(m, swap)

    def begin_exchange(self, m: Match) -> Optional[ExchangeTicket]:
        """Record the swap of `m`'s donor part with device victims (`Exchange.begin`)."""
        return self._exchanges.begin(m)

    def complete_exchange(self, t: ExchangeTicket) -> Node:
        """Settle an exchange whose every layer was swapped (contract: `Exchange.complete`)."""
        return self._exchanges.complete(t)

    def abort_exchange(self, t: ExchangeTicket, free_hit_slots: bool = True) -> array:
        """Settle an exchange whose swap failed or never ran (contract: `Exchange.abort`)."""
        return self._exchanges.abort(t, free_hit_slots)

    def exchanges_in_flight(self) -> int:
        return self._exchanges.in_flight()

    # ---- revocation, write-through copies, fetched content -------------------------------------

    def revoke(self, donor: str, lease_id: Optional[int] = None,
               blocks: Optional[Iterable[int]] = None, rescue: bool = False) -> RevokeResult:
        """A donor takes back `blocks` of one lease, a whole lease, or (both None) all its
        leases; with `rescue`, copies that would be lost move to host first. Contract:
        `Revoke.revoke`."""
        return self._revoke.revoke(donor, lease_id, blocks, rescue)

    def forget_rescue(self, moved: Iterable[Transfer]) -> RevokeResult:
        """Take back the host copies of a rescue whose rows could not be written (contract:
        `Revoke.forget_rescue`)."""
        return self._revoke.forget_rescue(moved)

    def back_up(self, node: Node, tier: str) -> tuple[tuple, tuple]:
        """A copy in `tier` for every device node on the path to `node` that has none there;
        (transfers, released). Contract: `Backup.back_up`."""
        return self._backup.back_up(node, tier)

    def forget_backup(self, transfers: tuple) -> None:
        """Take back the copies of `back_up` whose transfers could not run."""
        self._backup.forget_backup(transfers)

    def reserve(self, tier: str, num_tokens: int) -> Optional[tuple[int, Any, tuple]]:
        """Book `num_tokens` of `tier` for a fetch: (reservation id, residency, released) or
        None. Contract: `Fetched.reserve`."""
        return self._fetched.reserve(tier, num_tokens)

    def unreserve(self, rid: int) -> None:
        self._fetched.unreserve(rid)

    def attach(self, rid: int, key: Sequence[int], start: int, num_tokens: int,
               namespace: Any = None) -> int:
        """Add what reservation `rid` holds below the cached prefix `key[:start]`; the tokens
        added. Contract: `Fetched.attach`."""
        return self._fetched.attach(rid, key, start, num_tokens, namespace)

    # ---- queries --------------------------------------------------------------------------------

    def device_indices(self, node: Node) -> Any:
        """Device slot indices on the path from the root to `node` (which must be on the device),
        as one run of the kind they were inserted as (`slot_runs.join`)."""
        return self._nodes.device_indices(node)

    def prefix_of(self, node: Node) -> tuple[Any, array]:
        """(namespace, tokens) of the path from the root to `node`."""
        return self._nodes.prefix_of(node)

    def is_root(self, node: Node) -> bool:
        return node is self._nodes.root

    def evictable_size(self) -> int:
        """Device tokens held by the tree and not locked."""
        return self._nodes.evictable

    def protected_size(self) -> int:
        """Device tokens held by the tree under a lock."""
        return self._nodes.protected

    def leaving_size(self) -> int:
        """Device tokens of leaving nodes (stores in flight, or waiting on their children)."""
        return self._nodes.leaving_tokens

    def device_size(self) -> int:
        return self._nodes.device_size()

    def held_tokens(self) -> int:
        """Tokens cached in any tier, a prefix held in several tiers counted once."""
        return self._nodes.held_tokens()

    def tier_size(self, tier: str) -> int:
        """Tokens held in a lower tier."""
        return self._nodes.tier_size(tier)

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken. O(size of the tree); for tests.
        What it checks: `Integrity.check`."""
        self._integrity.check()
