"""The layer stream cache, step by step (SIMULATED): one request whose KV lives outside the local
pool, its forwards run layer by layer against per-layer loads on the simulated links.

The rules are the live server's (docs/layer_stream.md, sglang_swift/layer_stream/):
- every layer's KV lives in streamable memory: donor HBM under the lease first (read over the
  donor's NVLink egress and this GPU's NVLink ingress), then host memory (PCIe H2D); a token's
  rows of every layer live in the same place;
- D staging buffers are local; layer l uses staging l % D;
- one copy lane, in order: at layer l's first access the loads up to layer l+D-1 not yet
  enqueued, then layer l's write-through (the new tokens' rows, written to where each token
  lives: donor over NVLink egress, host over PCIe D2H). A load of layer j starts once its
  staging's last reader (layer j-D) has finished computing;
- layer l computes once layer l-1 has and its own load has landed;
- a forward reads every cached token of the request (the prefix), so each layer loads the
  prefix's rows of that layer; the new tokens are written into staging by the forward itself.
Compute per layer is the roofline of the whole forward divided by the layers, with the staged
rows (DMA writes into HBM) and the write-through reads added to its HBM bytes.
The resident twin runs the same forwards with the whole KV local: no loads, no write-through.
"""

from __future__ import annotations

from dataclasses import dataclass

from .clock import EventLoop
from .links import Network
from .roofline import Roofline


@dataclass(frozen=True)
class StreamSetup:
    """Where one streamed request's KV lives and how it reaches the GPU.

    donor_bytes: the lease, one entry per donor GPU (each reads out over its own NVLink egress);
    host_bytes: host memory streamed requests may use; nvlink_bw / pcie_bw: per direction.
    resident_tokens: the first tokens of a request have every layer's rows local (resident rows:
    never loaded, never written through). host_backed: the live server's store, every row in
    host memory (room for the resident rows too) with the leases holding copies of the first
    streamed rows, loaded from there; off: the leases hold rows host memory does not (capacities
    add up, a design the live server does not run)."""

    roofline: Roofline
    depth: int
    donor_bytes: tuple[float, ...]
    host_bytes: float
    nvlink_bw: float
    pcie_bw: float
    chunk: int
    resident_tokens: int = 0
    host_backed: bool = False

    def __post_init__(self) -> None:
        if self.depth < 1 or self.depth > self.roofline.model.layers:
            raise ValueError(f"depth {self.depth}: give 1..{self.roofline.model.layers} staging "
                             f"layers")
        if self.chunk <= 0:
            raise ValueError(f"chunk must be positive, got {self.chunk}")

    @property
    def layer_token_bytes(self) -> float:
        m = self.roofline.model
        return m.kv_bytes_per_token / m.layers

    @property
    def streamable_bytes(self) -> float:
        return self.host_bytes if self.host_backed else sum(self.donor_bytes) + self.host_bytes

    def fits(self, tokens: int) -> bool:
        """Whether a context of `tokens` fits the streamable memory (the live store holds every
        slot, resident ones included; the additive design only the streamed ones)."""
        held = tokens if self.host_backed else max(0, tokens - self.resident_tokens)
        return held * self.roofline.model.kv_bytes_per_token <= self.streamable_bytes


class _Lane:
    """One in-order copy lane: an op starts when the op before it ended and its own dependency
    (`ready`) has passed; an op is a set of transfers on the network, done when all are."""

    def __init__(self, loop: EventLoop, net: Network) -> None:
        self.loop, self.net = loop, net
        self.queue: list[tuple[list, callable, callable]] = []
        self.busy = False

    def submit(self, parts, is_ready, on_done) -> None:
        """`parts`: [(path, bytes)]; `is_ready()` says whether the dependency has passed (the lane
        is poked again when it may have)."""
        self.queue.append((parts, is_ready, on_done))
        self.poke()

    def poke(self) -> None:
        if self.busy or not self.queue or not self.queue[0][1]():
            return
        parts, _, on_done = self.queue.pop(0)
        self.busy = True
        left = [len(parts)]

        def one_done(_t=None):
            left[0] -= 1
            if left[0] == 0:
                self.busy = False
                on_done()
                self.poke()

        if not parts:
            left[0] = 1
            self.loop.after(0.0, one_done)
        for path, nbytes in parts:
            self.net.start(path, nbytes, one_done)


class StreamedRequest:
    """One request on a streaming server; `forward(prefix, new)` runs a forward and returns its
    seconds. Places tokens [0, n) donor-first as they are written."""

    def __init__(self, setup: StreamSetup, streamed: bool = True) -> None:
        self.s, self.streamed = setup, streamed
        self.loop = EventLoop()
        self.net = Network(self.loop)
        self.nvl_in = self.net.add_link("nvl_in", setup.nvlink_bw)
        self.nvl_out = self.net.add_link("nvl_out", setup.nvlink_bw)
        self.h2d = self.net.add_link("h2d", setup.pcie_bw)
        self.d2h = self.net.add_link("d2h", setup.pcie_bw)
        self.donors = [(self.net.add_link(f"donor{i}_out", setup.nvlink_bw),
                        self.net.add_link(f"donor{i}_in", setup.nvlink_bw), cap)
                       for i, cap in enumerate(setup.donor_bytes)]
        self.lane = _Lane(self.loop, self.net)
        self.last_end = 0.0  # when the previous forward's last layer finished computing
        self.stats = {"load_bytes": 0.0, "write_bytes": 0.0, "layer_wait_s": 0.0}

    # -- placement: token ranges to (path, bytes) per layer -------------------------------------
    def _parts(self, start: int, end: int, load: bool) -> list:
        """Per-layer transfers for tokens [start, end) past the resident ones: donors in order,
        then host (host-backed: loads as that, writes to host for every token besides)."""
        per = self.s.layer_token_bytes
        skip = self.s.resident_tokens
        start, end = max(start, skip) - skip, max(end, skip) - skip
        parts, pos = [], 0.0
        if end <= start:
            return parts
        for out_link, in_link, cap in self.donors:
            tokens = cap / self.s.roofline.model.kv_bytes_per_token
            lo, hi = max(start, pos), min(end, pos + tokens)
            if hi > lo:
                path = [out_link, self.nvl_in] if load else [self.nvl_out, in_link]
                parts.append((path, (hi - lo) * per))
            pos += tokens
        lo = start if self.s.host_backed and not load else max(start, pos)
        if end > lo:
            parts.append(([self.h2d] if load else [self.d2h], (end - lo) * per))
        return parts

    def _layer_compute(self, prefix: int, new: int, dma_bytes: float) -> float:
        rl, L = self.s.roofline, self.s.roofline.model.layers
        items = [(new, prefix)]
        t_c = rl.step_flops(items) / L / (rl.flops * rl.eff_compute)
        t_m = (rl.step_bytes(items) / L + dma_bytes) / (rl.hbm_bw * rl.eff_hbm)
        return max(t_c, t_m)

    def forward(self, prefix: int, new: int) -> float:
        """One forward computing `new` tokens after `prefix` cached ones; returns its seconds,
        from the previous forward's last layer to its own (a trailing write-through that holds
        the lane counts against the forward whose loads wait behind it)."""
        L, D = self.s.roofline.model.layers, self.s.depth
        t0 = self.loop.now
        if not self.streamed:
            dt = sum(self._layer_compute(prefix, new, 0.0) for _ in range(L))
            self.loop.run(until=t0 + dt)
            self.last_end = t0 + dt
            return dt
        load_parts = self._parts(0, prefix, load=True)
        write_parts = self._parts(prefix, prefix + new, load=False)
        load_b = sum(b for _, b in load_parts)
        write_b = sum(b for _, b in write_parts)
        computed = [False] * L  # computed[layer]: that layer's compute has ended
        started = [False] * L
        landed = [False] * L
        state = {"next": 0, "busy": False, "end": t0, "wait_from": t0}

        def try_compute() -> None:
            layer = state["next"]
            if state["busy"] or layer >= L or not landed[layer]:
                return
            state["busy"] = started[layer] = True
            self.stats["layer_wait_s"] += self.loop.now - state["wait_from"]
            self.lane.poke()  # this layer's write-through may go now
            dt = self._layer_compute(prefix, new, load_b + write_b)
            self.loop.after(dt, lambda layer=layer: done(layer))

        def done(layer: int) -> None:
            computed[layer] = True
            state["busy"] = False
            state["next"] = layer + 1
            state["end"] = state["wait_from"] = self.loop.now
            self.lane.poke()  # a load may have waited for this layer's staging
            try_compute()

        # The lane's order is the live server's: at a layer's first access, the loads up to
        # layer + D - 1 not yet enqueued, then that layer's write-through. The host runs ahead of
        # the device, so all of it is queued now; each op waits for its dependency: a load of
        # layer j for its staging's last reader (layer j-D) to finish, a write-through for its
        # layer to start (set_kv_buffer writes the new rows there).
        queued = 0
        for layer in range(L):
            while queued <= min(layer + D - 1, L - 1):
                j, reader = queued, queued - D
                self.lane.submit(load_parts, lambda r=reader: r < 0 or computed[r],
                                 lambda j=j: (landed.__setitem__(j, True), try_compute()))
                queued += 1
            self.lane.submit(write_parts, lambda layer=layer: started[layer], lambda: None)
        self.stats["load_bytes"] += L * load_b
        self.stats["write_bytes"] += L * write_b
        self.loop.run()
        if not all(computed):
            raise RuntimeError(f"forward stalled at layer {state['next']} of {L} (depth {D})")
        dt, self.last_end = state["end"] - self.last_end, state["end"]
        return dt


def run_request(setup: StreamSetup, context: int, decode_steps: int, streamed: bool = True) -> dict:
    """A request of `context` prompt tokens: chunked prefill, then `decode_steps` decode steps.
    Returns TTFT (the prefill's forwards), the mean decode step, and bytes moved."""
    if context <= 0 or decode_steps < 0:
        raise ValueError(f"context must be positive and decode_steps >= 0, got {context}, "
                         f"{decode_steps}")
    need = (context + decode_steps) * setup.roofline.model.kv_bytes_per_token
    if streamed and not setup.fits(context + decode_steps):
        raise ValueError(f"{context + decode_steps} tokens need {need / 1e9:.1f} GB of streamable "
                         f"memory, the setup has {setup.streamable_bytes / 1e9:.1f} GB "
                         f"({'host' if setup.host_backed else 'donor lease + host'})")
    req = StreamedRequest(setup, streamed)
    ttft, done = 0.0, 0
    while done < context:
        n = min(setup.chunk, context - done)
        ttft += req.forward(done, n)
        done += n
    steps = [req.forward(context + k, 1) for k in range(decode_steps)]
    return {"context": context, "ttft_s": ttft,
            "decode_step_s": sum(steps) / len(steps) if steps else None,
            "decode_steps": decode_steps, **req.stats}
