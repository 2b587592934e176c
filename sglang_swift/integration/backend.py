"""The `swiftcache` radix cache backend that SGLang builds when --enable-swiftcache is on.

`create_swift_tree_cache` builds the one cache class, `cache.SwiftRadixCache` (radix_ext behind
SGLang's prefix-cache interface), through `build.build_cache`, with a `SwiftRuntime` when the
server lends or borrows and the host tier and L3 HiCache's options ask for. Tree configuration
comes from `SwiftConfig`; model kinds and options the tree does not handle yet fail here, at
start-up, with the fix. A hybrid sliding-window or linear model keeps SGLang's own tree and
may lend (`hybrid_donor.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..layer_stream.hooks import LAYER_STREAM_TP

logger = logging.getLogger(__name__)


# --enable-hierarchical-cache reaches the scheduler as SwiftConfig.host_tier (the launcher clears
# SGLang's own flag, so SGLang builds no HiCache tree beside ours: plugin.py). A tree cache built
# with SGLang's flag still on was not started through --enable-swiftcache.
HICACHE_DIRECT = (
    "--enable-hierarchical-cache with --radix-cache-backend swiftcache (start the server with "
    "--enable-swiftcache instead: it gives SwiftCache's tree a host tier on SGLang's host pool)")


def model_kind(ctx: Any) -> str:
    """'model type X (architectures)' of the server's model, for start-up refusals."""
    hf = getattr(getattr(ctx, "model_config", None), "hf_config", None)
    kind = getattr(hf, "model_type", None) or "unknown"
    archs = ", ".join(getattr(hf, "architectures", None) or []) or "unknown architecture"
    return f"model type {kind!r} ({archs})"


def attention_kind(ctx: Any) -> str:
    """The attention the server's model uses, as SGLang's build context and config say it."""
    hf = getattr(getattr(ctx, "model_config", None), "hf_config", None)
    for name, on in (("hybrid sliding-window", getattr(ctx, "is_hybrid_swa", False)),
                     ("hybrid SSM/linear", getattr(ctx, "is_hybrid_ssm", False)),
                     ("DSA (sparse MLA)", getattr(ctx, "is_dsa", False)),
                     ("MLA", getattr(hf, "kv_lora_rank", None) is not None)):
        if on:
            return f"{name} attention"
    return "MHA/GQA attention"


# the model kind the tree refuses, and why: a pool beside the one KV pool whose slots the tree
# holds (hybrid sliding-window and linear models: `hybrid_donor.refusals`, per role)
DSA_REFUSAL = ("DSA attention (an indexer cache beside the latent KV, which the tree does not "
               "track)")


def _identity(server_args: Any) -> tuple[str, str, bool]:
    """(model, agent id, --enable-metrics) of the server: the agent id names the model's
    directory and the port, as `ctl status` shows it."""
    model = str(getattr(server_args, "served_model_name", None) or server_args.model_path)
    agent_id = f"{model.rstrip('/').rsplit('/', 1)[-1]}-{server_args.port}"
    return model, agent_id, bool(getattr(server_args, "enable_metrics", False))


def tp_problems(ctx: Any, config: Any) -> list[str]:
    """What SwiftCache does not do yet with --tp > 1 (each named with the reason). A TP
    borrower is served (`tp_sync.py`: rank 0's agent, every rank its own shard), and so is a
    TP donor (rank 0 plans, every rank lends the same page ids of its own pool), each with a
    host tier too (every rank its own host pool, copies and reclaim rescues agreed). L3 with
    TP is refused by the launcher (`host_tier.host_tier_problems`)."""
    tp_size = getattr(ctx, "tp_size", 1) or 1
    if tp_size <= 1:
        return []
    problems = []
    if config.streams_layers:
        problems.append(LAYER_STREAM_TP.format(tp=tp_size))
    if config.borrows and attention_kind(ctx) == "MLA attention":
        problems.append(f"borrowing with --tp {tp_size} on MLA attention (every rank holds the "
                        f"same latent rows: each would keep its own copy in donor pages)")
    return problems


def host_tier_problems(params: Any, config: Any) -> list[str]:
    """A host tier copies the rows of one MHA pool (SGLang's MHA host pool) or of SGLang's
    plain MLA pool (its MLA host pool): refused, with the reason, on a pool of another kind."""
    allocator = getattr(params, "token_to_kv_pool_allocator", None)
    if not config.host_tier or allocator is None:
        return []
    from ..dataplane.pool_lease import plain_mla_pool

    pool = allocator.get_kvcache()
    if isinstance(getattr(pool, "k_buffer", None), list) or plain_mla_pool(pool):
        return []
    return [f"a host tier (--enable-hierarchical-cache) on {type(pool).__name__}: SwiftCache's "
            f"host tier copies the rows of an MHA pool or of a plain MLA pool (SGLang's MHA "
            f"and MLA host pools)"]


def create_swift_tree_cache(ctx: Any, config: Any) -> Any:
    """Factory registered as radix cache backend `swiftcache`; `ctx` is SGLang's
    TreeCacheBuildContext."""
    from .hybrid_donor import is_hybrid

    if is_hybrid(ctx) and not getattr(ctx, "is_dsa", False):
        return _hybrid_tree_cache(ctx, config)
    unsupported = [DSA_REFUSAL] if getattr(ctx, "is_dsa", False) else []
    if getattr(ctx, "enable_hierarchical_cache", False):
        unsupported.append(HICACHE_DIRECT)
    params = ctx.params
    if (getattr(params, "eviction_policy", "lru") or "lru").lower() != "lru":
        unsupported.append(f"--radix-eviction-policy {params.eviction_policy} (SwiftCache orders "
                           f"evictions itself: use --swiftcache-eviction-policy)")
    if getattr(params, "enable_kv_cache_events", False):
        unsupported.append("KV cache events (not emitted by SwiftCache's tree yet)")
    unsupported += tp_problems(ctx, config)
    unsupported += host_tier_problems(params, config)
    if unsupported:
        _refuse(ctx, unsupported)
    from .build import build_cache
    from .tp_sync import tp_group_of

    tp = tp_group_of(ctx)  # None with one rank
    model, agent_id, metrics = _identity(ctx.server_args)
    host_kv = None
    if config.host_tier:  # with TP: this rank's host pool, its copies agreed between the ranks
        from .host_tier import HostKV

        host_kv = HostKV.from_server_args(params.token_to_kv_pool_allocator.get_kvcache(),
                                          ctx.server_args, params.page_size, tp=tp)
    storage = None
    if host_kv is not None and getattr(ctx.server_args, "hicache_storage_backend", None):
        from .storage_tier import StorageTier

        storage = StorageTier.build(host_kv, ctx.server_args, page_size=params.page_size,
                                    model_name=model)
        if storage is not None and config.borrows:
            # a reclaim's rows the host tier has no room for go on to L3 through these slots
            host_kv.reserve_spill()
    hosted = host_kv is not None
    tree_config = config.tree_config(params.page_size, host_kv.capacity if hosted else 0,
                                     write_through=hosted and host_kv.write_through,
                                     # donor rows reach host memory by CPU copies
                                     donor_to_host=hosted and host_kv.device.type == "cpu",
                                     l3_below=hosted and host_kv.spill_slots is not None)
    from ..dataplane import UnshareablePool

    try:
        cache = build_cache(params, tree_config, config, model=model, agent_id=agent_id,
                            tp_worker=ctx.tp_worker, host_kv=host_kv, storage=storage,
                            enable_metrics=metrics, tp=tp)
    except UnshareablePool as exc:  # a server that lends or borrows shares its pool's pages
        raise ValueError(f"SwiftCache cannot lend or borrow KV memory for {model_kind(ctx)} "
                         f"with {attention_kind(ctx)}: {exc}") from None
    logger.info("SwiftCache: radix_ext tree (page_size=%d, eviction=%s, host tier %d tokens, "
                "runtime %s)", params.page_size, cache.tree_config.eviction,
                cache.tree_config.host_capacity, "on" if cache.runtime is not None else "off")
    return cache


def _refuse(ctx: Any, unsupported: list[str]) -> None:
    raise ValueError(f"SwiftCache's tree does not support: {'; '.join(unsupported)} "
                     f"({model_kind(ctx)}, {attention_kind(ctx)}). Drop those options or "
                     f"run without --enable-swiftcache.")


def _hybrid_tree_cache(ctx: Any, config: Any) -> Any:
    """A hybrid sliding-window or linear model: SGLang's own tree for it, lending pages of its
    full-attention pool when the server lends (`hybrid_donor.py`); what it cannot do refused."""
    from ..dataplane import UnshareablePool
    from .hybrid_donor import create_lending_hybrid_cache, refusals

    unsupported = refusals(ctx, config)
    if getattr(ctx, "enable_hierarchical_cache", False):
        unsupported.append(HICACHE_DIRECT)
    if unsupported:
        _refuse(ctx, unsupported)
    model, agent_id, metrics = _identity(ctx.server_args)
    try:
        return create_lending_hybrid_cache(ctx, config, model=model, agent_id=agent_id,
                                           enable_metrics=metrics)
    except UnshareablePool as exc:
        raise ValueError(f"SwiftCache cannot lend KV memory for {model_kind(ctx)} with "
                         f"{attention_kind(ctx)}: {exc}") from None
