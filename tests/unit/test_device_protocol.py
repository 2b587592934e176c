"""The GPU branch of the data plane, run on the emulated asynchronous device (dataplane/
emulated.py): copies that complete later than they are issued, events, the stream the forward
runs on. These are the real `PoolTransferEngine`, `BatchLayerCounter`, `TimedLayerCounter`,
`LayerCounter`, `DeviceLane` and `copies.store_now` that a GPU runs; only the device is
emulated."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sglang_swift.dataplane import EmulatedDevice, LayerCounter, streams
from sglang_swift.dataplane.streams import DeviceLane
from sglang_swift.integration.copies import store_now
from sglang_swift.integration.layer_fan_in import BatchLayerCounter, TimedLayerCounter
from tests.unit.test_pool_transfer import Lease, same

COPY_S = 0.04  # each layer's copy takes this long on the lane's stream
COMPUTE_S = 0.01  # each layer's attention stand-in on the forward stream


@pytest.fixture
def dev():
    device = EmulatedDevice()
    yield device
    assert not device.errors, device.errors


def _stored_lease(dev, n=16):
    """A lease whose blocks hold the K/V of `n` borrower slots, and those slots poisoned after
    (the load must bring the bytes back), with a device-lane engine."""
    lease = Lease("layers", rows=64, seed=3)
    engine = lease.engine(lane=DeviceLane(dev))
    slots = lease.slots(n, aligned=True, seed=1)
    blocks = list(range(n // lease.g.page_size))
    handle = engine.begin_store(slots, blocks)
    handle.wait(10)  # the store's result, then the lane synchronized
    expect = ([k[slots].clone() for k in lease.k], [v[slots].clone() for v in lease.v])
    for buf in (*lease.k, *lease.v):
        buf[slots] = 0
    return lease, engine, slots, blocks, expect


def _forward(dev, forward, counter, layers, expect, slots, lease, log):
    """The forward stand-in, on `forward`: for each layer, attention asks the counter for the
    layer (host side, as SGLang's pool getter does) and then computes on the stream, checking
    the layer's bytes are in place when it runs."""
    with dev.stream(forward):
        for layer in range(layers):
            counter.wait_until(layer)

            def attend(layer=layer):
                log.append(("attend", layer, time.perf_counter()))
                ok = (same(lease.k[layer][slots], expect[0][layer])
                      and same(lease.v[layer][slots], expect[1][layer]))
                log.append(("bytes", layer, ok))
                time.sleep(COMPUTE_S)

            dev.launch(attend)


def test_attention_reads_layer_0_while_later_layers_still_copy_on_a_device_lane(dev):
    """Invariant (HiCache's LayerDoneCounter pattern, one protocol on every device): a batch
    load sealed on the scheduler's stream makes the forward's stream wait for exactly layer l's
    copy before attention on layer l, and for nothing else: attention on layer 0 starts before
    the last layer's copy completes, and every layer's bytes are in place when it is read."""
    lease, engine, slots, blocks, expect = _stored_lease(dev)
    layers = lease.g.num_layers
    schedule, forward = dev.Stream("schedule"), dev.Stream("forward")
    timed = TimedLayerCounter(LayerCounter(layers, timeout_s=10))
    log: list = []
    with dev.stream(schedule):  # SGLang's scheduler loop runs with its schedule stream current
        fan = BatchLayerCounter(timed)

        def slow(layer):  # on the lane's stream, before layer l's copy
            dev.launch(lambda: (time.sleep(COPY_S), log.append(("copying", layer))))

        handle = engine.begin_load(slots, blocks, fan, before_layer=slow)
        fan.seal()
        with dev.stream(engine.lane.stream):
            dev.launch(lambda: log.append(("copied", layers - 1, time.perf_counter())))
    timed.set_consumer(fan.pid)
    forward.wait_stream(schedule)  # as SGLang's run_batch does before the forward
    _forward(dev, forward, timed, layers, expect, slots, lease, log)
    forward.synchronize()
    assert handle.wait(10).ok
    first_attend = next(t for kind, layer, t in (e for e in log if len(e) == 3)
                        if kind == "attend" and layer == 0)
    last_copied = next(e[2] for e in log if e[0] == "copied")
    assert first_attend < last_copied, "layer 0 was read only after every layer's copy"
    assert [e[2] for e in log if e[0] == "bytes"] == [True] * layers
    # each layer was read after its own copy: the forward stream waited on that layer's event
    order = [(e[0], e[1]) for e in log if e[0] in ("copying", "attend")]
    for layer in range(layers):
        assert order.index(("copying", layer)) < order.index(("attend", layer))


def test_a_failed_part_is_reported_and_the_healthy_part_is_still_waited_on_per_layer(dev):
    """Invariant: a part that could not start (its donor not readable) adds no event and is
    named by `failed_parts` (its requests are dropped after the forward); each layer of the
    pool's counter carries exactly the healthy part's event for that layer."""
    lease, engine, slots, blocks, expect = _stored_lease(dev)
    layers = lease.g.num_layers
    inner = LayerCounter(layers, timeout_s=10)
    fan = BatchLayerCounter(TimedLayerCounter(inner))
    handle = engine.begin_load(slots, blocks, fan)
    fan.fail_part("lease gone")
    fan.seal()
    slot = inner._slots[fan.pid]
    assert [len(events) for events in slot.events] == [1] * layers
    assert len({id(events[0]) for events in slot.events}) == layers
    assert handle.wait(10).ok and fan.failed_parts() == {1: "lease gone"}


def _runtime(engine):
    tracked = []
    return SimpleNamespace(lease_engine=lambda *key: engine,
                           track=lambda key, handle, blocks: tracked.append(handle),
                           untrack=lambda key, handle: None, tracked=tracked)


def _write_rows(lease, slots, value, delay_s=0.0):
    def write():
        time.sleep(delay_s)
        for buf in (*lease.k, *lease.v):
            buf.view(torch.uint8)[slots] = value

    return write


def _donor_rows(lease, blocks, n, dev):
    """What the lease's blocks hold, loaded into fresh slots through the same device lane."""
    k = [torch.zeros_like(b) for b in lease.k]
    v = [torch.zeros_like(b) for b in lease.v]
    engine = lease.engine(k, v, lane=DeviceLane(dev))
    dst = torch.arange(n)
    counter = LayerCounter(lease.g.num_layers, timeout_s=10)
    assert engine.begin_load(dst, blocks, counter).wait(10).ok
    return [b.view(torch.uint8)[dst] for b in (*k, *v)]


@pytest.mark.parametrize("follow", [True, False])
def test_a_store_reads_rows_after_the_forward_that_wrote_them(dev, follow):
    """Invariant (SGLang 0.5.23 runs the forward on `model_runner.forward_stream`, apart from
    the scheduler's stream under overlap scheduling): with the forward stream followed, a store
    issued on the scheduler's stream while the forward still writes the rows copies what the
    forward wrote, and the slots, reused by the next forward right after `store_now` returns,
    are rewritten only after the store read them: the donor holds the first forward's bytes.
    Without it (the control) the store reads the rows before the forward wrote them."""
    lease = Lease("layers", rows=64, seed=5)
    engine = lease.engine(lane=DeviceLane(dev))
    n = 16
    slots = lease.slots(n, aligned=True, seed=2)
    blocks = list(range(n // lease.g.page_size))
    _write_rows(lease, slots, 0x11)()
    schedule, forward = dev.Stream("schedule"), dev.Stream("forward")
    streams.follow_forward_stream(dev, forward if follow else None)
    try:
        with dev.stream(forward):  # the forward that writes the rows, still running
            dev.launch(_write_rows(lease, slots, 0x22, delay_s=0.2))
        with dev.stream(schedule):  # an eviction on the scheduler thread stores them
            ok, copy = store_now(_runtime(engine), ("donor", 1), slots, blocks)
        assert ok and copy is not None
        forward.wait_stream(schedule)  # the next forward, after the scheduler's stream
        with dev.stream(forward):
            dev.launch(_write_rows(lease, slots, 0x33))
        forward.synchronize()
        engine.lane.synchronize()
    finally:
        streams.follow_forward_stream(dev, None)
    held = {int(x) for rows in _donor_rows(lease, blocks, n, dev) for x in rows.unique()}
    assert held == ({0x22} if follow else {0x11})
    assert lease.k[0].view(torch.uint8)[slots].unique().tolist() == [0x33]


def test_host_synchronisations_are_counted_with_their_thread_and_site(dev):
    """Invariant: the emulated device logs every host wait (event and stream synchronize) with
    the thread that made it and where, and not a query or a device-side wait."""
    s = dev.Stream("x")
    gate = threading.Event()
    s.launch(gate.wait)
    marker = streams.record_event(s)
    with dev.counting_syncs() as found:
        assert not streams.marker_done(marker)
        streams.wait_event_on_current_stream(marker)  # device side: no host wait
        gate.set()
        streams.wait_marker(marker)
    assert [what for what, _ in found] == ["Event.synchronize"]
    assert "test_device_protocol.py" in found[0][1]
    dev.default_stream.synchronize()
