"""Every number the simulator uses, with where it comes from. Nothing here is fitted to a result.

`P(value, unit, source)` keeps the citation next to the value; `assumptions_table()` renders all of
them for docs/simulation.md. Workload shapes (rates, think times, tool-result sizes) are stated
distributions of the scenario, not hardware parameters; they are in sglang_swift/workloads/specs.py
and, as chosen for the simulated node, in scenario.py.
"""

from __future__ import annotations

from dataclasses import dataclass

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
_LANDSCAPE = "shared/notes/landscape.md"
GPUS: dict[str, dict[str, P]] = {
    "H20": {
        "hbm_bytes": P(96 * GB, "B", "H20 96 GB HBM3 (willitrunai.com/gpus/h20-96gb; paper testbed 4x H20 96 GB)"),
        "hbm_bw": P(4.0e12, "B/s", "H20 4.0 TB/s (willitrunai.com/gpus/h20-96gb)"),
        "bf16_flops": P(148e12, "FLOP/s", "H20 148 TFLOPS FP16/BF16 dense (willitrunai.com/gpus/h20-96gb)"),
        "nvlink_bw_dir": P(200 * GB, "B/s", "paper testbed: NVLink 400 GB/s bidirectional -> 200 GB/s per direction (paper.md)"),
        "pcie_bw_dir": P(32 * GB, "B/s", "paper: PCIe quoted as 32 GB/s (paper.md)"),
    },
    "H100": {
        "hbm_bytes": P(80 * GB, "B", "H100 SXM 80 GB (landscape.md 6.1)"),
        "hbm_bw": P(3.35e12, "B/s", "H100 SXM 3.35 TB/s (landscape.md 6.1)"),
        "bf16_flops": P(989e12, "FLOP/s", "H100 SXM 989 TFLOPS BF16 dense (NVIDIA H100 datasheet)"),
        "nvlink_bw_dir": P(370 * GB, "B/s", "measured P2P write ~371-377 GB/s per pair, HGX H100 (NVIDIA/nccl#1264; landscape 6.1)"),
        "pcie_bw_dir": P(55.6 * GB, "B/s", "nvbandwidth H2D copy-engine 55.6 GB/s, PCIe Gen5 x16 (landscape 6.1)"),
    },
    "H200": {
        "hbm_bytes": P(141 * GB, "B", "H200 141 GB HBM3e (landscape.md 6.1)"),
        "hbm_bw": P(4.8e12, "B/s", "H200 4.8 TB/s (landscape.md 6.1)"),
        "bf16_flops": P(989e12, "FLOP/s", "H200 989 TFLOPS BF16 dense, same die as H100 (NVIDIA H200 datasheet)"),
        "nvlink_bw_dir": P(370 * GB, "B/s", "as H100: NVLink 4 via NVSwitch, measured ~371-377 GB/s (nccl#1264)"),
        "pcie_bw_dir": P(55.6 * GB, "B/s", "as H100: nvbandwidth H2D 55.6 GB/s (landscape 6.1)"),
    },
}

EFFICIENCY: dict[str, P] = {
    "compute": P(0.6, "-", "~600 of 989 TFLOP/s effective BF16 assumed in landscape.md 6.3 (ratio 0.61)"),
    "hbm": P(0.7, "-", "kernels reach 60-85% of HBM peak (landscape.md 6.1); lower half taken for KV reads"),
}

# -- SGLang serving defaults (0.5.23, sglang/srt/arg_groups/memory_hook.py) ---------------------------
SGLANG: dict[str, P] = {
    "chunked_prefill_size": P(8192, "tokens", "memory_hook.py: 8192 for 60-160 GB GPUs (H20/H100/H200)"),
    "max_running_requests": P(256, "reqs", "memory_hook.py: decode cuda-graph max_bs 256 for tp<4"),
    "reserved_mem_base": P(512 * MiB, "B", "memory_hook.py: reserved_mem = 512 MB + 1.5 MB x activation tokens"),
    "reserved_mem_per_token": P(1.5 * MiB, "B/token", "memory_hook.py: activation_tokens * 1.5 MB"),
    "reserved_mem_graph_per_bs": P(2 * MiB, "B/req", "memory_hook.py reserve_for_graph_mb: max_bs * 2 MB"),
    "reserved_mem_tp_slack": P(128 * MiB, "B", "memory_hook.py: tp*pp/8 * 1024 MB (tp=1)"),
    "reserved_mem_floor": P(10 * GiB, "B", "memory_hook.py: reserved >= 10 GB when GPU > 60 GB"),
    "page_size": P(64, "tokens", "HiCache recommended --page-size 64 (landscape.md 2.1); one radix key = one page"),
    "hicache_ratio": P(2, "x device", "HiCache --hicache-ratio 2 (minimum), landscape.md 2.1"),
}

# -- models: Qwen3 configs (HF model cards / configs; landscape.md 6.2) -----------------------------
_QWEN = "Qwen3 model card / HF config (landscape.md 6.2)"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float  # all parameters (weights bytes = 2 x params in BF16)
    nonembed_params: float  # matmul FLOPs per token = 2 x these
    source: str = _QWEN

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params


MODELS: dict[str, ModelSpec] = {
    "Qwen3-32B": ModelSpec("Qwen3-32B", 64, 64, 8, 128, 32.8e9, 31.2e9),
    "Qwen3-14B": ModelSpec("Qwen3-14B", 40, 40, 8, 128, 14.8e9, 13.2e9),
    "Qwen3-8B": ModelSpec("Qwen3-8B", 36, 32, 8, 128, 8.2e9, 6.95e9),
    "Qwen3-4B": ModelSpec("Qwen3-4B", 36, 32, 8, 128, 4.0e9, 3.6e9),
    "Qwen3-1.7B": ModelSpec("Qwen3-1.7B", 28, 16, 8, 128, 1.7e9, 1.4e9),
}

CHARS_PER_TOKEN = P(float(workload_specs.CHARS_PER_TOKEN), "chars/token",
                    "OpenAI tokenizer guidance: ~4 characters per English token")


def gpu(name: str) -> dict[str, float]:
    return {k: p.value for k, p in GPUS[name].items()}


def reserved_mem_bytes() -> float:
    """SGLang's activation/graph reserve for one TP=1 server (memory_hook.py), >= the 10 GB floor."""
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
    for group in (EFFICIENCY, SGLANG):
        for k, p in group.items():
            rows.append((k, f"{p.value:.4g}", p.unit, p.source))
    for m in MODELS.values():
        rows.append((m.name, f"L={m.layers} q={m.q_heads} kv={m.kv_heads} d={m.head_dim} "
                     f"P={m.params/1e9:.1f}B nonemb={m.nonembed_params/1e9:.2f}B "
                     f"KV={m.kv_bytes_per_token} B/tok", "-", m.source))
    rows.append(("chars_per_token", f"{CHARS_PER_TOKEN.value}", CHARS_PER_TOKEN.unit, CHARS_PER_TOKEN.source))
    return rows
