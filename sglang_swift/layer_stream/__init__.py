"""The layer stream cache: a server whose KV pool keeps only the layers being computed in local
memory and every layer's KV outside it, streamed in layer by layer under the forward pass, so it
serves contexts L/depth times longer than a stock pool of the same local memory.

- `slots.py`: which pool slots a forward reads (`SlotSet`: runs or one index);
- `store.py`: where every layer lives (`HostLayerStore`) and the copy lane (CPU / CUDA stream);
- `donor_store.py`: `DonorLayerStore`, the same rows in donor pool pages under leases, written
  through to a `HostLayerStore` that takes over for pages a donor takes back;
- `donor_lease.py`: one lease's blocks and addresses (`DonorLease`) and the copies (`LeaseCopy`);
- `store_leases.py`: `StoreLeases`, the runtime's borrower side for that store;
- `pool.py`: `LayerStreamKVPool`, SGLang's MHA pool with its layers aliasing staging buffers,
  and optionally resident rows (every layer's own, never streamed);
- `layer_views.py`: per-layer buffers mapped from a layer's own rows and a shared staging buffer
  (memfd on CPU, CUDA VMM on a GPU);
- `mapped.py`: depth 0, `MappedKVPool` over `MappedRows`: the rows past the local ones mapped
  from host memory or donor chunks and read in place, moved between forwards; `mapped_leases.py`:
  `MappedLeases`, the runtime's borrower side for it;
- `allocator.py`: SGLang's allocator made to hand out the lowest free slots (resident first);
- `hooks.py`: the plugin hooks that size the pool, build it and its allocator, and bracket each
  forward;
- `context_bench.py` (with `context_servers.py`, `context_resident.py`) and `cost_model.py`: the
  live benchmark behind scripts/bench_context.py and its GPU estimate.

docs/layer_stream.md has the design, the memory accounting and the measured costs. Importing
this package imports nothing from SGLang; `pool.py` does (it subclasses SGLang's pool).
"""
