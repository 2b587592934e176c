"""SwiftConfig: the one frozen, validated configuration object of SwiftCache.

Every `--swiftcache-*` CLI option is derived from a field here (see `cli_options()`), each field's
validator is the argparse `type=` of its option, so a bad value is an argparse error that names the
option. The parsed config travels to SGLang's spawned processes as JSON (`to_json` / `from_json`).
Environment variables are never read at import.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from radix_ext import EVICTION_POLICIES as _TREE_EVICTION_POLICIES

ROLES = ("auto", "donor", "borrower", "both")
LAYER_STREAM_TIERS = ("off", "host", "donor")  # where a streamed pool's layers live
LAYER_STREAMING = "layer streaming"  # the CLI group of the layer-stream options
EVICTION_POLICIES = tuple(sorted(_TREE_EVICTION_POLICIES))  # the names radix_ext knows
CONFIG_ENV = "SWIFTCACHE_CONFIG"


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        return value

    parse.__name__ = name
    return parse


def _number(name: str, kind: type, lo: float, hi: float | None = None, *, lo_open: bool = False):
    def parse(value: Any) -> Any:
        try:
            v = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a {kind.__name__}; got {value!r}") from None
        if v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            bound = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
            raise ValueError(f"{name} must be in {bound}; got {v}")
        return v

    parse.__name__ = name
    return parse


def _path(name: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if not isinstance(value, str) or not value or "\0" in value:
            raise ValueError(f"{name} must be a non-empty path; got {value!r}")
        return value

    parse.__name__ = name
    return parse


def _opt(parse: Callable[[Any], Any], help: str, group: str | None = None) -> dict:
    return {"parse": parse, "help": help, **({"group": group} if group else {})}


@dataclass(frozen=True)
class SwiftConfig:
    """What one SwiftCache-enabled server does. Defaults are safe for a single server on a node."""

    enabled: bool = False
    # set by the launcher, not an option: --enable-hierarchical-cache was given, so the tree has
    # a host tier on SGLang's host pool (integration/host_tier.py)
    host_tier: bool = False
    role: str = field(default="auto", metadata=_opt(_choice("role", ROLES),
        "donor lends, borrower borrows, both, or auto (lends when a lend fraction is set, "
        "borrows when a borrow limit is set)"))
    eviction_policy: str = field(default="lru", metadata=_opt(
        _choice("eviction-policy", EVICTION_POLICIES),
        "order and target of device evictions: lru, or cost_aware (reuse vs. reload cost per "
        "tier)"))
    lend_fraction: float = field(default=0.0, metadata=_opt(
        _number("lend-fraction", float, 0.0, 0.95),
        "donor: the most of its own KV pool it may lend to other servers, as a fraction (0: lend "
        "nothing); free pages above the reserve are lent, and idle cached ones "
        "(--swiftcache-lend-cached-after-s)"))
    reclaim_watermark: float = field(default=0.8, metadata=_opt(
        _number("reclaim-watermark", float, 0.0, 1.0, lo_open=True),
        "donor: keeps (1 - watermark) of its pool free for its own traffic; lends only above that "
        "and takes every lent page back when its free (or evictable) room falls below it"))
    relend_cooldown_s: float = field(default=5.0, metadata=_opt(
        _number("relend-cooldown-s", float, 0.0, 3600.0),
        "donor: after a reclaim, nothing is lent again for this long (no lend/reclaim "
        "oscillation while its own traffic is high)"))
    lend_cached_after_s: float = field(default=5.0, metadata=_opt(
        _number("lend-cached-after-s", float, 0.0, 86400.0),
        "donor: once it has had no requests of its own for this long, its own cached prefixes "
        "count as idle memory too: it evicts them (least recently used first) to lend up to "
        "its lend fraction again after a burst; 0: lend free pages only"))
    max_borrow_blocks: int = field(default=0, metadata=_opt(_number("max-borrow-blocks", int, 0),
        "borrower: most blocks (pages of this server's own model) it keeps in donor memory "
        "(0: no donor tier)"))
    heartbeat_interval_s: float = field(default=0.2, metadata=_opt(
        _number("heartbeat-interval-s", float, 0.0, 60.0, lo_open=True),
        "control-channel heartbeat period"))
    heartbeat_timeout_s: float = field(default=1.0, metadata=_opt(
        _number("heartbeat-timeout-s", float, 0.0, 600.0, lo_open=True),
        "a peer silent this long is suspected and re-validated (declared dead only on evidence: "
        "process gone, socket closed, or long silence; see docs/liveness.md)"))
    rendezvous_dir: str = field(default="", metadata=_opt(_path("rendezvous-dir"),
        "directory (created 0700) where agents on this node publish their ipc endpoints "
        "(default: /tmp/sglang_swift-$UID/control)"))
    secret_file: str = field(default="", metadata=_opt(_path("secret-file"),
        "node secret (0600) that authenticates control messages (default: "
        "<rendezvous-dir>/secret)"))
    layer_stream: str = field(default="off", metadata=_opt(
        _choice("layer-stream", LAYER_STREAM_TIERS),
        "keep only the KV of the layers being computed in the local KV pool and every layer's KV "
        "in host memory (host) or in donor pool pages under leases, written through to host "
        "memory (donor), streamed in layer by layer: --max-total-tokens (or the memory budget, "
        "then L/depth times the tokens) becomes the context the server can hold; off: stock pool",
        LAYER_STREAMING))
    layer_stream_depth: int = field(default=2, metadata=_opt(
        _number("layer-stream-depth", int, 0, 64),
        "staging layers kept local: the layer being computed plus depth-1 prefetched; local KV "
        "memory is depth/L of a stock pool of the same token count. 0 (with donor, on CPU): "
        "nothing is staged, the rows past the resident ones are read in place in donor pages "
        "(host memory where no lease holds them), and the resident fraction is the local part "
        "of the pool's tokens", LAYER_STREAMING))
    layer_stream_resident_fraction: float = field(default=0.5, metadata=_opt(
        _number("layer-stream-resident-fraction", float, 0.0, 0.95),
        "of the local KV memory, the part kept as every layer's own rows: requests whose "
        "context fits in the free resident slots are not streamed, the part that does not is; "
        "0 streams every row (the longest context: L/depth times a stock pool's)",
        LAYER_STREAMING))
    layer_stream_host_gb: float = field(default=0.0, metadata=_opt(
        _number("layer-stream-host-gb", float, 0.0),
        "host memory (GiB) streamed KV may use; the pool's token count is capped to fit "
        "(0: half the host memory free at start-up)", LAYER_STREAMING))

    def __post_init__(self) -> None:
        """Validate only (a frozen dataclass is never written here): each field must already be
        what its parser returns. `SwiftConfig.parse(**raw)` converts raw values (CLI, JSON)."""
        for f in dataclasses.fields(self):
            parse = f.metadata.get("parse")
            value = getattr(self, f.name)
            if parse is not None and value != f.default and parse(value) != value:
                raise ValueError(f"{f.name}={value!r} is not a valid value; "
                                 f"build the config with SwiftConfig.parse(...)")
        if self.streams_layers and (self.lends or self.borrows):
            raise ValueError(
                "layer-stream cannot be combined with lending or with the tree's donor tier (a "
                "streamed pool's pages are staging, not pages a lease can map); to stream from "
                "donor memory use --swiftcache-layer-stream donor without "
                "--swiftcache-lend-fraction / --swiftcache-max-borrow-blocks")
        if self.streams_from_donor and self.role == "donor":
            raise ValueError(
                "--swiftcache-layer-stream donor borrows donor pool pages for its store, but "
                "--swiftcache-role donor only lends; use --swiftcache-role auto or borrower")
        if self.streams_layers and self.layer_stream_depth == 1:
            raise ValueError("--swiftcache-layer-stream-depth 1 stages no layer ahead; use 0 "
                             "(read in place) or 2 and more")
        if self.streams_layers and self.layer_stream_depth == 0 and (
                self.layer_stream != "donor" or self.layer_stream_resident_fraction <= 0):
            raise ValueError("--swiftcache-layer-stream-depth 0 reads donor pages in place: it "
                             "needs --swiftcache-layer-stream donor and a "
                             "--swiftcache-layer-stream-resident-fraction above 0 (the local "
                             "part of the pool's tokens)")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat-timeout-s ({self.heartbeat_timeout_s}) must exceed "
                f"heartbeat-interval-s ({self.heartbeat_interval_s})")

    @classmethod
    def parse(cls, **raw: Any) -> "SwiftConfig":
        """A config from raw values (strings from a CLI, JSON numbers): each field's parser
        converts and checks its value, then the cross-field checks run."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"unknown SwiftCache config keys {unknown}; versions of sglang-swift "
                             f"differ?")
        values = {}
        for name, value in raw.items():
            f = fields[name]
            parse = f.metadata.get("parse")
            values[name] = parse(value) if parse is not None and value != f.default else value
        return cls(**values)

    # -- derived values (computed here and nowhere else) -------------------------------------
    @property
    def lends(self) -> bool:
        """This server offers part of its KV pool to borrowers."""
        return self.role in ("donor", "both", "auto") and self.lend_fraction > 0

    @property
    def borrows(self) -> bool:
        """This server keeps evicted prefixes in donor memory (the tree has a donor tier)."""
        return self.role in ("borrower", "both", "auto") and self.max_borrow_blocks > 0

    @property
    def streams_layers(self) -> bool:
        """The server's KV pool keeps only a few layers local and streams the others in."""
        return self.layer_stream != "off"

    @property
    def streams_from_donor(self) -> bool:
        """The streamed pool's store borrows donor pool pages (leases) for its rows, backed by
        host memory; the tree has no donor tier then."""
        return self.layer_stream == "donor"

    @property
    def uses_donation(self) -> bool:
        """The server runs a SwiftRuntime (control agent, arenas, copies)."""
        return self.lends or self.borrows or self.streams_from_donor

    def tree_config(self, page_size: int, host_capacity: int = 0,
                    write_through: bool = False, donor_to_host: bool = False,
                    l3_below: bool = False) -> Any:
        """The radix_ext `TreeConfig` of this server's tree. The donor tier exists when the
        server borrows, the host tier (`host_capacity` tokens) with --enable-hierarchical-cache;
        with `write_through` (host copies of what the device caches) a device victim also goes
        to donor pages when a lease has room. With `donor_to_host` (the server can copy donor
        rows into host memory: CPU engines) a copy pushed out of a full lease moves down into
        the host tier (`cascade` "down": room made there as for a demotion); else it is
        dropped, as is a copy pushed out of host (nothing below it in the tree). With both and
        `l3_below` (an L3 storage backend under the host tier) the eviction names each donor
        copy it still drops (`name_donor_drops`), which the server writes to L3."""
        from radix_ext import TreeConfig

        demotion = "cost_aware" if self.eviction_policy == "cost_aware" else "tiered"
        cascade = "down" if donor_to_host and host_capacity > 0 and self.borrows else "off"
        return TreeConfig(page_size=page_size, eviction=self.eviction_policy, donor=self.borrows,
                          demotion=demotion, host_capacity=host_capacity, cascade=cascade,
                          donor_over_host=write_through and self.borrows,
                          name_donor_drops=cascade == "down" and l3_below)

    def resolved_rendezvous_dir(self) -> str:
        """The rendezvous directory; by default the control channel's (what `ctl` reads)."""
        if self.rendezvous_dir:
            return self.rendezvous_dir
        from .control.control_config import default_rendezvous_dir

        return default_rendezvous_dir()

    def resolved_secret_file(self) -> str:
        return self.secret_file or os.path.join(self.resolved_rendezvous_dir(), "secret")

    # -- transport to child processes --------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SwiftConfig":
        return cls.parse(**json.loads(text))


def cli_options() -> list[tuple[str, dataclasses.Field]]:
    """(flag, field) for every configurable field: `--swiftcache-<field-name-with-dashes>`."""
    return [
        ("--swiftcache-" + f.name.replace("_", "-"), f)
        for f in dataclasses.fields(SwiftConfig)
        if "parse" in f.metadata
    ]
