"""Step cost of one forward pass from a roofline: max(FLOPs / compute, bytes / HBM bandwidth).

FLOPs: 2 x non-embedding params per new token (the matmuls) plus attention, 4 x layers x q_heads x
head_dim per (new token, attended token) pair (QK^T and PV, 2 FLOPs per multiply-add each).
Bytes: the weights once per step, plus the KV read for every attended context token and written for
every new token. Efficiency factors come from params.EFFICIENCY.
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import ModelSpec


@dataclass(frozen=True)
class Roofline:
    model: ModelSpec
    flops: float  # peak FLOP/s
    hbm_bw: float  # peak bytes/s
    eff_compute: float
    eff_hbm: float

    def step_flops(self, items) -> float:
        """`items`: iterable of (new_tokens, context_before) for every sequence in the batch."""
        m = self.model
        per_pair = 4.0 * m.layers * m.q_heads * m.head_dim
        new = 0
        attn = 0.0
        for n, ctx in items:
            new += n
            attn += n * (ctx + (n + 1) / 2.0)
        return 2.0 * m.nonembed_params * new + per_pair * attn

    def step_bytes(self, items) -> float:
        kv = sum(ctx + n for n, ctx in items) * self.model.kv_bytes_per_token
        return self.model.weight_bytes + kv

    def step_time(self, items, hbm_bw_taken: float = 0.0) -> float:
        """Seconds for one step; `hbm_bw_taken` is DMA traffic (bytes/s) already using this HBM."""
        items = list(items)
        if not items:
            return 0.0
        t_c = self.step_flops(items) / (self.flops * self.eff_compute)
        bw = max(self.hbm_bw * self.eff_hbm - hbm_bw_taken, 0.05 * self.hbm_bw * self.eff_hbm)
        t_m = self.step_bytes(items) / bw
        return max(t_c, t_m)

    def decode_step_time(self, items, hbm_bw_taken: float = 0.0) -> float:
        """One decode step: the roofline makes no difference between prefill and decode items."""
        return self.step_time(items, hbm_bw_taken)
