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
  or without SwiftCache: scheduler step times, with `forward`'s share of them;
- `donor_stored(runtime, lease_key, tickets)`: a borrower's store of `tickets` (victims
  demoted into one lease's donor blocks) succeeded on CPU (`demotion.py`); the one use is the
  test-only fault below.

Installing: `SWIFTCACHE_INSTRUMENTS=package.module:function` in a server's environment, read when
the plugin registers in each process (never at import); the function receives `OBSERVERS` and the
process's environment, and sets the points it wants. The benchmarks' observers are in
`benchmarks/instruments/`; the product never imports them by name.

Test-only fault (the negative control of "outputs identical"): `SWIFTCACHE_FAULT_DONOR_ROW`, a
JSON object `{"targets": [[first_token_id, layer], ...], "row": r, "report": "/path"}`, read at
the same start-up, installs a `donor_stored` that, in the first stored victim whose tokens begin
with `first_token_id`, overwrites layer `layer`'s K and V rows of its token `r` in the DONOR's
bytes (the lease region, through the lease's own engine) with seeded random values at the row's
own scale, once per target; then reads the block back and appends one JSON line to `report`
saying what changed (bytes changed, and whether any other layer's or token's bytes moved). It is
never installed unless the variable is set, and it corrupts only what the test names.
"""

from __future__ import annotations

import json
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

INSTRUMENTS_ENV = "SWIFTCACHE_INSTRUMENTS"
FAULT_ENV = "SWIFTCACHE_FAULT_DONOR_ROW"


@dataclass
class Observers:
    """The installed observers; None where nothing observes."""

    forward: Callable[[Any, Any], Callable[[], None]] | None = None
    batch_load: Callable[[dict], None] | None = None
    reclaim_fence: Callable[[], Callable[[], str]] | None = None
    step: Callable[[], None] | None = None
    donor_stored: Callable[[Any, tuple, list], None] | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.forward, self.batch_load, self.reclaim_fence,
                                           self.step, self.donor_stored))


OBSERVERS = Observers()


class InstrumentsUnavailable(RuntimeError):
    """SWIFTCACHE_INSTRUMENTS names something that cannot be imported or called."""


def install_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """Install the observers `INSTRUMENTS_ENV` names and the fault `FAULT_ENV` describes (once
    per process is enough; again re-installs); returns what was installed, or None when neither
    variable is set."""
    environ = os.environ if environ is None else environ
    fault = environ.get(FAULT_ENV, "").strip()
    if fault:
        try:
            OBSERVERS.donor_stored = DonorRowFault.from_json(fault)
        except (ValueError, TypeError, KeyError) as exc:
            raise InstrumentsUnavailable(
                f"{FAULT_ENV}={fault!r} is not a fault description ({exc}); give "
                f'{{"targets": [[first_token_id, layer], ...], "row": r, "report": path}} '
                f"or unset it") from exc
    spec = environ.get(INSTRUMENTS_ENV, "").strip()
    if not spec:
        return f"{FAULT_ENV} (test-only fault)" if fault else None
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
    OBSERVERS.donor_stored = None


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


class DonorRowFault:
    """The test-only `donor_stored` observer `FAULT_ENV` installs (see the module docstring)."""

    def __init__(self, targets: dict[int, int], row: int, report: str):
        self.targets = dict(targets)  # first token id -> layer, each used once
        self.row = row
        self.report = report

    @classmethod
    def from_json(cls, text: str) -> "DonorRowFault":
        spec = json.loads(text)
        targets = {int(tok): int(layer) for tok, layer in spec["targets"]}
        row = int(spec["row"])
        if not targets or row < 0 or not spec["report"]:
            raise ValueError("targets must be non-empty, row >= 0 and report a path")
        return cls(targets, row, str(spec["report"]))

    def __call__(self, runtime: Any, lease_key: tuple, tickets: list) -> None:
        for t in tickets:
            tokens = _ticket_tokens(t)
            layer = self.targets.get(tokens[0]) if tokens else None
            if layer is not None and self.row < len(tokens):
                del self.targets[tokens[0]]
                self._corrupt(runtime, lease_key, t, tokens[0], layer)

    def _corrupt(self, runtime: Any, lease_key: tuple, ticket: Any, first: int,
                 layer: int) -> None:
        import torch

        from ..dataplane.pool_transfer import PoolTransferEngine
        from ..dataplane.reclaim_staging import read_blocks

        out = {"first_token": first, "layer": layer, "row": self.row, "lease": list(lease_key)}
        engine = runtime.lease_engine(*lease_key)
        if engine is None or engine.lane.stream is not None:
            out["error"] = "no CPU lease engine"
            return self._write(out)
        page = engine.packing.borrower.page_size
        block = ticket.dst.blocks[self.row // page]
        at = self.row % page
        before, why = read_blocks(engine, [block])
        if before is None:
            out["error"] = f"read: {why}"
            return self._write(out)
        ks = [k.clone() for k in before.k]
        vs = [v.clone() for v in before.v]
        gen = torch.Generator().manual_seed(1000 * layer + self.row)
        for half in filter(None, (ks, vs)):  # a latent page (an MLA pool) has no V rows
            r = half[layer][at]
            scale = float(r.float().pow(2).mean().sqrt())
            half[layer][at] = (torch.randn(r.shape, generator=gen) * scale).to(r.dtype)
        writer = PoolTransferEngine(engine.packing, engine.region, ks, vs, lane=engine.lane,
                                    liveness=engine.liveness, lease_epoch=engine.lease_epoch,
                                    read_deadline=engine.read_deadline)
        result = writer.store_here(torch.arange(page), [block])
        after, why = read_blocks(engine, [block])
        if not result.ok or after is None:
            out["error"] = f"write: {result.reason}, read back: {why}"
            return self._write(out)
        changed = elsewhere = 0
        for old, new in ((before.k, after.k), (before.v, after.v)):
            for li, (a, b) in enumerate(zip(old, new)):
                diff = (a.view(torch.uint8) != b.view(torch.uint8)).reshape(page, -1)
                changed += int(diff.sum())
                mask = torch.ones(page, dtype=torch.bool)
                if li == layer:
                    mask[at] = False
                elsewhere += int(diff[mask].sum())
        out.update(block=int(block), changed_bytes=changed, changed_elsewhere_bytes=elsewhere,
                   row_bytes=sum(int(half[layer][at].numel() * half[layer].element_size())
                                 for half in filter(None, (before.k, before.v))))
        self._write(out)

    def _write(self, out: dict) -> None:
        with open(self.report, "a") as f:
            f.write(json.dumps(out) + "\n")


def _ticket_tokens(ticket: Any) -> list[int]:
    """The token ids a store ticket covers: its last `num_tokens` on the path to its node."""
    parts, need, node = [], ticket.num_tokens, ticket.node
    while need > 0 and node is not None and len(node.key):
        take = list(node.key)[-need:]
        parts.append(take)
        need -= len(take)
        node = node.parent
    return [tok for part in reversed(parts) for tok in part]
