"""The TP ranks of one server agree on everything that changes the tree.

SGLang's TP ranks each run a scheduler and keep identical radix trees: every rank takes the same
requests in the same loop (rank 0 receives them and broadcasts them on the TP CPU group,
`request_receiver.py`), and every decision that follows is a function of that state. SwiftCache's
lower tiers add inputs that are not: control events arrive on rank 0's agent thread, read
deadlines and copy outcomes depend on each rank's clock and copy thread. So, with `--tp > 1`:

- **decided on rank 0, applied everywhere**: the one control agent runs on rank 0; each
  scheduler loop rank 0 shares (SGLang's `broadcast_pyobj` on the TP CPU group, as SGLang
  shares requests) the control events it took from its agent and its view of which leases are
  readable; every rank applies them in the same order at the same step (`TpGroup.share`);
- **agreed by every rank**: an outcome that a rank's own copy decides (a store, a load, a
  grant mapped) counts as a success only when it succeeded on every rank (`all_ok`,
  `all_ok_each`, `union` of the failures), so a rank that falls behind or fails a copy makes
  the others drop the same prefix, never keep a different tree;
- **acknowledged after every rank**: a reclaim is acknowledged by rank 0 only after every rank
  stopped reading the pages (`barrier` after each rank's fence).

The data crossing here is SGLang's own pickled broadcast between the ranks of one server (no
socket, no other process), not the control channel's wire.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


class TpGroup:
    """The TP ranks of one server as SwiftCache uses them: `rank` of `size`, rank 0 decides.
    Every method is a collective: each rank calls it at the same point, in the same order."""

    rank: int = 0
    size: int = 1

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (what the others pass is ignored)."""
        raise NotImplementedError

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        raise NotImplementedError

    # ---- agreement, built on gather ------------------------------------------------------------
    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` was true on every rank."""
        return all(self.gather(bool(ok)))

    def all_ok_each(self, oks: Sequence[bool]) -> list[bool]:
        """Element-wise `all_ok` of equally long lists (one entry per item every rank has)."""
        rows = self.gather([bool(x) for x in oks])
        if any(len(r) != len(oks) for r in rows):
            raise RuntimeError(f"TP ranks disagree on the number of items: "
                               f"{[len(r) for r in rows]} (their trees diverged)")
        return [all(col) for col in zip(*rows)] if rows else []

    def union(self, items: Iterable[Any]) -> set:
        """The union of every rank's `items`."""
        out: set = set()
        for part in self.gather(sorted(set(items))):
            out.update(part)
        return out

    def barrier(self) -> None:
        self.gather(None)


class SglangTpGroup(TpGroup):
    """SGLang's TP group (`GroupCoordinator`, `TreeCacheBuildContext.tp_group`): its CPU (gloo)
    group carries SwiftCache's collectives, beside SGLang's own request broadcast."""

    def __init__(self, coordinator: Any):
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.size = coordinator.world_size

    def share(self, obj: Any) -> Any:
        from sglang.srt.utils import broadcast_pyobj

        c = self.coordinator
        # nothing to say is one size broadcast (SGLang's helper sends no payload for [])
        data = [] if (not self.leader or obj is None) else [obj]
        out = broadcast_pyobj(data, c.rank, c.cpu_group, src=c.ranks[0])
        return out[0] if out else None

    def gather(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.coordinator.cpu_group)
        return out


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
