"""What the hierarchy benchmark runs: sizes, traffic, and the five runs' servers.

Two models as in the node benchmark: the busy `small` model and a `tiny` donor. Every run gives
each server the same memory; the busy model's histories are larger than its device pool plus its
host tier, so what it keeps below the device decides how much it reuses.

The runs (same traffic each, one request at a time, the histories carrying run (r)'s answers):
- `r` stock SGLang, no HiCache: the reference outputs (`identical`) and a cache without lower tiers;
- `h` HiCache (`--enable-hierarchical-cache`, host tier `host_ratio` x the device pool);
- `s` HiCache with SwiftCache: the busy server borrows (device, donor pages while lent, host), the
  donor lends `lend_fraction` of its own pool;
- `u` the upper bound: stock SGLang (no HiCache, no hierarchy) whose ONE device pool holds the
  busy server's device pool, what (s)'s donor lends and the host tier together (`bound_pool`;
  the donor's pool shrinks by what it lends): every token any placement of (s)'s memory could
  keep, each one as fast to reach as device memory. With `--l3` the bound's pool holds every
  history instead (storage is unbounded). SwiftCache's cached tokens above it are not a gain
  (cli.py names the cause);
- `t` HiCache again, a twin of (h): the noise floor of a TTFT ratio against (h).
After the burst every run pauses `pause_after_burst_s` (15 s) before its next turn, as a
user's think time; (s)'s donor lends again inside that pause (`relent_after_burst`).
Every HiCache run uses the same `--hicache-write-policy`, `write_back` unless `--write-policy`
says otherwise (SwiftCache's host tier receives a prefix when it leaves the device; (h) does the
same, so the runs differ only in the tiers). With `--l3 file` every HiCache run also has
SGLang's `file` storage backend below its host tier, each run its own store, emptied before it
starts (`l3_args`); note that stock HiCache starts an L3 prefetch only from a host-backed (or
root) prefix, so under write_back a request whose prefix begins on the device is not looked up
in storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..nodebench.plan import COMMON_ARGS, HEARTBEAT_ARGS, ModelFacts

RUNS = ("r", "h", "s", "u", "t")
NAMES = {"r": "stock", "h": "hicache", "s": "hicache+swiftcache", "u": "upper bound",
         "t": "hicache twin"}
LAYOUT = ("--hicache-mem-layout", "layer_first")


@dataclass(frozen=True)
class TierPlan:
    """Sizes of one benchmark: pools in each model's own tokens."""

    busy_pool: int = 384
    host_ratio: float = 2.0
    donor_pool: int = 4096
    lend_fraction: float = 0.5
    conversations: int = 6
    turns: int = 5
    max_chars: int = 200
    max_tokens: int = 16
    burst_after_turn: int = 3  # the donor's burst comes after this many turns of every history
    burst_requests: int = 4
    burst_words: int = 350
    burst_max_tokens: int = 32
    # every run's busy traffic pauses this long after the burst, as a user's think time
    # between turns: (s)'s donor lends again inside it (its 5 s relend cooldown, then 5 s without
    # requests of its own before it lends its cached burst prefixes: --swiftcache-lend-cached-
    # after-s); 0: the turns go on at once, mostly without donor memory
    pause_after_burst_s: float = 15.0
    l3: str | None = None  # an L3 storage backend below every HiCache run's host tier
    write_policy: str = "write_back"  # every HiCache run's --hicache-write-policy

    def hicache_policy(self) -> tuple:
        return ("--hicache-write-policy", self.write_policy, *LAYOUT)

    def lent_busy_tokens(self, busy: ModelFacts, donor: ModelFacts) -> int:
        """What the donor lends, in the busy model's tokens (bytes over its bytes per token)."""
        lent_bytes = int(self.donor_pool * self.lend_fraction) * donor.kv_bytes_per_token
        return lent_bytes // busy.kv_bytes_per_token

    def host_tokens(self) -> int:
        return int(self.busy_pool * self.host_ratio)

    def host_pool_tokens(self) -> int:
        """HiCache's host pool as SGLang 0.5.23 sizes it (`pool_host/base.py`): the ratio times
        the device tokens, plus its padding page (one token on CPU)."""
        return self.host_tokens() + 1

    def bound_pool(self, busy: ModelFacts, donor: ModelFacts, host_measured: int = 0,
                   history_tokens: int = 0) -> int:
        """The upper bound's one device pool: the busy server's device pool, what the donor
        lends (busy tokens) and the host tier (the larger of SGLang's sizing and
        `host_measured`, what (s) reported); with L3 at least `history_tokens` plus one
        request's room (every history fits, as in unbounded storage)."""
        pool = (self.busy_pool + self.lent_busy_tokens(busy, donor)
                + max(self.host_pool_tokens(), host_measured))
        if self.l3 is not None:
            pool = max(pool, history_tokens + self.busy_pool)
        return pool


QUICK = TierPlan()
FULL = TierPlan(conversations=10, turns=6, burst_after_turn=4)


@dataclass(frozen=True)
class Server:
    model: Path
    pool: int
    args: tuple
    swiftcache: bool


def l3_args(plan: TierPlan, store: Path | None) -> tuple:
    """SGLang's storage backend below a HiCache run's host tier, in its own directory, emptied
    first: HiCache keys pages by their tokens, so pages an earlier run of the same traffic left
    there (a second benchmark with the same `--out`) would be hits this run did not earn."""
    if plan.l3 is None:
        return ()
    import json
    import shutil

    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    extra = {"file_storage_path": str(store), "prefetch_threshold": 16}
    return ("--hicache-storage-backend", plan.l3, "--hicache-storage-prefetch-policy",
            "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(extra))


def servers(run: str, plan: TierPlan, busy_dir: Path, donor_dir: Path, rendezvous: str,
            busy: ModelFacts, donor: ModelFacts, store: Path | None = None,
            bound_pool: int | None = None) -> dict[str, Server]:
    """The busy and donor servers of run `run`; `store`: its L3 directory (`plan.l3`);
    `bound_pool`: the upper bound's pool (default `plan.bound_pool` from the plan alone)."""
    lent = plan.lent_busy_tokens(busy, donor)
    lent_donor_tokens = int(plan.donor_pool * plan.lend_fraction)
    l3 = l3_args(plan, store)
    hicache = ("--enable-hierarchical-cache", "--hicache-ratio", str(plan.host_ratio),
               *plan.hicache_policy(), *l3)
    if run == "r":
        return {"busy": Server(busy_dir, plan.busy_pool, COMMON_ARGS, False),
                "donor": Server(donor_dir, plan.donor_pool, COMMON_ARGS, False)}
    if run in ("h", "t"):
        return {"busy": Server(busy_dir, plan.busy_pool, COMMON_ARGS + hicache, False),
                "donor": Server(donor_dir, plan.donor_pool, COMMON_ARGS, False)}
    if run == "u":
        pool = plan.bound_pool(busy, donor) if bound_pool is None else bound_pool
        return {"busy": Server(busy_dir, pool, COMMON_ARGS, False),
                "donor": Server(donor_dir, plan.donor_pool - lent_donor_tokens, COMMON_ARGS,
                                False)}
    if run == "s":
        swift = ("--swiftcache-rendezvous-dir", rendezvous, *HEARTBEAT_ARGS)
        return {"busy": Server(busy_dir, plan.busy_pool,
                               COMMON_ARGS + hicache + swift + (
                                   "--swiftcache-role", "borrower",
                                   "--swiftcache-max-borrow-blocks", str(2 * lent)), True),
                "donor": Server(donor_dir, plan.donor_pool,
                                COMMON_ARGS + swift + ("--swiftcache-role", "donor",
                                                       "--swiftcache-lend-fraction",
                                                       str(plan.lend_fraction)), True)}
    raise ValueError(f"unknown run {run!r}; use one of {RUNS}")
