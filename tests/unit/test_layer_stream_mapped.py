"""Depth 0 of the layer stream cache: a pool whose rows past the local ones are mapped from host
memory or, under a lease, from a donor's pool (another model's shape, in shared memory, mapped
as a borrower maps it) and read in place. Attention reads exactly what SGLang's own pool reads
through placement, a reclaim between forwards, a lost lease and a lease near its read deadline;
what it reads and writes on a placed piece is the donor's memory itself. SGLang's real
MHATokenToKVPool on CPU is the reference (`Twin` of test_layer_stream)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from sglang_swift.dataplane.sharing import HEADER_BYTES
from sglang_swift.layer_stream.mapped import (
    GONE,
    DonorChunks,
    MappedKVPool,
    mapped_rows,
    piece_bytes_for,
)
from sglang_swift.layer_stream.mapped_leases import _shm_opener
from sglang_swift.layer_stream.pool import StreamSettings
from tests.unit import test_layer_stream_donor
from tests.unit.test_layer_stream import ARGS, Twin
from tests.unit.test_packing import pool_of
from tests.unit.test_pool_transfer import POISON

HEAD_DIM = 64  # 2 heads x 64 x 4 bytes: 512-byte rows, 8 per 4 KiB piece


def _mapped(fraction: float = 0.25):
    settings = StreamSettings(depth=0, tier="donor", resident_fraction=fraction)
    cls = type("SmallPieces", (MappedKVPool.configured(settings),), {"piece_at_least": 4096})
    return cls(**{**ARGS, "head_dim": HEAD_DIM})


class Donor(test_layer_stream_donor.Donor):
    """test_layer_stream_donor's donor, large enough for whole 4 KiB chunks, with a read
    deadline and a way to overwrite what it lent."""

    def __init__(self, pages: int = 4096):
        super().__init__(pages)
        self.until = float("inf")  # the lease's read deadline

    def lend(self, store, pages):
        self.leases += 1
        chunks = DonorChunks.cut(self.layout, pages, store.piece_bytes)
        return store.add_lease(("donor", self.leases), chunks, self.mapped.region,
                               _shm_opener(self.mapped.arena.descriptor),
                               lambda: self.up and self.mapped.alive(), lambda: self.until)

    def poison(self) -> None:
        """The donor reuses its pages: whatever a borrower left there is overwritten."""
        self.mapped.region.fill_(POISON)


@pytest.fixture
def donor():
    d = Donor()
    yield d
    d.close()


@pytest.fixture
def twin():
    t = Twin(2, 64, seed=7, shuffle_slots=False, head_dim=HEAD_DIM)
    t.streamed = _mapped()
    return t


def _forwards(twin: Twin, first_row: int) -> None:
    twin.forward({first_row: 10}, "write-first")
    twin.forward({first_row: 7}, "read-first")
    twin.share_prefix(first_row + 1, first_row, 5)
    twin.forward({first_row + 1: 6, first_row: 1}, "write-first")
    for _ in range(3):
        twin.forward({first_row: 1, first_row + 1: 1}, "write-first")


def _fill(twin: Twin, tokens: int) -> None:
    """Prefill one request of `tokens` (slots 1..tokens) so the mapped rows hold KV."""
    twin.forward({7: tokens}, "write-first")


def test_rows_and_pieces_cover_the_pool():
    """Invariant: R is the resident fraction of the tokens rounded down to whole pages and
    mapping units; whole pieces cover the rest plus the padding page; a piece is whole rows and
    whole mapping units."""
    assert piece_bytes_for(512, 4096, 64 << 10) == 64 << 10
    assert piece_bytes_for(3 * 512, 4096, 4096) == 12288  # lcm(1536, 4096)
    resident, rows = mapped_rows(3071, 1, 1 / 3, 512, 64 << 10)
    assert resident == 1016 and (rows - resident) % 128 == 0 and rows >= 3072
    pool = _mapped()
    store = pool.layer_store
    assert pool.resident_rows == 24 and store.rows == 104 and store.pieces_per_half == 10
    assert pool.local_kv_bytes() == 4 * 2 * 24 * 512  # only the resident rows are local
    assert store.nbytes == store.num_pieces * 4096
    with pytest.raises(ValueError, match="resident fraction above 0"):
        StreamSettings(depth=0, resident_fraction=0.0)
    with pytest.raises(ValueError, match="depth must be 0"):
        StreamSettings(depth=1)


def test_chunks_are_whole_pieces_inside_lent_runs():
    """Invariant: chunks start page-aligned in the donor's file, lie inside one run of lent
    pages of one layer's K or V rows, and `touching` finds exactly those holding a page."""
    layout = pool_of(test_layer_stream_donor.DONOR_PAGE, 4096)
    pages = list(range(10, 700)) + list(range(900, 1200))
    chunks = DonorChunks.cut(layout, pages, 4096)
    lent = set(pages)
    for off, first, last in zip(chunks.offset, chunks.first, chunks.last):
        assert (off + HEADER_BYTES) % 4096 == 0
        assert all(p in lent for p in range(first, last + 1)) and last - first == 127
    # 690 lent pages hold 5 aligned chunks of 128 per layer half at most, 300 hold 2
    assert 6 * 5 <= len(chunks) <= 6 * (5 + 2)
    hit = chunks.touching([first := int(chunks.first[3])])
    assert 3 in hit.tolist() and all(chunks.first[c] <= first <= chunks.last[c] for c in hit)
    assert DonorChunks.cut(layout, range(10, 100), 4096).offset.size == 0  # no whole chunk


def test_placed_pieces_are_the_donors_memory(twin, donor):
    """Reads are SGLang's before and after placement; a placed piece's rows are bytes of the
    donor's region: a forward's writes land there, and the donor overwriting them is what
    attention then reads (which is why a reclaim moves them out first)."""
    _fill(twin, 30)
    _forwards(twin, 0)
    store = twin.streamed.layer_store
    lease = donor.lend(store, range(0, 3000))
    assert store.place() == store.num_pieces and store.pieces_on_donor == store.num_pieces
    _forwards(twin, 2)  # new rows on donor pieces, read back in place
    c = int(np.nonzero(lease.piece >= 0)[0][0])
    off = int(lease.chunks.offset[c])
    q = int(lease.piece[c])
    view_rows = store.views[0].view(torch.uint8).view(-1)
    at = store._address(q) - store._bases[q // (2 * store.pieces_per_half)]
    assert torch.equal(donor.mapped.region[off: off + 4096], view_rows[at: at + 4096])
    donor.poison()  # a donor that reused its pages without a reclaim: the reads change
    with pytest.raises(AssertionError, match="differs"):
        twin.forward({0: 1}, "write-first")


@pytest.mark.parametrize("fault", ["reclaim", "lost", "deadline", "dead"])
def test_a_piece_leaves_its_donor_with_every_row(twin, donor, fault):
    """Placed pieces leave the donor (a reclaim of some pages, the lease lost, the read deadline
    near, the donor process found dead) with every row: after the donor overwrites its pages,
    every read still equals SGLang's pool."""
    _fill(twin, 30)
    store = twin.streamed.layer_store
    lease = donor.lend(store, range(0, 3000))
    store.place()
    _forwards(twin, 0)  # rows written on donor pieces
    if fault == "reclaim":
        c = np.nonzero(lease.piece >= 0)[0][:5]
        pages = [int(lease.chunks.first[i]) + 3 for i in c]
        touched = lease.chunks.touching(pages)  # a page is every donor layer's rows of it
        held = int((lease.piece[touched] >= 0).sum())
        assert held >= 5 and store.fence(lease, pages) == held
        assert bool((lease.piece[touched] == GONE).all())
        assert store.pieces_on_donor == store.num_pieces - held
        for i in touched:  # only the reclaimed pages are overwritten
            off = int(lease.chunks.offset[i])
            donor.mapped.region[off: off + 4096] = POISON
    elif fault == "lost":
        assert store.drop(lease) == store.num_pieces and not store.leases
        donor.poison()
    else:
        if fault == "deadline":
            donor.until = time.monotonic() + 0.5
        else:
            donor.up = False
        twin.forward({0: 1, 1: 1}, "write-first")  # the forward's start moves them out
        assert store.pieces_on_donor == 0 and twin.streamed.pieces_left_before_forward > 0
        assert store.place() == 0  # not placed again while the lease cannot be read
        donor.poison()
    _forwards(twin, 2)
    twin.forward({0: 1, 1: 1, 2: 1}, "write-first")


def test_a_reclaim_waits_for_the_forward_reading(twin, donor):
    """A reclaim on another thread returns only after the forward that started before it."""
    _fill(twin, 40)
    store = twin.streamed.layer_store
    lease = donor.lend(store, range(0, 3000))
    store.place()
    pool = twin.streamed
    pool.begin_layer_stream(None, twin.req_to_token)
    done = threading.Event()
    t = threading.Thread(target=lambda: (store.fence(lease, range(0, 3000)), done.set()))
    t.start()
    assert not done.wait(0.3)
    pool.end_layer_stream()
    assert done.wait(5)
    t.join()
    assert store.pieces_on_donor == 0


def test_cuda_is_refused_with_the_reason():
    settings = StreamSettings(depth=0, tier="donor", resident_fraction=0.5)
    cls = MappedKVPool.configured(settings)
    pool = cls.__new__(cls)
    pool.device = "cuda"
    with pytest.raises(ValueError, match="virtual memory allocations"):
        pool._create_buffers_normal()
