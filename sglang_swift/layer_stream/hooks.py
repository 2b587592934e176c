"""The layer stream cache's attachment to SGLang: the bodies of its hooks, which the plugin
registers only in a server whose SwiftConfig streams layers (`--swiftcache-layer-stream host` or
`donor`) on the targets listed in `integration/touchpoints.py`; each still checks the config at
call time, so a hook never acts for a server that does not stream.

- `check_server_args` (called from the plugin's `ServerArgs.from_cli_args` hook): refuses what
  cannot stream (speculative decoding, PD disaggregation, attention backends that read the
  pool's buffers without its getters, HiCache, decode context parallelism) and turns CUDA graphs
  off, since a replayed graph skips the per-layer loads;
- AROUND `KVCacheConfigurator.config_from_budget`: the local memory budget SGLang profiled
  holds `depth` staging layers instead of L (and, with resident rows, a fraction f of it L rows
  per token), so it is given f + (1 - f) L/depth times the tokens (at depth 0, where only the
  fraction f of the tokens is local, 1/f times), capped by the host memory the
  streamed KV may use (--max-total-tokens still caps the result);
- AROUND `KVCacheConfigurator._build_mha_kv_pool`: SGLang builds `LayerStreamKVPool` (its own
  MHA pool, subclassed; `MappedKVPool` at depth 0) where it would build `MHATokenToKVPool`;
- AFTER `KVCacheConfigurator._build_token_to_kv_pool_allocator`: with resident rows, the
  allocator SGLang built hands out resident slots first (`allocator.py`);
- AROUND `ModelRunner.forward`: opens and closes the pool's per-forward stream (which slots the
  batch reads is known here);
- AFTER `managers.utils.validate_input_length`: a prompt longer than the streamed pool is
  refused by SGLang (HTTP 400) with a message that also names the streaming limits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# The layer stream cache keeps per-rank decisions (which rows are resident, when a layer is
# fetched, a fetch that failed) that no collective agrees on between the ranks.
LAYER_STREAM_TP = (
    "--swiftcache-layer-stream with --tp {tp} (each rank would stream its own shard with its own "
    "fetch decisions and faults, not agreed between the ranks, so their outputs could differ; "
    "run the layer stream cache with --tp 1)")

# Attention backends that read k_buffer / v_buffer directly instead of through the getters.
DIRECT_READ_BACKENDS = ("trtllm_mha", "aiter", "wave", "ascend")
GIB = 1 << 30

_limits: dict[str, int] = {}  # this process's streamed pool: tokens, depth, layers


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
    tp_size = getattr(server_args, "tp_size", 1) or 1
    if tp_size > 1:
        refused.append(LAYER_STREAM_TP.format(tp=tp_size).split(" with ", 1)[1])
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
    """SGLang's KV bytes per token (all layers) for this configurator, if it says (a private
    attribute: `touchpoints.CELL_SIZE`)."""
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    return getattr(create_memory_pool_configurator(configurator), "_cell_size", None) or None


def around_config_from_budget(orig, configurator, budget_bytes, *args, **kwargs):
    config = stream_config()
    if config is None or configurator.is_draft_worker:
        return orig(configurator, budget_bytes, *args, **kwargs)
    if getattr(configurator, "use_mla_backend", False):
        raise ValueError("SwiftCache layer streaming streams the K and V rows of an MHA pool; "
                         "this server's model has MLA attention (one latent buffer per layer, "
                         "SGLang's MLATokenToKVPool), which is not streamed. Drop "
                         "--swiftcache-layer-stream.")
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
    if depth == 0:
        logger.info("SwiftCache layer streaming: local KV budget %.2f GiB holds every layer of "
                    "%.0f%% of the tokens; the rest read in place -> %d tokens of context",
                    budget_bytes / GIB, 100 * settings.resident_fraction,
                    result.max_total_num_tokens)
        return result
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
    settings = StreamSettings(depth=config.layer_stream_depth, tier=config.layer_stream,
                              resident_fraction=config.layer_stream_resident_fraction)
    if settings.depth == 0:  # read in place: nothing staged
        from .mapped import MappedKVPool

        kwargs["mha_pool_class"] = MappedKVPool.configured(settings)
    else:
        kwargs["mha_pool_class"] = LayerStreamKVPool.configured(settings)
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
    """Open the streamed pool's per-forward stream before the forward and close it after, also
    when the forward raised (a pool that does not stream is passed through)."""
    pool = getattr(runner, "token_to_kv_pool", None)
    begin = getattr(pool, "begin_layer_stream", None)
    if begin is None:
        return orig(runner, forward_batch, *args, **kwargs)
    begin(forward_batch, runner.req_to_token_pool.req_to_token)
    try:
        return orig(runner, forward_batch, *args, **kwargs)
    finally:
        pool.end_layer_stream()


def after_validate_input_length(result, req, max_req_input_len, *args, **kwargs):
    """SGLang's refusal of a too-long prompt, with the streaming limits beside it."""
    if result is None or not _limits:
        return None
    return (f"{result} SwiftCache layer streaming holds at most {_limits['tokens']} tokens of "
            f"context per server here (the KV of {_limits['depth']} of {_limits['layers']} "
            f"layers local, every layer in {_limits['where']}); a longer context needs a larger "
            f"--max-total-tokens and --swiftcache-layer-stream-host-gb.")
