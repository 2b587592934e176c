"""The TP ranks of one server agree on everything that changes the tree.

SGLang's TP ranks each run a scheduler and keep identical radix trees: every rank takes the same
requests in the same loop (rank 0 receives them and broadcasts them on the TP CPU group,
`request_receiver.py`), and every decision that follows is a function of that state. SwiftCache's
lower tiers add inputs that are not: control events arrive on rank 0's agent thread, read
deadlines and copy outcomes depend on each rank's clock and copy thread. So, with `--tp > 1`:

- **decided on rank 0, applied everywhere**: the one control agent runs on rank 0; each
  scheduler loop rank 0 shares the control events it took from its agent and its view of which
  leases are readable (`PumpStep`), and a lending server what it lends or takes back
  (`LendStep`); every rank applies them in the same order at the same step (`TpGroup.share`);
- **agreed by every rank**: an outcome that a rank's own copy decides (a store, a load, a
  grant mapped) counts as a success only when it succeeded on every rank (`all_ok`,
  `all_ok_each`, `union` of the failures), so a rank that falls behind or fails a copy makes
  the others drop the same prefix, never keep a different tree;
- **acknowledged after every rank**: a reclaim is acknowledged by rank 0 only after every rank
  stopped reading the pages (`barrier` after each rank's fence).

The wire between the ranks: msgpack (msgspec), never pickle. A value is encoded to bytes and
moved as a uint8 tensor over SGLang's TP CPU (gloo) group, size first, then the payload
(`SglangTpGroup`); a collective with nothing to say costs the size alone. What crosses is plain
data or the typed structs below (control events inside tagged boxes, `MemoryDescriptor` as the
control protocol defines it), decoded against the type the caller names.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence, Union

import msgspec

from ..control.events import (
    BlocksReturned,
    LeaseGranted,
    LeaseLost,
    PeerChanged,
    ReclaimRequested,
    RequestFailed,
)

# Sent beside every size; ranks of one server run one build, so a mismatch means a rank runs
# another SwiftCache than its server (refused loudly, not decoded).
TP_WIRE_VERSION = 1


# ---- what crosses between the ranks ------------------------------------------------------------
class _Box(msgspec.Struct, frozen=True, tag_field="t"):
    """A control event (`control/events.py`, a dataclass) tagged with its kind."""


# One box per event kind, with its wire tag: `_Box` subclasses with the one field `ev`.
_BOXES = {ev.__name__: msgspec.defstruct(f"_{ev.__name__}Box", [("ev", ev)], bases=(_Box,),
                                         tag=tag, module=__name__)
          for tag, ev in (("granted", LeaseGranted), ("failed", RequestFailed),
                          ("reclaim", ReclaimRequested), ("lost", LeaseLost),
                          ("returned", BlocksReturned), ("peer", PeerChanged))}
EventBox = Union[tuple(_BOXES.values())]


class LeaseReadable(msgspec.Struct, frozen=True, array_like=True):
    """Whether matches may offer lease (donor, lease_id) until the next pump."""

    donor: str
    lease_id: int
    readable: bool


class PumpStep(msgspec.Struct, frozen=True):
    """What rank 0 shares at a pump: its agent's events in its order, its lease view, and each
    donor's read deadline (CLOCK_MONOTONIC seconds, one clock for every rank of the host)."""

    events: list[EventBox]
    view: list[LeaseReadable]
    deadlines: dict[str, float]

    @classmethod
    def of(cls, events: Sequence[Any], view: dict, deadlines: dict) -> "PumpStep":
        boxes = []
        for ev in events:
            box = _BOXES.get(type(ev).__name__)
            if box is None:
                raise TypeError(f"no TP wire form for control event {type(ev).__name__}")
            boxes.append(box(ev))
        return cls(boxes, [LeaseReadable(d, int(i), bool(ok)) for (d, i), ok in view.items()],
                   {str(k): float(v) for k, v in deadlines.items()})

    def unpack(self) -> tuple[list, dict, dict]:
        """(events, {(donor, lease_id): readable}, deadlines)."""
        return ([box.ev for box in self.events],
                {(r.donor, r.lease_id): r.readable for r in self.view}, dict(self.deadlines))


class LendStep(msgspec.Struct, frozen=True):
    """A lending server's step, decided on rank 0 (`PoolLender.plan`): pages to demand back,
    and how many to take out of every rank's allocator and lend (the same page ids on every
    rank, checked: `PoolLender.apply`)."""

    demand: int = 0
    lend: int = 0


def encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def decode(data: bytes, type: Any = Any) -> Any:
    return msgspec.msgpack.decode(data, type=type)


class TpGroup:
    """The TP ranks of one server as SwiftCache uses them: `rank` of `size`, rank 0 decides.
    Every method is a collective: each rank calls it at the same point, in the same order.
    Values cross as msgpack (`encode`); a transport implements `_share_bytes` and
    `_gather_bytes`."""

    rank: int = 0
    size: int = 1

    def share(self, obj: Any, type: Any = Any) -> Any:
        """Rank 0's `obj` on every rank, decoded as `type` (what the others pass is ignored;
        None, or nothing to say, costs one size broadcast)."""
        data = encode(obj) if self.leader and obj is not None else b""
        out = self._share_bytes(data)
        return decode(out, type) if out else None

    def gather(self, obj: Any, type: Any = Any) -> list:
        """Every rank's `obj`, in rank order, on every rank, each decoded as `type`."""
        return [decode(raw, type) for raw in self._gather_bytes(encode(obj))]

    def _share_bytes(self, data: bytes) -> bytes:
        """Rank 0's `data` on every rank (b"" for nothing)."""
        raise NotImplementedError

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order, on every rank."""
        raise NotImplementedError

    # ---- agreement, built on gather ------------------------------------------------------------
    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` was true on every rank."""
        return all(self.gather(bool(ok), bool))

    def all_ok_each(self, oks: Sequence[bool]) -> list[bool]:
        """Element-wise `all_ok` of equally long lists (one entry per item every rank has)."""
        rows = self.gather([bool(x) for x in oks], list[bool])
        if any(len(r) != len(oks) for r in rows):
            raise RuntimeError(f"TP ranks disagree on the number of items: "
                               f"{[len(r) for r in rows]} (their trees diverged)")
        return [all(col) for col in zip(*rows)] if rows else []

    def union(self, items: Iterable[int | str]) -> set:
        """The union of every rank's `items` (ints or strings)."""
        out: set = set()
        for part in self.gather(sorted(set(items)), list[int | str]):
            out.update(part)
        return out

    def barrier(self) -> None:
        self.gather(None)


class SglangTpGroup(TpGroup):
    """SGLang's TP group (`GroupCoordinator`, `TreeCacheBuildContext.tp_group`): its CPU (gloo)
    group carries SwiftCache's bytes as uint8 tensors, beside SGLang's own request broadcast:
    an int64 pair (wire version, byte count) first, then the payload when there is one."""

    def __init__(self, coordinator: Any):
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.size = coordinator.world_size

    def _share_bytes(self, data: bytes) -> bytes:
        import torch
        import torch.distributed as dist

        c = self.coordinator
        src = c.ranks[0]  # a global rank, as torch.distributed's src is
        head = torch.tensor([TP_WIRE_VERSION, len(data) if self.leader else 0],
                            dtype=torch.int64)
        dist.broadcast(head, src=src, group=c.cpu_group)
        n = _checked(head, "rank 0")
        if n == 0:
            return b""
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.leader
               else torch.empty(n, dtype=torch.uint8))
        dist.broadcast(buf, src=src, group=c.cpu_group)
        return data if self.leader else buf.numpy().tobytes()

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        import torch
        import torch.distributed as dist

        group = self.coordinator.cpu_group
        head = torch.tensor([TP_WIRE_VERSION, len(data)], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(self.size)]
        dist.all_gather(heads, head, group=group)
        sizes = [_checked(h, f"rank {r}") for r, h in enumerate(heads)]
        longest = max(sizes)
        if longest == 0:
            return [b""] * self.size
        buf = torch.zeros(longest, dtype=torch.uint8)  # gloo gathers equal sizes: padded
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(bufs, buf, group=group)
        return [b[:n].numpy().tobytes() for b, n in zip(bufs, sizes)]


def _checked(head: Any, who: str) -> int:
    """The byte count of a size pair, after checking its wire version."""
    version, n = (int(x) for x in head.tolist())
    if version != TP_WIRE_VERSION:
        raise RuntimeError(f"{who} of this server speaks TP wire version {version}, this rank "
                           f"{TP_WIRE_VERSION}: every rank must run the same SwiftCache build")
    return n


def tp_group_of(ctx: Any) -> TpGroup | None:
    """The server's TP group from SGLang's tree build context, or None with one rank."""
    size = getattr(ctx, "tp_size", 1) or 1
    if size <= 1:
        return None
    return SglangTpGroup(ctx.tp_group)


class FollowerAgent:
    """What a TP rank other than 0 has in place of a control agent: it talks to nobody (rank 0's
    agent speaks for the server) and answers read deadlines from the view rank 0 shared at the
    last pump, which are times on the host's one CLOCK_MONOTONIC, so each rank's copies stop at
    rank 0's deadline or earlier (`set_view`)."""

    def __init__(self, agent_id: str):
        self.agent_id = agent_id
        self._deadlines: dict[str, float] = {}

    def set_view(self, deadlines: dict) -> None:
        self._deadlines = dict(deadlines)

    def read_deadline(self, donor: str, lease_id: int | None = None) -> float:
        return self._deadlines.get(donor, 0.0)

    def poll_events(self) -> list:
        return []

    def peer_count(self) -> int:
        return 0

    def donor_layout(self) -> None:
        return None

    def defer(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    # rank 0's agent does these for the server
    start = stop = set_memory = offer = demand = request = release = avoid_donor = _nothing
    ack_reclaim = on_reclaim = set_capacity = check_integrity = _nothing
