"""Policies, apart from the mechanism: which device node to evict, where to demote it, which
lower-tier copy to drop. Chosen by name from small registries; LRU is the default.

The cost-aware strategies weigh how likely a prefix is reused against what it would cost to
bring it back from where it would end up: recompute, a donor fetch over NVLink, or a host fetch
over PCIe. A donor copy's cost is an expectation: with probability `reclaim_hazard` the donor
has taken its memory back before the reuse, and the prefix is recomputed instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from radix_ext.residency import DEVICE, DONOR, HOST

if TYPE_CHECKING:
    from radix_ext.structure import Structure


@dataclass(frozen=True)
class CostModel:
    """Per-token cost, in units of one token's recompute, of getting KV back on the device.

    Defaults come from the back-of-envelope numbers in notes/landscape.md section 6.3
    (Qwen3-8B, 32K-token prefix): recompute ~1.29 s, NVLink peer fetch ~13.1 ms, PCIe host
    fetch ~88 ms, so donor ~0.0102 and host ~0.068 of a recompute.
    """

    recompute: float = 1.0
    donor: float = 0.0102
    host: float = 0.068

    def __post_init__(self) -> None:
        if not (0 <= self.donor <= self.recompute and 0 <= self.host <= self.recompute):
            raise ValueError(f"tier costs must lie in [0, recompute]: {self}")

    def donor_expected(self, hazard: float) -> float:
        return (1.0 - hazard) * self.donor + hazard * self.recompute

    def residency_cost(self, tier: str, res: Any, nodes: "Structure") -> float:
        """Expected per-token cost to bring `res` (in `tier`) back to the device."""
        if tier == DEVICE:
            return 0.0
        if tier == HOST:
            return self.host
        if tier == DONOR:
            lease = nodes.donor.leases.get((res.donor, res.lease)) if nodes.donor else None
            return self.donor_expected(lease.reclaim_hazard if lease else 1.0)
        return self.recompute


def reuse_estimate(node: Any, nodes: "Structure") -> float:
    """Chance of reuse, modelled as decaying hyperbolically with the ticks since the last access.

    Recency only, on purpose: in multi-turn traces a node's hit count mostly says how shallow it
    is (every turn of a conversation re-matches its whole history), not whether it will be used
    again; a first version weighted hits and kept finished conversations too long. With equal
    reload costs this orders exactly like LRU.
    """
    return 1.0 / (nodes.clock - node.last_access + 1.0)


# ---- eviction order ---------------------------------------------------------------------------


class LRUEviction:
    """Least recently used first, on device and in every lower tier (what SGLang does)."""

    name = "lru"

    def device_priority(self, node: Any, nodes: "Structure") -> float:
        return node.last_access

    def tier_priority(self, node: Any, tier: str, nodes: "Structure", pending: Any = None) -> float:
        """A lower copy of a node that is on the device goes first: dropping it loses nothing
        now, while a copy of an evicted node is all that keeps it from a recompute (a small
        donor tier full of duplicates of device prefixes turned away the prefixes the device
        had just evicted). Among the others, least recently used first."""
        if pending is None and DEVICE in node.res:
            return -1.0
        return node.last_access


class CostAwareEviction:
    """Lowest expected reload cost first: reuse estimate x per-token cost of the next-best copy.

    A device node that already has a donor or host copy costs little to evict; one whose only
    fallback is recompute is kept longer, and a prefix on a donor likely to reclaim its memory
    counts nearly as a recompute.
    """

    name = "cost_aware"

    def __init__(self, cost: CostModel, demotion: Any):
        self.cost = cost
        self.demotion = demotion  # prices the tier a node without another copy would go to

    def _fallback_cost(self, node: Any, skip: str, nodes: "Structure") -> float:
        best = None
        for tier, res in node.res.items():
            if tier != skip and tier != DEVICE:
                c = self.cost.residency_cost(tier, res, nodes)
                best = c if best is None or c < best else best
        if best is not None:
            return best
        # No other copy: it would be demoted to the best tier with room, or recomputed.
        return self.demotion.best_target_cost(len(node.key), node, nodes, skip=skip)

    def device_priority(self, node: Any, nodes: "Structure") -> float:
        return reuse_estimate(node, nodes) * self._fallback_cost(node, DEVICE, nodes)

    def tier_priority(self, node: Any, tier: str, nodes: "Structure", pending: Any = None) -> float:
        """`pending`: the destination in `tier` of a store in flight for `node` (which is
        leaving the device), priced as the copy it becomes."""
        if pending is None and DEVICE in node.res:
            return -1.0  # dropping a lower copy of a device-resident node loses nothing now
        copy = node.res[tier] if pending is None else pending
        now = self.cost.residency_cost(tier, copy, nodes)
        return reuse_estimate(node, nodes) * (self._fallback_cost(node, tier, nodes) - now)


# ---- demotion target --------------------------------------------------------------------------


class TieredDemotion:
    """Donor when leased capacity is free (lease with most free blocks first), else host; only
    when no target has free room, make room in them, in the same order."""

    name = "tiered"
    make_room_first = False

    def cost_of(self, tier: str, pref: Sequence) -> float:
        """Expected per-token reload cost of a copy placed in (tier, pref)."""
        if tier == DONOR:
            return min((self.cost.donor_expected(x.reclaim_hazard) for x in pref),
                       default=self.cost.donor)
        return self.cost.host if tier == HOST else self.cost.recompute

    def room_bar(self, node: Any, nodes: "Structure", tier: str, pref: Sequence,
                 later: Sequence, have: float) -> float:
        return float("inf")

    def __init__(self, cost: CostModel):
        self.cost = cost

    def targets(self, node: Any, nodes: "Structure") -> Sequence[tuple[str, Sequence]]:
        return ((DONOR, ()), (HOST, ()))

    def best_target_cost(self, num_tokens: int, node: Any, nodes: "Structure", skip: str) -> float:
        for tier, pref in self.targets(node, nodes):
            if tier == skip:
                continue
            t = nodes.tiers.get(tier)
            if t is not None and t.available_tokens() >= num_tokens:
                if tier == DONOR:
                    leases = pref or t.leases.values()
                    return min(self.cost.donor_expected(x.reclaim_hazard) for x in leases)
                return self.cost.host
        return self.cost.recompute


class CostAwareDemotion(TieredDemotion):
    """Cheapest expected reload first: each donor lease priced by its reclaim hazard, the host
    at its fetch cost; a flaky donor can rank below the host. When a cheaper target is full,
    room is made there only by dropping copies worth less (by the eviction policy's measure)
    than what placing the victim in the next target with room would lose."""

    name = "cost_aware"
    make_room_first = True

    def room_bar(self, node: Any, nodes: "Structure", tier: str, pref: Sequence,
                 later: Sequence, have: float) -> float:
        """Per-token loss of not placing `node` in (tier, pref) but in the best later target
        with free room, or keeping the copy it has (cost `have`; recompute when none): the most
        a copy dropped to make room may be worth."""
        n = len(node.key)
        fallback = have
        for t, p in later:
            room = (sum(len(x.free_blocks) for x in p) * nodes.page_size if t == DONOR and p
                    else nodes.tiers[t].available_tokens())
            if room >= n:
                fallback = min(fallback, self.cost_of(t, p))
                break
        return reuse_estimate(node, nodes) * (fallback - self.cost_of(tier, pref))

    def targets(self, node: Any, nodes: "Structure") -> Sequence[tuple[str, Sequence]]:
        options: list[tuple[float, str, Sequence]] = []
        if nodes.donor is not None:
            for lease in sorted(nodes.donor.leases.values(), key=lambda x: x.reclaim_hazard):
                options.append((self.cost.donor_expected(lease.reclaim_hazard), DONOR, (lease,)))
        if nodes.host is not None:
            options.append((self.cost.host, HOST, ()))
        options.sort(key=lambda o: o[0])
        return tuple((tier, pref) for _, tier, pref in options)


EVICTION_POLICIES = {"lru": LRUEviction, "cost_aware": CostAwareEviction}
DEMOTION_POLICIES = {"tiered": TieredDemotion, "cost_aware": CostAwareDemotion}


def make_eviction(name: str, cost: CostModel, demotion: Any):
    """The eviction policy `name`; `demotion`: the demotion policy it prices victims with."""
    try:
        cls = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; "
                         f"choose one of {sorted(EVICTION_POLICIES)}") from None
    return cls(cost, demotion) if cls is CostAwareEviction else cls()


def make_demotion(name: str, cost: CostModel):
    try:
        return DEMOTION_POLICIES[name](cost)
    except KeyError:
        raise ValueError(f"unknown demotion policy {name!r}; "
                         f"choose one of {sorted(DEMOTION_POLICIES)}") from None
