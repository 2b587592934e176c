"""KV transfer kernels between SGLang's per-layer local pool and a block-major arena, and the
row copy (`copy_rows`, row_copy.py) the pool-lease transfers are built on.

Three implementations of the same two operations, chosen by `backend`:
  "reference"   plain torch, obviously right (the oracle the tests compare against);
  "vectorized"  the CPU data path (wide row gathers, see kv_vectorized);
  "triton"      the GPU kernels (on CPU only under TRITON_INTERPRET=1, for tests);
  "auto"        triton on CUDA tensors, vectorized on CPU.
Every entry point takes the model's `KVGeometry` (geometry.py, the project's one description of
a KV page), validates shapes, dtypes, strides and index ranges against it and raises ValueError
naming the problem before anything is written. Importing this package needs neither a GPU nor
Triton: Triton is imported on first use.
"""

from __future__ import annotations

import os

import torch

from . import kv_layout as _lay
from .geometry import K, V, KVGeometry, dtype_from_name, dtype_name
from .kv_layout import arena_layer_views, page_address
from .kv_reference import load_layer_ref, store_layer_ref
from .kv_vectorized import RowPlan, load_layer_fast, plan_rows, store_layer_fast
from .row_copy import copy_rows

__all__ = [
    "BACKENDS",
    "K",
    "KVGeometry",
    "RowPlan",
    "V",
    "arena_layer_views",
    "copy_rows",
    "dtype_from_name",
    "dtype_name",
    "load_layer",
    "page_address",
    "plan_rows",
    "resolve_backend",
    "store_layer",
    "store_pages",
    "triton_available",
]

BACKENDS = ("auto", "reference", "vectorized", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "vectorized"
    if backend == "triton":
        if not triton_available():
            raise ValueError(
                "backend 'triton' needs the triton package; install it or use "
                "backend='vectorized' on CPU"
            )
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "Triton runs on CPU tensors only under TRITON_INTERPRET=1, exported "
                "before triton is imported; use backend='vectorized' on CPU"
            )
    if backend == "vectorized" and device.type != "cpu":
        raise ValueError("backend 'vectorized' is the CPU path; use 'triton' on CUDA")
    return backend


def _validate_layer(arena, geometry, layer, k, v, slots, blocks, check_ranges):
    """The one-layer form of kv_layout.check_transfer."""
    if not isinstance(geometry, KVGeometry):
        raise ValueError(f"pass the model's KVGeometry, got {type(geometry).__name__}")
    _lay.check_arena(arena)
    _lay.check_layer_buffers(geometry, k, v)
    if arena.device != k.device and not (arena.is_cuda and k.is_cuda):
        raise ValueError(f"arena on {arena.device} but the local buffers on {k.device}")
    _lay.check_fits(arena, geometry)
    geometry.elem_span(layer, K)  # raises for a layer outside the geometry
    _lay.check_indices(slots, blocks, k.shape[0], arena.shape[0], geometry.page_size, k.device,
                       check_ranges)


def _run(op, backend, arena, geometry, layer, k, v, slots, blocks, plan, tuning=None):
    if backend == "reference":
        (store_layer_ref if op == "store" else load_layer_ref)(
            arena, geometry, layer, k, v, slots, blocks
        )
    elif backend == "vectorized":
        plan = plan or plan_rows(slots, blocks, geometry.page_size)
        (store_layer_fast if op == "store" else load_layer_fast)(
            arena, geometry, layer, k, v, plan
        )
    else:
        from . import kv_triton

        kernel = kv_triton.store_layer_kernel if op == "store" else kv_triton.load_layer_kernel
        kv_triton.launch(kernel, arena, geometry, layer, k, v, slots, blocks, tuning)


def store_pages(
    arena,
    k_buffers,
    v_buffers,
    slots,
    blocks,
    geometry: KVGeometry,
    *,
    backend="auto",
    check_ranges=True,
    plan: RowPlan | None = None,
) -> None:
    """Gather a prefix's tokens from every layer of the local pool into arena blocks.

    `k_buffers[l]` / `v_buffers[l]`: layer l's local [num_slots, H, D] tensors; token i goes from
    slot `slots[i]` to row `i % page_size` of block `blocks[i // page_size]`, all layers.
    """
    if not isinstance(geometry, KVGeometry):
        raise ValueError(f"pass the model's KVGeometry, got {type(geometry).__name__}")
    slots, blocks = slots.contiguous(), blocks.contiguous()
    _lay.check_transfer(arena, geometry, k_buffers, v_buffers, slots, blocks, check_ranges)
    be = resolve_backend(backend, k_buffers[0].device)
    if be == "vectorized" and plan is None:
        plan = plan_rows(slots, blocks, geometry.page_size)
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        _run("store", be, arena, geometry, layer, k, v, slots, blocks, plan)


def store_layer(
    arena,
    layer,
    k,
    v,
    slots,
    blocks,
    geometry: KVGeometry,
    *,
    backend="auto",
    check_ranges=True,
    plan: RowPlan | None = None,
    tuning=None,
    validate=True,
) -> None:
    """Store one layer (the unit the GPU side stream and the CPU worker thread schedule)."""
    _one_layer("store", arena, layer, k, v, slots, blocks, geometry, backend, check_ranges, plan,
               tuning, validate)


def load_layer(
    arena,
    layer,
    k,
    v,
    slots,
    blocks,
    geometry: KVGeometry,
    *,
    backend="auto",
    check_ranges=True,
    plan: RowPlan | None = None,
    tuning=None,
    validate=True,
) -> None:
    """Scatter layer `layer` of the arena blocks into local slots: k/v[slots[i]] = token i.
    `tuning` (triton only): {"block", "tokens", "num_warps"}, see kv_triton.DEFAULT_TUNING.
    `validate=False` skips every check: only for a caller that validated the same arguments
    already (the transfer engine checks once per transfer, not once per layer)."""
    _one_layer("load", arena, layer, k, v, slots, blocks, geometry, backend, check_ranges, plan,
               tuning, validate)


def _one_layer(direction, arena, layer, k, v, slots, blocks, geometry, backend, check_ranges,
               plan, tuning, validate) -> None:
    """The body `store_layer` and `load_layer` share; `direction` picks the kernel."""
    slots, blocks = slots.contiguous(), blocks.contiguous()
    if validate:
        _validate_layer(arena, geometry, layer, k, v, slots, blocks, check_ranges)
    _run(direction, resolve_backend(backend, k.device), arena, geometry, layer, k, v, slots,
         blocks, plan, tuning)
