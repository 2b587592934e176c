"""What a borrower with a host tier keeps of a reclaim: the reclaimed blocks' bytes, read before
the acknowledgement lets the donor have them back, then written into the host slots the tree
moves those prefixes to (`RadixTree.revoke(rescue=True)`).

Threads: `first_fence` and `stage` run on the thread that fences (the agent's, or the
scheduler's when the agent's thread did not know the lease yet); `take` and `write` on the
scheduler thread at its pump. Only the first fence of a reclaim stages: it comes before the ack,
a later one may come after it. The read checks the lease's read deadline and the reclaim's (the
donor may take the pages back without an ack after it), the donor's liveness and the lease epoch,
as any copy: bytes read past any of them could be the donor's own again, so such a read fails
and its prefixes are recomputed, never loaded.

With TP (`tp`, a `tp_sync.TpGroup`) every rank fences, reads its own shard of the blocks and
writes it into its own host pool, at the same pump (rank 0 acknowledges after all of them). What
a rank's read or write decides is agreed before it reaches the tree: `take` hands out the staged
blocks only when every rank staged the same ones (else none, on every rank: no rank rescues),
and a write that failed on any rank takes the rescued host copies back on every rank
(`RadixTree.forget_rescue`). No rank ever keeps rows another rank lacks.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .pool_transfer import PoolTransferEngine

logger = logging.getLogger(__name__)


@dataclass
class Staged:
    """Lease blocks read before a reclaim let them go: block `blocks[i]` is rows
    `i * page_size ...` of the per-layer `k` / `v` tensors."""

    blocks: list
    k: list
    v: list


class ReclaimStaging:
    """`write_host(host_slots, k_rows, v_rows)` writes rows into the host tier (`HostKV`)."""

    def __init__(self, write_host: Callable[[torch.Tensor, list, list], None]):
        self.write_host = write_host
        self._staged: dict[tuple[str, int], list[Staged]] = {}
        self._fenced: set = set()  # (lease key, reclaim id) of reclaims fenced once already
        self._lock = threading.Lock()

    def first_fence(self, ev: Any) -> bool:
        """Whether this is the first fence of reclaim `ev` (any thread)."""
        tag = (ev.key, ev.reclaim_id)
        with self._lock:
            if tag in self._fenced:
                return False
            self._fenced.add(tag)
            return True

    def stage(self, held: Any, blocks: list[int], deadline: float) -> None:
        """Read lease `held`'s blocks `blocks` into fresh local memory (CPU engines: on the
        calling thread; a GPU lease is not staged yet, so its reclaimed prefixes are recomputed
        as without a host tier). What could not be read is not staged: the tree then drops
        those copies."""
        if not blocks or held.engine.lane.stream is not None:
            return
        staged, reason = read_blocks(held.engine, blocks, deadline)
        if staged is None:
            logger.warning("SwiftCache: could not read the reclaimed blocks of lease %s before "
                           "letting them go (%s); their prefixes will be recomputed",
                           held.key, reason)
            return
        with self._lock:
            self._staged.setdefault((held.key.donor, held.key.lease_id), []).append(staged)

    def take(self, ev: Any, tp: Any = None) -> dict:
        """The staged blocks of `ev`'s lease, block -> (part, position), forgotten here. With
        `tp` a collective: the blocks when every rank staged the same ones, else none on any
        rank (a rank whose read failed makes every rank drop those prefixes)."""
        with self._lock:
            staged = self._staged.pop((ev.key.donor, ev.key.lease_id), [])
            self._fenced.discard((ev.key, ev.reclaim_id))
        rows = {b: (part, i) for part in staged for i, b in enumerate(part.blocks)}
        if tp is not None:
            every = tp.gather(sorted(rows), list[int])
            if any(blocks != every[0] for blocks in every):
                logger.warning("SwiftCache: another TP rank could not read the reclaimed blocks "
                               "of lease %s before letting them go; their prefixes will be "
                               "recomputed on every rank", ev.key)
                return {}
        return rows

    def write(self, moved: tuple, rows: dict, page: int, tree: Any, tp: Any = None) -> int:
        """Write the staged rows of each rescued copy (`Transfer` donor -> host) into the host
        slots `tree` gave it; returns the tokens written. A write that failed (with `tp`: on
        any rank; a collective) is taken back from the tree (`forget_rescue`, on every rank):
        those prefixes are recomputed, never read from rows that were not written."""
        error = None
        try:
            n = self._write(moved, rows, page)
        except Exception as exc:  # noqa: BLE001 - agreed below, then dropped
            error, n = exc, 0
        ok = error is None if tp is None else tp.all_ok(error is None)
        if ok:
            logger.info("SwiftCache: moved %d tokens of reclaimed donor pages into the host tier",
                        n)
            return n
        logger.warning("SwiftCache: the rescued rows of %d prefixes could not be written into "
                       "the host tier (%s); they will be recomputed", len(moved),
                       repr(error) if error is not None else "failed on another TP rank")
        tree.forget_rescue(moved)
        return 0

    def _write(self, moved: tuple, rows: dict, page: int) -> int:
        host: list[int] = []
        for t in moved:
            host.extend(t.dst.indices)
        ks, vs = gather_rows([(t.src, len(t.dst.indices)) for t in moved], rows, page)
        self.write_host(torch.tensor(host, dtype=torch.int64), ks, vs)
        return len(host)


def read_blocks(engine: Any, blocks: list[int],
                deadline: float = math.inf) -> tuple[Staged | None, str | None]:
    """Lease blocks `blocks` read through lease engine `engine` (a CPU one) into fresh local
    tensors, on the calling thread, under the engine's checks (donor alive, lease epoch, read
    deadline, and `deadline`): (the `Staged` rows, None), or (None, why) when the read
    failed. Nothing of the borrower's pool is touched."""
    g = engine.packing.borrower
    rows = len(blocks) * g.page_size
    dev = engine.local_device
    ks = [torch.empty(rows, g.num_kv_heads, g.head_dim, dtype=g.dtype, device=dev)
          for _ in range(g.num_layers)]
    vs = [] if g.latent else [  # a latent page (an MLA pool's rows) has no V rows
        torch.empty(rows, g.num_kv_heads, g.v_head_dim, dtype=g.dtype, device=dev)
        for _ in range(g.num_layers)]
    reader = PoolTransferEngine(engine.packing, engine.region, ks, vs, lane=engine.lane,
                                liveness=engine.liveness, lease_epoch=engine.lease_epoch,
                                read_deadline=lambda: min(engine.read_deadline(), deadline))
    result = reader.load_here(torch.arange(rows), blocks)
    if not result.ok:
        return None, result.reason
    return Staged(list(blocks), ks, vs), None


def gather_rows(copies: list, rows: dict, page: int) -> tuple[list, list]:
    """The staged rows of `copies` (`(DonorResidency, tokens)` pairs, in order), one `[n, ...]`
    tensor per layer for K and for V (none for V of a latent page); `rows` maps a block to its
    (`Staged`, position), as `ReclaimStaging.take` returns it."""
    n = 0
    picks: dict[int, list] = {}  # id(part) -> (position in the result, row in the part)
    parts: dict[int, Staged] = {}
    for src, tokens in copies:
        for i in range(tokens):
            part, pos = rows[src.blocks[i // page]]
            parts[id(part)] = part
            picks.setdefault(id(part), []).append((n, pos * page + i % page))
            n += 1
    first = next(iter(parts.values()))
    ks = [torch.empty((n, *k.shape[1:]), dtype=k.dtype, device=k.device) for k in first.k]
    vs = [torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=v.device) for v in first.v]
    for pid, pairs in picks.items():
        part = parts[pid]
        at = torch.tensor([a for a, _ in pairs])
        src = torch.tensor([b for _, b in pairs])
        for mine, theirs in ((ks, part.k), (vs, part.v)):  # no V rows: an MLA pool's
            for layer, rows_of_part in enumerate(theirs):
                mine[layer][at] = rows_of_part[src]
    return ks, vs
