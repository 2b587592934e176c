"""The whole hierarchy of a borrower, device -> donor pages -> host -> L3, on real CPU servers,
with two of SGLang's storage backends below the host tier: `file` and Mooncake's store (its
master started here, over TCP on 127.0.0.1); the borrower serves the GQA `small` model (K and V
rows) or the MLA `tiny-mla` (one latent row per token and layer, SGLang's MLA host pool).

Invariants:
- while the donor lends, a multi-turn replay keeps evicted prefixes in donor pages and its
  outputs are stock SGLang's, token for token (up to float near-ties, `harness.same_greedy`);
- a donor burst takes every lent page back; under write_back the borrower moves those prefixes
  into its host tier before it acknowledges; the next turns are stock's;
- prefixes that reached host were written to L3; after /flush_cache (device and host emptied,
  nothing in donor pages) the same conversations are fetched from L3 (the server's own
  `swiftcache_l3_fetched_tokens_total`) and the outputs are still stock's.

Mooncake runs where `mooncake-transfer-engine-non-cuda` and its `libibverbs.so.1` are installed
(`bash scripts/setup_mooncake.sh`); elsewhere that case skips and says what is missing.
"""

from __future__ import annotations

import ctypes.util
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from integration.harness import LocalServer, free_port, metric, wait_for
from integration.test_donation_e2e import SMALL_POOL
from integration.test_hicache_cpu import flush

from benchmarks.tools.tiny_model import MLA_SERVER_ARGS

pytestmark = pytest.mark.integration

MOONCAKE_SEGMENT = 256 << 20  # bytes the borrower gives the store: far more than it writes


def mooncake_missing() -> str | None:
    """Why Mooncake cannot run here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        if ctypes.util.find_library("ibverbs") is None:
            return f"Mooncake's store needs libibverbs.so.1 even over TCP ({e})"
        return f"mooncake-transfer-engine-non-cuda is not installed ({e})"
    if _master_binary() is None:
        return "mooncake_master is not on PATH nor beside this Python"
    return None


def _master_binary() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


@contextmanager
def mooncake_master(log_path: Path) -> Iterator[dict]:
    """Mooncake's master with its HTTP metadata server, on 127.0.0.1 and free ports, for the
    length of the block; yields a borrower's `--hicache-storage-backend-extra-config`."""
    rpc, meta, metrics = free_port(), free_port(), free_port()
    cmd = [_master_binary(), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
           "--enable_http_metadata_server=1", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={meta}", "--metrics_host=127.0.0.1",
           f"--metrics_port={metrics}"]

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited: {log_path.read_text()[-2000:]}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", rpc)) == 0

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(listening, 30, "Mooncake's master to listen")
            yield {"master_server_address": f"127.0.0.1:{rpc}",
                   "metadata_server": f"http://127.0.0.1:{meta}/metadata", "protocol": "tcp",
                   "device_name": "", "global_segment_size": MOONCAKE_SEGMENT,
                   "local_buffer_size": 64 << 20, "local_hostname": "127.0.0.1",
                   "prefetch_threshold": 16}
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def _store(backend: str, tmp_path: Path) -> Iterator[dict]:
    """The backend's extra config, with whatever it needs running for the block."""
    if backend == "mooncake":
        with mooncake_master(tmp_path / "mooncake_master.log") as extra:
            yield extra
        return
    store = tmp_path / "l3"
    store.mkdir()
    yield {"file_storage_path": str(store), "prefetch_threshold": 16}


# the borrower's model: its pool, the server options SGLang's CPU engine serves it with, and a
# replay (conversations, characters per message, turns before and after the reclaim) whose
# histories overflow that pool; the MLA model's interpreted Triton kernels want short prompts
BORROWERS = {
    "small": dict(pool=SMALL_POOL, extra=(), convs=5, chars=200, turns=(3, 4)),
    "mla": dict(pool=256, extra=MLA_SERVER_ARGS, convs=3, chars=120, turns=(2, 3)),
}


# the `file` backend through the MLA borrower, Mooncake's store through the GQA one (where
# scripts/setup_mooncake.sh installed it); the GQA borrower with `file` below its host tier:
# test_hicache_swift_e2e.py::test_l3_below_the_host_tier_serves_after_a_flush_like_stock
@pytest.mark.parametrize("shape, backend", [("small", "mooncake"), ("mla", "file")])
def test_a_borrowers_hierarchy_down_to_l3_serves_like_stock(tiny_model, tmp_path, shape,
                                                             backend, stock_servers):
    from integration.test_donation_e2e import (
        _args,
        _check,
        _donor_burst,
        _lending_donor,
        _replay,
        _stock_replays,
    )

    from benchmarks.tools.demo import wait_for_lease
    from benchmarks.tools.local_server import starting
    from benchmarks.tools.tiny_model import ensure_tiny_model
    from benchmarks.workloads.sharegpt import load_conversations

    if backend == "mooncake" and (why := mooncake_missing()):
        pytest.skip(why)
    spec = BORROWERS[shape]
    model = ensure_tiny_model(shape=shape)
    first, then = spec["turns"]
    convs = load_conversations(spec["convs"], min_turns=then,
                               max_chars_per_message=spec["chars"])
    with _store(backend, tmp_path) as extra:
        rendezvous = str(tmp_path / "rv")
        donor = _lending_donor(tiny_model, rendezvous, tmp_path / "donor.log")
        tiers = ["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy",
                 "write_back", "--hicache-mem-layout", "page_first",  # Mooncake: MHA pages
                 "--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy",
                 "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(extra)]
        borrower = LocalServer(model, max_total_tokens=spec["pool"],
                               log_path=tmp_path / "borrower.log",
                               extra_args=_args(rendezvous, "borrower", "--enable-metrics",
                                                "--swiftcache-max-borrow-blocks", "1500",
                                                *spec["extra"], *tiers))
        with starting(donor, borrower) as ready:  # they start while stock answers
            ref, ref_tail = _stock_replays(stock_servers, model, convs, first, then,
                                           pool=spec["pool"], extra=spec["extra"])
            ready()
            wait_for_lease(rendezvous, timeout_s=90)
            got = _replay(borrower, convs, first, forced=ref)
            _check(got, ref)
            in_donor = wait_for(lambda: metric(borrower, "swiftcache_donor_tier_tokens"), 30,
                                "prefixes kept in the donor tier")
            _donor_burst(donor)  # its own traffic takes every lent page back
            rescued = wait_for(lambda: metric(borrower, "swiftcache_rescued_tokens_total"), 30,
                               "the borrower to move the reclaimed prefixes into host memory")
            assert (metric(borrower, "swiftcache_revoked_tokens_total") or 0) == 0
            _check(_replay(borrower, convs, then, forced=ref_tail), ref_tail)
            written = wait_for(lambda: metric(borrower, "swiftcache_l3_written_pages_total"), 30,
                               f"pages written to {backend}")
            flush(borrower)  # writes in flight drained; device and host emptied; L3 keeps them
            assert not metric(borrower, "swiftcache_donor_tier_tokens")
            again = _replay(borrower, convs, then, forced=ref_tail)
            fetched = wait_for(lambda: metric(borrower, "swiftcache_l3_fetched_tokens_total"),
                               30, f"tokens fetched from {backend}")
            assert borrower.proc.poll() is None, borrower.log_tail()
        _check(again, ref_tail)
        print(f"{shape} on {backend}: donor tier {in_donor} tokens, rescued {rescued} into host, "
              f"{written} pages written to L3, {fetched} tokens fetched after the flush")
