"""Every place SwiftCache touches SGLang: one typed entry per hook target, private attribute,
class swapped at run time, computation re-implemented and call signature assumed.

The plugin registers its hooks on the targets named here (`plugin.py`) and checks ALL entries
against the installed SGLang before it registers anything (`problems`): a missing hook target, a
changed signature or behaviour, or a private attribute no longer set makes the plugin refuse
`--enable-swiftcache` with the list, instead of failing later inside a request. Each entry says
the SGLang versions it holds for (`versions`: the range it is meant for and the releases it was
verified on; an installed SGLang outside the range is reported) and how it is checked (`Check`):
by signature, or by a small run of SGLang's code (`touchpoint_probes.py`) where a signature says
too little. The source is searched (`How.SOURCE`) only where neither can show it: attributes
SGLang sets or reads inside code that cannot run without a server (the scheduler and its idle
sleeper, a process group, a pool configurator, a record's resolution), and the tree
members the scheduler calls. Entries for the CPU compatibility layer (`cpu_only`) are checked
only where it is active.

Modules above `integration` import their target names from here. `layer_stream` and `cpu_compat`
sit below it in the import layers, so they take no hook target from here (the plugin registers
their hooks); the private names they read are listed with `used_in`, and a unit test checks that
each listed name is in that module and nowhere else unlisted.
"""

from __future__ import annotations

import enum
import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..cpu_compat import hicache as cpu_hicache
from ..cpu_compat.server_defaults import RESOLVE_ONCE
from . import touchpoint_probes as probes


class Kind(enum.Enum):
    BEFORE = "hook BEFORE"
    AFTER = "hook AFTER"
    AROUND = "hook AROUND"
    EXTENSION = "extension point call"
    SUBCLASS = "subclass"
    PRIVATE_READ = "private read"
    PRIVATE_WRITE = "private write"
    CLASS_SWAP = "class swap"
    REIMPLEMENTATION = "re-implementation"
    SIGNATURE = "signature assumption"
    PRIVATE_CALL = "private call"

    @property
    def is_hook(self) -> bool:
        return self in (Kind.BEFORE, Kind.AFTER, Kind.AROUND)


class How(enum.Enum):
    EXISTS = "the dotted name resolves"
    SOURCE = "each name appears in the source of the probe (inspect.getsource)"
    LEADING_PARAMS = "the probe's first parameters are exactly these (inspect.signature)"
    KEYWORD_PARAMS = "the probe has parameters of these names (inspect.signature)"
    BEHAVES = "a small run of the probe behaves as SwiftCache relies on (touchpoint_probes)"


def version_key(version: str) -> tuple[int, ...]:
    """'0.5.23' -> (0, 5, 23); a suffix after the numbers ('0.6.0rc1', '0.5.23.post1') is
    dropped, so a pre- or post-release counts as its release."""
    parts = []
    for part in version.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(parts)


@dataclass(frozen=True)
class Versions:
    """The SGLang releases an entry holds for: `low` to `high`, both included, and the ones it
    was `verified` on (each inside the range)."""

    low: str
    high: str
    verified: tuple[str, ...]

    def __contains__(self, version: str) -> bool:
        return version_key(self.low) <= version_key(version) <= version_key(self.high)

    def __str__(self) -> str:
        span = self.low if self.low == self.high else f"{self.low} to {self.high}"
        return f"{span} (verified on {', '.join(self.verified)})"


# the pinned release, on which every entry below was verified
SGLANG_0_5_23 = Versions("0.5.23", "0.5.23", ("0.5.23",))


def installed_sglang() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def cpu_compat_active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the CPU compatibility layer is on in this process (the CPU venv's `.pth` ran, or
    it was turned on in-process, and not opted out), as `register_cpu_defaults` decides: its
    stand-ins are touch points only there. A GPU install has no `.pth`."""
    import os

    from ..cpu_compat import site_hook

    environ = os.environ if environ is None else environ
    compat = environ.get("SWIFTCACHE_CPU_COMPAT")
    return compat != "0" and (site_hook.activated() or compat == "1")


@dataclass(frozen=True)
class Check:
    """One check against the installed SGLang; `probe` is a dotted name (the entry's target when
    empty), `names` what SOURCE and the *_PARAMS checks look for, `behaves` the run a BEHAVES
    check makes with the probe's object (None when it holds, else what differs)."""

    how: How = How.EXISTS
    probe: str = ""
    names: tuple[str, ...] = ()
    behaves: Callable[[Any], str | None] | None = None

    def problem(self, target: str) -> str | None:
        """None when the installed SGLang passes; else what is wrong."""
        probe = self.probe or target
        obj = resolve(probe)
        if obj is None:
            return f"{probe} not found"
        if self.how is How.EXISTS:
            return None
        if self.how is How.BEHAVES:
            try:
                return self.behaves(obj)
            except Exception as exc:  # noqa: BLE001 - whatever the run raised is the finding
                return f"a run of {probe} raised {type(exc).__name__}: {exc}"
        if self.how is How.SOURCE:
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                return f"the source of {probe} cannot be read"
            missing = [n for n in self.names if n not in source]
            return f"{probe} no longer mentions {', '.join(missing)}" if missing else None
        try:
            params = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"the signature of {probe} cannot be read"
        if self.how is How.LEADING_PARAMS:
            lead = tuple(params[:len(self.names)])
            return None if lead == self.names else (
                f"{probe} takes {', '.join(lead)} first, not {', '.join(self.names)}")
        missing = [n for n in self.names if n not in params]
        return f"{probe} has no parameter {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class TouchPoint:
    """What SwiftCache touches (`target`, dotted), how (`kind`), why, what breaks if SGLang
    changes it, which product module does it (`used_in`), how the plugin checks it, the SGLang
    releases it holds for (`versions`), whether it exists only where the CPU compatibility
    layer is active (`cpu_only`) and the word `used_in` spells where it touches (`mark`; the
    target's last component when empty)."""

    target: str
    kind: Kind
    why: str
    breaks: str
    used_in: str
    checks: tuple[Check, ...] = (Check(),)
    versions: Versions | None = None
    cpu_only: bool = False
    mark: str = ""

    @property
    def attr(self) -> str:
        """The last component of the target: the method, attribute or class name."""
        return self.target.rpartition(".")[2]

    def problems(self, version: str | None = None) -> list[str]:
        """What fails on the installed SGLang (`version`: its release, when known)."""
        out = [f"{self.target} ({self.kind.value}): {p}" for c in self.checks
               if (p := c.problem(self.target)) is not None]
        if version is not None and self.versions is not None and version not in self.versions:
            out.append(f"{self.target} ({self.kind.value}): holds for sglang {self.versions}, "
                       f"not {version}")
        return out


def resolve(dotted: str) -> Any:
    """The object a dotted name names, or None (whatever the import raises)."""
    module_path, _, attr = dotted.rpartition(".")
    try:
        return getattr(pkgutil.resolve_name(module_path), attr)
    except Exception:  # an ImportError, AttributeError or anything a broken import raises
        return None


SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
MHA_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
MLA_POOL = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool"
ALLOCATOR = "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator"
INTEGRATION = "sglang_swift.integration"

# ---- every process: the flag --------------------------------------------------------------------
ADD_CLI_ARGS = TouchPoint(
    f"{SERVER_ARGS}.add_cli_args", Kind.AFTER,
    "adds --enable-swiftcache and the --swiftcache-* options to SGLang's parser",
    "the flag is unknown: argparse rejects --enable-swiftcache", f"{INTEGRATION}.plugin",
    (Check(How.LEADING_PARAMS, names=("parser",)),),
    versions=SGLANG_0_5_23)
OPTION_STRINGS = TouchPoint(
    "argparse._ActionsContainer._option_string_actions", Kind.PRIVATE_READ,
    "adds the options once when add_cli_args runs twice on one parser",
    "a second add_cli_args on one parser raises a conflicting-option error",
    f"{INTEGRATION}.plugin",
    (Check(How.BEHAVES, "argparse._ActionsContainer.__init__",
           behaves=probes.option_strings_index),),
    versions=SGLANG_0_5_23)
FROM_CLI_ARGS = TouchPoint(
    f"{SERVER_ARGS}.from_cli_args", Kind.AFTER,
    "with the flag: builds the SwiftConfig, selects the backend, exports the config to the "
    "spawned processes (CONFIG_ENV); without it: leaves ServerArgs as stock",
    "the flag is parsed but ignored: the server starts as stock SGLang", f"{INTEGRATION}.plugin",
    (Check(How.LEADING_PARAMS, names=("args",)),),
    versions=SGLANG_0_5_23)
CPU_DEFAULTS = TouchPoint(
    RESOLVE_ONCE, Kind.BEFORE,
    "CPU venv only (the CPU stand-in, with or without the flag): fills --device cpu and "
    "--attention-backend torch_native where the user left them unset",
    "a CPU server without those flags looks for an accelerator and fails to start",
    "sglang_swift.cpu_compat.server_defaults", cpu_only=True,
    versions=SGLANG_0_5_23)
RESOLUTION_STATE = TouchPoint(
    f"{SERVER_ARGS}._resolution_finished", Kind.PRIVATE_READ,
    "the CPU defaults are filled only before a record's first resolution (also reads "
    "`_resolution_failed`)",
    "defaults could be filled into an already resolved record (ignored, or inconsistent)",
    "sglang_swift.cpu_compat.server_defaults",
    (Check(How.SOURCE, f"{SERVER_ARGS}.resolve_once",
           ("_resolution_finished", "_resolution_failed")),), cpu_only=True,
    versions=SGLANG_0_5_23)

# ---- a SwiftCache server's scheduler process --------------------------------------------------
REGISTER_BACKEND = TouchPoint(
    "sglang.srt.mem_cache.registry.register_radix_cache_backend", Kind.EXTENSION,
    "registers the `swiftcache` radix cache backend the flag selects",
    "the scheduler cannot build the selected backend and refuses to start",
    f"{INTEGRATION}.plugin",
    versions=SGLANG_0_5_23)
RADIX_CACHE = TouchPoint(
    "sglang.srt.mem_cache.radix_cache.RadixCache", Kind.SUBCLASS,
    "SwiftRadixCache is SGLang's prefix-cache interface with radix_ext inside",
    "the cache class no longer matches what the scheduler calls", f"{INTEGRATION}.cache",
    versions=SGLANG_0_5_23)
SCHEDULER_STEP = TouchPoint(
    f"{SCHEDULER}.get_next_batch_to_run", Kind.BEFORE,
    "once per loop: control events (leases, reclaims, lost donors) and the donor's lending "
    "step run on the scheduler thread (servers that lend or borrow); every SwiftCache "
    "tree pushes its counters to /metrics there",
    "leases and reclaims are never handled: a donor never gets its pages back",
    f"{INTEGRATION}.plugin",
    versions=SGLANG_0_5_23)
OWN_DEMAND = TouchPoint(
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset",
    Kind.REIMPLEMENTATION,
    "a donor counts its own requests' KV demand over the scheduler's queues as PrefillAdder "
    "does (output budget clipped at CLIP_MAX_NEW_TOKENS, times the new-token ratio unless "
    "ignore_eos), to lend only what its own admission will not need",
    "the donor lends pages its own admission then lacks (a burst waits for a reclaim), or "
    "lends too little", f"{INTEGRATION}.lending",
    (Check(How.BEHAVES, behaves=probes.running_request_reservation),
     Check(probe="sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS")),
    mark="CLIP_MAX_NEW_TOKENS",
    versions=SGLANG_0_5_23)
BATCH_BUILT = TouchPoint(
    f"{SCHEDULER}.get_new_batch_prefill", Kind.AFTER,
    "a borrower starts the donor loads its new prefill batch queued and sets the batch's "
    "layer-counter consumer index (servers that borrow)",
    "donor hits are never loaded: their requests wait for the load deadline and are aborted",
    f"{INTEGRATION}.plugin",
    versions=SGLANG_0_5_23)
BATCH_RAN = TouchPoint(
    f"{SCHEDULER}.run_batch", Kind.AFTER,
    "after a forward, a borrower drops the output of the requests whose load failed before "
    "it is used, and sends them back to the queue or aborts them (servers that borrow)",
    "a request whose donor load failed would answer from unloaded KV", f"{INTEGRATION}.plugin",
    versions=SGLANG_0_5_23)
RUN_BATCH_SIGNATURE = TouchPoint(
    f"{SCHEDULER}.run_batch.batch", Kind.SIGNATURE,
    "the BATCH_RAN hook takes the batch as the first positional argument after self",
    "the hook settles the wrong object (or raises in the scheduler loop)",
    f"{INTEGRATION}.plugin",
    (Check(How.LEADING_PARAMS, f"{SCHEDULER}.run_batch", ("self", "batch")),),
    versions=SGLANG_0_5_23)
PENDING_CHUNKED_ABORT = TouchPoint(
    f"{SCHEDULER}._pending_chunked_abort_req", Kind.PRIVATE_WRITE,
    "a chunked request whose donor load failed is released like a client abort, through "
    "SGLang's own pending-abort slot, so its next chunk does not run",
    "the failed request's next chunk runs on KV that never arrived",
    f"{INTEGRATION}.streaming",
    (Check(How.SOURCE, f"{SCHEDULER}.process_pending_chunked_abort",
           ("_pending_chunked_abort_req",)),),
    versions=SGLANG_0_5_23)
RETRY_RELEASE = TouchPoint(
    "sglang.srt.managers.schedule_batch.ScheduleBatch.release_req", Kind.EXTENSION,
    "a request whose donor load failed is released as SGLang retracts a decode request (its KV "
    "row freed without entering the tree, its prefix match and lock reset, marked retracted so "
    "the result processor skips its output), to run again instead of answering 503",
    "a failed load's request leaks its KV row or its output is used",
    f"{INTEGRATION}.load_retry",
    (Check(How.LEADING_PARAMS, names=("self", "idx", "remaing_req_count", "offload_kv")),
     Check(How.SOURCE, "sglang.srt.managers.schedule_batch.release_req",
           ("release_kv_cache", "reset_for_retract"))),
    versions=SGLANG_0_5_23)
RETRY_REQUEUE = TouchPoint(
    f"{SCHEDULER}._add_request_to_queue", Kind.PRIVATE_CALL,
    "a retried request leaves `last_batch` and `running_batch` before get_next_batch_to_run "
    "merges them and, once no result in `result_queue` holds it, re-enters the waiting queue "
    "as SGLang re-queues a retracted request",
    "a retried request decodes without KV, or never runs again",
    f"{INTEGRATION}.load_retry",
    (Check(How.LEADING_PARAMS, names=("self", "req", "is_retracted")),
     Check(How.SOURCE, f"{SCHEDULER}.get_next_batch_to_run",
           ("last_batch.filter_batch", "running_batch.merge_batch")),
     Check(How.SOURCE, f"{SCHEDULER}.event_loop_overlap", ("result_queue", "batch.copy()"))),
    versions=SGLANG_0_5_23)
REQ_TREE_LOCK = TouchPoint(
    "sglang.srt.managers.schedule_batch.Req.lock", Kind.PRIVATE_WRITE,
    "a request whose exchanged donor hit failed keeps the hit's slots as its own: its tree lock "
    "(`Req.lock`, `Req.last_node`) moves to the hit's device parent and the tree-owned part of "
    "its row (`ReqKvInfo.cache_protected_len`) ends there, as SGLang's own checkpoint moves a "
    "lock, so SGLang frees those slots with the request",
    "the failed request's slots stay locked in the tree or are freed twice",
    f"{INTEGRATION}.streaming",
    (Check(How.BEHAVES, "sglang.srt.managers.schedule_batch.Req",
           behaves=probes.request_tree_lock),
     Check(How.KEYWORD_PARAMS, "sglang.srt.managers.schedule_batch.ReqKvInfo",
           ("cache_protected_len",))),
    versions=SGLANG_0_5_23)
KV_POOL_BUFFERS = TouchPoint(
    f"{MHA_POOL}._create_buffers_normal", Kind.AROUND,
    "a lending server's KV pool is allocated in shareable memory (servers that lend)",
    "the pool is SGLang's own: the server lends nothing (its log says why)",
    "sglang_swift.integration.shared_kv_pool",
    (Check(How.LEADING_PARAMS, names=("self",)),),
    versions=SGLANG_0_5_23)
KV_POOL_LATENT_BUFFERS = TouchPoint(
    f"{MLA_POOL}._create_buffers", Kind.AROUND,
    "a lending server's MLA KV pool (one latent buffer per layer, `kv_buffer`, rows of "
    "`kv_cache_dim`) is allocated in shareable memory (servers that lend)",
    "the pool is SGLang's own: the server lends nothing (its log says why)",
    "sglang_swift.integration.shared_kv_pool",
    (Check(How.LEADING_PARAMS, names=("self",)),
     Check(How.SOURCE, names=("kv_buffer", "kv_cache_dim", "self.size + self.page_size"))),
    versions=SGLANG_0_5_23)

FORWARD_STREAM = TouchPoint(
    "sglang.srt.model_executor.model_runner.ModelRunner.forward_stream", Kind.PRIVATE_READ,
    "a borrower's copy lanes order every copy after the stream the model's forward runs on "
    "(`streams.follow_forward_stream`): with overlap scheduling the forward runs there, apart "
    "from the scheduler's own stream, and HiCache fences its copies on it the same way "
    "(`Scheduler.__init__` sets the controller's load and write fences)",
    "a store could read KV rows before the forward that writes them, and a load could write "
    "slots a forward still reads: wrong bytes in the donor tier or the batch",
    f"{INTEGRATION}.donor_hits",
    (Check(How.SOURCE, "sglang.srt.model_executor.model_runner.ModelRunner.__init__",
           ("self.forward_stream",)),
     Check(How.SOURCE, f"{SCHEDULER}.__init__",
           ("load_fence_stream", "model_runner.forward_stream"))),
    versions=SGLANG_0_5_23)

STEP_MARK = TouchPoint(
    f"{SCHEDULER}.ingest_requests", Kind.BEFORE,
    "debug seam only (a step observer installed by a benchmark): marks each scheduler loop "
    "iteration, so scheduler step times can be compared with and without SwiftCache",
    "the step benchmark gets no step marks (no server behaves differently)",
    f"{INTEGRATION}.plugin",
    versions=SGLANG_0_5_23)

# ---- the host tier (--enable-swiftcache with --enable-hierarchical-cache) ---------------------
HOST_POOL = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
HICACHE_FLAG = TouchPoint(
    f"{SERVER_ARGS}.enable_hierarchical_cache", Kind.PRIVATE_WRITE,
    "cleared in the launcher once SwiftCache took HiCache's options for its tree's host tier, "
    "so the scheduler builds and drives no HiCache tree beside SwiftCache's",
    "the scheduler calls HiCache's tree members on SwiftCache's tree and fails at start-up",
    f"{INTEGRATION}.plugin",
    (Check(),  # the ServerArgs field
     Check(How.KEYWORD_PARAMS, "sglang.srt.mem_cache.registry.TreeCacheBuildContext",
           ("enable_hierarchical_cache",))),
    versions=SGLANG_0_5_23)
HOST_POOL_CLASS = TouchPoint(
    "sglang.srt.mem_cache.pool_host.mha.get_mha_host_pool_cls", Kind.EXTENSION,
    "the host tier's memory is SGLang's own host pool class for the device pool, built as "
    "HiCache builds it (ratio or size, layout, the device pool's buffer info)",
    "the server refuses to start with --enable-hierarchical-cache (the pool cannot be built)",
    f"{INTEGRATION}.host_tier",
    (Check(How.KEYWORD_PARAMS, f"{HOST_POOL}.__init__",
           ("device_capacity_tokens", "start_layer", "end_layer", "write_back_staging")),
     Check(probe=f"{MHA_POOL}.get_device_pool_infos")),
    versions=SGLANG_0_5_23)
HOST_POOL_TRANSFERS = TouchPoint(
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.load_to_device_per_layer", Kind.SIGNATURE,
    "host tier copies go through the host pool's own transfer methods (also "
    "`backup_from_device_all_layer`) with --hicache-io-backend",
    "host tier stores and loads fail: those prefixes are recomputed (never wrong KV)",
    f"{INTEGRATION}.host_tier",
    (Check(How.LEADING_PARAMS, names=("self", "device_pool", "host_indices", "device_indices",
                                      "layer_id", "io_backend")),
     Check(How.LEADING_PARAMS, "sglang.srt.mem_cache.pool_host.base.HostKVCache."
           "backup_from_device_all_layer",
           ("self", "device_pool", "host_indices", "device_indices", "io_backend"))),
    versions=SGLANG_0_5_23)

HOST_INDEX_RULE = TouchPoint(
    "sglang.srt.managers.cache_controller.HiCacheController.move_indices", Kind.REIMPLEMENTATION,
    "host tier copies place their index tensors as HiCache's controller does "
    "(`host_tier.place_indices`: kernel copies take host indices on the device, direct ones "
    "device indices on the host, layer_first's in host order)",
    "host tier copies get their indices on the wrong device: they fail, and those prefixes "
    "are recomputed", f"{INTEGRATION}.host_tier",
    (Check(How.BEHAVES, behaves=probes.host_index_rule),), mark="place_indices",
    versions=SGLANG_0_5_23)

CONTROLLER = "sglang.srt.managers.cache_controller.HiCacheController"
HOST_BASE = "sglang.srt.mem_cache.pool_host.base.HostKVCache"
STORAGE_BACKEND = TouchPoint(
    "sglang.srt.mem_cache.storage.StorageBackendFactory.create_backend", Kind.EXTENSION,
    "L3 below the host tier is SGLang's storage backend named by --hicache-storage-backend, "
    "built by its factory over the host tier's host pool (`register_mem_pool_host`)",
    "the server starts without L3 (logged) and serves with device, donor and host tiers",
    f"{INTEGRATION}.storage_tier",
    (Check(How.LEADING_PARAMS, names=("backend_name", "storage_config", "mem_pool_host")),),
    versions=SGLANG_0_5_23)
STORAGE_API = "sglang.srt.mem_cache.hicache_storage"
STORAGE_CONFIG = TouchPoint(
    f"{CONTROLLER}._generate_storage_config", Kind.REIMPLEMENTATION,
    "the backend's `HiCacheStorageConfig` is made as HiCache's controller makes it "
    "(`storage_pages.storage_config`: this rank's parallel place, the host layout, the model "
    "name tagged with the host pool's page format by `storage_model_name`)",
    "the backend gets another config than HiCache's would: it may key or split pages "
    "differently (a shared store misses) or refuse to start (the server serves without L3)",
    f"{INTEGRATION}.storage_pages",
    (Check(How.LEADING_PARAMS, names=("self", "model_name", "storage_backend_extra_config")),
     Check(How.KEYWORD_PARAMS, f"{STORAGE_API}.HiCacheStorageConfig",
           ("tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size",
            "is_mla_model", "enable_storage_metrics", "is_page_first_layout", "model_name",
            "tp_lcm_size", "should_split_heads", "dp_rank", "extra_config", "dcp_size",
            "dcp_rank", "logical_page_size")),
     Check(How.LEADING_PARAMS, "sglang.srt.managers.cache_controller.storage_model_name",
           ("model_name", "host_pool"))),
    mark="HiCacheStorageConfig(",
    versions=SGLANG_0_5_23)
STORAGE_PAGE_RULES = TouchPoint(
    f"{CONTROLLER}._storage_hit_query", Kind.REIMPLEMENTATION,
    "L3 hit queries, reads and writes follow HiCache's controller (`storage_pages.StoragePages`:"
    " page keys queried in batches of STORAGE_BATCH_SIZE up to the first miss, the keys before "
    "each batch passed as `prefix_keys`; zero-copy v1 calls for the backends HiCache runs "
    "zero-copy, flat data pages otherwise; also `_generic_page_get/_set`, "
    "`_page_get/_set_zero_copy`)",
    "L3 finds fewer pages than HiCache would, or a backend gets calls of the kind it does not "
    "serve: they count as misses or failed writes (recomputed, never wrong KV)",
    f"{INTEGRATION}.storage_pages",
    (Check(How.LEADING_PARAMS, names=("self", "operation")),
     Check(probe=f"{STORAGE_API}.STORAGE_BATCH_SIZE"),
     Check(How.KEYWORD_PARAMS, f"{STORAGE_API}.HiCacheStorageExtraInfo", ("prefix_keys",)),
     Check(How.LEADING_PARAMS, f"{CONTROLLER}._generic_page_get",
           ("self", "operation", "hash_values", "host_indices")),
     Check(How.LEADING_PARAMS, f"{CONTROLLER}._page_set_zero_copy",
           ("self", "hash_values", "host_indices"))),
    mark="STORAGE_BATCH_SIZE",
    versions=SGLANG_0_5_23)
STORAGE_INTERFACE = TouchPoint(
    f"{STORAGE_API}.HiCacheStorage.batch_exists", Kind.SIGNATURE,
    "L3 calls the backend's public interface (also `batch_get`, `batch_set`, `batch_get_v1`, "
    "`batch_set_v1`) and the host pool's page accessors (`get_data_page`, "
    "`get_dummy_flat_data_page`, `set_from_flat_data_page`)",
    "L3 queries, reads or writes raise: they count as misses or failed writes (recomputed, "
    "never wrong KV)", f"{INTEGRATION}.storage_pages",
    (Check(How.LEADING_PARAMS, names=("self", "keys", "extra_info")),
     Check(How.LEADING_PARAMS, f"{STORAGE_API}.HiCacheStorage.batch_get",
           ("self", "keys", "target_locations")),
     Check(How.LEADING_PARAMS, f"{STORAGE_API}.HiCacheStorage.batch_set",
           ("self", "keys", "values")),
     Check(How.LEADING_PARAMS, f"{STORAGE_API}.HiCacheStorage.batch_get_v1",
           ("self", "keys", "host_indices", "extra_info")),
     Check(How.LEADING_PARAMS, f"{STORAGE_API}.HiCacheStorage.batch_set_v1",
           ("self", "keys", "host_indices", "extra_info")),
     Check(How.LEADING_PARAMS, f"{HOST_BASE}.get_data_page", ("self", "index")),
     Check(How.LEADING_PARAMS, f"{HOST_BASE}.get_dummy_flat_data_page", ("self",)),
     Check(How.LEADING_PARAMS, f"{HOST_BASE}.set_from_flat_data_page",
           ("self", "index", "data_page"))),
    versions=SGLANG_0_5_23)
STORAGE_KEYS = TouchPoint(
    "sglang.srt.mem_cache.utils.get_storage_hash_str", Kind.SIGNATURE,
    "L3 pages are keyed as HiCache keys them (namespace seed, one hash per page chained on "
    "the one before), so SwiftCache and HiCache servers of one model share a store",
    "keys differ from HiCache's: a shared store misses across the two kinds of servers",
    f"{INTEGRATION}.storage_hits",
    (Check(How.LEADING_PARAMS, names=("key", "prior_hash", "page_size")),),
    versions=SGLANG_0_5_23)
SCHEDULER_PREFETCH = TouchPoint(
    "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache", Kind.SIGNATURE,
    "with --hicache-storage-backend set the scheduler calls the tree's L3 members "
    "(`prefetch_from_storage`, `check_prefetch_progress`, `pop_prefetch_loaded_span`, "
    "`is_backuped`, `get_last_hash_value`); SwiftCache's tree implements them",
    "no L3 fetch starts: requests whose prefix is only in storage recompute it",
    f"{INTEGRATION}.storage_hits",
    (Check(How.SOURCE, names=("prefetch_from_storage", "is_backuped", "get_last_hash_value",
                              "matched_prefix_tokens")),
     Check(How.SOURCE, "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
           ("check_prefetch_progress", "pop_prefetch_loaded_span"))),
    versions=SGLANG_0_5_23)

# ---- the layer stream cache (--swiftcache-layer-stream host|donor) ---------------------------
LAYER_STREAM = "sglang_swift.layer_stream"
CONFIG_FROM_BUDGET = TouchPoint(
    f"{CONFIGURATOR}.config_from_budget", Kind.AROUND,
    "the local budget holds `depth` staging layers instead of all: the pool is sized for "
    "L/depth times the tokens, capped by the host memory allowed",
    "a streamed pool gets only a stock pool's tokens", f"{LAYER_STREAM}.hooks",
    (Check(How.KEYWORD_PARAMS, names=("budget_bytes", "cap_tokens")),),
    versions=SGLANG_0_5_23)
CELL_SIZE = TouchPoint(
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._cell_size",
    Kind.PRIVATE_READ,
    "KV bytes per token over all layers, to cap the streamed pool by host memory",
    "the host cap is skipped (the pool is still refused later if the store does not fit)",
    f"{LAYER_STREAM}.hooks",
    (Check(How.SOURCE, "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator."
           "__init__", ("_cell_size",)),
     Check(probe="sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator")),
    versions=SGLANG_0_5_23)
BUILD_MHA_POOL = TouchPoint(
    f"{CONFIGURATOR}._build_mha_kv_pool", Kind.AROUND,
    "SGLang builds LayerStreamKVPool (its MHA pool, subclassed; MappedKVPool at depth 0) where "
    "it would build MHATokenToKVPool",
    "the pool is not streamed: the server starts with a stock pool", f"{LAYER_STREAM}.hooks",
    (Check(How.KEYWORD_PARAMS, names=("mha_pool_class", "quant_method")),),
    versions=SGLANG_0_5_23)
MHA_POOL_CLASS = TouchPoint(
    MHA_POOL, Kind.SUBCLASS,
    "LayerStreamKVPool keeps SGLang's MHA pool, with layers aliasing staging buffers",
    "the streamed pool's buffers no longer match what attention reads",
    f"{LAYER_STREAM}.pool",
    versions=SGLANG_0_5_23)
MAPPED_POOL_CLASS = TouchPoint(
    MHA_POOL, Kind.SUBCLASS,
    "MappedKVPool (depth 0) keeps SGLang's MHA pool, each layer's fused K/V buffer a range of "
    "addresses onto which local rows, host pieces and donor chunks are mapped; it overrides "
    "`_create_buffers_normal` and wraps the host-side readers (`get_cpu_copy`, "
    "`load_cpu_copy`, `move_kv_cache`) in its forward lock",
    "the mapped pool's buffers no longer match what attention reads",
    f"{LAYER_STREAM}.mapped",
    (Check(How.SOURCE, f"{MHA_POOL}._create_buffers_normal", ("fused", "k_buffer", "v_buffer")),),
    versions=SGLANG_0_5_23)
BUILD_ALLOCATOR = TouchPoint(
    f"{CONFIGURATOR}._build_token_to_kv_pool_allocator", Kind.AFTER,
    "with resident rows, the allocator hands out resident slots first",
    "short requests land on streamed slots while resident ones are free (slower, still right)",
    f"{LAYER_STREAM}.hooks",
    (Check(How.KEYWORD_PARAMS, names=("token_to_kv_pool",)),),
    versions=SGLANG_0_5_23)
RESIDENT_FIRST = TouchPoint(
    ALLOCATOR, Kind.CLASS_SWAP,
    "the allocator SGLang built becomes a direct subclass that sorts freed pages back in "
    "(SGLang's `need_sort` mode and `merge_and_sort_free`) before each allocation",
    "allocations stop preferring resident slots, or the swap fails at start-up",
    f"{LAYER_STREAM}.allocator",
    (Check(How.KEYWORD_PARAMS, f"{ALLOCATOR}.__init__", ("need_sort",)),
     Check(probe=f"{ALLOCATOR}.merge_and_sort_free")),
    versions=SGLANG_0_5_23)
MODEL_FORWARD = TouchPoint(
    "sglang.srt.model_executor.model_runner.ModelRunner.forward", Kind.AROUND,
    "opens and closes the streamed pool's per-forward stream (which slots the batch reads "
    "is known here), or holds the depth-0 pool's forward lock; also where the debug seam's "
    "forward observer runs",
    "no layer is loaded: attention reads stale staging buffers", f"{LAYER_STREAM}.hooks",
    (Check(How.LEADING_PARAMS, names=("self", "forward_batch")),),
    versions=SGLANG_0_5_23)
VALIDATE_INPUT = TouchPoint(
    "sglang.srt.managers.utils.validate_input_length", Kind.AFTER,
    "SGLang's refusal of a too-long prompt also names the streaming limits",
    "the refusal still happens, without the streaming limits in its message",
    f"{LAYER_STREAM}.hooks",
    (Check(How.LEADING_PARAMS, names=("req", "max_req_input_len")),),
    versions=SGLANG_0_5_23)

# ---- a lending server serving a hybrid sliding-window or linear-attention model ---------------
UNIFIED = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
CREATE_UNIFIED = TouchPoint(
    "sglang.srt.mem_cache.registry.create_unified_radix_cache", Kind.EXTENSION,
    "a hybrid server keeps the tree SGLang builds for its model, built by SGLang's own factory "
    "with SwiftCache's subclass as `cache_class`",
    "a hybrid server with --enable-swiftcache cannot start", f"{INTEGRATION}.hybrid_donor",
    (Check(How.KEYWORD_PARAMS, names=("ctx", "cache_class")),),
    versions=SGLANG_0_5_23)
UNIFIED_CACHE = TouchPoint(
    UNIFIED, Kind.SUBCLASS,
    "LendingUnifiedRadixCache: SGLang's tree for a hybrid model, counting lent pages in "
    "full_protected_size()/protected_size() and evicting its full-attention part to lend "
    "(full_evictable_size, evict)",
    "a hybrid donor's lent pages read as leaked in SGLang's idle memory check, or it lends "
    "nothing", f"{INTEGRATION}.hybrid_donor",
    (Check(probe=f"{UNIFIED}.full_protected_size"), Check(probe=f"{UNIFIED}.protected_size"),
     Check(probe=f"{UNIFIED}.full_evictable_size"), Check(probe=f"{UNIFIED}.evict")),
    versions=SGLANG_0_5_23)
HYBRID_FREE_LIST = TouchPoint(
    "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator.full_attn_allocator",
    Kind.PRIVATE_READ,
    "a sliding-window donor lends through the full-attention free list of SGLang's hybrid "
    "allocator only (no window slot is taken)",
    "a sliding-window donor cannot find its full-attention free list and lends nothing",
    f"{INTEGRATION}.hybrid_donor",
    (Check(How.SOURCE, "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator.__init__",
           ("self.full_attn_allocator",)),),
    versions=SGLANG_0_5_23)
HYBRID_FULL_POOL = TouchPoint(
    "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool.full_kv_pool", Kind.PRIVATE_READ,
    "a hybrid donor lends pages of the full-attention MHA pool inside SGLang's SWAKVPool or "
    "HybridLinearKVPool (`full_kv_pool`, with the linear pool's slots its token allocator's)",
    "a hybrid donor cannot find its full-attention pool and lends nothing",
    f"{INTEGRATION}.hybrid_donor",
    (Check(How.SOURCE, "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool.__init__",
           ("self.full_kv_pool",)),
     Check(How.SOURCE, "sglang.srt.mem_cache.memory_pool.HybridLinearKVPool.__init__",
           ("self.full_kv_pool",))),
    versions=SGLANG_0_5_23)

# ---- CPU venv only: HiCache's CUDA-only pieces (cpu_compat/hicache.py installs them on import
# of each target module when SGLang's CPU engine is active; its PATCHES are the source)
# ---- a lending or borrowing server with --tp > 1 -----------------------------------------------
TP_GROUP = TouchPoint(
    "sglang.srt.distributed.parallel_state.GroupCoordinator.cpu_group", Kind.PRIVATE_READ,
    "the TP group SGLang hands the tree build (`TreeCacheBuildContext.tp_group`): its gloo CPU "
    "group, ranks, rank_in_group and world_size carry SwiftCache's per-step agreement between "
    "the ranks (`tp_sync.py`: msgpack bytes as uint8 tensors, torch.distributed's broadcast "
    "and all_gather on that group)",
    "a TP borrower cannot agree on leases and copies between its ranks: start-up fails",
    f"{INTEGRATION}.tp_sync",
    (Check(How.SOURCE, "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__",
           ("self.cpu_group", "self.ranks", "self.rank_in_group", "self.world_size")),
     Check(How.KEYWORD_PARAMS, "sglang.srt.mem_cache.registry.TreeCacheBuildContext",
           ("tp_group", "tp_size"))),
    versions=SGLANG_0_5_23)
IDLE_SLEEPER = "sglang.srt.managers.scheduler_components.idle_sleeper.IdleSleeper"
IDLE_POLLER = TouchPoint(
    f"{IDLE_SLEEPER}.poller", Kind.PRIVATE_WRITE,
    "rank 0's scheduler with --sleep-on-idle sleeps in its idle sleeper's zmq poll (up to a "
    "second, `Scheduler.idle_sleeper`): SwiftCache registers a pipe of its own (bytes only) on "
    "that poller at the first scheduler step, and the agent's I/O thread writes a byte to it "
    "when a reclaim (or a TP donor's returned pages) waits for the pump, so the loop runs at "
    "once; the step drains it (`loop_wake.py`)",
    "an idle TP server acknowledges a reclaim only when its loop wakes on its own (up to a "
    "second): the donor's own requests wait that long for their pages",
    f"{INTEGRATION}.loop_wake",
    (Check(How.SOURCE, f"{SCHEDULER}.init_idle_sleeper", ("self.idle_sleeper", "IdleSleeper(")),
     Check(How.BEHAVES, IDLE_SLEEPER, behaves=probes.idle_sleeper_poller),
     Check(How.SOURCE, f"{IDLE_SLEEPER}.maybe_sleep", ("self.poller.poll",))),
    versions=SGLANG_0_5_23)
_STAND_IN_PIN = cpu_hicache.PINNED_SGLANG  # the release the stand-ins check themselves against
HICACHE_STAND_INS: tuple[TouchPoint, ...] = tuple(
    TouchPoint(patch.dotted, Kind(patch.kind), f"CPU stand-in `{patch.name}`: {patch.why}",
               f"breaks if {patch.breaks_if}; {patch.unpatched}", cpu_hicache.USED_IN,
               versions=Versions(_STAND_IN_PIN, _STAND_IN_PIN, (_STAND_IN_PIN,)), cpu_only=True)
    for patch in cpu_hicache.PATCHES)

ALL: tuple[TouchPoint, ...] = (
    ADD_CLI_ARGS, OPTION_STRINGS, FROM_CLI_ARGS, CPU_DEFAULTS, RESOLUTION_STATE,
    REGISTER_BACKEND, RADIX_CACHE, SCHEDULER_STEP, OWN_DEMAND, BATCH_BUILT, BATCH_RAN,
    RUN_BATCH_SIGNATURE, PENDING_CHUNKED_ABORT, RETRY_RELEASE, RETRY_REQUEUE, REQ_TREE_LOCK,
    KV_POOL_BUFFERS, KV_POOL_LATENT_BUFFERS, FORWARD_STREAM,
    STEP_MARK, HICACHE_FLAG, HOST_POOL_CLASS, HOST_POOL_TRANSFERS, HOST_INDEX_RULE,
    STORAGE_BACKEND, STORAGE_CONFIG, STORAGE_PAGE_RULES, STORAGE_INTERFACE, STORAGE_KEYS,
    SCHEDULER_PREFETCH,
    CONFIG_FROM_BUDGET, CELL_SIZE, BUILD_MHA_POOL, MHA_POOL_CLASS, BUILD_ALLOCATOR,
    RESIDENT_FIRST, MODEL_FORWARD, VALIDATE_INPUT, TP_GROUP, IDLE_POLLER, CREATE_UNIFIED,
    UNIFIED_CACHE, HYBRID_FREE_LIST, HYBRID_FULL_POOL, *HICACHE_STAND_INS,
)


def problems(points: tuple[TouchPoint, ...] = ALL, *, version: str | None = None,
             environ: Mapping[str, str] | None = None) -> list[str]:
    """What the installed SGLang (release `version`, read from the install when None) no
    longer provides, one line per failed check; CPU-only entries only where the CPU
    compatibility layer is active (`environ`: the process environment when None)."""
    version = installed_sglang() if version is None else version
    cpu = cpu_compat_active(environ)
    return [p for point in points if cpu or not point.cpu_only
            for p in point.problems(version)]
