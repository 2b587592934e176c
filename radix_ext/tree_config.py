"""The one frozen configuration of a `RadixTree`, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from radix_ext.placement import DEMOTION_POLICIES, EVICTION_POLICIES, CostModel

CASCADES = ("any", "down", "off")


@dataclass(frozen=True)
class TreeConfig:
    """`page_size`: tokens per page (keys and splits are page-aligned; one donor block = one page).
    `host_capacity`: host pool tokens, 0 for no host tier. `donor`: whether a donor tier exists
    (its leases are added at run time). `eviction` / `demotion`: policy names. `cascade`: where
    a copy pushed out of one lower tier goes: "any", to another lower tier with free room;
    "down", to a tier below it (donor -> host), room made there by dropping copies valued less
    than it (a demotion, as HiCache's host eviction makes room for a device victim); "off",
    dropped (for a caller with no data path between its lower tiers). `donor_over_host`: a device
    victim that already has a host copy (write-through) is also stored in donor memory when a
    lease has free room, a faster copy to load from. `name_donor_drops`: an eviction names each
    donor copy it drops (`EvictionPlan.dropped_donor`), for a caller with a tier below the tree."""

    page_size: int = 1
    host_capacity: int = 0
    donor: bool = False
    eviction: str = "lru"
    demotion: str = "tiered"
    cost: CostModel = field(default_factory=CostModel)
    cascade: str = "any"
    donor_over_host: bool = False
    name_donor_drops: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.host_capacity < 0:
            raise ValueError(f"host_capacity must be >= 0, got {self.host_capacity}")
        if self.cascade not in CASCADES:
            raise ValueError(f"cascade={self.cascade!r} is unknown; use one of {CASCADES}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction={self.eviction!r} is unknown; use one of {sorted(EVICTION_POLICIES)}"
            )
        if self.demotion not in DEMOTION_POLICIES:
            raise ValueError(
                f"demotion={self.demotion!r} is unknown; use one of {sorted(DEMOTION_POLICIES)}"
            )
