"""The layer stream hooks act only for a server whose SwiftConfig streams layers: its options
live in the 'layer streaming' CLI group, its pool is sized L/depth larger within the host cap,
built as LayerStreamKVPool, bracketed per forward, and what cannot stream is refused naming the
fix."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from sglang_swift.config import CONFIG_ENV, SwiftConfig
from sglang_swift.layer_stream import hooks

STREAMING = SwiftConfig(enabled=True, layer_stream="host", layer_stream_host_gb=1.0)


@pytest.fixture
def streaming(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, STREAMING.to_json())
    monkeypatch.setattr(hooks, "_limits", {})
    return STREAMING


def _configurator(**kw):
    base = dict(is_draft_worker=False, layer_info=types.SimpleNamespace(num_effective_layers=8),
                kv_cache_dtype_str="auto", post_capture_kv_active=False, kv_shard_rank=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_options_sit_in_the_layer_streaming_group_with_working_defaults():
    """--swiftcache-layer-stream, -depth, -resident-fraction and -host-gb are in the group titled
    'layer streaming'; left out, the server does not stream (off), depth is 2 and half the local
    KV memory is resident rows. Depth 1 is refused; depth 0 only reads donor pages in place, and
    with a resident fraction (the local part of the tokens)."""
    from sglang_swift.integration.plugin import add_swiftcache_args, config_from_namespace

    parser = argparse.ArgumentParser()
    add_swiftcache_args(parser)
    group = next(g for g in parser._action_groups if g.title == "layer streaming")
    flags = {o for a in group._group_actions for o in a.option_strings}
    assert flags == {"--swiftcache-layer-stream", "--swiftcache-layer-stream-depth",
                     "--swiftcache-layer-stream-resident-fraction",
                     "--swiftcache-layer-stream-host-gb"}
    default = config_from_namespace(parser.parse_args(["--enable-swiftcache"]))
    assert not default.streams_layers and default.layer_stream_depth == 2
    assert default.layer_stream_resident_fraction == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--swiftcache-layer-stream-resident-fraction", "1"])
    on = config_from_namespace(parser.parse_args(
        ["--enable-swiftcache", "--swiftcache-layer-stream", "host"]))
    assert on.streams_layers
    with pytest.raises(SystemExit):
        parser.parse_args(["--swiftcache-layer-stream-depth", "-1"])
    with pytest.raises(ValueError, match="depth 1 stages no layer"):
        SwiftConfig(enabled=True, layer_stream="host", layer_stream_depth=1)
    for tier, fraction in (("host", 0.5), ("donor", 0.0)):  # depth 0 reads donor pages in place
        with pytest.raises(ValueError, match="depth 0 reads donor pages in place"):
            SwiftConfig(enabled=True, layer_stream=tier, layer_stream_depth=0,
                        layer_stream_resident_fraction=fraction)
    assert SwiftConfig(enabled=True, layer_stream="donor", layer_stream_depth=0,
                       layer_stream_resident_fraction=0.25).streams_from_donor


def test_streaming_with_lending_or_borrowing_is_refused():
    """A streamed pool's pages are staging, not lendable pages, and its tree has no donor tier:
    the config refuses lending and tree borrowing with either tier, naming the donor mode."""
    for tier in ("host", "donor"):
        with pytest.raises(ValueError, match="layer-stream cannot be combined.*stream donor"):
            SwiftConfig(enabled=True, layer_stream=tier, lend_fraction=0.5)
        with pytest.raises(ValueError, match="layer-stream cannot be combined"):
            SwiftConfig(enabled=True, layer_stream=tier, max_borrow_blocks=4)


def test_streaming_from_donors_as_a_pure_donor_is_refused():
    """A server that streams from donor memory borrows; role donor only lends: refused with a
    message naming both options, while roles auto and borrower are accepted."""
    with pytest.raises(ValueError, match="layer-stream donor.*role donor"):
        SwiftConfig.parse(enabled=True, layer_stream="donor", role="donor")
    for role in ("auto", "borrower"):
        assert SwiftConfig.parse(enabled=True, layer_stream="donor", role=role).streams_from_donor


def test_streaming_from_donors_runs_the_runtime_without_a_donor_tier():
    """`--swiftcache-layer-stream donor` borrows for the store: the server runs a runtime
    (uses_donation) while its tree has no donor tier; host mode runs none."""
    donor = SwiftConfig.parse(enabled=True, layer_stream="donor")
    assert donor.streams_from_donor and donor.uses_donation and not donor.borrows
    assert not donor.tree_config(1).donor
    host = SwiftConfig.parse(enabled=True, layer_stream="host")
    assert not host.streams_from_donor and not host.uses_donation


def test_server_args_that_cannot_stream_are_refused_and_graphs_turned_off():
    """Speculative decoding and backends that bypass the getters stop the launch naming the
    option; otherwise CUDA graphs (which skip the per-layer loads) are turned off."""
    args = types.SimpleNamespace(attention_backend="trtllm_mha", speculative_algorithm="EAGLE")
    with pytest.raises(SystemExit, match="--speculative-algorithm.*--attention-backend trtllm_mha"):
        hooks.check_server_args(args, STREAMING)
    ok = types.SimpleNamespace(attention_backend="torch_native")
    hooks.check_server_args(ok, STREAMING)
    assert ok.disable_decode_cuda_graph and ok.disable_prefill_cuda_graph
    stock = types.SimpleNamespace(attention_backend="trtllm_mha")
    hooks.check_server_args(stock, SwiftConfig(enabled=True))
    assert not hasattr(stock, "disable_decode_cuda_graph")


def test_budget_holds_l_over_depth_more_tokens_within_the_host_cap(streaming, monkeypatch):
    """The profiled local budget buys depth staging layers for the streamed part and L layers for
    the resident fraction f, so SGLang is given f + (1 - f) L/depth times the bytes (L/depth with
    no resident rows), with tokens capped to the host memory the store may use."""
    monkeypatch.setattr(hooks, "_cell_bytes", lambda configurator: 1024)
    seen = {}

    def orig(configurator, budget, *, cap_tokens=None):
        seen.update(budget=budget, cap=cap_tokens)
        return types.SimpleNamespace(max_total_num_tokens=min(budget // 1024, cap_tokens))

    hooks.around_config_from_budget(orig, _configurator(), 1000 * 1024)
    assert seen == {"budget": 2500 * 1024, "cap": (1 << 30) // 1024}  # 0.5 + 0.5 * 8 / 2
    hooks.around_config_from_budget(orig, _configurator(), 1000 * 1024, cap_tokens=7)
    assert seen["cap"] == 7
    all_streamed = SwiftConfig.parse(enabled=True, layer_stream="host", layer_stream_host_gb=1.0,
                                     layer_stream_resident_fraction=0.0)
    monkeypatch.setenv(CONFIG_ENV, all_streamed.to_json())
    hooks.around_config_from_budget(orig, _configurator(), 1000 * 1024)
    assert seen["budget"] == 4000 * 1024


def test_a_pool_with_resident_rows_gets_a_resident_first_allocator():
    """The allocator SGLang built for a pool with resident rows is made to sort its free list;
    for any other pool the hook leaves SGLang's result alone."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(32, torch.float32, "cpu", None, need_sort=False)
    plain = types.SimpleNamespace(resident_rows=0)
    assert hooks.after_build_allocator(alloc, _configurator(), token_to_kv_pool=plain) is None
    pool = types.SimpleNamespace(resident_rows=8)
    made = hooks.after_build_allocator(alloc, _configurator(), token_to_kv_pool=pool)
    assert made is alloc and alloc.need_sort and type(alloc).__name__.startswith("ResidentFirst")


def test_stock_servers_and_drafts_are_untouched(monkeypatch):
    """Without streaming (or for a draft worker) every hook calls SGLang as it is."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    calls = []
    orig = lambda *a, **kw: calls.append((a, kw)) or "stock"  # noqa: E731
    assert hooks.around_config_from_budget(orig, _configurator(), 5) == "stock"
    assert hooks.around_build_mha_kv_pool(orig, _configurator(), mha_pool_class=int) == "stock"
    monkeypatch.setenv(CONFIG_ENV, STREAMING.to_json())
    assert hooks.around_config_from_budget(orig, _configurator(is_draft_worker=True), 5) == "stock"
    assert calls[0] == ((_configurator(), 5), {})


def _build(pool_class, **kw):
    args = dict(size=50, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=8,
                device="cpu", enable_memory_saver=False)
    return pool_class(**args)


def test_sglang_builds_the_streamed_pool_in_place_of_its_own(streaming):
    """The pool class SGLang passes is swapped for LayerStreamKVPool with the configured depth;
    its limits then reach the too-long-prompt message."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_swift.layer_stream.pool import LayerStreamKVPool

    pool = hooks.around_build_mha_kv_pool(
        lambda c, *, mha_pool_class, quant_method=None, max_total_num_tokens:
        _build(mha_pool_class),
        _configurator(), max_total_num_tokens=50, mha_pool_class=MHATokenToKVPool)
    assert isinstance(pool, LayerStreamKVPool) and pool.settings.depth == 2
    message = hooks.after_validate_input_length("Input length (90 tokens) exceeds 44.", None, 44)
    assert "at most 50 tokens" in message and "2 of 8 layers" in message


def test_pools_that_cannot_stream_or_exceed_host_memory_are_refused(streaming, monkeypatch):
    """Another pool class or a quantized KV stops start-up naming it; a store beyond the host
    limit names --swiftcache-layer-stream-host-gb."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    build = lambda c, *, mha_pool_class, **kw: _build(mha_pool_class)  # noqa: E731
    with pytest.raises(ValueError, match="pool class int"):
        hooks.around_build_mha_kv_pool(build, _configurator(), mha_pool_class=int)
    with pytest.raises(ValueError, match="fp4 / mxfp8"):
        hooks.around_build_mha_kv_pool(build, _configurator(kv_cache_dtype_str="mxfp8"),
                                       mha_pool_class=MHATokenToKVPool)
    monkeypatch.setattr(hooks, "host_limit_bytes", lambda config: 1000)
    with pytest.raises(ValueError, match="--swiftcache-layer-stream-host-gb"):
        hooks.around_build_mha_kv_pool(build, _configurator(), mha_pool_class=MHATokenToKVPool)


def test_each_forward_is_bracketed_even_when_it_fails():
    """The pool's stream opens before the model runs and closes after, also on an exception;
    a runner whose pool does not stream is called as it is."""
    events = []
    pool = types.SimpleNamespace(begin_layer_stream=lambda fb, r2t: events.append(("begin", fb)),
                                 end_layer_stream=lambda: events.append(("end",)))
    runner = types.SimpleNamespace(token_to_kv_pool=pool,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=None))

    def boom(runner, fb):
        events.append(("run", fb))
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError):
        hooks.around_model_forward(boom, runner, "fb")
    assert events == [("begin", "fb"), ("run", "fb"), ("end",)]
    plain = types.SimpleNamespace(token_to_kv_pool=object())
    assert hooks.around_model_forward(lambda r, fb: "ok", plain, "fb") == "ok"
