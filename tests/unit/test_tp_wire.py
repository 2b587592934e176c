"""The TP wire between the ranks of one server (integration/tp_sync.py): msgpack bytes, never
pickle, moved as uint8 tensors over a gloo group, size first.

Invariants: every control event and a pump's lease view survive the round trip as the same
typed values; a value that has no wire form is refused with its type named, not pickled; over a
real two-process gloo group, `share` gives every rank rank 0's value (nothing to say is None),
`gather` every rank's value in rank order (payloads of different lengths), and a rank speaking
another wire version is refused with the versions named."""

from __future__ import annotations

import os
import pickle
import socket

import msgspec
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_swift.control import (
    BlocksReturned,
    LeaseGranted,
    LeaseKey,
    LeaseLost,
    MemoryDescriptor,
    PeerChanged,
    ReclaimRequested,
    RequestFailed,
)
from sglang_swift.control.protocol import PoolLayoutMsg
from sglang_swift.integration import tp_sync
from sglang_swift.integration.tp_sync import LendStep, PumpStep, SglangTpGroup, decode, encode

KEY = LeaseKey("donor-7", 3, 42)
MEMORY = MemoryDescriptor(kind="shm", handle=b"/swift-x", device="cpu", total_bytes=8192,
                          block_bytes=4096, num_blocks=1, owner_pid=123, owner_uuid="u-1",
                          layout=PoolLayoutMsg(2, 64, 80, 1, 16, 16, "float32", 1, 0))
EVENTS = [LeaseGranted(5, KEY, (1, 2, 9), MEMORY), RequestFailed(6, "donor-7", "no_capacity"),
          ReclaimRequested(KEY, 11, (2, 9), 1234.5), LeaseLost(KEY, (1,), "left"),
          BlocksReturned((4, 5)), PeerChanged("donor-7", 3, False, "left", at=99.25)]


def test_a_pump_step_round_trips_as_the_same_typed_values():
    step = PumpStep.of(EVENTS, {("donor-7", 42): True, ("donor-8", 1): False},
                       {"donor-7": 1300.0, "donor-8": 0.0})
    raw = encode(step)
    assert b"pickle" not in raw and not raw.startswith(b"\x80")  # msgpack, not a pickle
    events, view, deadlines = decode(raw, PumpStep).unpack()
    assert events == EVENTS and [type(e) for e in events] == [type(e) for e in EVENTS]
    assert isinstance(events[0].key, LeaseKey) and events[0].memory == MEMORY
    assert view == {("donor-7", 42): True, ("donor-8", 1): False}
    assert deadlines == {"donor-7": 1300.0, "donor-8": 0.0}
    assert decode(encode(LendStep(demand=3)), LendStep) == LendStep(3, 0)


def test_what_has_no_wire_form_is_refused_not_pickled():
    with pytest.raises(TypeError, match="no TP wire form for control event object"):
        PumpStep.of([object()], {}, {})
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(msgspec.ValidationError):  # typed decode refuses a wrong shape
        decode(encode({"events": 1}), PumpStep)
    with pytest.raises(msgspec.DecodeError):
        decode(pickle.dumps(EVENTS), PumpStep)


class _Coordinator:
    """What SglangTpGroup reads of SGLang's GroupCoordinator."""

    def __init__(self, rank: int, size: int):
        self.rank_in_group, self.world_size = rank, size
        self.ranks = list(range(size))
        self.cpu_group = dist.group.WORLD


def _rank(rank: int, size: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = SglangTpGroup(_Coordinator(rank, size))
        mine = PumpStep.of(EVENTS if rank == 0 else [], {("d", rank): True}, {"d": 1.0})
        got = group.share(mine, PumpStep)
        nothing = group.share(None if rank == 0 else mine, PumpStep)
        rows = group.gather(["x" * (10 * rank + 1), rank])
        ok = group.all_ok(rank == 0)
        group.barrier()
        out[rank] = (got.unpack(), nothing, rows, ok)
        tp_sync.TP_WIRE_VERSION = 1 + rank  # rank 1 now speaks another version
        try:
            group.gather(None)
        except RuntimeError as exc:
            out[f"err{rank}"] = str(exc)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_share_and_gather_over_a_real_gloo_group_of_two_processes():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0], dict(out)
        results = dict(out)
    for rank in range(2):
        (events, view, _), nothing, rows, ok = results[rank]
        assert events == EVENTS and view == {("d", 0): True}  # rank 0's, on every rank
        assert nothing is None
        assert rows == [["x", 0], ["x" * 11, 1]]
        assert ok is False
    assert "TP wire version 2" in results["err0"] and "version 1" in results["err1"]


def test_a_grant_of_a_tp_donor_names_every_rank_pool_on_the_control_wire():
    """Invariant: `MemoryDescriptor.ranks` (every rank's region and layout, rank 0's first)
    crosses the control channel's signed msgpack frames intact; a one-region descriptor's
    dict has no `ranks` key (what a --tp 1 donor exports is unchanged)."""
    from sglang_swift.control import protocol as p

    ranks = [MEMORY.to_dict(), {**MEMORY.to_dict(), "handle": b"/swift-y", "owner_uuid": "u-2"}]
    memory = MemoryDescriptor.coerce({**MEMORY.to_dict(), "ranks": ranks})
    codec = p.Codec(b"k" * 32)
    grant = p.Grant(request_id=1, lease_id=2, epoch=3, blocks=[4, 5], memory=memory)
    env = codec.decode(codec.encode(p.Envelope("donor", 3, 0, 1, grant)))
    assert env.body.memory == memory
    assert [r.owner_uuid for r in env.body.memory.ranks] == ["u-1", "u-2"]
    assert env.body.memory.ranks[1].layout == MEMORY.layout
    assert "ranks" not in MEMORY.to_dict() and memory.to_dict()["ranks"][1]["handle"] == b"/swift-y"
