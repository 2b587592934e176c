"""Which donor rank pools a borrower's TP rank maps (docs/integration.md "Tensor parallelism").

A TP donor lends the same page ids of every rank's pool; its grant names every rank's pool
(`MemoryDescriptor.ranks`). Borrower rank r maps the pools `donor_ranks_of` names; when it maps
several, each is a sub-lease of the grant with its own tree lease id (`sub_lease_id`), and a
reclaim or loss of the grant revokes all of them (`merged_revokes`). Arithmetic only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .sharing import MappingError

SUB_LEASE_SHIFT = 40  # sub-lease j of a grant is tree lease `lease_id + (j << 40)`


def sub_lease_id(lease_id: int, j: int) -> int:
    """The tree's lease id of sub-lease `j` of grant `lease_id` (sub-lease 0: the grant's)."""
    if lease_id >= 1 << SUB_LEASE_SHIFT:
        raise ValueError(f"lease id {lease_id} is too large to number sub-leases after it")
    return lease_id + (j << SUB_LEASE_SHIFT)


def donor_ranks_of(rank: int, ranks: int, donor_ranks: int, geometry: Any = None,
                   layout: Any = None) -> list[tuple[int, tuple[int, int]]]:
    """The donor rank pools borrower rank `rank` of `ranks` maps, each with the shard of a
    borrower block it keeps there, `(donor rank, (shard, shards))`: with as many or more donor
    ranks (a multiple), rank r maps k = donor_ranks / ranks pools, r*k .. r*k + k - 1, each
    holding whole blocks of its own shard; with fewer (a divisor), m = ranks / donor_ranks
    borrower ranks share donor rank r // m, each its slice r % m of every block there. Any other
    pair cannot be mapped: MappingError("geometry") naming the shapes."""
    if donor_ranks % ranks == 0:
        k = donor_ranks // ranks
        return [(rank * k + j, (0, 1)) for j in range(k)]
    if ranks % donor_ranks == 0:
        m = ranks // donor_ranks
        return [(rank // m, (rank % m, m))]
    raise MappingError("geometry", f"a borrower of {ranks} TP ranks (each rank's page "
                       f"{shape_of(geometry)}) cannot map a donor of {donor_ranks} rank pools "
                       f"(each rank's page {shape_of(getattr(layout, 'geometry', None))}): one "
                       f"rank count must divide the other")


def shape_of(g: Any) -> str:
    """A KVGeometry in words, for refusals."""
    if g is None:
        return "unknown"
    return (f"{g.num_layers} layers x {g.num_kv_heads} KV heads x {g.head_dim}/{g.v_head_dim} "
            f"dims, {str(g.dtype).replace('torch.', '')}, {g.page_size} tokens")


def merged_revokes(results: list) -> Any:
    """One RevokeResult of several (the sub-leases of a grant), or None."""
    results = [r for r in results if r is not None]
    if len(results) <= 1:
        return results[0] if results else None
    return type(results[0])(**{
        f.name: (sum(getattr(r, f.name) for r in results) if f.name == "num_tokens_lost"
                 else tuple(x for r in results for x in getattr(r, f.name)))
        for f in dataclasses.fields(results[0])})
