"""HiCache's CPU stand-ins (sglang_swift.cpu_compat.hicache / hicache_ops).

The copies are checked against a per-token reference written from the layout table in
hicache_ops' docstring, once as bare ops and once through SGLang's own MHATokenToKVPoolHost and
L2TransferEngine (the patched methods); the patches are checked to be idempotent, inactive off the
CPU engine, and loud about a target that does not match the pinned SGLang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from sglang_swift.cpu_compat import hicache
from sglang_swift.cpu_compat.hicache_ops import (
    CpuDeviceModule,
    CpuEvent,
    CpuStream,
    backup_layer,
    load_layer,
)

LAYERS, HEADS, DIM, PAGE = 3, 2, 4, 4
HOST_PAGES = 5
HOST_SLOTS = HOST_PAGES * PAGE
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
PAIRS = [(io, layout) for io, layouts in hicache.SUPPORTED.items() for layout in layouts]


def host_shape(layout: str) -> tuple[int, ...]:
    return {"layer_first": (LAYERS, HOST_SLOTS, HEADS, DIM),
            "page_first": (HOST_SLOTS, LAYERS, HEADS, DIM),
            "page_first_direct": (HOST_PAGES, LAYERS, PAGE, HEADS, DIM),
            "page_head": (HOST_PAGES, HEADS, PAGE, LAYERS, DIM)}[layout]


def ref_coords(layout: str, layer: int, slot: int, head: int, d: int) -> tuple[int, ...]:
    """Where element (head, d) of host slot `slot` in `layer` lives, from the layout table."""
    page, offset = divmod(slot, PAGE)
    return {"layer_first": (layer, slot, head, d),
            "page_first": (slot, layer, head, d),
            "page_first_direct": (page, layer, offset, head, d),
            "page_head": (page, head, offset, layer, d)}[layout]


def ref_row(host: torch.Tensor, layout: str, layer: int, slot: int) -> torch.Tensor:
    """The (heads, dim) row of host slot `slot` in `layer`, one element at a time."""
    row = torch.empty(HEADS, DIM, dtype=host.dtype)
    for h in range(HEADS):
        for d in range(DIM):
            row[h, d] = host[ref_coords(layout, layer, slot, h, d)]
    return row


def slots(pages: list[int]) -> torch.Tensor:
    """Page-aligned host slots, as HiCache allocates them."""
    return torch.tensor([p * PAGE + o for p in pages for o in range(PAGE)], dtype=torch.int64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_layer_writes_exactly_the_given_slots_of_that_layer(layout):
    """Device -> host, one layer: each host slot's row is its device row; nothing else moves."""
    torch.manual_seed(0)
    device = torch.randn(16, HEADS, DIM)
    host = torch.zeros(host_shape(layout))
    host_idx, device_idx = slots([3, 1]), torch.tensor([9, 2, 5, 7, 0, 1, 15, 4])
    backup_layer(host, device, layout, 1, host_idx, device_idx, PAGE)
    for h_slot, d_slot in zip(host_idx.tolist(), device_idx.tolist()):
        assert torch.equal(ref_row(host, layout, 1, h_slot), device[d_slot])
    assert int((host != 0).sum()) == len(host_idx) * HEADS * DIM


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_layer_fills_exactly_the_given_device_slots(layout):
    """Host -> device, one layer: device[d] = host row of its slot; other device rows unchanged."""
    torch.manual_seed(1)
    host = torch.randn(host_shape(layout))
    device = torch.zeros(16, HEADS, DIM)
    host_idx, device_idx = slots([4, 0]), torch.tensor([3, 11, 12, 6, 8, 9, 10, 14])
    load_layer(host, device, layout, 2, host_idx, device_idx, PAGE)
    for h_slot, d_slot in zip(host_idx.tolist(), device_idx.tolist()):
        assert torch.equal(device[d_slot], ref_row(host, layout, 2, h_slot))
    untouched = [i for i in range(16) if i not in device_idx.tolist()]
    assert device[untouched].abs().sum() == 0


@pytest.fixture(scope="module")
def sglang_pools():
    """SGLang's own device pool and host pool class (imported on the CPU engine: patched)."""
    import sglang.srt.managers.cache_controller  # noqa: F401 - every patched module imported
    from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    def build(layout: str):
        device = MHATokenToKVPool(size=32, page_size=PAGE, dtype=torch.float32, head_num=HEADS,
                                  head_dim=DIM, layer_num=LAYERS, device="cpu",
                                  enable_memory_saver=False)
        for layer in range(LAYERS):
            device.k_buffer[layer].normal_()
            device.v_buffer[layer].normal_()
        info = device.get_device_pool_infos()[0].buffer_info
        host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, device_capacity_tokens=32,
                                    start_layer=0, end_layer=LAYERS)  # pin_memory left default
        return device, host

    return types.SimpleNamespace(build=build, L2Transfer=L2Transfer, Engine=L2TransferEngine)


@pytest.mark.parametrize("io_backend,layout", PAIRS)
def test_sglang_host_pool_round_trip_through_the_stand_ins(sglang_pools, io_backend, layout):
    """SGLang's MHATokenToKVPoolHost (unpinned) with SGLang's L2TransferEngine: backup of all
    layers puts every layer's rows in the host slots (checked per token against the layout), a
    per-layer load moves only that layer, and the full load restores every layer."""
    device, host = sglang_pools.build(layout)
    assert host.pin_memory is False and host.get_dummy_flat_data_page().numel() > 0
    engine = sglang_pools.Engine(io_backend)
    host_idx, src = host.alloc(2 * PAGE), torch.arange(4, 4 + 2 * PAGE)
    done = engine.submit_device_to_host([sglang_pools.L2Transfer(host, device, host_idx, src)])
    assert done.finish_event.query()
    for layer in range(LAYERS):
        for component, dev in ((host.k_buffer, device.k_buffer), (host.v_buffer, device.v_buffer)):
            for h_slot, d_slot in zip(host_idx.tolist(), src.tolist()):
                assert torch.equal(ref_row(component, layout, layer, h_slot), dev[layer][d_slot])
    dst = torch.arange(20, 20 + 2 * PAGE)
    host.load_to_device_per_layer(device, host_idx, dst, 1, io_backend)
    assert torch.equal(device.k_buffer[1][dst], device.k_buffer[1][src])
    assert not torch.equal(device.k_buffer[0][dst], device.k_buffer[0][src])
    layers_done = []
    engine.submit_host_to_device([sglang_pools.L2Transfer(host, device, host_idx, dst)],
                                 transfer_layer_id_max=LAYERS, on_layer_done=layers_done.append)
    assert layers_done == list(range(LAYERS))
    for layer in range(LAYERS):
        assert torch.equal(device.k_buffer[layer][dst], device.k_buffer[layer][src])
        assert torch.equal(device.v_buffer[layer][dst], device.v_buffer[layer][src])


@pytest.mark.parametrize("io_backend,layout", [("direct", "page_head"),
                                               ("kernel", "page_first_direct"),
                                               ("kernel_ascend", "page_first_direct")])
def test_unserved_pairs_are_refused_naming_the_options(io_backend, layout):
    with pytest.raises(ValueError, match=f"--hicache-io-backend {io_backend} with "
                                         f"--hicache-mem-layout {layout}"):
        hicache.check_pair(io_backend, layout)


def test_startup_check_refuses_host_pools_without_a_cpu_copy(sglang_pools):
    """A host pool class whose copies are not stood in (MLA, asymmetric MHA, ...) is refused by
    name; the plain MHA pool in a HostPoolGroup-like container passes and reports its layout."""
    _, host = sglang_pools.build("page_first")

    class OtherHostPool:
        layout = "page_first"

        def load_to_device_per_layer(self, *a, **k): ...

        def backup_from_device_all_layer(self, *a, **k): ...

    group = types.SimpleNamespace(entries=[types.SimpleNamespace(host_pool=host)])
    assert hicache.check_host_pools(group, "kernel") == "page_first"
    with pytest.raises(ValueError, match="OtherHostPool, which has no CPU copy"):
        hicache.check_host_pools(OtherHostPool(), "kernel")
    with pytest.raises(ValueError, match="--hicache-mem-layout page_first has no CPU copy"):
        hicache.check_host_pools(group, "direct")


def test_install_is_idempotent(sglang_pools):
    """A second install or apply changes nothing: one finder, the same objects in place."""
    import sglang.srt.layers.attention.torch_native_backend as native
    import sglang.srt.managers.cache_controller as controller
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    def state():
        return (mha.MHATokenToKVPoolHost.load_to_device_per_layer, controller.device_module,
                controller.HiCacheController.__init__, mla.MLATokenToKVPoolHost.__dict__.copy(),
                native.TorchNativeAttnBackend.__dict__.copy())

    before = state()
    hicache.install()
    hicache.install()
    assert [hicache.apply_to_module(m) for m in (mha, controller, mla, native)] == [[]] * 4
    after = state()
    assert before == after and controller.device_module is CpuDeviceModule
    assert sum(isinstance(f, hicache.PostImportFinder) for f in sys.meta_path) == 1
    assert all(hicache.installed(p.name) for p in hicache.PATCHES)
    assert controller.HiCacheController.__init__.__wrapped__ is not None


def test_nothing_is_applied_off_the_cpu_engine():
    """Off the CPU engine, or with the layer opted out, nothing is patched; a fresh process with
    SGLANG_USE_CPU_ENGINE=0 imports the HiCache modules as stock."""
    module = types.ModuleType("sglang.srt.mem_cache.l2_transfer")
    for environ in ({"SGLANG_USE_CPU_ENGINE": "0"}, {},
                    {"SGLANG_USE_CPU_ENGINE": "1", "SWIFTCACHE_CPU_COMPAT": "0"}):
        assert hicache.apply_to_module(module, environ=environ) == []
    code = ("import sglang.srt.mem_cache.pool_host.mha as m, sglang.srt.mem_cache.l2_transfer as l;"
            "from sglang_swift.cpu_compat import hicache as h;"
            "print(getattr(m.MHATokenToKVPoolHost.load_to_device_per_layer, h.MARK, None),"
            " l.device_module.__name__, sorted(h._state['installed']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "SGLANG_USE_CPU_ENGINE": "0"}, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "None torch.cpu []", out.stdout


def test_a_target_that_changed_is_reported_and_refuses_start(monkeypatch, capsys):
    """A missing attribute or a missing parameter is not patched, is reported on stderr naming
    the target, and the start-up check then refuses HiCache with the list."""
    monkeypatch.setattr(hicache, "_state", {"installed": set(), "failed": {}, "logged": False,
                                            "version_warned": True})
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    l2 = types.ModuleType("sglang.srt.mem_cache.l2_transfer")  # no device_module
    base = types.ModuleType("sglang.srt.mem_cache.pool_host.base")

    class HostKVCache:
        def __init__(self, *, pinned: bool): ...

    base.HostKVCache = HostKVCache
    assert hicache.apply_to_module(l2, environ=env) == []
    assert hicache.apply_to_module(base, environ=env) == []
    assert base.HostKVCache.__init__ is vars(HostKVCache)["__init__"]
    err = capsys.readouterr().err
    assert "'cpu_l2_streams' not installed: sglang.srt.mem_cache.l2_transfer:device_module " \
           "does not exist" in err
    assert "has no parameter(s) pin_memory" in err
    with pytest.raises(RuntimeError, match="cpu_l2_streams: does not exist"):
        hicache.check_host_pools(types.SimpleNamespace(entries=[]), "kernel")


def test_cpu_streams_and_events_never_wait():
    stream, event = CpuStream(), CpuEvent(enable_timing=True)
    with CpuDeviceModule.stream(stream) as current:
        assert current is stream
        event.record()
        end = stream.record_event(CpuEvent(enable_timing=True))
    for call in (stream.synchronize, event.synchronize, lambda: event.wait(stream),
                 lambda: stream.wait_stream(CpuDeviceModule.current_stream()),
                 lambda: CpuDeviceModule.current_stream().wait_event(event)):
        assert call() is None
    assert stream.query() and event.query() and CpuEvent().query()
    assert event.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        CpuEvent().elapsed_time(end)


def test_the_touch_point_list_names_an_existing_target_for_every_patch(sglang_pools):
    """PATCHES is data for the manifest of SGLang touch points: every entry complete, its kind
    one of the manifest's, its target present (here: as its stand-in) in the pinned SGLang."""
    from sglang_swift.integration.touchpoints import Kind, resolve

    names = [p.name for p in hicache.PATCHES]
    assert len(set(names)) == len(names) == len(hicache._MAKERS)
    for patch in hicache.PATCHES:
        module, _, attr = patch.target.partition(":")
        assert module.startswith("sglang.srt.") and attr and patch.why and patch.breaks_if
        assert Kind(patch.kind) and resolve(patch.dotted) is not None, patch.target
