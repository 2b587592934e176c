"""One machine: N GPUs with NVLink (per-direction egress/ingress) and PCIe (H2D/D2H) links,
one model server per GPU, and the donation wiring between them.

Donation uses the project's own placement code: each donor's `DonorLedger` (control/ledger.py,
proportional policy) decides grants and reclaims; the borrower's `radix_ext` tree gets the lease
(`DonorTier.add_lease`) and gives blocks back through `RadixTree.revoke`. A ledger block is one
page of the borrower's KV; on the donor it removes the equivalent bytes from its own page pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radix_ext import DEVICE, DONOR
from sglang_swift.control.grant_policy import create_policy
from sglang_swift.control.ledger import DonorLedger

from .capacity import lend_blocks
from .clock import EventLoop
from .links import Link, Network


@dataclass(eq=False)
class Gpu:
    index: int
    nvl_out: Link
    nvl_in: Link
    h2d: Link
    d2h: Link
    server: object = None

    @property
    def links(self) -> tuple[Link, ...]:
        return (self.nvl_out, self.nvl_in, self.h2d, self.d2h)


@dataclass
class Donation:
    donor: object  # ModelServer
    ledger: DonorLedger
    lease_id: int = 0
    tree_block: dict = field(default_factory=dict)  # ledger block id -> tree block index
    own_pages_per_block: float = 1.0
    reclaimed_blocks: int = 0


class _Delayed:
    """A copy that starts after a fixed latency (`Node.copy_latency_s`); `end` as a Transfer's."""

    def __init__(self) -> None:
        self.end: float | None = None


class Node:
    def __init__(self, nvlink_bw: float, pcie_bw: float, num_gpus: int,
                 copy_latency_s: dict[tuple[str, str], float] | None = None) -> None:
        """`copy_latency_s`: a fixed time per copy by (source tier, destination tier) before its
        bytes move (a measured engine's per-transfer cost; none on the GPU node's links)."""
        self.copy_latency_s = dict(copy_latency_s or {})
        self.loop = EventLoop()
        self.net = Network(self.loop)
        self.gpus = []
        for g in range(num_gpus):
            self.gpus.append(Gpu(g, self.net.add_link(f"nvl_out{g}", nvlink_bw),
                                 self.net.add_link(f"nvl_in{g}", nvlink_bw),
                                 self.net.add_link(f"h2d{g}", pcie_bw),
                                 self.net.add_link(f"d2h{g}", pcie_bw)))
        self.by_name: dict[str, object] = {}
        self.donations: dict[str, Donation] = {}
        self.bytes_by_route: dict[tuple[str, str], float] = {}

    def dma_rate(self, gpu: Gpu) -> float:
        """Bytes/s that copy engines currently read or write in this GPU's HBM."""
        return sum(self.net.rate_through(link) for link in gpu.links)

    # -- transfers routed by (source tier, destination tier) -------------------------------------
    def _route(self, server, tier: str, res):
        if tier == DEVICE:
            return server.gpu, None
        if tier == DONOR:
            return self.by_name[res.donor].gpu, None
        return None, "host"

    def copy(self, server, cp, on_done):
        """Start the copy `cp` (a radix_ext Transfer) of `server`'s KV; returns the link
        transfer."""
        src_gpu, _ = self._route(server, cp.src_tier, cp.src)
        dst_gpu, _ = self._route(server, cp.dst_tier, cp.dst)
        if src_gpu is not None and dst_gpu is not None:
            path = [src_gpu.nvl_out, dst_gpu.nvl_in]
        elif src_gpu is not None:
            path = [src_gpu.d2h]
        elif dst_gpu is not None:
            path = [dst_gpu.h2d]
        else:
            raise ValueError(f"host-to-host copy {cp}")
        pages = cp.src.num_tokens(1)
        nbytes = pages * server.page_bytes
        key = (cp.src_tier, cp.dst_tier)
        self.bytes_by_route[key] = self.bytes_by_route.get(key, 0.0) + nbytes
        latency = self.copy_latency_s.get(key, 0.0)
        if latency <= 0:
            return self.net.start(path, nbytes, on_done, tag=f"{cp.src_tier}->{cp.dst_tier}")
        handle = _Delayed()

        def finished(t):
            handle.end = self.loop.now
            on_done(t)

        self.loop.after(latency, lambda: self.net.start(path, nbytes, finished,
                                                        tag=f"{key[0]}->{key[1]}"))
        return handle

    # -- donation --------------------------------------------------------------------------------
    def lend(self, donor, borrower, lend_fraction: float, watermark: float) -> int:
        """`donor` offers `lend_fraction` of its KV pool; `borrower` asks for all of it in one
        request sized in the donor's pages, as the live borrower does (`Borrowing.maybe_request`
        reads the layout the donor advertises in its Hello): one lease of everything.
        Returns the blocks granted (one block = one borrower page)."""
        own_per_block = borrower.page_bytes / donor.page_bytes
        blocks = lend_blocks(lend_fraction, donor.cache.device_pages * donor.page_bytes,
                             borrower.page_bytes)
        ledger = DonorLedger(create_policy("proportional"))
        ledger.offer(range(blocks))
        asks = [blocks]
        d = None
        granted = 0
        for want in asks:
            lease = (ledger.grant(borrower.name, epoch=1, want=want, priority=0)
                     if want > 0 else None)
            if lease is None:  # nothing (more) to lend: lend_fraction 0, or a pool too small
                continue
            if d is None:
                d = Donation(donor, ledger, lease.lease_id, {}, own_per_block)
            granted += self._hold_lease(d, borrower, lease)
        if d is None:
            return 0
        self._take_pages(d, granted)
        donor.watermark = watermark
        donor.on_pressure = lambda pages, d=d, b=borrower: self._reclaim(d, b, pages)
        self.donations[donor.name] = d
        return granted

    def relend(self, donor, borrower) -> int:
        """After a reclaim took every lent block back, the donor offers them again and the
        borrower takes one new lease of them (the live donor lends again once its cooldown is
        over and it has no requests of its own; its ledger numbers the new lease). Returns the
        blocks granted."""
        d = self.donations[donor.name]
        if d.ledger.leases or d.ledger.offered:
            raise ValueError("relend: the donor's blocks are not all back yet")
        n = len(d.tree_block)
        d.ledger.offer(range(n))
        lease = d.ledger.grant(borrower.name, epoch=1, want=n, priority=0)
        if lease is None:
            return 0
        d.lease_id = lease.lease_id
        d.tree_block = {}
        granted = self._hold_lease(d, borrower, lease)
        self._take_pages(d, granted)
        return granted

    @staticmethod
    def _hold_lease(d: Donation, borrower, lease) -> int:
        """The borrower's tree gets `lease`; returns its blocks."""
        for i, b in enumerate(sorted(lease.active)):
            d.tree_block[b] = i  # block index within its own lease (the tree numbers per lease)
        borrower.cache.add_lease(d.donor.name, lease.lease_id, 1, len(lease.active))
        return len(lease.active)

    @staticmethod
    def _take_pages(d: Donation, granted: int) -> None:
        """The donor's own pages behind `granted` lent blocks leave its pool."""
        d.donor.lent_pages = d.donor.cache.alloc(int(granted * d.own_pages_per_block + 0.999999))

    def _reclaim(self, d: Donation, borrower, own_pages: int) -> None:
        """The donor needs `own_pages` of its pages back: ledger reclaims, borrower revokes, ack."""
        blocks = min(int(own_pages / d.own_pages_per_block) + 1, len(d.ledger.offered))
        if blocks <= 0:
            return
        returned, reclaims = d.ledger.demand(blocks)
        for rec in reclaims:
            tree_blocks = [d.tree_block[b] for b in rec.blocks]
            borrower.cache.revoke(d.donor.name, rec.lease_id, tree_blocks)
            returned += d.ledger.ack(borrower.name, rec.reclaim_id, rec.lease_id)
        d.reclaimed_blocks += len(returned)
        give = min(len(d.donor.lent_pages), int(len(returned) * d.own_pages_per_block))
        if give:
            back = d.donor.lent_pages[len(d.donor.lent_pages) - give:]
            del d.donor.lent_pages[len(d.donor.lent_pages) - give:]
            d.donor.cache.free(back)
