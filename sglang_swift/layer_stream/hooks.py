"""The layer stream cache's attachment to SGLang: six hooks, all no-ops unless the server's
SwiftConfig streams layers (`--swiftcache-layer-stream host`), read at call time.

- `check_server_args` (called from the plugin's `ServerArgs.from_cli_args` hook): refuses what
  cannot stream (speculative decoding, PD disaggregation, attention backends that read the
  pool's buffers without its getters, HiCache, decode context parallelism) and turns CUDA graphs
  off, since a replayed graph skips the per-layer loads;
- AROUND `KVCacheConfigurator.config_from_budget`: the local memory budget SGLang profiled
  holds `depth` staging layers instead of L (and, with resident rows, a fraction f of it L rows
  per token), so it is given f + (1 - f) L/depth times the tokens, capped by the host memory the
  streamed KV may use (--max-total-tokens still caps the result);
- AROUND `KVCacheConfigurator._build_mha_kv_pool`: SGLang builds `LayerStreamKVPool` (its own
  MHA pool, subclassed) where it would build `MHATokenToKVPool`;
- AFTER `KVCacheConfigurator._build_token_to_kv_pool_allocator`: with resident rows, the
  allocator SGLang built hands out resident slots first (`allocator.py`);
- AROUND `ModelRunner.forward`: opens and closes the pool's per-forward stream (which slots the
  batch reads is known here); with SWIFTCACHE_FORWARD_TRACE set (benchmarks), it also appends
  each forward's mode, size, wall and thread CPU time to that file, streamed or not;
- AFTER `managers.utils.validate_input_length`: a prompt longer than the streamed pool is
  refused by SGLang (HTTP 400) with a message that also names the streaming limits.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_FROM_BUDGET = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                      "config_from_budget")
BUILD_MHA_POOL = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                  "_build_mha_kv_pool")
BUILD_ALLOCATOR = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                   "_build_token_to_kv_pool_allocator")
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
VALIDATE_INPUT = "sglang.srt.managers.utils.validate_input_length"
HOOK_TARGETS = (CONFIG_FROM_BUDGET, BUILD_MHA_POOL, BUILD_ALLOCATOR, MODEL_FORWARD,
                VALIDATE_INPUT)
# Attention backends that read k_buffer / v_buffer directly instead of through the getters.
DIRECT_READ_BACKENDS = ("trtllm_mha", "aiter", "wave", "ascend")
GIB = 1 << 30

# A file that gets one JSON line per forward pass of this server (streamed or not), for
# benchmarks: thread CPU time is what the forward cost, whatever else shares the cores.
FORWARD_TRACE_ENV = "SWIFTCACHE_FORWARD_TRACE"

_limits: dict[str, int] = {}  # this process's streamed pool: tokens, depth, layers
_forward_trace: str | None = None  # set at registration from FORWARD_TRACE_ENV


def stream_config() -> Any:
    """This server's SwiftConfig if it streams layers, else None."""
    from ..config import CONFIG_ENV, SwiftConfig

    text = os.environ.get(CONFIG_ENV)
    if not text:
        return None
    config = SwiftConfig.from_json(text)
    return config if config.enabled and config.streams_layers else None


def host_limit_bytes(config: Any) -> int:
    """Host memory the streamed KV may use: the option, or half of what is free now."""
    if config.layer_stream_host_gb > 0:
        return int(config.layer_stream_host_gb * GIB)
    import psutil

    return psutil.virtual_memory().available // 2


# ---- start-up checks ----------------------------------------------------------------------------
def check_server_args(server_args: Any, config: Any) -> None:
    """Refuse options layer streaming cannot serve (SystemExit naming the fix); turn off CUDA
    graphs. Called once in the launcher, before SGLang resolves the arguments."""
    if not config.streams_layers:
        return
    refused = []
    if getattr(server_args, "speculative_algorithm", None):
        refused.append("--speculative-algorithm (the draft model's pool is not streamed)")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        refused.append("--disaggregation-mode (PD transfers read the pool's buffers directly)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        refused.append("--enable-hierarchical-cache (its host pool copies every layer of the "
                       "local buffers)")
    if (getattr(server_args, "dcp_size", 1) or 1) > 1:
        refused.append("--dcp-size > 1")
    for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(server_args, name, None)
        if backend in DIRECT_READ_BACKENDS:
            refused.append(f"--{name.replace('_', '-')} {backend} (it reads the KV buffers "
                           f"without the pool's getters; use flashinfer, triton, fa3 or "
                           f"torch_native)")
    for name in ("cuda_graph_backend_decode", "cuda_graph_backend_prefill"):
        if getattr(server_args, name, None) not in (None, "disabled"):
            refused.append(f"--{name.replace('_', '-')} {getattr(server_args, name)} (a "
                           f"replayed graph skips the per-layer loads)")
    if refused:
        raise SystemExit("--swiftcache-layer-stream cannot be combined with: "
                         + "; ".join(refused) + ". Drop those options or the layer stream.")
    server_args.disable_decode_cuda_graph = True
    server_args.disable_prefill_cuda_graph = True


# ---- hooks --------------------------------------------------------------------------------------
def _cell_bytes(configurator: Any) -> int | None:
    """SGLang's KV bytes per token (all layers) for this configurator, if it says."""
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    return getattr(create_memory_pool_configurator(configurator), "_cell_size", None) or None


def around_config_from_budget(orig, configurator, budget_bytes, *args, **kwargs):
    config = stream_config()
    if config is None or configurator.is_draft_worker:
        return orig(configurator, budget_bytes, *args, **kwargs)
    from .pool import StreamSettings

    layers = configurator.layer_info.num_effective_layers
    depth = min(config.layer_stream_depth, layers)
    settings = StreamSettings(depth=depth, resident_fraction=config.layer_stream_resident_fraction)
    scaled = int(budget_bytes * settings.tokens_per_local_token(layers))
    cell = _cell_bytes(configurator)
    if cell:
        host_cap = host_limit_bytes(config) // cell
        cap = kwargs.get("cap_tokens")
        kwargs["cap_tokens"] = host_cap if cap is None else min(cap, host_cap)
    result = orig(configurator, scaled, *args, **kwargs)
    logger.info("SwiftCache layer streaming: local KV budget %.2f GiB holds %d of %d layers "
                "(%.0f%% of it resident rows) -> %d tokens of streamable context",
                budget_bytes / GIB, depth, layers, 100 * settings.resident_fraction,
                result.max_total_num_tokens)
    return result


def around_build_mha_kv_pool(orig, configurator, *args, **kwargs):
    config = stream_config()
    if config is None or configurator.is_draft_worker:
        return orig(configurator, *args, **kwargs)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from .pool import LayerStreamKVPool, StreamSettings

    given = kwargs.get("mha_pool_class")
    problems = []
    if given is not MHATokenToKVPool:
        problems.append(f"SGLang chose the KV pool class {getattr(given, '__name__', given)} "
                        f"(page-major layout or a platform pool)")
    if kwargs.get("quant_method") is not None or configurator.kv_cache_dtype_str == "mxfp8":
        problems.append("a block-scaled (fp4 / mxfp8) KV cache dtype")
    if configurator.post_capture_kv_active:
        problems.append("post-capture KV resizing")
    if getattr(configurator, "kv_shard_rank", None) is not None:
        problems.append("--enable-kv-cache-sharding")
    if problems:
        raise ValueError("SwiftCache layer streaming cannot stream this server's KV pool: "
                         + "; ".join(problems) + ". Drop --swiftcache-layer-stream or those "
                         "options.")
    kwargs["mha_pool_class"] = LayerStreamKVPool.configured(
        StreamSettings(depth=config.layer_stream_depth, tier=config.layer_stream,
                       resident_fraction=config.layer_stream_resident_fraction))
    pool = orig(configurator, *args, **kwargs)
    limit = host_limit_bytes(config)
    if pool.layer_store.nbytes > limit:
        raise ValueError(
            f"SwiftCache layer streaming: the KV of {pool.size} tokens over {pool.layer_num} "
            f"layers needs {pool.layer_store.nbytes / GIB:.2f} GiB of host memory, more than the "
            f"{limit / GIB:.2f} GiB allowed; lower --max-total-tokens or raise "
            f"--swiftcache-layer-stream-host-gb")
    _limits.update(tokens=pool.size, depth=pool.settings.depth, layers=pool.layer_num,
                   where=pool.layer_store.where)
    return pool


def after_build_allocator(allocator, configurator, *args, **kwargs):
    """A streamed pool with resident rows: its allocator hands out resident slots first."""
    pool = kwargs.get("token_to_kv_pool")
    resident = getattr(pool, "resident_rows", 0)
    if not resident or getattr(configurator, "is_draft_worker", False):
        return None
    from .allocator import prefer_resident

    return prefer_resident(allocator)


def around_model_forward(orig, runner, forward_batch, *args, **kwargs):
    pool = getattr(runner, "token_to_kv_pool", None)
    begin = getattr(pool, "begin_layer_stream", None)
    if begin is None and _forward_trace is None:
        return orig(runner, forward_batch, *args, **kwargs)
    wall, cpu = time.perf_counter(), time.thread_time()
    faults = _minor_faults() if _forward_trace is not None else 0
    traced_copies = begin is not None and _forward_trace is not None
    before = dict(pool.stream_stats()) if traced_copies else None
    if begin is not None:
        begin(forward_batch, runner.req_to_token_pool.req_to_token)
    try:
        return orig(runner, forward_batch, *args, **kwargs)
    finally:
        if begin is not None:
            pool.end_layer_stream()
        if _forward_trace is not None:
            copies = {}
            if traced_copies:
                after = pool.stream_stats()
                copies = {k: after[k] - before[k] for k in ("copy_s", "rows_loaded", "rows_saved")}
            copies["minor_faults"] = _minor_faults() - faults
            _trace_forward(forward_batch, begin is not None, time.perf_counter() - wall,
                           time.thread_time() - cpu, copies)


def _minor_faults() -> int:
    """Minor page faults of the calling thread so far (first touches of memory)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _trace_forward(forward_batch, streamed: bool, wall_s: float, cpu_s: float,
                   copies: dict) -> None:
    """One JSON line per forward (benchmarks, tests): its mode, tokens, wall and thread CPU time,
    and for a streamed pool the thread CPU time of the layer copies within it and the rows
    (token-layers) they loaded from and wrote through to the store; the thread's minor page
    faults in it, and in how many runs of consecutive slots its new tokens' KV was written
    (`slot_runs`: 1 when contiguous, `new_tokens` when no two are adjacent)."""
    seq = forward_batch.seq_lens_cpu
    loc = forward_batch.out_cache_loc
    slot_runs = int((loc[1:] - loc[:-1] != 1).sum()) + 1 if loc.numel() else 0
    record = {"mode": forward_batch.forward_mode.name, "bs": int(forward_batch.batch_size),
              "new_tokens": int(forward_batch.out_cache_loc.numel()),
              "seq_tokens": int(seq.sum()) if seq is not None else None, "streamed": streamed,
              "wall_ms": wall_s * 1e3, "cpu_ms": cpu_s * 1e3,
              "copy_ms": copies.get("copy_s", 0.0) * 1e3,
              "rows_loaded": copies.get("rows_loaded", 0),
              "rows_saved": copies.get("rows_saved", 0),
              "minor_faults": copies.get("minor_faults", 0), "slot_runs": slot_runs}
    with open(_forward_trace, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def after_validate_input_length(result, req, max_req_input_len, *args, **kwargs):
    """SGLang's refusal of a too-long prompt, with the streaming limits beside it."""
    if result is None or not _limits:
        return None
    return (f"{result} SwiftCache layer streaming holds at most {_limits['tokens']} tokens of "
            f"context per server here (the KV of {_limits['depth']} of {_limits['layers']} "
            f"layers local, every layer in {_limits['where']}); a longer context needs a larger "
            f"--max-total-tokens and --swiftcache-layer-stream-host-gb.")


def register_layer_stream_hooks(registry: Any, hook_type: Any) -> None:
    """Register the hooks (each does nothing unless this server streams layers, or, for the
    forward hook, a forward trace was asked for)."""
    global _forward_trace
    _forward_trace = os.environ.get(FORWARD_TRACE_ENV) or None
    registry.register(CONFIG_FROM_BUDGET, around_config_from_budget, hook_type.AROUND)
    registry.register(BUILD_MHA_POOL, around_build_mha_kv_pool, hook_type.AROUND)
    registry.register(BUILD_ALLOCATOR, after_build_allocator, hook_type.AFTER)
    registry.register(MODEL_FORWARD, around_model_forward, hook_type.AROUND)
    registry.register(VALIDATE_INPUT, after_validate_input_length, hook_type.AFTER)
