"""The one debug seam: named points where measuring code may observe a server, off by default.

The product calls an observer only where one is installed; with none (every server not started
for a measurement) each point costs one attribute read, and no forward is wrapped for it.

Points (`Observers`):
- `forward(runner, forward_batch) -> done()`: called before each model forward, `done()` after
  it (also when it raised), outside the layer stream's per-forward stream;
- `batch_load(facts: dict)`: a borrower settled one batch's donor loads (`streaming.py`): layer
  ready and reached times from the batch's start, the scheduler's waits, the copies;
- `reclaim_fence() -> finish() -> str`: called as a borrower's agent thread starts fencing a
  reclaim, `finish()` once acknowledged; its text joins the acknowledgement's log line;
- `step()`: called as each scheduler loop iteration begins (before it takes in requests), with
  or without SwiftCache: scheduler step times, with `forward`'s share of them.

Installing: `SWIFTCACHE_INSTRUMENTS=package.module:function` in a server's environment, read when
the plugin registers in each process (never at import); the function receives `OBSERVERS` and the
process's environment, and sets the points it wants. The benchmarks' observers are in
`benchmarks/instruments/`; the product never imports them by name.
"""

from __future__ import annotations

import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

INSTRUMENTS_ENV = "SWIFTCACHE_INSTRUMENTS"


@dataclass
class Observers:
    """The installed observers; None where nothing observes."""

    forward: Callable[[Any, Any], Callable[[], None]] | None = None
    batch_load: Callable[[dict], None] | None = None
    reclaim_fence: Callable[[], Callable[[], str]] | None = None
    step: Callable[[], None] | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.forward, self.batch_load, self.reclaim_fence,
                                           self.step))


OBSERVERS = Observers()


class InstrumentsUnavailable(RuntimeError):
    """SWIFTCACHE_INSTRUMENTS names something that cannot be imported or called."""


def install_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """Install the observers `INSTRUMENTS_ENV` names (once per process is enough; again
    re-installs); returns the name, or None when the variable is unset."""
    environ = os.environ if environ is None else environ
    spec = environ.get(INSTRUMENTS_ENV, "").strip()
    if not spec:
        return None
    try:
        install = pkgutil.resolve_name(spec)
        install(OBSERVERS, environ)
    except Exception as exc:
        raise InstrumentsUnavailable(
            f"{INSTRUMENTS_ENV}={spec} could not be installed ({type(exc).__name__}: {exc}); "
            f"give module:function importable in the server (for the benchmarks' "
            f"instruments, the repository root on PYTHONPATH) or unset it") from exc
    return spec


def reset() -> None:
    """No observer at any point (tests)."""
    OBSERVERS.forward = OBSERVERS.batch_load = OBSERVERS.reclaim_fence = OBSERVERS.step = None


def around_forward(orig: Callable, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any):
    """AROUND hook on the model forward, registered only where a forward observer is installed."""
    observe = OBSERVERS.forward
    if observe is None:
        return orig(runner, forward_batch, *args, **kwargs)
    done = observe(runner, forward_batch)
    try:
        return orig(runner, forward_batch, *args, **kwargs)
    finally:
        done()


def before_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on the scheduler's per-iteration intake, registered only where a step
    observer is installed."""
    observe = OBSERVERS.step
    if observe is not None:
        observe()
