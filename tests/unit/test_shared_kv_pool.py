"""A lending server's SGLang KV pool lives in shared memory with SGLang's own shapes; other pools
are untouched. Uses SGLang's real MHATokenToKVPool on CPU with the plugin's hooks applied."""

from __future__ import annotations

import pytest
import torch

from sglang_swift.config import CONFIG_ENV, SwiftConfig
from sglang_swift.dataplane.pool_layout import PoolLayout
from sglang_swift.integration.shared_kv_pool import shared_region_of


@pytest.fixture(scope="module", autouse=True)
def loaded_plugins():
    from tests.unit.test_runtime import apply_lending_hooks

    apply_lending_hooks()  # the hook that puts a lending server's pool in shared memory


def _pool(**kw):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    args = dict(size=60, page_size=4, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3,
                device="cpu", enable_memory_saver=False)
    args.update(kw)
    return MHATokenToKVPool(**args)


def test_lending_pool_is_a_view_of_one_shared_region(monkeypatch):
    """Every K/V byte SGLang writes for page p, layer l lands at PoolLayout.chunk_offset(p, l, h)
    of the shared region, and the buffers keep SGLang's shapes."""
    monkeypatch.setenv(CONFIG_ENV, SwiftConfig(enabled=True, lend_fraction=0.5).to_json())
    pool = _pool()
    shared = shared_region_of(pool)
    assert shared is not None
    arena, layout = shared
    assert pool.k_buffer[0].shape == (64, 2, 8) and pool.v_buffer[2].shape == (64, 2, 8)
    assert arena.export()["kind"] == "shm"
    torch.manual_seed(0)
    for layer in range(3):
        pool.k_buffer[layer].copy_(torch.randn_like(pool.k_buffer[layer]))
        pool.v_buffer[layer].copy_(torch.randn_like(pool.v_buffer[layer]))
    region = arena.memory.view(-1)
    for page in (1, 7, 15):
        for layer in range(3):
            for half, buf in ((0, pool.k_buffer), (1, pool.v_buffer)):
                off = layout.chunk_offset(page, layer, half)
                raw = region[off: off + layout.chunk_bytes(half)].view(torch.float32)
                rows = buf[layer][page * 4:(page + 1) * 4].reshape(-1)
                assert torch.equal(raw, rows)
    arena.close()


def test_pool_of_a_server_that_does_not_lend_is_sglangs_own(monkeypatch):
    """A borrower (or a server without SwiftCache) keeps SGLang's private buffers."""
    monkeypatch.setenv(CONFIG_ENV, SwiftConfig(enabled=True, max_borrow_blocks=8).to_json())
    assert shared_region_of(_pool()) is None
    monkeypatch.delenv(CONFIG_ENV)
    assert shared_region_of(_pool()) is None


def test_layout_round_trips_and_rejects_nonsense():
    """The layout record travels as the wire's flat fields (a dict or the protocol's
    PoolLayoutMsg) and comes back equal; impossible layouts are refused naming the field."""
    from sglang_swift.control.protocol import PoolLayoutMsg
    from sglang_swift.dataplane import KVGeometry

    lay = PoolLayout(KVGeometry(2, 1, 4, 2, "bfloat16", 4), rows=10, padded_rows=12,
                     data_offset=4096)
    assert PoolLayout.from_dict(lay.to_dict()) == lay
    assert PoolLayout.from_dict(PoolLayoutMsg(**lay.to_dict())) == lay
    assert set(lay.to_dict()) == set(PoolLayoutMsg.__struct_fields__)
    assert lay.layer_stride == 12 * (4 + 2) * 2 and lay.v_offset == 12 * 4 * 2
    assert lay.chunk_offset(1, 1, 1) == 4096 + lay.layer_stride + lay.v_offset + 4 * 2 * 2
    flat = dict(num_layers=1, rows=10, padded_rows=10, head_num=1, head_dim=4, v_head_dim=4,
                dtype="float32", page_size=4, data_offset=0)
    with pytest.raises(ValueError, match="padded_rows"):
        PoolLayout.from_dict(flat)
    with pytest.raises(ValueError, match="dtype"):
        PoolLayout.from_dict({**flat, "padded_rows": 12, "dtype": "int7"})
    with pytest.raises(ValueError, match="missing"):
        PoolLayout.from_dict({k: v for k, v in flat.items() if k != "rows"})


def test_a_pool_whose_shared_region_cannot_be_exported_is_built_as_usual(monkeypatch, caplog):
    """Invariant (a mapping fault never takes a server down): when the shareable region cannot
    be allocated or exported (here the export raises, as a refused CUDA IPC export would), the
    lending server's pool is SGLang's own, it lends nothing, and its log says why."""
    from sglang_swift.dataplane import sharing

    def refuse(self):
        raise RuntimeError("export refused")

    monkeypatch.setattr(sharing.SharedArena, "_make_handle", refuse)
    monkeypatch.setenv(CONFIG_ENV, SwiftConfig(enabled=True, lend_fraction=0.5).to_json())
    with caplog.at_level("WARNING"):
        pool = _pool()
    assert shared_region_of(pool) is None
    assert pool.k_buffer[0].shape == (64, 2, 8)
    assert "could not be placed in shareable memory (RuntimeError: export refused)" in caplog.text
