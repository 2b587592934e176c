"""`Backup`: write-through copies, a lower-tier copy of device prefixes made while they stay on
the device.

HiCache's write_through keeps a host copy of what the device caches, so a device eviction needs
no copy and a host hit never waits for one. `back_up(node, tier)` is the tree half: it books the
copies, the caller makes them.
"""

from __future__ import annotations

from typing import Any

from radix_ext.residency import DEVICE
from radix_ext.results import Transfer
from radix_ext.room import Room
from radix_ext.structure import Structure


class Backup:
    """Write-through copies; stateless (the copies are residencies of the nodes)."""

    def __init__(self, nodes: Structure, room: Room):
        self._nodes = nodes
        self._room = room

    def back_up(self, node: Any, tier: str) -> tuple[tuple, tuple]:
        """Give every node on the path to `node` that is on the device and has no copy in
        `tier` one there, root first; returns (transfers, released).

        Contract: each `Transfer(device -> tier)` names a copy the caller makes before anything
        reads its destination (the residency is in the tree at once: a later match may load
        from it); `released` lists the lower copies dropped to make room (already back in their
        tier), chosen by the eviction policy as for a demotion, never one on this path. It stops
        at the first node the tier has no room for (a backup follows the path from the root). A
        copy that could not be made is taken back with `forget_backup`."""
        nodes = self._nodes
        if tier not in nodes.tiers:
            raise ValueError(f"no {tier} tier to back up into")
        path = []
        x = node
        while x is not nodes.root:
            if DEVICE in x.res and tier not in x.res:
                path.append(x)
            x = x.parent
        if not path:
            return (), ()
        path.reverse()
        transfers: list = []
        released: list = []
        with nodes.held(path):  # making room must not drop a copy on this path
            for x in path:
                res = self._room.alloc_or_make_room(tier, len(x.key), released)
                if res is None:
                    break
                nodes.add_res(x, res)
                transfers.append(Transfer(DEVICE, x.res[DEVICE], tier, res))
        return tuple(transfers), tuple(released)

    def forget_backup(self, transfers: tuple) -> None:
        """Take back the copies of `back_up` whose transfers could not run (their tier
        residencies are freed; the device copies are untouched)."""
        nodes = self._nodes
        for tr in transfers:
            for x in nodes.in_tier[tr.dst_tier]:
                if x.res.get(tr.dst_tier) is tr.dst:
                    nodes.tiers[tr.dst_tier].free(nodes.pop_res(x, tr.dst_tier))
                    break
