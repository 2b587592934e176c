"""`Structure`: the nodes of a `RadixTree` and the books kept over them.

It owns the root, the clock, node ids, and the books every other part reads: device tokens by
state (evictable, protected, leaving), the set of evictable device leaves, the departure marks
(`leaving`: set and cleared by `Departures`; a split copies its node's mark to the new head),
and per lower tier the nodes with a copy there. It also holds the tiers, and the policies price
against it (`clock`, `donor`, `host`, `tiers`, `page_size`). Everything that changes a node's
residencies goes through `add_res` / `pop_res`, so the books cannot drift from the nodes.
"""

from __future__ import annotations

from array import array
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional

from radix_ext.node import Node
from radix_ext.placement import CostModel
from radix_ext.residency import DEVICE, DONOR, HOST
from radix_ext.results import LoadSegment, Released
from radix_ext.slot_runs import join


class Structure:
    """Nodes, residencies and their books. Public state, read by the other parts of the tree:
    `root`, `clock` (bumped by each match or insert, and whenever tier contents change under a
    cached scan), `evictable` / `protected` / `leaving_tokens` (device tokens by state),
    `leaves` (device-resident, unlocked, unpinned nodes with no device child but leaving ones),
    `leaving` (leaving node -> its store ticket in flight, None, or `UNDECIDED`) and `in_tier`
    (tier name -> nodes with a copy there)."""

    def __init__(self, page_size: int, cost: CostModel, tiers: dict[str, Any],
                 donor: Any, host: Any):
        self.page_size = page_size
        self.cost = cost
        self.tiers = tiers
        self.donor = donor
        self.host = host
        self.clock = 0
        self._next_id = 1
        self.root = Node(0, None, array("q"), None, 0)
        self.root.lock_ref = 1
        self.evictable = 0
        self.protected = 0
        self.leaving_tokens = 0
        self.leaves: set[Node] = set()
        self.leaving: dict = {}
        self.in_tier: dict[str, set[Node]] = {name: set() for name in tiers}

    def release_all(self) -> None:
        """Give every lower-tier residency of every node back to its tier (before a reset)."""
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            for tier, res in x.res.items():
                if tier in self.tiers:
                    self.tiers[tier].free(res)
            stack.extend(x.children.values())

    # ---- nodes and residencies ------------------------------------------------------------------

    def new_node(self, parent: Node, key: array, ck: Any) -> Node:
        node = Node(self._next_id, parent, key, ck, self.clock)
        self._next_id += 1
        return node

    def add_res(self, node: Node, res: Any) -> None:
        tier = res.tier
        node.res[tier] = res
        if tier == DEVICE:
            if node.lock_ref:
                self.protected += len(node.key)
            else:
                self.evictable += len(node.key)
        else:
            self.in_tier[tier].add(node)

    def pop_res(self, node: Node, tier: str) -> Any:
        res = node.res.pop(tier)
        if tier == DEVICE:
            if node.lock_ref:
                self.protected -= len(node.key)
            elif node in self.leaving:
                self.leaving_tokens -= len(node.key)
            else:
                self.evictable -= len(node.key)
            self.leaves.discard(node)
        else:
            self.in_tier[tier].discard(node)
        return res

    def refresh_leaf(self, node: Node) -> None:
        """Keep `leaves` = device-resident, unlocked, unpinned (so not leaving), and no child on
        the device other than leaving ones."""
        if node is self.root:
            return
        if DEVICE in node.res and not node.lock_ref and not node.pins:
            leaving = self.leaving
            for c in node.children.values():
                if DEVICE in c.res and c not in leaving:
                    self.leaves.discard(node)
                    return
            self.leaves.add(node)
        else:
            self.leaves.discard(node)

    def has_device_child(self, node: Node) -> bool:
        for c in node.children.values():
            if DEVICE in c.res:
                return True
        return False

    def child_key(self, key: array, pos: int, parent: Node, namespace: Any) -> Any:
        page = self.page_size
        first = key[pos] if page == 1 else tuple(key[pos : pos + page])
        return (namespace, first) if parent is self.root else first

    def split(self, child: Node, at: int) -> Node:
        """Cut `child` after `at` tokens; the new head takes its place and returns."""
        parent = child.parent
        head = self.new_node(parent, child.key[:at], child.ck)
        head.last_access, head.hits = child.last_access, child.hits
        head.lock_ref, head.pins = child.lock_ref, child.pins
        for tier, res in child.res.items():
            h, t = res.split(at, self.page_size)
            head.res[tier] = h
            child.res[tier] = t
            if tier != DEVICE:
                self.in_tier[tier].add(head)
        if child in self.leaving:  # a leaving node leaves whole (one store covers both)
            self.leaving[head] = self.leaving[child]
        child.key = child.key[at:]
        child.ck = self.child_key(child.key, 0, head, None)
        child.parent = head
        head.children[child.ck] = child
        parent.children[head.ck] = head
        return head

    def remove_subtree(self, x: Node, released: list) -> list:
        """Detach `x` and everything below it, releasing every residency; returns the nodes."""
        parent = x.parent
        del parent.children[x.ck]
        gone = []
        stack = [x]
        while stack:
            y = stack.pop()
            gone.append(y)
            for tier in list(y.res):
                res = self.pop_res(y, tier)
                if tier != DEVICE:
                    self.tiers[tier].free(res)
                released.append(Released(tier, res))
            stack.extend(y.children.values())
        self.refresh_leaf(parent)
        return gone

    @contextmanager
    def held(self, nodes: Iterable[Node]) -> Iterator[None]:
        """Pin `nodes` for the block (room made meanwhile never drops their copies), as
        `admission.holding` does for a match's lower part."""
        nodes = tuple(nodes)
        for x in nodes:
            x.pins += 1
        try:
            yield
        finally:
            for x in nodes:
                x.pins -= 1

    def cheapest(self, node: Node) -> LoadSegment:
        if len(node.res) == 1:  # the usual case for a load: one copy, nothing to price
            for tier, res in node.res.items():
                return LoadSegment(node, tier, res)
        best: Optional[tuple] = None
        for tier, res in node.res.items():
            c = self.cost.residency_cost(tier, res, self)
            if best is None or c < best[0]:
                best = (c, tier, res)
        return LoadSegment(node, best[1], best[2])

    # ---- paths ----------------------------------------------------------------------------------

    def device_indices(self, node: Node) -> Any:
        """Device slot indices on the path from the root to `node` (which must be on the device),
        as one run of the kind they were inserted as (`slot_runs.join`)."""
        parts = []
        root = self.root
        while node is not root:
            parts.append(node.res[DEVICE].indices)
            node = node.parent
        parts.reverse()
        return join(parts)

    def prefix_of(self, node: Node) -> tuple[Any, array]:
        """(namespace, tokens) of the path from the root to `node`."""
        parts = []
        ns = None
        while node is not self.root:
            parts.append(node.key)
            if node.parent is self.root:
                ns = node.ck[0]
            node = node.parent
        out = array("q")
        for p in reversed(parts):
            out.extend(p)
        return ns, out

    def depth(self, node: Node) -> int:
        d = 0
        while node is not self.root:
            node = node.parent
            d += 1
        return d

    def below(self, x: Node, nodes: set) -> bool:
        """Whether an ancestor of `x` is in `nodes`."""
        if not nodes:
            return False
        y = x.parent
        while y is not None and y is not self.root:
            if y in nodes:
                return True
            y = y.parent
        return False

    def attached(self, x: Node) -> bool:
        """Whether `x` is still in the tree (a revoke or a drop may have removed it)."""
        while x is not self.root:
            parent = x.parent
            if parent is None or parent.children.get(x.ck) is not x:
                return False
            x = parent
        return True

    # ---- sizes ----------------------------------------------------------------------------------

    def device_size(self) -> int:
        return self.evictable + self.protected + self.leaving_tokens

    def held_tokens(self) -> int:
        """Tokens cached in any tier, a prefix held in several tiers counted once: what the
        device, host and donor tiers together must hold to keep everything cached."""
        n = self.device_size()
        host = self.in_tier.get(HOST, ())
        n += sum(len(x.key) for x in host if DEVICE not in x.res)
        n += sum(len(x.key) for x in self.in_tier.get(DONOR, ())
                 if DEVICE not in x.res and HOST not in x.res)
        return n

    def tier_size(self, tier: str) -> int:
        """Tokens held in a lower tier."""
        t = self.tiers.get(tier)
        return 0 if t is None else t.capacity_tokens() - t.available_tokens()
