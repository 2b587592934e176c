"""Node-level bookkeeping of `RadixTree` (mixin): residencies, device sizes, the evictable-leaf
set, splits, and read-only queries (path indices, prefixes, sizes)."""

from __future__ import annotations

from array import array
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from radix_ext.node import Node
from radix_ext.residency import DEVICE, DONOR, HOST
from radix_ext.results import LoadSegment
from radix_ext.slot_runs import join


class StructureMixin:
    @contextmanager
    def _held(self, nodes: Iterable[Node]) -> Iterator[None]:
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

    def _new_node(self, parent: Node, key: array, ck: Any) -> Node:
        node = Node(self._next_id, parent, key, ck, self.clock)
        self._next_id += 1
        return node

    def _add_res(self, node: Node, res: Any) -> None:
        tier = res.tier
        node.res[tier] = res
        if tier == DEVICE:
            if node.lock_ref:
                self.dev_protected += len(node.key)
            else:
                self.dev_evictable += len(node.key)
        else:
            self._in_tier[tier].add(node)

    def _pop_res(self, node: Node, tier: str) -> Any:
        res = node.res.pop(tier)
        if tier == DEVICE:
            if node.lock_ref:
                self.dev_protected -= len(node.key)
            elif node in self._leaving:
                self.dev_leaving -= len(node.key)
            else:
                self.dev_evictable -= len(node.key)
            self._dev_leaves.discard(node)
        else:
            self._in_tier[tier].discard(node)
        return res

    def _refresh_leaf(self, node: Node) -> None:
        """Keep `_dev_leaves` = device-resident, unlocked, unpinned (so not leaving), and no
        child on the device other than leaving ones."""
        if node is self.root:
            return
        if DEVICE in node.res and not node.lock_ref and not node.pins:
            leaving = self._leaving
            for c in node.children.values():
                if DEVICE in c.res and c not in leaving:
                    self._dev_leaves.discard(node)
                    return
            self._dev_leaves.add(node)
        else:
            self._dev_leaves.discard(node)

    def _has_device_child(self, node: Node) -> bool:
        for c in node.children.values():
            if DEVICE in c.res:
                return True
        return False

    def _child_key(self, key: array, pos: int, parent: Node, namespace: Any) -> Any:
        page = self.page_size
        first = key[pos] if page == 1 else tuple(key[pos : pos + page])
        return (namespace, first) if parent is self.root else first

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child` after `at` tokens; the new head takes its place and returns."""
        parent = child.parent
        head = self._new_node(parent, child.key[:at], child.ck)
        head.last_access, head.hits = child.last_access, child.hits
        head.lock_ref, head.pins = child.lock_ref, child.pins
        for tier, res in child.res.items():
            h, t = res.split(at, self.page_size)
            head.res[tier] = h
            child.res[tier] = t
            if tier != DEVICE:
                self._in_tier[tier].add(head)
        if child in self._leaving:  # a leaving node leaves whole (one store covers both)
            self._leaving[head] = self._leaving[child]
        child.key = child.key[at:]
        child.ck = self._child_key(child.key, 0, head, None)
        child.parent = head
        head.children[child.ck] = child
        parent.children[head.ck] = head
        return head

    def _cheapest(self, node: Node) -> LoadSegment:
        if len(node.res) == 1:  # the usual case for a load: one copy, nothing to price
            for tier, res in node.res.items():
                return LoadSegment(node, tier, res)
        best = None
        for tier, res in node.res.items():
            c = self.cost.residency_cost(tier, res, self)
            if best is None or c < best[0]:
                best = (c, tier, res)
        return LoadSegment(node, best[1], best[2])

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

    def is_root(self, node: Node) -> bool:
        return node is self.root

    # ---- sizes --------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Device tokens held by the tree and not locked."""
        return self.dev_evictable

    def protected_size(self) -> int:
        """Device tokens held by the tree under a lock."""
        return self.dev_protected

    def leaving_size(self) -> int:
        """Device tokens of leaving nodes (stores in flight, or waiting on their children)."""
        return self.dev_leaving

    def device_size(self) -> int:
        return self.dev_evictable + self.dev_protected + self.dev_leaving

    def held_tokens(self) -> int:
        """Tokens cached in any tier, a prefix held in several tiers counted once: what the
        device, host and donor tiers together must hold to keep everything cached."""
        n = self.device_size()
        host = self._in_tier.get(HOST, ())
        n += sum(len(x.key) for x in host if DEVICE not in x.res)
        n += sum(len(x.key) for x in self._in_tier.get(DONOR, ())
                 if DEVICE not in x.res and HOST not in x.res)
        return n

    def tier_size(self, tier: str) -> int:
        """Tokens held in a lower tier."""
        t = self.tiers.get(tier)
        return 0 if t is None else t.capacity_tokens() - t.available_tokens()
