"""Every number the simulator uses, with where it comes from. Nothing here is fitted to a result.

`P(value, unit, source)` keeps the citation next to the value; `assumptions_table()` renders all of
them for docs/simulation.md. Workload shapes (rates, think times, tool-result sizes) are stated
distributions of the scenario, not hardware parameters; they are in benchmarks/workloads/specs.py
and, as chosen for the simulated node, in scenario.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_swift.config import SwiftConfig

from ..workloads import specs as workload_specs

GB = 1e9
GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class P:
    value: float
    unit: str
    source: str


# -- GPUs ---------------------------------------------------------------------------------------
_PAPER = "SwiftCache paper, arXiv 2606.16135, testbed"
_NVLINK_MEASURED = ("measured P2P write ~371-377 GB/s per GPU pair on HGX H100, "
                    "p2pBandwidthLatencyTest (github.com/NVIDIA/nccl/issues/1264)")
_PCIE_MEASURED = ("copy-engine H2D 55.6 GB/s on PCIe Gen5 x16, nvbandwidth example output "
                  "(github.com/NVIDIA/nvbandwidth/issues/24)")
_H20_PAGE = "willitrunai.com/gpus/h20-96gb"
GPUS: dict[str, dict[str, P]] = {
    "H20": {
        "hbm_bytes": P(96 * GB, "B", f"H20 96 GB HBM3 ({_H20_PAGE}; {_PAPER}: 4x H20 96 GB)"),
        "hbm_bw": P(4.0e12, "B/s", f"H20 4.0 TB/s ({_H20_PAGE})"),
        "bf16_flops": P(148e12, "FLOP/s", f"H20 148 TFLOPS FP16/BF16 dense ({_H20_PAGE})"),
        "nvlink_bw_dir": P(200 * GB, "B/s",
                           f"{_PAPER}: NVLink 400 GB/s bidirectional -> 200 GB/s per direction"),
        "pcie_bw_dir": P(32 * GB, "B/s", f"{_PAPER}: PCIe quoted as 32 GB/s"),
    },
    "H100": {
        "hbm_bytes": P(80 * GB, "B",
                       "H100 SXM 80 GB HBM3 (NVIDIA H100 Tensor Core GPU datasheet)"),
        "hbm_bw": P(3.35e12, "B/s", "H100 SXM 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet)"),
        "bf16_flops": P(989e12, "FLOP/s", "H100 SXM 989 TFLOPS BF16 dense "
                        "(NVIDIA H100 Tensor Core GPU datasheet)"),
        "nvlink_bw_dir": P(370 * GB, "B/s", _NVLINK_MEASURED),
        "pcie_bw_dir": P(55.6 * GB, "B/s", _PCIE_MEASURED),
    },
    "H200": {
        "hbm_bytes": P(141 * GB, "B",
                       "H200 SXM 141 GB HBM3e (NVIDIA H200 Tensor Core GPU datasheet)"),
        "hbm_bw": P(4.8e12, "B/s", "H200 SXM 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet)"),
        "bf16_flops": P(989e12, "FLOP/s", "H200 SXM 989 TFLOPS BF16 dense, same die as H100 "
                        "(NVIDIA H200 datasheet)"),
        "nvlink_bw_dir": P(370 * GB, "B/s",
                           f"as H100 (NVLink 4 through NVSwitch): {_NVLINK_MEASURED}"),
        "pcie_bw_dir": P(55.6 * GB, "B/s", f"as H100: {_PCIE_MEASURED}"),
    },
}

EFFICIENCY: dict[str, P] = {
    "compute": P(0.6, "-", "assumed: large prefill GEMMs reach ~60% of dense BF16 peak (~600 of "
                 "989 TFLOP/s on H100); a stated assumption, not a measurement"),
    "hbm": P(0.7, "-", "assumed: memory-bound kernels reach 60-85% of HBM peak (mikamirai.com "
             "H100 HBM study); the lower part is taken for KV reads"),
}

# -- SGLang serving defaults (pinned sglang 0.5.23: sglang/srt/arg_groups/memory_hook.py) -------
_MEMORY_HOOK = "sglang 0.5.23 srt/arg_groups/memory_hook.py"
_HICACHE_DOCS = ("SGLang HiCache best practices "
                 "(docs.sglang.io/advanced_features/hicache_best_practices.html)")
SGLANG: dict[str, P] = {
    "chunked_prefill_size": P(8192, "tokens",
                              f"{_MEMORY_HOOK}: 8192 for 60-160 GB GPUs (H20/H100/H200)"),
    "max_running_requests": P(256, "reqs",
                              f"{_MEMORY_HOOK}: decode cuda-graph max_bs 256 for tp<4"),
    "reserved_mem_base": P(512 * MiB, "B",
                           f"{_MEMORY_HOOK}: reserved_mem = 512 MB + 1.5 MB x activation tokens"),
    "reserved_mem_per_token": P(1.5 * MiB, "B/token",
                                f"{_MEMORY_HOOK}: activation_tokens * 1.5 MB"),
    "reserved_mem_graph_per_bs": P(2 * MiB, "B/req",
                                   f"{_MEMORY_HOOK} reserve_for_graph_mb: max_bs * 2 MB"),
    "reserved_mem_tp_slack": P(128 * MiB, "B", f"{_MEMORY_HOOK}: tp*pp/8 * 1024 MB (tp=1)"),
    "reserved_mem_floor": P(10 * GiB, "B", f"{_MEMORY_HOOK}: reserved >= 10 GB when GPU > 60 GB"),
    "page_size": P(64, "tokens", f"--page-size 64, {_HICACHE_DOCS}; one radix key = one page"),
    "hicache_ratio": P(2, "x device", f"--hicache-ratio 2, {_HICACHE_DOCS}; also the default in "
                       "cache mode (sglang 0.5.23 srt/arg_groups/fields/memory.py)"),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float  # all parameters (weights bytes = 2 x params in BF16)
    nonembed_params: float  # matmul FLOPs per token = 2 x these
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params


# -- models: Qwen3 configs (config.json and model card of each, huggingface.co/Qwen/<name>) ------
def _qwen(name: str) -> str:
    return (f"huggingface.co/Qwen/{name}: config.json (layers, heads, head_dim) and model card "
            "(parameters)")


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("Qwen3-32B", 64, 64, 8, 128, 32.8e9, 31.2e9, _qwen("Qwen3-32B")),
    ModelSpec("Qwen3-14B", 40, 40, 8, 128, 14.8e9, 13.2e9, _qwen("Qwen3-14B")),
    ModelSpec("Qwen3-8B", 36, 32, 8, 128, 8.2e9, 6.95e9, _qwen("Qwen3-8B")),
    ModelSpec("Qwen3-4B", 36, 32, 8, 128, 4.0e9, 3.6e9, _qwen("Qwen3-4B")),
    ModelSpec("Qwen3-1.7B", 28, 16, 8, 128, 1.7e9, 1.4e9, _qwen("Qwen3-1.7B")),
    # the paper's long-context model: Llama-2-7B architecture, KV in fp16 (its torch_dtype);
    # parameters from the config (32 x (4 x 4096^2 + 3 x 4096 x 11008) + 2 x 32000 x 4096)
    ModelSpec("LWM-Text-1M", 32, 32, 32, 128, 6.74e9, 6.48e9,
              "LWM-Text-1M config.json (LlamaForCausalLM: 32 layers, 32 heads, 32 KV heads, hidden "
              "4096, intermediate 11008, vocab 32000, max_position_embeddings 1048576, float16; "
              "huggingface.co/LargeWorldModel/LWM-Text-1M, params 13.5 GB in LWM-Text-1M-Jax)"),
)}

# -- the long-context setup (layer streaming) ------------------------------------------------------
LONG_CONTEXT: dict[str, P] = {
    "node_host_bytes": P(128 * GB, "B", f"{_PAPER}: 64-core CPU, 128 GB host memory"),
    "host_share": P(0.5, "-", "SwiftConfig layer_stream_host_gb = 0 (the default): half the free "
                    "host memory at start-up (docs/layer_stream.md); free memory taken as the "
                    "whole 128 GB"),
    "depth": P(SwiftConfig().layer_stream_depth, "layers", "SwiftConfig layer_stream_depth "
               "default: the active layer and the prefetched ones (docs/layer_stream.md)"),
    "window_tokens": P(1048576, "tokens", "LWM-Text-1M config.json max_position_embeddings"),
}

CHARS_PER_TOKEN = P(float(workload_specs.CHARS_PER_TOKEN), "chars/token",
                    "OpenAI tokenizer guidance: ~4 characters per English token")


def gpu(name: str) -> dict[str, float]:
    return {k: p.value for k, p in GPUS[name].items()}


def reserved_mem_bytes() -> float:
    """SGLang's activation/graph reserve for one TP=1 server (memory_hook.py), >= the 10 GB
    floor."""
    s = {k: p.value for k, p in SGLANG.items()}
    r = (s["reserved_mem_base"] + s["chunked_prefill_size"] * s["reserved_mem_per_token"]
         + s["reserved_mem_tp_slack"] + s["max_running_requests"] * s["reserved_mem_graph_per_bs"])
    return max(r, s["reserved_mem_floor"])


def kv_pool_bytes(gpu_name: str, model: ModelSpec) -> float:
    """KV pool of one SGLang server alone on a GPU: HBM - reserve - weights."""
    free = GPUS[gpu_name]["hbm_bytes"].value - reserved_mem_bytes() - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on {gpu_name}")
    return free


def assumptions_table() -> list[tuple[str, str, str, str]]:
    rows = []
    for g, d in GPUS.items():
        for k, p in d.items():
            rows.append((f"{g}.{k}", f"{p.value:.4g}", p.unit, p.source))
    for group in (EFFICIENCY, SGLANG, LONG_CONTEXT):
        for k, p in group.items():
            rows.append((k, f"{p.value:.4g}", p.unit, p.source))
    for m in MODELS.values():
        rows.append((m.name, f"L={m.layers} q={m.q_heads} kv={m.kv_heads} d={m.head_dim} "
                     f"P={m.params/1e9:.1f}B nonemb={m.nonembed_params/1e9:.2f}B "
                     f"KV={m.kv_bytes_per_token} B/tok", "-", m.source))
    rows.append(("chars_per_token", f"{CHARS_PER_TOKEN.value}", CHARS_PER_TOKEN.unit,
                 CHARS_PER_TOKEN.source))
    return rows
