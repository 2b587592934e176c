"""radix_ext: a radix prefix tree whose nodes live in tiers (device, donor HBM, host).

Pure bookkeeping: imports neither torch nor SGLang, holds indices and residency records, and
returns what to copy and free; it never touches memory.
"""

from radix_ext.admission import (
    Admission,
    DevicePool,
    admit,
    evict,
    holding,
    settle,
    should_exchange,
)
from radix_ext.placement import DEMOTION_POLICIES, EVICTION_POLICIES, CostModel
from radix_ext.residency import DEVICE, DONOR, HOST, DeviceResidency, DonorResidency, HostResidency
from radix_ext.results import (
    EvictionPlan,
    ExchangeResult,
    ExchangeTicket,
    InsertResult,
    LoadOutcome,
    LoadSegment,
    LoadTicket,
    LostPrefix,
    Match,
    Released,
    RevokeResult,
    StoreOutcome,
    StoreTicket,
    Transfer,
    Unrescued,
)
from radix_ext.tiers import DonorTier, HostTier, LeasedBlocks
from radix_ext.tree import RadixTree
from radix_ext.tree_config import TreeConfig

__all__ = [
    "Admission", "CostModel", "DEMOTION_POLICIES", "DEVICE", "DONOR", "DeviceResidency",
    "DevicePool", "DonorResidency", "DonorTier", "EVICTION_POLICIES", "EvictionPlan",
    "ExchangeResult", "ExchangeTicket", "HOST", "HostResidency", "HostTier", "InsertResult",
    "LeasedBlocks", "LoadOutcome", "LoadSegment", "LoadTicket", "LostPrefix", "Match",
    "RadixTree", "Released", "RevokeResult", "StoreOutcome", "StoreTicket", "Transfer",
    "TreeConfig", "Unrescued", "admit", "evict", "holding", "settle", "should_exchange",
]
