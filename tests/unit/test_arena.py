"""The shared region a donor exports (`SharedArena`) and a borrower maps (`map_arena`): block
alignment, the descriptor, mapping checks, revocation; and the page layout `KVGeometry`
describes (in-process; the cross-process path is tests/integration/test_dataplane_processes.py).
Who owns each page is the donor's ledger: tests/unit/test_control_ledger.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import swift_kernels as sk
from sglang_swift.dataplane import (
    BLOCK_ALIGN_BYTES,
    KVGeometry,
    MappingError,
    SharedArena,
    map_arena,
)
from sglang_swift.dataplane.sharing import DESCRIPTOR_KEYS

LLAMA3_8B = KVGeometry(32, 8, 128, 128, torch.bfloat16, 16)  # 4 KiB per token per layer
QWEN3_0_6B = KVGeometry(28, 8, 128, 128, torch.bfloat16, 16)
SMALL_FP32 = KVGeometry(3, 2, 8, 4, torch.float32, 4)
SMALL_FP16 = KVGeometry(5, 1, 16, 16, torch.float16, 8)


def test_geometry_sizes():
    """Invariant: a page holds page_size tokens of all layers, K and V; geometries are
    validated and round-trip through their wire form."""
    assert LLAMA3_8B.bytes_per_token_per_layer == 4096
    assert LLAMA3_8B.page_bytes == 32 * 16 * 4096
    assert QWEN3_0_6B.page_bytes == 28 * 16 * 4096
    with pytest.raises(ValueError, match="positive int"):
        KVGeometry(0, 1, 1, 1, torch.float16, 1)
    assert KVGeometry.from_dict(SMALL_FP16.to_dict()) == SMALL_FP16


@pytest.mark.parametrize("g", [LLAMA3_8B, SMALL_FP32, SMALL_FP16], ids=str)
def test_layer_spans_tile_the_page_in_order(g):
    """Invariant: (layer, K/V) spans are back to back in layer order, K before V, each
    page_size rows long, and together exactly page_bytes: the page layout has no gap or
    overlap for any shape (V head dim differing from K's included)."""
    at = 0
    for layer in range(g.num_layers):
        for kv, row in ((sk.K, g.k_row_elems), (sk.V, g.v_row_elems)):
            offset, nbytes = g.span(layer, kv)
            assert (offset, nbytes) == (at, g.page_size * row * g.itemsize)
            at += nbytes
    assert at == g.page_bytes == g.num_layers * g.layer_bytes
    assert g.bytes_per_token * g.page_size == g.page_bytes
    with pytest.raises(ValueError, match="outside"):
        g.span(g.num_layers, sk.K)
    with pytest.raises(ValueError, match="kv must be"):
        g.span(0, "q")


def test_region_size_is_aligned_or_refused():
    """Invariant: a region's size is a multiple of BLOCK_ALIGN_BYTES (the one alignment), both
    where it is built and where a borrower maps it."""
    assert BLOCK_ALIGN_BYTES == 512
    with pytest.raises(ValueError, match="multiple of 512"):
        SharedArena(1000)
    donor = SharedArena(2048)
    try:
        desc = {**donor.export(), "block_bytes": 1000, "num_blocks": 1, "total_bytes": 4096 + 1000}
        with pytest.raises(MappingError) as err:
            map_arena(desc)
        assert err.value.reason == "bad_descriptor"
    finally:
        donor.close()


def test_export_descriptor_has_exactly_the_protocol_keys_and_maps():
    """Invariant: export() gives exactly the protocol's descriptor keys (the region's size as
    one block), and a dict or an object with those fields maps the same bytes."""
    donor = SharedArena(3 * 1024)
    try:
        desc = donor.export()
        assert tuple(sorted(desc)) == tuple(sorted(DESCRIPTOR_KEYS))
        assert desc["kind"] == "shm" and desc["device"] == "cpu"
        assert desc["total_bytes"] == 4096 + 3 * 1024
        assert (desc["num_blocks"], desc["block_bytes"]) == (1, 3 * 1024)
        donor.memory[1024:2048].fill_(7)
        mapped = map_arena(desc)
        assert mapped.memory.shape == (3 * 1024,) and int(mapped.memory[1024 + 5]) == 7
        assert int(mapped.memory[5]) == 0

        @dataclass
        class Desc:  # the control channel's MemoryDescriptor is an object with these fields
            kind: str
            handle: bytes
            device: str
            total_bytes: int
            block_bytes: int
            num_blocks: int
            owner_pid: int
            owner_uuid: str

        assert map_arena(Desc(**desc)).alive()
        mapped.close()
    finally:
        donor.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"owner_uuid": "someone-else"}, "identity"),
        ({"block_bytes": 1024, "num_blocks": 3}, "identity"),
        ({"block_bytes": 6144, "total_bytes": 4096 + 6144}, "size"),
        ({"total_bytes": 999}, "bad_descriptor"),
        ({"kind": "rdma"}, "unsupported"),
        ({"handle": b"swift_no_such_segment"}, "not_found"),
        ({"owner_pid": None}, "owner_dead"),
    ],
)
def test_mapping_is_checked(change, reason):
    """Invariant: a descriptor that disagrees with the region (identity, size, kind, name,
    owner) is refused with the matching MappingError reason."""
    donor = SharedArena(3 * 1024)
    try:
        desc = {**donor.export(), **change}
        if reason == "owner_dead":
            desc["owner_pid"] = _dead_pid()
        with pytest.raises(MappingError) as err:
            map_arena(desc)
        assert err.value.reason == reason
    finally:
        donor.close()


def test_missing_descriptor_keys_are_named():
    """Invariant: a descriptor without one of the protocol's keys is refused, naming it."""
    donor = SharedArena(2 * 1024)
    try:
        desc = donor.export()
        del desc["owner_uuid"]
        with pytest.raises(MappingError, match="owner_uuid"):
            map_arena(desc)
    finally:
        donor.close()


def test_revoked_region_is_an_expected_event():
    """Invariant: after revoke_export a mapped borrower sees the region dead (reason revoked)
    and no new mapping succeeds."""
    donor = SharedArena(2 * 1024)
    try:
        desc = donor.export()
        mapped = map_arena(desc)
        donor.revoke_export()
        assert not mapped.alive()
        with pytest.raises(MappingError) as err:
            mapped.check()
        assert err.value.reason == "revoked"
        with pytest.raises(MappingError) as err:
            map_arena(desc)
        assert err.value.reason == "not_found"
        mapped.close()
    finally:
        donor.close()


def test_cuda_ipc_handle_encoding_round_trips_without_pickle():
    """Invariant: the CUDA IPC handle fields round-trip through the length-prefixed
    encoding; garbage is a bad_descriptor."""
    from sglang_swift.dataplane.cuda_ipc import _pack_fields, _unpack_fields

    fields = [0, b"\x00\x01ipc-handle", 1 << 40, 0, b"/torch_123_ref", 7, None, True, 4096]
    assert _unpack_fields(_pack_fields(fields)) == fields
    with pytest.raises(MappingError) as err:
        _unpack_fields(b"zz")
    assert err.value.reason == "bad_descriptor"


def test_cuda_ipc_descriptor_without_cuda_is_an_expected_failure():
    """Invariant: a cuda_ipc descriptor on a machine without CUDA is refused as unsupported,
    not a crash."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    donor = SharedArena(2 * 1024)
    try:
        desc = {**donor.export(), "kind": "cuda_ipc", "handle": b""}
        with pytest.raises(MappingError) as err:
            map_arena(desc)
        assert err.value.reason == "unsupported"
    finally:
        donor.close()
