"""Device slot indices as the tree holds them: runs the caller handed in, never read.

The tree needs a run's length and slices of it (a node splits where a match ends), and joins
runs to hand them back (a path's slots, an eviction's slots to free); it never needs the
values. So a run stays the kind the caller gave: `array('q')` (the simulator, `bench_tree`,
the tests) or a device tensor (SGLang's slot indices in a live server: reading those on the
host would make the scheduler thread wait for the GPU). `join` keeps the kind: arrays are
joined here, any other kind by the function its user registered for it (`register`; the live
cache registers `torch.cat` for tensors), so this package still imports without torch.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Sequence

_JOINS: list[tuple[type, Callable[[list], Any]]] = []


def register(kind: type, join_runs: Callable[[list], Any]) -> None:
    """Runs of `kind` (and its subclasses) are joined by `join_runs(list_of_runs)`. Idempotent."""
    if not any(k is kind for k, _ in _JOINS):
        _JOINS.append((kind, join_runs))


def join(parts: Sequence[Any]) -> Any:
    """The runs `parts` as one run of their kind; an empty `array('q')` when there are none.
    Only lengths are looked at (a tensor's length is metadata, not a read of its values)."""
    runs = [p for p in parts if len(p)]
    if not runs:
        return array("q")
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    if type(first) is array:
        out = array("q")
        for r in runs:
            out.extend(r)
        return out
    for kind, join_runs in _JOINS:
        if isinstance(first, kind):
            return join_runs(runs)
    raise TypeError(f"no join registered for slot runs of type {type(first).__name__}; "
                    f"call radix_ext.slot_runs.register(kind, join) first")


def as_run(seq: Sequence[int]) -> Any:
    """`seq` as a run: an array or a registered kind as it is, any other sequence as an array."""
    if type(seq) is array or any(isinstance(seq, kind) for kind, _ in _JOINS):
        return seq
    return array("q", seq)


def values(run: Any) -> list[int]:
    """The slot numbers of `run` as ints: for checks only (`check_integrity`), since for a
    device tensor this reads it on the host."""
    tolist = getattr(run, "tolist", None)
    return list(tolist()) if tolist is not None else list(run)
