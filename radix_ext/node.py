"""A radix tree node: a page-aligned run of tokens and the residencies that hold its KV."""

from __future__ import annotations

from array import array
from typing import Any, Optional


class Node:
    """`key`: this node's tokens (array('q'), a multiple of the page size; empty for the root).
    `ck`: the key under which the parent stores it. `res`: tier name -> residency; a node may be
    in several tiers at once (write-through copies). `lock_ref`: locks held on this node or below
    it (a locked node is in use and stays on the device); `direct_locks`: those held on it.
    `pins`: in-flight load-backs through it (a pinned node is never evicted, demoted or dropped).
    """

    __slots__ = (
        "id", "parent", "children", "key", "ck", "res",
        "lock_ref", "direct_locks", "pins", "last_access", "hits",
    )

    def __init__(self, node_id: int, parent: Optional["Node"], key: array, ck: Any, tick: int):
        self.id = node_id
        self.parent = parent
        self.children: dict[Any, Node] = {}
        self.key = key
        self.ck = ck
        self.res: dict[str, Any] = {}
        self.lock_ref = 0
        self.direct_locks = 0
        self.pins = 0
        self.last_access = tick
        self.hits = 0

    def __lt__(self, other: "Node") -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        tiers = ",".join(sorted(self.res))
        return (f"Node#{self.id}(len={len(self.key)}, tiers=[{tiers}], lock={self.lock_ref}, "
                f"pins={self.pins})")
