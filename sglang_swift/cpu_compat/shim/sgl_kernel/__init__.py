"""Pure-torch stand-in for `sgl_kernel`, for SGLang's CPU engine on a machine without its CPU build.

Put first on PYTHONPATH by `sglang_swift.cpu_compat.cpu_env()`, only for CPU runs. It implements
the one op a dense Llama calls on the CPU engine; every other name imports (so
`from sgl_kernel import X` in SGLang's modules succeeds) but raises NotImplementedError if called,
naming the op. It registers nothing under `torch.ops.sgl_kernel`, so SGLang's AMX check stays False
and layers use native torch.
"""

from __future__ import annotations

SWIFTCACHE_STAND_IN = True


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offsets, end_offsets,
                                 out_cache_loc, pool_len):
    """Write each request's new KV slots into its row: req_to_token[row, start:end] = next slots."""
    rows = req_pool_indices.tolist()
    starts = start_offsets.tolist()
    ends = end_offsets.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"bad token range [{start}, {end}) for a row of {pool_len}")
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is SwiftCache's CPU stand-in for "
            "sgl_kernel, which implements only what a dense Llama needs on SGLang's CPU engine")

    op.__name__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
