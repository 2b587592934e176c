"""KV memory per tier, and the maximum context one request of the high-demand model can have
(SIMULATED model).

Memory: every size here is the one the event runs use (`scenario._server` and `Node.lend` call
these functions), so a table printed beside a result states exactly what that run had.

Maximum context: Radix, HiCache and vLLM offload need the whole context's KV in local HBM while it
runs (their lower tiers only hold cached prefixes), so the bound is the local KV pool. SwiftCache's
layer stream cache keeps only some layers resident and streams the others from donor HBM each
step, so the bound is local pool + leased donor memory (at least two layers' worth must fit
locally: the active layer and the one being prefetched). Streaming is not free: every decode step
pulls the streamed layers over NVLink, so TPOT at that length is reported too.
"""

from __future__ import annotations

from . import params
from .roofline import Roofline

PAGE_TOKENS = int(params.SGLANG["page_size"].value)


def page_bytes(model_name: str) -> int:
    """Bytes of one KV page (PAGE_TOKENS tokens) of `model_name`."""
    return PAGE_TOKENS * params.MODELS[model_name].kv_bytes_per_token


def device_pages(gpu_name: str, model_name: str) -> int:
    """Whole pages in the KV pool of one SGLang server alone on a GPU (params.kv_pool_bytes)."""
    return int(params.kv_pool_bytes(gpu_name, params.MODELS[model_name]) // page_bytes(model_name))


def lend_blocks(lend_fraction: float, donor_pool_bytes: float, borrower_page_bytes: float) -> int:
    """Blocks a donor offers: `lend_fraction` of its pool, in whole borrower pages (one block each)."""
    return int(lend_fraction * donor_pool_bytes // borrower_page_bytes)


def lendable_pages(scn, lend_fraction: float) -> list[int]:
    """Master pages each donor of `scn` lends at `lend_fraction` (what `Node.lend` grants)."""
    mpage = page_bytes(scn.master)
    return [lend_blocks(lend_fraction, device_pages(scn.gpu, d) * page_bytes(d), mpage) for d in scn.donors]


def lendable_bytes(scn, lend_fraction: float) -> float:
    return sum(lendable_pages(scn, lend_fraction)) * page_bytes(scn.master)


def master_tier_pages(scn, host: bool | str, donor: bool) -> dict[str, int]:
    """Pages of the high-demand model's KV per tier for a system with these `host` and `donor` flags.

    host: False (none), True (hicache_ratio x device, HiCache's --hicache-ratio) or "big" (that plus
    the donor lease, so its cache is as large as SwiftCache's donor + host tiers together).
    """
    dev = device_pages(scn.gpu, scn.master)
    lent = sum(lendable_pages(scn, scn.lend_fraction))
    host_pages = int(params.SGLANG["hicache_ratio"].value * dev) if host else 0
    if host == "big":
        host_pages += lent
    return {"device": dev, "donor": lent if donor else 0, "host": host_pages}


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
