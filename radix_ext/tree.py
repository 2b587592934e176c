"""`RadixTree`: a page-aligned radix prefix tree whose nodes live in tiers (bookkeeping only).

The public structure operations live here (match, insert, lock/unlock); node bookkeeping and
queries in `structure.py`; moving KV between tiers
is in `tiering.py` (evict/demote, make room), two-phase stores in `store.py`, two-phase
load-back in `loadback.py`, a donor hit swapped with device victims in `exchange.py`, donor
revocation in `revoke.py`, and `check_integrity` in
`integrity.py`. `admission.py` runs match, lock, evict, re-match and load-back for callers.

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
from typing import Any, Optional, Sequence

from radix_ext.backup import BackupMixin
from radix_ext.exchange import ExchangeMixin
from radix_ext.fetched import FetchedMixin
from radix_ext.integrity import IntegrityMixin
from radix_ext.loadback import LoadBackMixin
from radix_ext.node import Node
from radix_ext.placement import make_demotion, make_eviction
from radix_ext.residency import DEVICE, DONOR, HOST, DeviceResidency
from radix_ext.results import InsertResult, Match
from radix_ext.revoke import RevokeMixin
from radix_ext.slot_runs import as_run
from radix_ext.store import StoreMixin
from radix_ext.structure import StructureMixin
from radix_ext.tiering import TieringMixin
from radix_ext.tiers import DonorTier, HostTier
from radix_ext.tree_config import TreeConfig


def _as_array(seq: Sequence[int]) -> array:
    return seq if type(seq) is array else array("q", seq)


def common_len(a: array, b: array, pos: int, n: int, page: int) -> int:
    """Length of the common prefix of `a` and `b[pos:n]`, rounded down to a page."""
    m = min(len(a), n - pos)
    if a[:m] == b[pos : pos + m]:
        return m - m % page
    lo, hi = 0, m  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo - lo % page


DEFAULT_CONFIG = TreeConfig()


class RadixTree(StructureMixin, TieringMixin, StoreMixin, LoadBackMixin, RevokeMixin, ExchangeMixin,
                BackupMixin, FetchedMixin, IntegrityMixin):
    """Radix prefix tree with tiered residency. Never frees or copies memory: every operation
    returns what the caller must copy and free."""

    def __init__(self, config: TreeConfig = DEFAULT_CONFIG):
        self.config = config
        self.page_size = config.page_size
        self.cost = config.cost
        self.eviction = make_eviction(config.eviction, config.cost)
        self.demotion = make_demotion(config.demotion, config.cost)
        self.donor: Optional[DonorTier] = DonorTier(config.page_size) if config.donor else None
        self.host: Optional[HostTier] = (HostTier(config.host_capacity, config.page_size)
                                         if config.host_capacity else None)
        self.tiers: dict[str, Any] = {}
        if self.donor is not None:
            self.tiers[DONOR] = self.donor
        if self.host is not None:
            self.tiers[HOST] = self.host
        self.reset()

    def reset(self) -> None:
        """Forget every cached prefix; lower-tier indices go back to their free sets (leases stay).
        Tickets in flight are forgotten too: settling one afterwards raises."""
        if hasattr(self, "root"):
            for t in self._stores.values():
                if t.dst is not None:
                    self.tiers[t.dst_tier].free(t.dst)
            for res in self._reserved.values():
                self.tiers[res.tier].free(res)
            stack = list(self.root.children.values())
            while stack:
                x = stack.pop()
                for tier, res in x.res.items():
                    if tier in self.tiers:
                        self.tiers[tier].free(res)
                stack.extend(x.children.values())
        self._next_id = 1
        self.clock = 0
        self.root = Node(0, None, array("q"), None, 0)
        self.root.lock_ref = 1
        self.dev_evictable = 0
        self.dev_protected = 0
        self.dev_leaving = 0
        self._dev_leaves: set[Node] = set()
        self._leaving: dict = {}  # leaving node -> its StoreTicket in flight, or None
        self._fresh: dict = {}  # node -> store begun by the running evict_device (else empty)
        self._in_tier: dict[str, set[Node]] = {name: set() for name in self.tiers}
        self._tickets: dict = {}  # load tickets in flight, by id
        self._exchanges: dict = {}  # exchange tickets in flight, by id (ids shared with loads)
        self._exchanging: dict = {}  # node -> the exchange in flight it is a side of
        self._stores: dict = {}  # store tickets in flight, by id (ids shared with loads)
        self._reserved: dict = {}  # fetch reservations, by id (ids shared with loads)
        self._store_holds: dict = {}  # store id -> nodes it holds on the device (see store.py)
        self._next_ticket = 1
        self._room_floor: dict = {}  # make-room scan cache, see TieringMixin._make_room
        self._room_hint = 0  # tokens the running evict_device may still demote
        self._drops: list | None = None  # donor copies the running eviction dropped, named

    # ---- public operations --------------------------------------------------------------------

    def match(self, key: Sequence[int], namespace: Any = None) -> Match:
        """Longest page-aligned prefix of `key` cached in any tier, within `namespace`.

        Contract: the result splits the prefix into the device part (`device_len`, ending at
        `last_device_node`) and `loads`, the nodes to bring back in path order, each from its
        cheapest tier. Splits a node when the match ends inside it; refreshes access time and
        hit counts along the path. Frees, copies and locks nothing. A match ends before a side
        of an exchange in flight (`begin_exchange`): nobody but its caller may read it yet.
        """
        key = _as_array(key)
        page = self.page_size
        n = len(key) - len(key) % page
        self.clock += 1
        tick = self.clock
        root = self.root
        if n == 0:
            return Match(0, 0, root, root)
        ck = (namespace, key[0] if page == 1 else tuple(key[:page]))
        node, pos, dev_len, last_dev, loads = root, 0, 0, root, None
        children = root.children
        exchanging = self._exchanging
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
                child = self._split(child, m)
            child.last_access = tick
            child.hits += 1
            if loads is None and DEVICE in child.res:
                dev_len += m
                last_dev = child
            else:
                if loads is None:
                    loads = []
                loads.append(self._cheapest(child))
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
        key = _as_array(key)
        idx = as_run(device_indices)  # SGLang's device tensor stays one (never read here)
        page = self.page_size
        n = len(key) - len(key) % page
        if len(idx) < n:
            raise ValueError(f"insert needs {n} device indices, got {len(idx)}")
        self.clock += 1
        tick = self.clock
        node, pos, dup = self.root, 0, 0
        if n == 0:
            return InsertResult(0, 0, node)
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
                child = self._split(child, m)
            child.last_access = tick
            if DEVICE in child.res:
                dup = pos + m
            else:
                if child.pins:
                    self._mark_stale(child)
                self._keep(node)  # its parent must stay on the device now
                self._add_res(child, DeviceResidency(idx[pos : pos + m]))
                self._refresh_leaf(child)
                self._refresh_leaf(node)
            node = child
            pos += m
            if m < kl or pos >= n:
                break
            ck = key[pos] if page == 1 else tuple(key[pos : pos + page])
        prefix_len = pos
        if pos < n:
            ck = self._child_key(key, pos, node, namespace)
            leaf = self._new_node(node, key[pos:n], ck)
            node.children[ck] = leaf
            self._keep(node)
            self._add_res(leaf, DeviceResidency(idx[pos:n]))
            self._refresh_leaf(leaf)
            self._refresh_leaf(node)
            node = leaf
        return InsertResult(prefix_len, dup, node)

    def lock(self, node: Node) -> None:
        """Mark `node` (and so its path) in use: never evicted, demoted or dropped until the
        matching `unlock`. The node must be on the device (or be the root, a no-op); a leaving
        node on the path stays on the device (its store, if any, still completes)."""
        if node is self.root:
            return
        if DEVICE not in node.res:
            raise ValueError(f"lock needs a device-resident node, got {node}; load it back first")
        self._hold(node)

    def _hold(self, node: Node) -> None:
        node.direct_locks += 1
        root = self.root
        while node is not root:
            if node.lock_ref == 0 and node in self._leaving:
                self._stay(node)  # may hold `node` itself (a store in flight): lock_ref > 0
            if node.lock_ref == 0:
                n = len(node.key)
                self.dev_evictable -= n
                self.dev_protected += n
                self._dev_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Release one `lock(node)`; raises if `node` holds no lock (an unbalanced unlock)."""
        if node is self.root:
            return
        if node.direct_locks <= 0:
            raise ValueError(f"unlock without a matching lock on {node}")
        self._release(node)

    def _release(self, node: Node) -> None:
        node.direct_locks -= 1
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                self.dev_evictable += n
                self.dev_protected -= n
                self._refresh_leaf(node)
            node = node.parent
