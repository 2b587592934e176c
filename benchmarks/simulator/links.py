"""Shared links (NVLink directions, PCIe directions) with max-min fair bandwidth sharing.

A transfer crosses a path of links (e.g. donor NVLink egress, then borrower NVLink ingress). Rates
are recomputed by progressive filling whenever a transfer starts or ends, so one transfer of B bytes
alone on a link of bandwidth W takes exactly B / W, and two equal ones sharing it take 2 B / W each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .clock import EventLoop


@dataclass(eq=False)
class Link:
    name: str
    bandwidth: float  # bytes per second
    bytes_moved: float = 0.0
    busy_time: float = 0.0  # time with at least one active transfer

    def __repr__(self) -> str:
        return f"Link({self.name}, {self.bandwidth:.3g} B/s)"


@dataclass(eq=False)
class Transfer:
    path: tuple[Link, ...]
    nbytes: float
    on_done: Callable[["Transfer"], None] | None
    tag: str = ""
    remaining: float = 0.0
    rate: float = 0.0
    start: float = 0.0
    end: float | None = None
    meta: dict = field(default_factory=dict)


class Network:
    """All links of a node; owns the active transfers and their completion events."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.links: dict[str, Link] = {}
        self.active: list[Transfer] = []
        self._last = 0.0
        self._version = 0

    def add_link(self, name: str, bandwidth: float) -> Link:
        if bandwidth <= 0:
            raise ValueError(f"link {name}: bandwidth must be positive")
        link = Link(name, bandwidth)
        self.links[name] = link
        return link

    def start(self, path, nbytes: float, on_done=None, tag: str = "") -> Transfer:
        """Begin moving `nbytes` along `path`; `on_done(transfer)` runs at completion."""
        t = Transfer(tuple(path), float(nbytes), on_done, tag, remaining=float(nbytes))
        t.start = self.loop.now
        if not t.path or nbytes <= 0:
            t.end = self.loop.now
            if on_done:
                self.loop.after(0.0, lambda: on_done(t))
            return t
        self._advance()
        self.active.append(t)
        self._reschedule()
        return t

    def rate_through(self, link: Link) -> float:
        """Current bytes/s flowing through `link` (used to charge DMA traffic against HBM)."""
        return sum(t.rate for t in self.active if link in t.path)

    # -- internals -------------------------------------------------------------------------------
    def _advance(self) -> None:
        dt = self.loop.now - self._last
        if dt > 0:
            used: set[int] = set()
            for t in self.active:
                moved = t.rate * dt
                t.remaining -= moved
                for link in t.path:
                    link.bytes_moved += moved
                    if id(link) not in used:
                        link.busy_time += dt
                        used.add(id(link))
        self._last = self.loop.now

    def _assign_rates(self) -> None:
        """Progressive filling: repeatedly saturate the link with the smallest fair share."""
        unfixed = list(self.active)
        cap = {id(link): link.bandwidth for t in unfixed for link in t.path}
        while unfixed:
            count: dict[int, int] = {}
            for t in unfixed:
                for link in t.path:
                    count[id(link)] = count.get(id(link), 0) + 1
            bottleneck = min(count, key=lambda k: cap[k] / count[k])
            share = cap[bottleneck] / count[bottleneck]
            still = []
            for t in unfixed:
                if any(id(link) == bottleneck for link in t.path):
                    t.rate = share
                    for link in t.path:
                        cap[id(link)] -= share
                else:
                    still.append(t)
            unfixed = still

    def _reschedule(self) -> None:
        self._assign_rates()
        self._version += 1
        if not self.active:
            return
        version = self._version
        nxt = min(self.active, key=lambda t: t.remaining / t.rate)
        dt = max(nxt.remaining / nxt.rate, 0.0)
        self.loop.after(dt, lambda: self._on_tick(version))

    def _on_tick(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later start/finish
        self._advance()
        # done: within 1e-9 of its bytes, or less than 1 ns of transfer left (below the float
        # resolution of the clock, where advancing by dt would move nothing)
        done = [t for t in self.active
                if t.remaining <= 1e-9 * max(1.0, t.nbytes) or t.remaining <= t.rate * 1e-9]
        self.active = [t for t in self.active if t not in done]
        self._reschedule()
        for t in done:
            t.remaining = 0.0
            t.end = self.loop.now
            if t.on_done:
                t.on_done(t)
