"""KV memory per tier (SIMULATED model).

Every size here is the one the event runs use (`scenario._server` and `Node.lend` call these
functions), so a table printed beside a result states exactly what that run had. The maximum
context of one request comes from the stepwise layer stream model (long_context.py).
"""

from __future__ import annotations

from . import params

PAGE_TOKENS = int(params.SGLANG["page_size"].value)


def page_bytes(model_name: str) -> int:
    """Bytes of one KV page (PAGE_TOKENS tokens) of `model_name`."""
    return PAGE_TOKENS * params.MODELS[model_name].kv_bytes_per_token


def device_pages(gpu_name: str, model_name: str) -> int:
    """Whole pages in the KV pool of one SGLang server alone on a GPU (params.kv_pool_bytes)."""
    return int(params.kv_pool_bytes(gpu_name, params.MODELS[model_name]) // page_bytes(model_name))


def lend_blocks(lend_fraction: float, donor_pool_bytes: float, borrower_page_bytes: float) -> int:
    """Blocks a donor offers: `lend_fraction` of its pool, in whole borrower pages (one block
    each)."""
    return int(lend_fraction * donor_pool_bytes // borrower_page_bytes)


def lendable_pages(scn, lend_fraction: float) -> list[int]:
    """Master pages each donor of `scn` lends at `lend_fraction` (what `Node.lend` grants)."""
    mpage = page_bytes(scn.master)
    return [lend_blocks(lend_fraction, device_pages(scn.gpu, d) * page_bytes(d), mpage)
            for d in scn.donors]


def lendable_bytes(scn, lend_fraction: float) -> float:
    return sum(lendable_pages(scn, lend_fraction)) * page_bytes(scn.master)


def master_tier_pages(scn, host: bool | str, donor: bool, ideal: bool = False) -> dict[str, int]:
    """Pages of the high-demand model's KV per tier for a system with these `host` and `donor`
    flags.

    host: False (none), True (HiCache's host tier: `scn.host_bytes`, by default hicache_ratio x
    device, HiCache's --hicache-ratio) or "big" (that plus the donor lease, so its cache is as large
    as SwiftCache's donor + host tiers together). `ideal`: the donor lease is added to the device
    pool instead (the lent memory with no link and no lease).
    """
    dev = device_pages(scn.gpu, scn.master)
    lent = sum(lendable_pages(scn, scn.lend_fraction))
    host_pages = 0
    if host:
        host_bytes = getattr(scn, "host_bytes", None)
        host_pages = (int(params.SGLANG["hicache_ratio"].value * dev) if host_bytes is None
                      else int(host_bytes // page_bytes(scn.master)))
    if host == "big":
        host_pages += lent
    return {"device": dev + (lent if ideal else 0), "donor": lent if donor else 0,
            "host": host_pages}
