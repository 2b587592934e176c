"""What streaming costs on a GPU, from bandwidths (no GPU needed): the expected ratio of a
streamed decode step, and of a streamed prefill token, to the same request with all layers
resident. Every hardware and model number comes from `simulator.params` (each with its source).

Decode step, one request of context c (memory-bound, as decode is):
    resident  t_res = (W + c*kv) / (B_hbm * e_hbm)
    streamed  t_str = max(t_res + c*kv / (B_hbm * e_hbm), c*kv / B_link)
W = weight bytes, kv = KV bytes per token (all layers), B_link = the link the streamed KV comes
over (donor HBM: NVLink per direction; host memory: PCIe per direction). Each step loads every
layer's c*kv/L once; with depth 2 the load of layer l+1 runs while layer l computes, so the step
takes the longer of the two, and the staged rows cost one extra HBM write besides.

Read in place (depth 0, every row of the context on the donor's pages): attention reads the
context over the link inside the step, after the weights, with nothing to overlap it:
    in place  t_map = W / (B_hbm * e_hbm) + c*kv / B_link
(no staging write; for a long prefill attention reads each K/V tile once per query block unless
the GPU's L2 serves it again, which a bandwidth formula cannot say: not estimated here.)

Prefill, a chunk of C tokens after a prefix of p tokens (compute-bound):
    resident per token  t_res = 2*N / (F * e_c)          (N = non-embedding parameters)
    streamed per token  t_str = max(t_res, p*kv / (C * B_link))
since each chunk loads the prefix's KV once per layer, under that chunk's compute.
"""

from __future__ import annotations

from ..simulator import params

LINKS = {"donor HBM over NVLink": "nvlink_bw_dir", "host memory over PCIe": "pcie_bw_dir"}


def decode_step_ratio(gpu: str, model: str, context: int, link: str) -> dict:
    g, m = params.gpu(gpu), params.MODELS[model]
    hbm = g["hbm_bw"] * params.EFFICIENCY["hbm"].value
    kv = context * m.kv_bytes_per_token
    resident = (m.weight_bytes + kv) / hbm
    transfer = kv / g[LINKS[link]]
    streamed = max(resident + kv / hbm, transfer)
    in_place = m.weight_bytes / hbm + transfer
    return {"resident_ms": resident * 1e3, "streamed_ms": streamed * 1e3,
            "ratio": streamed / resident, "in_place_ms": in_place * 1e3,
            "in_place_ratio": in_place / resident}


def prefill_token_ratio(gpu: str, model: str, prefix: int, chunk: int, link: str) -> dict:
    g, m = params.gpu(gpu), params.MODELS[model]
    resident = 2 * m.nonembed_params / (g["bf16_flops"] * params.EFFICIENCY["compute"].value)
    transfer = prefix * m.kv_bytes_per_token / (chunk * g[LINKS[link]])
    streamed = max(resident, transfer)
    return {"resident_us": resident * 1e6, "streamed_us": streamed * 1e6,
            "ratio": streamed / resident}


def expected_costs(model: str = "Qwen3-32B", context: int = 32768) -> list[dict]:
    """One row per (GPU, link): decode step and prefill token, streamed vs resident."""
    chunk = int(params.SGLANG["chunked_prefill_size"].value)
    rows = []
    for gpu in ("H20", "H200"):
        for link in LINKS:
            d = decode_step_ratio(gpu, model, context, link)
            p = prefill_token_ratio(gpu, model, context - chunk, chunk, link)
            rows.append({"gpu": gpu, "link": link, "model": model, "context": context,
                         "link_GBps": params.gpu(gpu)[LINKS[link]] / 1e9,
                         "decode_resident_ms": round(d["resident_ms"], 2),
                         "decode_streamed_ms": round(d["streamed_ms"], 2),
                         "decode_step_ratio": round(d["ratio"], 2),
                         "decode_in_place_ms": round(d["in_place_ms"], 2),
                         "decode_in_place_ratio": round(d["in_place_ratio"], 2),
                         "prefill_token_ratio": round(p["ratio"], 2)})
    return rows


def sources() -> dict[str, str]:
    """Where each number in `expected_costs` comes from."""
    out = {f"{gpu}.{key}": params.GPUS[gpu][key].source for gpu in ("H20", "H200")
           for key in ("hbm_bw", "bf16_flops", "nvlink_bw_dir", "pcie_bw_dir")}
    out.update({f"efficiency.{k}": p.source for k, p in params.EFFICIENCY.items()})
    out["Qwen3-32B"] = params.MODELS["Qwen3-32B"].source
    out["chunked_prefill_size"] = params.SGLANG["chunked_prefill_size"].source
    return out
