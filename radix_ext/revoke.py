"""`Revoke`: donors taking their memory back."""

from __future__ import annotations

from typing import Iterable, Optional

from radix_ext.loadback import LoadBack
from radix_ext.residency import DEVICE, DONOR, HOST
from radix_ext.results import LostPrefix, Released, RevokeResult, Transfer, Unrescued
from radix_ext.room import Room
from radix_ext.store import Store
from radix_ext.structure import Structure


class Revoke:
    """Revocation and its rescue into host; stateless (it changes the nodes, the stores in
    flight and the donor tier through their interfaces)."""

    def __init__(self, nodes: Structure, store: Store, loads: LoadBack, room: Room):
        self._nodes = nodes
        self._store = store
        self._loads = loads
        self._room = room

    def revoke(
        self, donor: str, lease_id: Optional[int] = None, blocks: Optional[Iterable[int]] = None,
        rescue: bool = False,
    ) -> RevokeResult:
        """A donor takes back `blocks` of one lease, a whole lease, or (both None) all its leases.

        Contract: every donor residency touching a revoked block is dropped, even if pinned
        (the in-flight loads through it become stale and will fail). Nodes left with no copy lose
        their subtree too; `lost` says where each lost subtree starts. A store in flight into a
        revoked block becomes stale (completing it fails; its nodes are still on the device, so
        nothing is lost yet); its other blocks stay reserved until it settles. The revoked blocks
        leave the donor tier for good; a revoked lease is forgotten. An expected event, never an
        error: the caller falls back to host or recompute.

        With `rescue` (the caller still has the revoked blocks' bytes, read before it let them
        go) and a host tier, a dropped donor copy with no other copy (none on the device, none
        in host: a device copy reaches host when it is evicted) moves to host first, room
        made there as for a demotion (the least valuable host copies dropped; nothing pinned or
        on the revoked path): `moved` lists one `Transfer(donor -> host)` per rescued copy, for
        the caller to copy from those bytes before anything reads the host slots. A copy that
        finds no host room is dropped as without `rescue`; `unrescued` names each such copy
        (its path's tokens and its donor residency), for a caller that can keep those bytes in
        a tier below the tree (L3).
        """
        nodes = self._nodes
        donor_tier = nodes.donor
        if donor_tier is None:
            return RevokeResult()
        if blocks is not None and lease_id is None:
            raise ValueError("revoking blocks needs the lease they belong to")
        gone_blocks = None if blocks is None else set(blocks)

        def hit(res) -> bool:
            if res.donor != donor or (lease_id is not None and res.lease != lease_id):
                return False
            return gone_blocks is None or any(b in gone_blocks for b in res.blocks)

        if gone_blocks is not None:
            lease = donor_tier.leases.get((donor, lease_id))
            if lease is None:
                raise ValueError(f"no lease {donor}/{lease_id} to revoke blocks from")
            owned = set(lease.free_blocks)
            for r in [x.res[DONOR] for x in nodes.in_tier[DONOR]] + self._store.pending(DONOR):
                if (r.donor, r.lease) == (donor, lease_id):
                    owned.update(r.blocks)
            if not gone_blocks <= owned:
                raise ValueError(f"blocks {sorted(gone_blocks - owned)[:8]} are not in lease "
                                 f"{donor}/{lease_id}; nothing was revoked")
        # in node order, not the set's (its order is the objects' addresses): the blocks freed
        # and the host slots given go in the same order in every tree that made the same moves
        # (the TP ranks' trees, each in its own process)
        victims = sorted(x for x in nodes.in_tier[DONOR] if hit(x.res[DONOR]))
        released: list = []
        stale: list = self._store.revoke_dst(hit, gone_blocks)
        orphans = []
        moved: list = []
        moved_nodes: list = []
        unrescued: list = []
        if rescue and nodes.host is not None:
            moved, moved_nodes, unrescued = self._rescue(victims, released)
        for x in victims:
            if x.pins:
                stale.extend(self._loads.mark_stale(x))
            res = nodes.pop_res(x, DONOR)
            donor_tier.free(res)
            released.append(Released(DONOR, res))
            if not x.res:
                orphans.append(x)
        lost, leaves, num_lost = self._drop_orphans(orphans, released, stale)
        if gone_blocks is not None:
            donor_tier.remove_blocks(donor, lease_id, gone_blocks)
        else:
            for key in [k for k in donor_tier.leases if k[0] == donor]:
                if lease_id is None or key[1] == lease_id:
                    donor_tier.remove_lease(*key)
        return RevokeResult(tuple(lost), tuple(released), tuple(sorted(set(stale))), num_lost,
                            tuple(moved), tuple(leaves), tuple(moved_nodes), tuple(unrescued))

    def forget_rescue(self, moved: Iterable[Transfer]) -> RevokeResult:
        """Take back the host copies a `revoke(rescue=True)` gave (its `moved`) whose rows could
        not be written: each host residency is freed, and a node left with no copy loses its
        subtree, as in a revoke (`lost`, `lost_paths`, `num_tokens_lost` say what). Call it
        before anything reads those host slots."""
        nodes = self._nodes
        holders = {id(x.res[HOST]): x for x in nodes.in_tier[HOST]}  # used in `moved` order
        released: list = []
        stale: list = []
        orphans = []
        for tr in moved:
            x = holders.get(id(tr.dst))
            if x is None:
                continue  # not in the host tier any more
            if x.pins:
                stale.extend(self._loads.mark_stale(x))
            nodes.tiers[HOST].free(nodes.pop_res(x, HOST))
            released.append(Released(HOST, tr.dst))
            if not x.res:
                orphans.append(x)
        lost, leaves, num_lost = self._drop_orphans(orphans, released, stale)
        return RevokeResult(tuple(lost), tuple(released), tuple(sorted(set(stale))), num_lost,
                            (), tuple(leaves), ())

    def _drop_orphans(self, orphans: list, released: list, stale: list) -> tuple:
        """Remove the subtrees of `orphans` (nodes left with no copy), shallowest first so a lost
        subtree is reported (and removed) once, at its top; returns (lost, leaves, tokens)."""
        nodes = self._nodes
        orphans.sort(key=lambda x: (nodes.depth(x), x.id))
        removed: set = set()
        lost: list = []
        num_lost = 0
        leaves: list = []
        for x in orphans:
            if x in removed:
                continue
            ns, tokens = nodes.prefix_of(x)
            lost.append(LostPrefix(ns, tokens, len(tokens) - len(x.key)))
            cached = len(tokens) - len(x.key)
            stack = [x]
            while stack:  # every path that ended in the lost subtree
                y = stack.pop()
                if y.children:
                    stack.extend(y.children.values())
                else:
                    leaves.append(LostPrefix(ns, nodes.prefix_of(y)[1], cached))
            for y in nodes.remove_subtree(x, released):
                removed.add(y)
                num_lost += len(y.key)
                if y.pins:
                    stale.extend(self._loads.mark_stale(y))
        return lost, leaves, num_lost

    def _rescue(self, victims: list, released: list) -> tuple[list, list, list]:
        """Host copies for the victims that have no other copy, shallowest first (a victim on the
        device needs none: its eviction stores it again, and host room is kept for what would
        be lost); returns the transfers,
        their nodes, and an `Unrescued` per victim left without a copy (read before the drop).
        A victim that finds no room is dropped with its subtree, so nothing below it is moved;
        another victim may still fit. Room is made with every victim held, so making it never
        drops another victim."""
        nodes = self._nodes
        todo = sorted((x for x in victims if HOST not in x.res and DEVICE not in x.res),
                      key=lambda x: (nodes.depth(x), x.id))
        moved, rescued = [], []
        failed: set = set()
        with nodes.held(todo):
            for x in todo:
                if nodes.below(x, failed):
                    failed.add(x)
                    continue
                res = self._room.alloc_or_make_room(HOST, len(x.key), released)
                if res is None:
                    failed.add(x)  # dropped with its subtree; a smaller one may still fit
                    continue
                nodes.add_res(x, res)
                moved.append(Transfer(DONOR, x.res[DONOR], HOST, res))
                rescued.append(x)
        unrescued = []
        for x in todo:
            if x in failed:
                ns, tokens = nodes.prefix_of(x)
                unrescued.append(Unrescued(ns, tokens, len(tokens) - len(x.key), x.res[DONOR]))
        return moved, rescued, unrescued
