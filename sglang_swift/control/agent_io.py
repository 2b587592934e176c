"""The control agent's I/O side: what runs on its background thread (or in ``pump`` in manual
mode), and what the donor and borrower sides, the peer table and liveness call there.

``AgentIO`` is a mixin of ``ControlAgent`` (agent.py), which owns the state these methods use
(the link, the lock, the queues of commands, events and reclaims, the sides, the peer table);
it is split out so each file reads in one sitting. One step (``_step``): poll the link for a
batch of frames, hand them to the peer table, run the owner's reclaim handler on each new
reclaim and send its ack at once, send the owner's queued commands, run deferred work (logging
after the acks), then the periodic tick (heartbeats, liveness, request timeouts) every half
heartbeat interval.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import queue
import time
from typing import TYPE_CHECKING

from sglang_swift.common.private_resources import sweep_shm
from sglang_swift.control import discovery
from sglang_swift.control import protocol as p
from sglang_swift.control.events import Event, PeerChanged, ReclaimRequested
from sglang_swift.control.link import Link

if TYPE_CHECKING:
    from sglang_swift.control.peers import Peer

log = logging.getLogger("sglang_swift.control.agent")  # one logger name for the whole agent


class AgentIO:
    """The I/O thread's methods of ``ControlAgent`` (see the module docstring)."""

    # ---- used by the sides, on the I/O thread ----
    def now(self) -> float:
        return time.monotonic()

    def emit(self, event: Event) -> None:
        if type(event) is ReclaimRequested and self._reclaim_handler is not None:
            self._reclaims.append(event)  # to the handler first, outside the lock (_step)
        else:
            self._queue(event)

    def _queue(self, event: Event) -> None:
        """Queue ``event`` for the owner, then tell the owner's ``on_queued`` handler."""
        self._events.put(event)
        handler = self._queued_handler
        if handler is not None:
            try:
                handler(event)
            except Exception:  # the owner's bug: the event is queued all the same
                log.exception("on_queued handler failed on %s", type(event).__name__)
                with self._lock:
                    self.count("queued_handler_errors")

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def send(self, peer: Peer, body) -> None:
        env = p.Envelope(self.config.agent_id, self.epoch, peer.epoch, next(self._seq), body)
        self.count("msgs_out")
        self.link.send(peer.endpoint, env)

    def send_to(self, endpoint: str, to_epoch: int, body) -> None:
        env = p.Envelope(self.config.agent_id, self.epoch, to_epoch, next(self._seq), body)
        self.count("msgs_out")
        self.link.send(endpoint, env)

    def reply(self, routing_id: bytes, body, to_epoch: int = 0) -> None:
        env = p.Envelope(self.config.agent_id, self.epoch, to_epoch, next(self._seq), body)
        self.count("msgs_out")
        self.link.reply(routing_id, env)

    def notify(self) -> None:
        self._changed.notify_all()

    # ---- I/O thread ----
    def _command(self, fn, *args) -> None:
        self._commands.put((fn, args))
        if self.link is not None:
            self.link.wake()

    def pump(self, timeout: float = 0.0) -> None:
        """Manual mode only: handle what is ready (waiting up to ``timeout`` s), the owner's
        commands, and the periodic work that is due. Never blocks longer than ``timeout``."""
        if not self._manual:
            raise RuntimeError("pump() is for agents started with thread=False")
        self._step(min(timeout, max(0.0, self._next_tick - time.monotonic())))

    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                self._step(max(0.0, self._next_tick - time.monotonic()))
        except BaseException:
            log.exception("control agent %s I/O thread crashed", self.config.agent_id)
            raise
        finally:
            self._teardown()

    def _step(self, timeout: float) -> None:
        batch = self.link.poll(timeout)
        first = next(batch, None)  # the wait for a message (a collection may run meanwhile)
        # from a message's arrival to the acks it made, no collection runs: a reclaim's donor
        # waits for that span (see _collections_after)
        with _collections_after():
            for frames, rid, source in itertools.chain(() if first is None else (first,), batch):
                with self._lock:
                    try:
                        self._table.on_frames(frames, rid, source)
                    except Exception:  # a bug must not take the channel down with it
                        log.exception("handling a message from %s failed; dropped", source)
                        self.count("handler_errors")
            self._deliver_reclaims()  # sends each ack the handler made as soon as it returns
            self._drain_commands()
        self._run_deferred()
        with self._lock:
            self._changed.notify_all()  # wake wait_until() callers to re-check
        now = time.monotonic()
        if now >= self._next_tick:
            with self._lock:
                try:
                    self._table.tick(now)
                    self.borrower.tick(now)
                    self.donor.tick(now)
                    self._bad_log.tick(now)
                except Exception:
                    log.exception("control agent periodic work failed")
                    self.count("tick_errors")
            self._next_tick = now + self.config.heartbeat_interval_s / 2

    def _deliver_reclaims(self) -> None:
        """Run the owner's reclaim handler on each new reclaim (not under the lock: it waits for
        copies, whose threads may ask this agent for read deadlines), then queue the event."""
        while self._reclaims:
            event = self._reclaims.popleft()
            handler = self._reclaim_handler
            if handler is not None:
                with _collections_after():  # one due now runs once the ack left, not before
                    try:
                        handler(event)
                    except Exception:  # the owner's bug: its scheduler path still gets the event
                        log.exception("reclaim handler failed on %s", event.key)
                        with self._lock:
                            self.count("reclaim_handler_errors")
                    self._drain_commands()  # its ack leaves before the next reclaim's handler
            self._queue(event)

    def _run_deferred(self) -> None:
        while self._deferred:
            fn, args = self._deferred.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the owner's bug, never fatal here
                log.exception("deferred %s failed", getattr(fn, "__name__", fn))

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, args = self._commands.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                try:
                    fn(*args)
                except Exception as exc:  # the owner's mistake is logged, never fatal here
                    log.error("owner command %s%r refused: %s", fn.__name__, args[:2], exc)
                    self.count("commands_refused")

    def _setup(self) -> None:
        cfg = self.config
        # What killed servers of this user left behind (their pids are gone).
        swept = discovery.sweep(cfg.rendezvous_dir) + sweep_shm()
        if swept:
            self.count("swept", len(swept))
        if cfg.transport == "ipc":
            endpoint = discovery.ipc_endpoint(cfg.rendezvous_dir, cfg.agent_id)
        else:
            endpoint = f"tcp://{cfg.tcp_host}:{cfg.tcp_port}"
        self.link = Link(self.codec, endpoint, cfg.max_message_bytes)
        self.endpoint = self.link.endpoint
        self._record = discovery.PeerRecord(
            cfg.agent_id, self.epoch, os.getpid(), self.endpoint, self.model, self.liveness.host
        )
        discovery.publish(cfg.rendezvous_dir, self._record)
        log.info(
            "control agent %s epoch %d listening on %s", cfg.agent_id, self.epoch, self.endpoint
        )

    def _teardown(self) -> None:
        try:
            self._bad_log.tick(float("inf"))  # report what the rate limit held back
            discovery.withdraw(self.config.rendezvous_dir, self._record)
            with self._lock:
                for peer in list(self.peers.values()):
                    self.send(peer, p.Bye())
        finally:
            self.link.close(linger_ms=200)  # lets the Bye frames leave

    def on_bad(self, err: p.BadMessage, source: str) -> None:
        self.count("bad_" + err.code)
        self._bad_log(err.code, err.detail, source)

    def on_refused(self, counter: str, detail: str, env: p.Envelope) -> None:
        """A well-formed, authenticated frame that is stale, replayed or from a non-peer."""
        self.count(counter)
        self._bad_log(
            counter, f"{type(env.body).__name__} {detail}", f"{env.sender} epoch {env.epoch}"
        )

    def peer_changed(self, peer: Peer, joined: bool, reason: str = "") -> None:
        self.emit(PeerChanged(peer.agent_id, peer.epoch, joined, reason))
        self.notify()


@contextlib.contextmanager
def _collections_after():
    """No cyclic garbage collection inside: one that comes due (any thread's allocation crossing
    a threshold) runs at the first allocation after, instead. For the span a reclaim's donor
    waits for (the message handled, the fence, the ack sent): a full collection walks every
    object not frozen (SGLang freezes the heap at /freeze_gc; what traffic created since is
    not): 130 ms for 700k lists measured on this CPU, and nothing there needs one.
    Restores the state it found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
