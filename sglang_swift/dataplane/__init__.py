"""SwiftCache's data plane: sharing donor memory across processes, the KV transfers between
SGLang's local pool and donor memory, and per-layer completion. Donor memory is a donor's own
SGLang pool lent page by page: the pool lives in a region exported once (`SharedArena`) and
mapped by borrowers (`map_pool`, over `map_arena`); `LeasePacking` packs a borrower's pages of
any shape into the donor's pages and `PoolTransferEngine` copies them, two-phase.

What it does not hold: the page's shape (`KVGeometry`, from swift_kernels, re-exported here) and
the book of who owns each page (`DonorLedger`, control/ledger.py, kept by the donor's agent).
Block numbers come in several spaces (local slots, donor page ids, lease-local block indices);
docs/dataplane.md "Block numbers" says which name holds which.

Importing it touches no GPU and starts nothing; SGLang is never imported here.
"""

from swift_kernels import KVGeometry

from .block_size import BLOCK_ALIGN_BYTES
from .emulated import EmulatedDevice
from .layer_counter import CpuLayerCounter, CudaLayerCounter, LayerCounter, LayerWaitResult
from .packing import LeasePacking
from .pool_layout import PoolLayout
from .pool_lease import MappedPool, UnshareablePool, map_pool, pool_geometry, why_pool_unshareable
from .pool_transfer import PoolTransferEngine
from .sharing import (
    MappedArena,
    MappingError,
    SharedArena,
    map_arena,
    owner_alive,
    unlink_descriptor,
)
from .transfer import PoolTransferHandle, TransferResult

__all__ = [
    "BLOCK_ALIGN_BYTES",
    "CpuLayerCounter",
    "CudaLayerCounter",
    "EmulatedDevice",
    "KVGeometry",
    "LayerCounter",
    "LayerWaitResult",
    "LeasePacking",
    "MappedArena",
    "MappedPool",
    "MappingError",
    "PoolLayout",
    "PoolTransferEngine",
    "PoolTransferHandle",
    "SharedArena",
    "TransferResult",
    "UnshareablePool",
    "make_layer_counter",
    "map_arena",
    "map_pool",
    "owner_alive",
    "pool_geometry",
    "unlink_descriptor",
    "why_pool_unshareable",
]


def make_layer_counter(num_layers: int, device="cpu", timeout_s: float = 30.0):
    """The layer counter of a pool on `device`: one class for every lane (a CPU lane signals
    layers on the host, a device lane also hands over the events to wait on)."""
    return LayerCounter(num_layers, timeout_s=timeout_s)
