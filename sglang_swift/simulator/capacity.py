"""Maximum context one request of the high-demand model can have, per system (SIMULATED model).

Radix, HiCache and vLLM offload need the whole context's KV in local HBM while it runs (their
lower tiers only hold cached prefixes), so the bound is the local KV pool. SwiftCache's layer
stream cache keeps only some layers resident and streams the others from donor HBM each step,
so the bound is local pool + leased donor memory (at least two layers' worth must fit locally:
the active layer and the one being prefetched). Streaming is not free: every decode step pulls
the streamed layers over NVLink, so TPOT at that length is reported too.
"""

from __future__ import annotations

from . import params
from .roofline import Roofline


def lendable_bytes(scn, lend_fraction: float) -> float:
    page = params.SGLANG["page_size"].value
    mpage = page * params.MODELS[scn.master].kv_bytes_per_token
    total = 0.0
    for d in scn.donors:
        pool = params.kv_pool_bytes(scn.gpu, params.MODELS[d])
        total += (lend_fraction * pool) // mpage * mpage  # whole borrower pages, as the ledger grants
    return total


def max_context(scn, lend_fraction: float | None = None) -> dict:
    lend_fraction = scn.lend_fraction if lend_fraction is None else lend_fraction
    m = params.MODELS[scn.master]
    hw = params.gpu(scn.gpu)
    local = params.kv_pool_bytes(scn.gpu, m)
    lent = lendable_bytes(scn, lend_fraction)
    per_tok = m.kv_bytes_per_token
    per_layer_tok = per_tok / m.layers
    base = int(local // per_tok)
    swift = int(min(local + lent, local * m.layers / 2) // per_tok)
    # layers that stay resident at that length; the rest stream every step
    resident = min(m.layers, int(local // (swift * per_layer_tok)))
    streamed_bytes = (m.layers - resident) * swift * per_layer_tok
    rl = Roofline(m, hw["bf16_flops"], hw["hbm_bw"], params.EFFICIENCY["compute"].value,
                  params.EFFICIENCY["hbm"].value)
    tpot_stream = max(rl.step_time([(1, swift)]), streamed_bytes / hw["nvlink_bw_dir"])
    tpot_local_base = rl.step_time([(1, base)])
    return {
        "local_kv_gb": local / 1e9, "lent_gb": lent / 1e9, "lend_fraction": lend_fraction,
        "max_tokens": {"sglang-radix": base, "sglang-hicache": base, "vllm-offload": base, "swiftcache": swift},
        "ratio": swift / base,
        "swiftcache_resident_layers": resident,
        "tpot_at_max_s": {"baseline": tpot_local_base, "swiftcache": tpot_stream},
    }
