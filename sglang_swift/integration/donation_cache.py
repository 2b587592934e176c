"""`DonationRadixCache`: the `swiftcache` backend with donated memory attached.

`SwiftRadixCache` (tree_cache_adapter) puts radix_ext behind SGLang's prefix-cache interface; this
subclass adds the live side (`SwiftRuntime`): the tree's donor tier is fed by leases from other
SwiftCache servers on the node, device evictions are demoted into donor blocks (a real copy of
every layer), and a match that hits donor blocks is loaded back into fresh local slots before the
scheduler sees it, so SGLang reports and reuses those tokens as an ordinary device prefix hit.

Faults are expected events: a copy that cannot run (donor gone, read deadline passed, mapping
revoked) is undone in the tree (`revoke` / `abort_load_back`), so the request recomputes those
tokens; nothing reads a block after its lease ended.

Load-back is synchronous in `match_prefix` here: correct everywhere, and layer-wise on the copy
lane, but the scheduler does not yet overlap it with the forward pass (see docs/integration.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams

from radix_ext import DEVICE, DONOR, TreeConfig

from ..dataplane import make_layer_counter
from .runtime import SwiftRuntime
from .cache import SwiftRadixCache, indices_to_tensor, namespace_of

logger = logging.getLogger(__name__)
STEP_INTERVAL_S = 0.02
REPORT_INTERVAL_S = 5.0
METRICS_INTERVAL_S = 1.0


class DonationRadixCache(SwiftRadixCache):
    """SwiftRadixCache plus a SwiftRuntime (control agent, arena, leases, copies)."""

    def __init__(self, params: Any, tree_config: TreeConfig, config: Any, *, model: str,
                 agent_id: str | None = None, enable_metrics: bool = False):
        self.runtime: SwiftRuntime | None = None
        self._last_step = self._last_report = self._last_metrics = 0.0
        self._reported: dict = {}
        super().__init__(params, tree_config)
        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        self.runtime = SwiftRuntime(config, model=model, kv_pool=kv_pool,
                                    allocator=self.token_to_kv_pool_allocator, tree=self.tree,
                                    page_size=self.page_size, agent_id=agent_id)
        self.counter = make_layer_counter(kv_pool.layer_num, self.runtime.device)
        self.metrics = None
        if enable_metrics:  # SGLang's --enable-metrics: our series join its /metrics
            from .metrics import SwiftMetrics

            self.metrics = SwiftMetrics({"agent": self.runtime.agent_id, "role": config.role})
        self.runtime.start()

    def swift_step(self) -> None:
        """Called once per scheduler loop iteration (plugin hook): handle control events at
        most every STEP_INTERVAL_S, so an idle server still takes leases and reclaims."""
        now = time.monotonic()
        if now - self._last_step >= STEP_INTERVAL_S:
            self._last_step = now
            self.runtime.pump()
        if self.metrics is not None and now - self._last_metrics >= METRICS_INTERVAL_S:
            from .metrics import gauges_of

            self._last_metrics = now
            self.metrics.update(self.runtime.stats, gauges_of(self.runtime, self.tree))
        if now - self._last_report >= REPORT_INTERVAL_S and self.runtime.stats != self._reported:
            self._last_report, self._reported = now, dict(self.runtime.stats)
            logger.info("SwiftCache stats: %s; donor tier %d tokens", self._reported,
                        self.tree.tier_size(DONOR) if self.tree.donor is not None else 0)

    def reset(self) -> None:
        super().reset()  # a new, empty tree: hand it the leases we still hold
        if self.runtime is not None:
            self.runtime.attach_tree(self.tree)

    # ---- match: load donor hits back before the scheduler sees the prefix --------------------
    def match_prefix(self, params: MatchPrefixParams):
        if not self.disable and len(params.key):
            self.runtime.pump()
            m = self.tree.match(params.key.raw_token_ids(), namespace_of(params.key))
            if m.loads:
                self._load_back(params.key)
        return super().match_prefix(params)

    def _load_back(self, key: Any) -> None:
        tokens, ns = key.raw_token_ids(), namespace_of(key)
        need = self.tree.match(tokens, ns).load_len
        slots = self._alloc(need)
        if slots is None:
            return
        m = self.tree.match(tokens, ns)  # allocation may have evicted: plan on the tree as it is
        if m.load_len != need or any(s.tier != DONOR for s in m.loads):
            self._free(slots)
            return
        ticket = self.tree.begin_load_back(m.last_node, slots.tolist())
        if ticket is None:
            self._free(slots)
            return
        ok = self.runtime.load([(c.src, c.dst.indices) for c in ticket.copies], self.counter)
        outcome = (self.tree.complete_load_back(ticket) if ok
                   else self.tree.abort_load_back(ticket))
        if outcome.ok:
            self.tree.unlock(outcome.last_node)  # the scheduler locks it when it takes the prefix
        elif len(outcome.device_indices_to_free):
            self._free(indices_to_tensor(outcome.device_indices_to_free, self.device))

    def _alloc(self, n: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n - allocator.available_size()))
        if allocator.available_size() < n:
            return None
        return allocator.alloc(n)

    def _free(self, slots: torch.Tensor) -> None:
        self.token_to_kv_pool_allocator.free(slots)

    # ---- evict: demote into donor blocks ------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        self.runtime.pump()
        plan = self.tree.evict_device(params.num_tokens)
        copies = plan.copies
        for step in copies:
            if step.src_tier != DEVICE or step.dst_tier != DONOR:
                raise RuntimeError(f"no data path from {step.src_tier} to {step.dst_tier}")
        done = self.runtime.store([(step.src.indices, step.dst) for step in copies])
        for step, ok in zip(copies, done):
            if not ok:  # the copy did not happen: the tree must not keep it
                dst = step.dst
                self.runtime.forget(self.tree.revoke(dst.donor, lease_id=dst.lease,
                                                     blocks=dst.blocks))
        allocator = self.token_to_kv_pool_allocator
        for rel in plan.released:
            if rel.tier == DEVICE:
                allocator.free_segment(indices_to_tensor(rel.residency.indices, self.device),
                                       start_pos=0)
        return EvictResult(num_tokens_evicted=plan.num_evicted)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.runtime.agent.check_integrity()
