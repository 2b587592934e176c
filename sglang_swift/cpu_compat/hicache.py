"""CPU stand-ins for the CUDA-only pieces of SGLang's HiCache (`--enable-hierarchical-cache`).

On SGLang's CPU engine, stock HiCache stops at three things that exist only for accelerators:
1. the host KV pool is pinned (`cudaHostRegister`; `torch.zeros(pin_memory=True)` for L3 pages);
2. the host<->device copies are `sgl_kernel.kvcacheio` / JIT kernels, imported only on CUDA, ROCm
   and XPU (`NameError: transfer_kv_all_layer_lf_pf`);
3. the transfer streams and events come from `torch.cpu`, whose Stream has no `synchronize`.
Here: host pools are never pinned; the copies are torch index copies over the host layouts
(SUPPORTED: the io-backend/layout pairs stock SGLang serves on a GPU, anything else is refused
when the HiCache controller starts, naming the option); streams and events are immediate (CPU
torch has no device streams: every op has finished when its call returns, and HiCache issues its
L2 copies from the scheduler thread, so a recorded event is complete). HiCache's own logic (tree,
controller, L3 backends and their threads) runs as is.

Installation follows the other stand-ins: the venv's `.pth` (site_hook) calls `install()`, which
puts a meta-path finder in place that acts when a patched SGLang module has just been imported,
and patches it only when SGLang's CPU engine is on (SGLANG_USE_CPU_ENGINE=1, decided at
`import sglang`). Patches are named, idempotent, checked against the pinned SGLang (a mismatch is
reported loudly and that patch is skipped; HiCache then refuses to start on the CPU engine), and
logged once, when a HiCache controller starts. PATCHES lists every touch point as data; it also
holds the one CPU-engine patch outside HiCache, through the same machinery: the CPU attention
backend's reads of sliding-window layers (`window_reads.py`).

This module is imported at every interpreter start of the CPU venv: nothing heavy at the top.
"""

from __future__ import annotations

import os
import sys
from collections import namedtuple

PINNED_SGLANG = "0.5.23"


HICACHE_REFUSES = "HiCache then refuses to start on the CPU engine"


class Patch(namedtuple("Patch", "name target kind why breaks_if hicache_needs unpatched",
                       defaults=(True, HICACHE_REFUSES))):
    """One patch: `name` of the stand-in; `target` "module:attribute" it replaces; `kind` in the
    words of integration/touchpoints.Kind values; `why`; `breaks_if`: what to re-check when SGLang
    changes (the parameters each replaced callable needs are checked at install:
    _EXPECTED_PARAMS); `hicache_needs`: whether a HiCache controller refuses to start without it
    (False for a host pool's stand-ins, checked per pool in use, and for patches outside
    HiCache); `unpatched`: what goes wrong where it is missing. The manifest
    (integration/touchpoints.py) lists every patch."""

    __slots__ = ()

    @property
    def dotted(self) -> str:
        """The target as one dotted name (touchpoints.resolve)."""
        return self.target.replace(":", ".")


USED_IN = "sglang_swift.cpu_compat.hicache"
_WINDOW_UNPATCHED = ("a hybrid sliding-window model reads other tokens' window rows once its "
                     "free lists part (a donor that lent)")
PATCHES = (
    Patch("unpinned_host_pool", "sglang.srt.mem_cache.pool_host.base:HostKVCache.__init__",
               "hook BEFORE",
               "pin_memory=False: CPU torch has no pinned allocator (cudaHostRegister, "
               "torch.zeros(pin_memory=True) raise)",
               "the keyword `pin_memory` of HostKVCache.__init__ is renamed or pinning moves "
               "out of the host pool"),
    Patch("cpu_load_per_layer",
               "sglang.srt.mem_cache.pool_host.mha:MHATokenToKVPoolHost.load_to_device_per_layer",
               "re-implementation",
               "host->device copy of one layer; the kernels it calls exist only for CUDA/HIP/XPU",
               "its signature, the host layouts (init_kv_buffer), or device_k_buffers/"
               "device_v_buffers/k_buffer/v_buffer/target_layer_num change"),
    Patch("cpu_backup_all_layers",
               "sglang.srt.mem_cache.pool_host.mha:MHATokenToKVPoolHost.backup_from_device_all_layer",
               "re-implementation",
               "device->host copy of all layers; same kernels",
               "as cpu_load_per_layer"),
    Patch("cpu_mla_load_per_layer",
               "sglang.srt.mem_cache.pool_host.mla:MLATokenToKVPoolHost.load_to_device_per_layer",
               "re-implementation",
               "host->device copy of one layer of an MLA host pool (one latent buffer per layer); "
               "the kernels it calls exist only for CUDA/HIP/XPU/NPU",
               "its signature, the host layouts (init_kv_buffer), or kv_buffer/"
               "device_kv_buffers/_buffer_index_by_layer/_host_layer_by_controller change",
               hicache_needs=False),
    Patch("cpu_mla_backup_all_layers",
               "sglang.srt.mem_cache.pool_host.mla:MLATokenToKVPoolHost."
               "backup_from_device_all_layer",
               "re-implementation",
               "device->host copy of all layers of an MLA host pool; same kernels",
               "as cpu_mla_load_per_layer", hicache_needs=False),
    Patch("cpu_l2_streams", "sglang.srt.mem_cache.l2_transfer:device_module",
               "class swap",
               "the L2 transfer streams/events; torch.cpu.Stream has no synchronize",
               "L2TransferEngine stops taking its streams/events from module-level device_module"),
    Patch("cpu_layer_events", "sglang.srt.managers.cache_controller:device_module",
               "class swap",
               "LayerLoadingEvent events and the consumer wait, one kind with the L2 events",
               "as cpu_l2_streams, for LayerLoadingEvent/LayerDoneCounter"),
    Patch("cpu_window_reads_extend",
               "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend."
               "forward_extend",
               "hook AROUND",
               "a sliding-window layer's rows read at its window-pool slots (the CPU backend "
               "reads them at full-pool slots: window_reads.py)",
               "TorchNativeAttnBackend stops reading req_to_token_pool.req_to_token per request "
               "run, or SWAKVPool's layers_mapping/full_to_swa_index_mapping change",
               hicache_needs=False, unpatched=_WINDOW_UNPATCHED),
    Patch("cpu_window_reads_decode",
               "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend."
               "forward_decode",
               "hook AROUND",
               "as cpu_window_reads_extend, for decode",
               "as cpu_window_reads_extend", hicache_needs=False, unpatched=_WINDOW_UNPATCHED),
    Patch("cpu_startup_check",
               "sglang.srt.managers.cache_controller:HiCacheController.__init__",
               "hook BEFORE",
               "refuses host pools and io-backend/layout pairs the CPU copies don't serve, at "
               "start-up, naming the option; logs the stand-ins once",
               "its parameters `mem_pool_host`/`io_backend` or HostPoolGroup.entries change"),
)
# the parameters each replaced callable must have in the pinned SGLang
_EXPECTED_PARAMS = {
    "unpinned_host_pool": ("self", "pin_memory"),
    "cpu_load_per_layer": ("self", "device_pool", "host_indices", "device_indices", "layer_id",
                           "io_backend", "is_draft"),
    "cpu_backup_all_layers": ("self", "device_pool", "host_indices", "device_indices",
                              "io_backend"),
    "cpu_startup_check": ("self", "mem_pool_host", "io_backend"),
    "cpu_mla_load_per_layer": ("self", "device_pool", "host_indices", "device_indices",
                               "layer_id", "io_backend", "is_draft"),
    "cpu_mla_backup_all_layers": ("self", "device_pool", "host_indices", "device_indices",
                                  "io_backend"),
    "cpu_window_reads_extend": ("self", "q", "k", "v", "layer", "forward_batch"),
    "cpu_window_reads_decode": ("self", "q", "k", "v", "layer", "forward_batch"),
}
# io backend -> host layouts whose copies are stood in (stock SGLang serves the same pairs on GPU)
SUPPORTED = {"kernel": ("layer_first", "page_first", "page_head"),
             "direct": ("layer_first", "page_first_direct")}
MARK = "__swiftcache_stand_in__"  # set on every installed replacement (idempotence, tests)

_state = {"installed": set(), "failed": {}, "logged": False, "version_warned": False}


def cpu_engine_active(environ=None) -> bool:
    """Whether this process runs SGLang's CPU engine with the compatibility layer on."""
    environ = os.environ if environ is None else environ
    return environ.get("SGLANG_USE_CPU_ENGINE") == "1" and \
        environ.get("SWIFTCACHE_CPU_COMPAT") != "0"


def check_pair(io_backend: str, layout: str) -> None:
    """Raise ValueError naming the options when the CPU copies don't serve this pair."""
    if layout not in SUPPORTED.get(io_backend, ()):
        served = "; ".join(f"--hicache-io-backend {io} with --hicache-mem-layout "
                           f"{'|'.join(layouts)}" for io, layouts in SUPPORTED.items())
        raise ValueError(
            f"HiCache on SGLang's CPU engine: --hicache-io-backend {io_backend} with "
            f"--hicache-mem-layout {layout} has no CPU copy. Served: {served}. The defaults "
            "(kernel, page_first) work.")


def cpu_load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,
                                 io_backend, *, is_draft: bool = False):
    """Stand-in for MHATokenToKVPoolHost.load_to_device_per_layer (same contract)."""
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    from .hicache_ops import load_layer

    check_pair(io_backend, self.layout)
    for host, device in ((self.k_buffer, self.device_k_buffers[layer_id]),
                         (self.v_buffer, self.device_v_buffers[layer_id])):
        load_layer(host, device, self.layout, layer_id, host_indices, device_indices,
                   self.page_size)


def cpu_backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend):
    """Stand-in for MHATokenToKVPoolHost.backup_from_device_all_layer (same contract)."""
    from .hicache_ops import backup_layer

    check_pair(io_backend, self.layout)
    for layer in range(len(self.device_k_buffers)):
        for host, device in ((self.k_buffer, self.device_k_buffers[layer]),
                             (self.v_buffer, self.device_v_buffers[layer])):
            backup_layer(host, device, self.layout, layer, host_indices, device_indices,
                         self.page_size)


def _mla_slots(pool, layer_id: int):
    """(host layer, device latent buffer) of controller layer `layer_id` of MLA host pool
    `pool`, as SGLang's own MLA copies address them."""
    return (pool._host_layer_by_controller[layer_id],
            pool.device_kv_buffers[pool._buffer_index_by_layer[layer_id]])


def _check_mla(pool, io_backend: str) -> None:
    check_pair(io_backend, pool.layout)
    if getattr(pool, "dcp_size", 1) != 1 or not pool.device_kv_buffers:
        raise ValueError("HiCache on SGLang's CPU engine copies an MLA host pool over one "
                         "packed latent buffer per layer, without decode context parallelism")


def cpu_mla_load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,
                                     io_backend, *, is_draft: bool = False):
    """Stand-in for MLATokenToKVPoolHost.load_to_device_per_layer (same contract)."""
    if not is_draft and layer_id not in self._target_layer_indices:
        return
    from .hicache_ops import load_layer

    _check_mla(self, io_backend)
    host_layer, device = _mla_slots(self, layer_id)
    load_layer(self.kv_buffer, device, self.layout, host_layer, host_indices, device_indices,
               self.page_size)


def cpu_mla_backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                         io_backend):
    """Stand-in for MLATokenToKVPoolHost.backup_from_device_all_layer (same contract): every
    target layer, then the draft layers, as SGLang's copies run them."""
    from .hicache_ops import backup_layer

    _check_mla(self, io_backend)
    for layer_id in self._buffer_index_by_layer:
        host_layer, device = _mla_slots(self, layer_id)
        backup_layer(self.kv_buffer, device, self.layout, host_layer, host_indices,
                     device_indices, self.page_size)


# -- start-up check -----------------------------------------------------------------------------
def host_pools(mem_pool_host) -> list:
    """The host pools behind a controller's `mem_pool_host` (a HostPoolGroup or one pool)."""
    entries = getattr(mem_pool_host, "entries", None)
    return [mem_pool_host] if entries is None else [entry.host_pool for entry in entries]


def check_host_pools(mem_pool_host, io_backend: str) -> str:
    """Raise (what to do) unless every host pool is copied by the stand-ins; returns the layouts
    in use, for the log line."""
    # a host pool's stand-ins are checked per pool in use below (the MLA host pool's module is
    # imported only where SGLang needs it)
    missing = [p.name for p in PATCHES if p.hicache_needs and p.name not in _state["installed"]]
    if missing:
        problems = "; ".join(f"{name}: {_state['failed'].get(name, 'target never imported')}"
                             for name in missing)
        raise RuntimeError(
            f"HiCache on SGLang's CPU engine: stand-ins missing ({problems}). They were written "
            f"for sglang=={PINNED_SGLANG}; install that version or update "
            "sglang_swift/cpu_compat/hicache.py, or run without --enable-hierarchical-cache.")
    layouts = []
    for pool in host_pools(mem_pool_host):
        cls = type(pool)
        if getattr(cls.load_to_device_per_layer, MARK, None) is None or \
                getattr(cls.backup_from_device_all_layer, MARK, None) is None:
            raise ValueError(
                f"HiCache on SGLang's CPU engine copies plain MHA and MLA KV host pools only; this "
                f"model needs {cls.__module__}.{cls.__name__}, which has no CPU copy. Run it "
                "without --enable-hierarchical-cache on the CPU engine.")
        check_pair(io_backend, pool.layout)
        layouts.append(pool.layout)
    return ", ".join(sorted(set(layouts)))


def _checked_controller_init(original):
    import inspect
    import logging

    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        io_backend = bound.arguments.get("io_backend", signature.parameters["io_backend"].default)
        layouts = check_host_pools(bound.arguments["mem_pool_host"], io_backend)
        if not _state["logged"]:
            _state["logged"] = True
            logging.getLogger(__name__).info(
                "SwiftCache CPU compat: HiCache on SGLang's CPU engine with stand-ins: host pool "
                "not pinned, torch index copies (--hicache-io-backend %s, layout %s), immediate "
                "CPU streams/events", io_backend, layouts)
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def _unpinned_host_pool_init(original):
    def __init__(self, *args, **kwargs):
        kwargs["pin_memory"] = False  # keyword-only in HostKVCache.__init__ (_EXPECTED_PARAMS)
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


# -- installation -------------------------------------------------------------------------------
def _cpu_device_module(original):
    from .hicache_ops import CpuDeviceModule

    return CpuDeviceModule


def _window_reads(original):
    from .window_reads import window_reads

    return window_reads(original)


# name -> how the replacement is made from the original
_MAKERS = {
    "unpinned_host_pool": _unpinned_host_pool_init,
    "cpu_load_per_layer": lambda original: cpu_load_to_device_per_layer,
    "cpu_backup_all_layers": lambda original: cpu_backup_from_device_all_layer,
    "cpu_l2_streams": _cpu_device_module,
    "cpu_layer_events": _cpu_device_module,
    "cpu_startup_check": _checked_controller_init,
    "cpu_mla_load_per_layer": lambda original: cpu_mla_load_to_device_per_layer,
    "cpu_mla_backup_all_layers": lambda original: cpu_mla_backup_from_device_all_layer,
    "cpu_window_reads_extend": _window_reads,
    "cpu_window_reads_decode": _window_reads,
}
TARGET_MODULES = tuple(dict.fromkeys(p.target.split(":")[0] for p in PATCHES))


def apply_to_module(module, environ=None) -> list[str]:
    """Install the stand-ins whose target lives in `module` (just imported); returns the names
    installed now. Nothing outside SGLang's CPU engine; idempotent."""
    if not cpu_engine_active(environ):
        return []
    _warn_version_once()
    done = []
    for patch in PATCHES:
        module_name, _, path = patch.target.partition(":")
        if module_name != module.__name__:
            continue
        problem = _install(module, path, patch)
        if problem is None:
            _state["failed"].pop(patch.name, None)
            if patch.name not in _state["installed"]:
                _state["installed"].add(patch.name)
                done.append(patch.name)
        else:
            _state["failed"][patch.name] = problem
            _loud(f"HiCache stand-in {patch.name!r} not installed: {patch.target} {problem} "
                  f"(written for sglang=={PINNED_SGLANG}). Breaks if {patch.breaks_if}. "
                  "HiCache will refuse to start on the CPU engine.")
    return done


def _install(module, path: str, patch: Patch) -> str | None:
    owner_path, _, attr = path.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part, None)
    if owner is None or attr not in vars(owner):
        return "does not exist"
    original = vars(owner)[attr]
    if getattr(original, MARK, None) is not None:
        return None  # already a stand-in: installing twice changes nothing
    expected = _EXPECTED_PARAMS.get(patch.name)
    if expected is not None:
        import inspect

        params = inspect.signature(original).parameters
        missing = [p for p in expected if p not in params]
        if missing:
            return f"has no parameter(s) {', '.join(missing)}"
    replacement = _MAKERS[patch.name](original)
    if not isinstance(replacement, type):
        setattr(replacement, MARK, patch.name)
    setattr(owner, attr, replacement)
    return None


def installed(name: str) -> bool:
    return name in _state["installed"]


def _warn_version_once() -> None:
    if _state["version_warned"]:
        return
    _state["version_warned"] = True
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        return
    if found != PINNED_SGLANG:
        _loud(f"sglang=={found} is installed; the HiCache CPU stand-ins were checked against "
              f"sglang=={PINNED_SGLANG} (each target is re-checked as it is patched)")


def _loud(message: str) -> None:
    import logging

    logging.getLogger(__name__).error("SwiftCache CPU compat: %s", message)
    print(f"SwiftCache CPU compat: {message}", file=sys.stderr)


class _LoaderProxy:
    """Runs the real loader, then `apply_to_module` on the fresh module."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        apply_to_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PostImportFinder:
    """A sys.meta_path finder for TARGET_MODULES: lets the other finders find the module and
    wraps its loader, so the stand-ins go in the moment the module has executed."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TARGET_MODULES or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LoaderProxy(spec.loader)
        return spec


def install() -> None:
    """Put the finder in place (idempotent) and patch target modules already imported. Cheap:
    nothing is imported here, and nothing is patched outside SGLang's CPU engine."""
    if not any(isinstance(f, PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())
    for name in TARGET_MODULES:
        if name in sys.modules:
            apply_to_module(sys.modules[name])


def register_hicache_stand_ins() -> bool:
    """For a caller that cannot rely on the venv's `.pth` (the plugin's entry point, an embedded
    interpreter): install as the site hook does. True when the CPU engine is active."""
    install()
    return cpu_engine_active()
