"""SwiftCache's data plane: sharing donor memory across processes, the KV transfers between
SGLang's local pool and donor memory, and per-layer completion. Donor memory is either a
donor's own SGLang pool lent page by page (`PoolLayout`, `map_pool`, `LeasePacking`,
`PoolTransferEngine`: any two model shapes) or a block-major arena (`SharedArena`, `map_arena`,
`TransferEngine`: one borrower page per block).

What it does not hold: the page's shape (`KVGeometry`, from swift_kernels, re-exported here) and
the book of who owns each block (`DonorLedger`, control/ledger.py, kept by the donor's agent).
Block numbers come in three spaces (local slots, arena block ids, lease-local block indices);
docs/dataplane.md "Block numbers" says which name holds which.

Importing it touches no GPU and starts nothing; SGLang is never imported here.
"""

from swift_kernels import KVGeometry

from .block_size import (
    BLOCK_ALIGN_BYTES,
    block_bytes_for,
    choose_block_bytes,
    fit_page_size,
    unused_bytes,
)
from .layer_counter import CpuLayerCounter, CudaLayerCounter, LayerWaitResult
from .packing import LeasePacking
from .pool_layout import PoolLayout
from .pool_lease import (MappedPool, UnshareablePool, map_pool, pool_geometry,
                         why_pool_unshareable)
from .pool_transfer import PoolTransferEngine, PoolTransferHandle
from .sharing import (
    MappedArena,
    MappingError,
    SharedArena,
    map_arena,
    owner_alive,
    unlink_descriptor,
)
from .transfer import TransferEngine, TransferHandle, TransferResult

__all__ = [
    "BLOCK_ALIGN_BYTES",
    "CpuLayerCounter",
    "CudaLayerCounter",
    "KVGeometry",
    "LayerWaitResult",
    "LeasePacking",
    "MappedArena",
    "MappedPool",
    "MappingError",
    "PoolLayout",
    "PoolTransferEngine",
    "PoolTransferHandle",
    "SharedArena",
    "TransferEngine",
    "TransferHandle",
    "TransferResult",
    "UnshareablePool",
    "block_bytes_for",
    "choose_block_bytes",
    "fit_page_size",
    "make_layer_counter",
    "map_arena",
    "map_pool",
    "owner_alive",
    "pool_geometry",
    "unlink_descriptor",
    "unused_bytes",
    "why_pool_unshareable",
]


def make_layer_counter(num_layers: int, device="cpu", timeout_s: float = 30.0):
    """The layer counter for `device`: CUDA events on a GPU, thread signals on CPU."""
    import torch

    cls = CudaLayerCounter if torch.device(device).type == "cuda" else CpuLayerCounter
    return cls(num_layers, timeout_s=timeout_s)
