"""ControlAgent: one per SwiftCache server, in its scheduler process, beside the scheduler loop.

The agent owns a background I/O thread; every public method is thread-safe and never blocks
on the network. The owner (the scheduler) talks to it through commands and drains events:

* Donor owner: ``set_memory(descriptor)``, ``offer(blocks)`` to lend blocks it does not use,
  ``demand(n)`` / ``report_free(n)`` when it needs memory back; it then receives
  ``BlocksReturned`` once blocks are safe to reuse (never earlier).
* Borrower owner: ``request(n)`` -> request id; then ``LeaseGranted`` or ``RequestFailed``.
  On ``ReclaimRequested`` it stops reading the blocks, then calls ``ack_reclaim(event)``; it
  must never read them after acking. ``LeaseLost`` means the blocks are gone. It may read a
  donor's blocks only while ``time.monotonic() < read_deadline(donor)`` (or per lease,
  ``read_deadline(donor, lease_id)``); a deadline that passes while the donor lives moves
  again once the donor re-validates the lease (the lease, its blocks and their content stay).
  ``release(key)`` gives blocks back early. Events come from ``poll_events()`` or
  ``next_event(timeout)``. An owner whose own loop may not drain events for a while (a
  scheduler in a long forward) registers ``on_reclaim(handler)``: each ReclaimRequested is
  then handed to ``handler`` on the I/O thread at once, and an ``ack_reclaim`` it makes leaves
  in the same I/O step (the event is still queued for the owner afterwards). An owner whose
  loop may sleep until its own input comes registers ``on_queued(handler)``: each event is handed
  to ``handler`` on the I/O thread right after it is queued (to wake that loop).

With tensor parallelism only one rank (rank 0) creates the agent; it speaks for the server,
and the data plane forwards grants and reclaims to the other ranks. ``agent_id`` must be
unique per live server on the node and stable across restarts (a restart gets a new epoch).
Owner commands found invalid on the I/O thread (say, offering a block twice) are logged and
counted (``commands_refused``), never raised there. Events queue up until drained.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import queue
import threading
from collections.abc import Callable

from sglang_swift.control import discovery
from sglang_swift.control import protocol as p
from sglang_swift.control.agent_io import AgentIO
from sglang_swift.control.auth import ensure_private_dir, load_or_create_secret
from sglang_swift.control.borrower import BorrowerSide
from sglang_swift.control.control_config import ControlConfig
from sglang_swift.control.donor import DonorSide
from sglang_swift.control.events import Event, LeaseKey, ReclaimRequested
from sglang_swift.control.link import BadMessageLog, Link
from sglang_swift.control.liveness import Liveness
from sglang_swift.control.peers import Peer, PeerTable
from sglang_swift.control.status import agent_status

log = logging.getLogger(__name__)


class ControlAgent(AgentIO):
    """The owner's API and the agent's state; its I/O thread's methods are in agent_io.py."""

    def __init__(
        self,
        config: ControlConfig,
        *,
        model: str = "",
        memory: p.MemoryDescriptor | dict | None = None,
    ) -> None:
        self.config, self.model = config, model
        self.capacity: p.CapacityStatus | None = None
        ensure_private_dir(config.rendezvous_dir)
        self.codec = p.Codec(load_or_create_secret(config.secret_path), config.max_message_bytes)
        self.epoch = discovery.next_epoch(config.rendezvous_dir, config.agent_id)
        self.peers: dict[str, Peer] = {}
        self.counters: dict[str, int] = {}
        self.donor = DonorSide(self)
        self.borrower = BorrowerSide(self)
        self._avoided: frozenset = frozenset()  # donors whose memory cannot be read from here
        if memory is not None:
            self.donor.set_memory(p.MemoryDescriptor.coerce(memory))
        self.liveness = Liveness(self)
        self._table = PeerTable(self)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._reclaim_handler: Callable[[ReclaimRequested], None] | None = None
        self._queued_handler: Callable[[Event], None] | None = None
        self._reclaims: collections.deque = collections.deque()  # for the handler (I/O thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._deferred: collections.deque = collections.deque()  # defer(): after the acks
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._bad_log = BadMessageLog()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.link: Link | None = None
        self.endpoint = ""
        self._manual = False
        self._next_tick = 0.0

    # ---- lifecycle ----
    def start(self, timeout: float = 10.0, *, thread: bool = True) -> ControlAgent:
        """Bind, publish and begin. ``thread=False`` is manual mode: no background thread;
        the owner calls ``pump()`` from its own loop often enough (well within the heartbeat
        interval), which avoids competing for the GIL but stalls heartbeats while it is busy."""
        atexit.register(self._stop_at_exit)  # an interpreter exit without stop() still cleans up
        if not thread:
            self._setup()
            self._manual = True
            return self
        self._thread = threading.Thread(
            target=self._run, name=f"swift-ctl-{self.config.agent_id}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout) or self._error:
            self.stop()
            raise RuntimeError(f"control agent failed to start: {self._error}")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Say goodbye to peers (their leases with us end), close sockets, withdraw the record."""
        atexit.unregister(self._stop_at_exit)
        if self._manual:
            self._manual = False
            self._teardown()
            return
        self._stop.set()
        if self.link is not None:
            self.link.wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def _stop_at_exit(self) -> None:
        if self.is_alive():
            self.stop()

    def is_alive(self) -> bool:
        """False once stopped (or if the I/O thread died, which is logged)."""
        return self._manual or (self._thread is not None and self._thread.is_alive())

    def __enter__(self) -> ControlAgent:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- owner API (thread-safe, non-blocking) ----
    def set_capacity(self, kv_pool_tokens: int, lent_tokens: int, borrowed_tokens: int,
                     usable_tokens: int, **tiers: int) -> None:
        """The owner's KV capacity for `status()` (one reference swap: no lock needed);
        `tiers`: the lower tiers' fields of `CapacityStatus` (donor_tier_tokens, ...)."""
        self.capacity = p.CapacityStatus(int(kv_pool_tokens), int(lent_tokens),
                                         int(borrowed_tokens), int(usable_tokens),
                                         **{k: int(v) for k, v in tiers.items()})

    def set_memory(self, memory: p.MemoryDescriptor | dict) -> None:
        """The arena this donor lends (the data plane's descriptor dict or struct). Its
        An empty ``owner_uuid`` becomes ``"<agent_id>:<epoch>"`` in every grant."""
        self._command(self.donor.set_memory, p.MemoryDescriptor.coerce(memory))

    def offer(self, blocks) -> None:
        self._command(self.donor.offer, list(blocks))

    def demand(self, n: int) -> None:
        """The owner needs ``n`` offered blocks back; they arrive as BlocksReturned events."""
        self._command(self.donor.demand, int(n))

    def report_free(self, owner_free_blocks: int) -> None:
        """The owner's own free blocks; below ``low_watermark_blocks`` the shortfall is
        demanded back. Report again only after applying the BlocksReturned events received."""
        self._command(self.donor.report_free, int(owner_free_blocks))

    def request(self, num_blocks: int, priority: int = 0, donor: str | None = None) -> int:
        """Ask ``donor`` (default: the peer advertising the most) for blocks; the answer is a
        LeaseGranted (maybe fewer blocks) or RequestFailed event carrying the returned id."""
        if not 1 <= num_blocks <= p.MAX_BLOCKS_PER_MESSAGE or not 0 <= priority <= 100:
            raise ValueError(
                f"request({num_blocks}, priority={priority}): need 1..{p.MAX_BLOCKS_PER_MESSAGE}"
                " blocks and priority 0..100"
            )
        rid = next(self._ids)
        self._command(self.borrower.request, rid, int(num_blocks), int(priority), donor)
        return rid

    def ack_reclaim(self, event: ReclaimRequested) -> None:
        """Tell the donor the reclaimed blocks are no longer read or written here (a second
        ack of the same reclaim, or one for a lease lost meanwhile, is ignored)."""
        self._command(self.borrower.ack, event.key, event.reclaim_id)

    def defer(self, fn: Callable[..., None], *args) -> None:
        """Run ``fn(*args)`` on the I/O thread once the commands queued so far (a reclaim
        handler's ack) are sent, outside the agent's lock: for a handler's logging, which must
        not delay the ack. An exception in it is logged."""
        self._deferred.append((fn, args))
        if self.link is not None and threading.current_thread() is not self._thread:
            self.link.wake()

    def on_reclaim(self, handler: Callable[[ReclaimRequested], None] | None) -> None:
        """Deliver each ReclaimRequested to ``handler`` on the I/O thread as soon as it arrives,
        outside the agent's lock (so it may wait on threads that call this agent), before the
        event is queued for ``poll_events``. The handler stops using the blocks and may call
        ``ack_reclaim``; it delays this agent's I/O while it runs, so it must be short (stop
        copies, not wait for a scheduler). An exception in it is logged and counted
        (``reclaim_handler_errors``); the owner still gets the event. None unregisters."""
        self._reclaim_handler = handler

    def on_queued(self, handler: Callable[[Event], None] | None) -> None:
        """Hand each event to ``handler`` on the I/O thread right after it is queued for
        ``poll_events`` (a reclaim after its ``on_reclaim`` handler ran), so an owner whose loop
        sleeps until input comes can wake it: whatever the woken loop polls then holds the event.
        The handler must be short and never block (it may run under the agent's lock); an
        exception in it is logged and counted (``queued_handler_errors``). None unregisters."""
        self._queued_handler = handler

    def release(self, key: LeaseKey, blocks=None) -> None:
        self._command(self.borrower.release, key, None if blocks is None else list(blocks))

    def read_deadline(self, donor: str, lease_id: int | None = None) -> float:
        """CLOCK_MONOTONIC time until which ``donor``'s blocks (of ``lease_id`` only, when
        given) may be read; 0.0 when no lease from it is held. See BorrowerSide."""
        with self._lock:
            return self.borrower.read_deadline(donor, lease_id)

    def poll_events(self) -> list[Event]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def next_event(self, timeout: float | None = None) -> Event | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_until(self, predicate, timeout: float) -> bool:
        """Block the caller until ``predicate(agent)`` holds (checked under the agent's lock
        after every batch of I/O) or ``timeout`` passes. Not for manual mode: pump instead."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    def status(self) -> p.AgentStatus:
        with self._lock:
            return agent_status(self)

    def peer_count(self) -> int:
        """Known live peers: what the owner's step needs, without building a whole status."""
        with self._lock:
            return len(self.peers)

    def check_integrity(self) -> None:
        with self._lock:
            self.donor.ledger.check_integrity()
            self.borrower.check_integrity()

    def pick_donor(self, num_blocks: int) -> Peer | None:
        avoid = self._avoided
        best = max((q for q in list(self.peers.values()) if q.agent_id not in avoid),
                   key=lambda q: q.lendable, default=None)
        return best if best is not None and best.lendable > 0 else None

    def avoid_donor(self, agent_id: str) -> None:
        """Never ask `agent_id` for a lease again (its memory cannot be read from here); any
        thread (one reference swap)."""
        self._avoided = self._avoided | {agent_id}

    def donor_layout(self) -> p.PoolLayoutMsg | None:
        """The pool layout (from its Hello) of the donor a request would go to now, if it lends
        its own pool: a borrower sizes its first request in that pool's pages. Any thread."""
        best = self.pick_donor(1)
        return best.hello.layout if best is not None else None
