"""SGLang plugin: adds --enable-swiftcache and registers the `swiftcache` radix cache backend.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in every process it starts
(launcher, scheduler, detokenizer). Nothing else in this package touches SGLang at import time.
Every target touched is an entry of `touchpoints.py`; a process registers only what it needs:

- the launcher (the process SGLang's plugin loader runs in first, not a spawned child):
  AFTER-hooks `ServerArgs.add_cli_args` (adds `--enable-swiftcache` and the
  `--swiftcache-*` options derived from `SwiftConfig`; a bad value is an argparse error naming the
  option) and `ServerArgs.from_cli_args` (with the flag: builds the one frozen `SwiftConfig`,
  carries it to the spawned processes as a bookkeeping attribute that pickles with ServerArgs and
  as CONFIG_ENV, and selects the `swiftcache` backend; without it: leaves ServerArgs as stock);
- a process of a server started with the flag (CONFIG_ENV inherited): the `swiftcache` backend
  (`register_radix_cache_backend`) and the hooks its configuration uses (`server_hooks`):
  BEFORE `Scheduler.get_next_batch_to_run` when it lends, borrows or has a host tier (control
  events and finished copies once per loop); AFTER `Scheduler.get_new_batch_prefill` and
  `Scheduler.run_batch` when it borrows or has a host tier (the loads its batch queued start,
  and after the forward the requests whose load failed run again (`load_retry.py`) or are
  aborted: SGLang 0.5.23 drives its own layer-wise loads this way only for HiCache and the
  external linker); AROUND
  `MHATokenToKVPool._create_buffers_normal` and `MLATokenToKVPool._create_buffers` when it
  lends (the pool in shareable memory, `shared_kv_pool.py`); the layer stream cache's hooks
  (`layer_stream/hooks.py`) when it streams layers;
- where the debug seam has a forward observer (`debug_seam.py`, benchmarks only): AROUND the
  model forward.

Before any of that it checks the installed sglang version and every touch point. On a mismatch
it prints a loud message (logging is not configured yet in the launcher) and installs only a
refusal: `--enable-swiftcache` then stops the server with that message instead of half-applying.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from ..config import CONFIG_ENV, SwiftConfig, cli_options
from . import debug_seam
from . import touchpoints as tp
from .touchpoints import TouchPoint

logger = logging.getLogger(__name__)

PINNED_SGLANG = "0.5.23"
BACKEND_NAME = "swiftcache"
CONFIG_ATTR = "_swiftcache_config"  # bookkeeping attribute on ServerArgs (pickled into children)
# The first words of the one line each process prints about what it registered (see register()).
REGISTERED = "SwiftCache plugin registered in pid"
NOTHING = "nothing"  # the registration line of a process SwiftCache is off in
FLAG_POINTS = (tp.ADD_CLI_ARGS, tp.FROM_CLI_ARGS)  # what the launcher registers


class SwiftCacheUnavailable(RuntimeError):
    """SwiftCache cannot run on this SGLang; the message says why and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Start-up checks
# ---------------------------------------------------------------------------------------------
def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def target_exists(dotted: str) -> bool:
    return tp.resolve(dotted) is not None


def check_sglang(version: str, points: Sequence[TouchPoint] = tp.ALL) -> list[str]:
    """Problems that stop SwiftCache from running on this SGLang (empty when all is well): the
    version pin, then every touch point's checks (`touchpoints.py`)."""
    problems = []
    if version != PINNED_SGLANG:
        problems.append(
            f"sglang {version} is installed, SwiftCache supports exactly sglang=={PINNED_SGLANG}; "
            f"install it with `pip install sglang=={PINNED_SGLANG}`")
    failed = tp.problems(tuple(points))
    if failed:
        problems.append("SGLang no longer matches SwiftCache's touch points: " + "; ".join(failed))
    return problems


def _shout(problems: list[str], *,
           consequence: str = "--enable-swiftcache will refuse to start the server.") -> None:
    bar = "!" * 78
    title = "plugin DISABLED" if consequence.startswith("--enable") else "instruments NOT installed"
    print(f"{bar}\nSwiftCache {title} (pid {os.getpid()}):", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    print(f"{consequence}\n{bar}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def add_swiftcache_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SwiftCache", "donated HBM, elastic arena, layer streaming")
    group.add_argument("--enable-swiftcache", action="store_true",
                       help="enable SwiftCache (selects the 'swiftcache' radix cache backend)")
    groups = {None: group}  # a field's metadata "group" names its own argument group
    for flag, f in cli_options():
        title = f.metadata.get("group")
        if title not in groups:
            groups[title] = parser.add_argument_group(title, f"SwiftCache: {title}")
        groups[title].add_argument(flag, dest="swiftcache_" + f.name,
                                   type=_argparse_type(f.metadata["parse"]), default=None,
                                   help=f"{f.metadata['help']} (default: {f.default!r})")


def config_from_namespace(args: argparse.Namespace) -> SwiftConfig:
    """The SwiftConfig the user asked for; options not given keep their defaults."""
    values = {f.name: getattr(args, "swiftcache_" + f.name) for _, f in cli_options()
              if getattr(args, "swiftcache_" + f.name, None) is not None}
    return SwiftConfig(enabled=bool(getattr(args, "enable_swiftcache", False)), **values)


def _after_add_cli_args(result: Any, parser: argparse.ArgumentParser, *a: Any, **kw: Any) -> None:
    if not any(o == "--enable-swiftcache" for o in parser._option_string_actions):
        add_swiftcache_args(parser)


def _after_from_cli_args(server_args: Any, cls: Any, args: argparse.Namespace, *a: Any,
                         **kw: Any) -> None:
    if not getattr(args, "enable_swiftcache", False):
        given = [flag for flag, f in cli_options()
                 if getattr(args, "swiftcache_" + f.name, None) is not None]
        if given:
            raise SystemExit(f"{', '.join(given)} given without --enable-swiftcache")
        os.environ.pop(CONFIG_ENV, None)  # a stale one must not turn SwiftCache on in children
        return None
    try:
        config = config_from_namespace(args)
    except ValueError as exc:  # cross-option checks that argparse cannot do per option
        raise SystemExit(f"SwiftCache: invalid configuration: {exc}") from None
    chosen = getattr(server_args, "radix_cache_backend", None)
    if chosen not in (None, "", BACKEND_NAME):
        raise SystemExit(f"--enable-swiftcache selects --radix-cache-backend {BACKEND_NAME}; "
                         f"it cannot be combined with --radix-cache-backend {chosen}")
    if getattr(server_args, "disable_radix_cache", False):
        raise SystemExit("--enable-swiftcache needs the radix cache; drop --disable-radix-cache")
    from ..layer_stream.hooks import check_server_args

    check_server_args(server_args, config)
    if getattr(server_args, "enable_hierarchical_cache", False):
        config = _with_host_tier(server_args, config)
    server_args.radix_cache_backend = BACKEND_NAME
    setattr(server_args, CONFIG_ATTR, config.to_json())
    os.environ[CONFIG_ENV] = config.to_json()  # inherited by the spawned processes: register()
    # there reads it and registers the hooks this configuration uses
    return None


def _with_host_tier(server_args: Any, config: SwiftConfig) -> SwiftConfig:
    """--enable-hierarchical-cache with --enable-swiftcache: SwiftCache's tree gets a host tier
    on SGLang's host pool, sized and laid out by HiCache's options as SGLang resolved them
    (`host_tier.py`). SGLang's own flag is cleared (touchpoints.HICACHE_FLAG), so its scheduler
    builds and drives no HiCache tree of its own beside SwiftCache's. `--hicache-storage-backend`
    stays set: the scheduler then calls the tree's L3 members (`storage_hits.py`), which run
    SGLang's storage backend below the host tier. Options the host tier does not honour yet are
    refused here, before any model loads, each named."""
    from .host_tier import host_tier_problems

    problems = host_tier_problems(server_args, config)
    if problems:
        raise SystemExit("--enable-swiftcache with --enable-hierarchical-cache does not support: "
                         + "; ".join(problems))
    server_args.enable_hierarchical_cache = False  # touchpoints.HICACHE_FLAG
    import dataclasses

    return dataclasses.replace(config, host_tier=True)


def _refuse_from_cli_args(problems: list[str]) -> Callable[..., None]:
    def hook(server_args: Any, cls: Any, args: argparse.Namespace, *a: Any, **kw: Any) -> None:
        if getattr(args, "enable_swiftcache", False):
            raise SystemExit("--enable-swiftcache refused: " + "; ".join(problems))

    return hook


# ---------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------
def config_for_server(server_args: Any) -> SwiftConfig:
    """The config the launcher parsed, as seen in a spawned process."""
    text = getattr(server_args, CONFIG_ATTR, None) or os.environ.get(CONFIG_ENV)
    if not text:
        raise SwiftCacheUnavailable(
            f"radix cache backend '{BACKEND_NAME}' selected without --enable-swiftcache; "
            "start the server with --enable-swiftcache instead of --radix-cache-backend swiftcache")
    return SwiftConfig.from_json(text)


def _before_scheduler_step(scheduler: Any, *a: Any, **kw: Any) -> None:
    """Once per scheduler loop iteration, after SGLang took in new requests and before it admits
    any: let a SwiftCache tree handle control-channel events (leases granted, reclaims, lost
    donors) on the scheduler thread, and a donor weigh its queued requests' demand against what
    it lent. Stock trees have no step."""
    step = getattr(getattr(scheduler, "tree_cache", None), "swift_step", None)
    if step is not None:
        step(scheduler)
    return None


def _after_batch_built(plan: Any, scheduler: Any, *a: Any, **kw: Any) -> None:
    """A prefill batch was built (its requests admitted, their rows written): a SwiftCache
    borrower starts the loads they queued, before the forward runs."""
    hook = getattr(getattr(scheduler, "tree_cache", None), "swift_batch_built", None)
    if hook is not None and plan is not None and plan.batch_to_run is not None:
        hook(plan.batch_to_run)
    return None


def _after_batch_ran(result: Any, scheduler: Any, *a: Any, **kw: Any) -> None:
    """A batch's forward ran: a SwiftCache borrower drops the output of the requests whose
    load failed, before SGLang processes it, and sends them back to the queue (or aborts
    them)."""
    hook = getattr(getattr(scheduler, "tree_cache", None), "swift_batch_ran", None)
    if hook is not None:
        hook(scheduler, a[0] if a else kw["batch"])
    return None


def swiftcache_backend_factory(ctx: Any) -> Any:
    from .backend import create_swift_tree_cache

    config = config_for_server(ctx.server_args)
    logger.info("SwiftCache: building the '%s' tree cache in pid %d with %s",
                BACKEND_NAME, os.getpid(), config.to_json())
    return create_swift_tree_cache(ctx, config)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def config_in_process(environ: Mapping[str, str] | None = None) -> SwiftConfig | None:
    """The SwiftConfig of this process's server when SwiftCache is on for it, else None: a
    scheduler (or other) process that SGLang spawned for a server started with the flag inherits
    CONFIG_ENV from the launcher's `from_cli_args` hook."""
    text = (os.environ if environ is None else environ).get(CONFIG_ENV)
    if not text:
        return None
    config = SwiftConfig.from_json(text)
    return config if config.enabled else None


def server_hooks(config: SwiftConfig | None,
                 observers: debug_seam.Observers) -> list[tuple[TouchPoint, Callable]]:
    """The hooks beyond the flag's two that a process needs: only those its server's
    configuration uses (none without SwiftCache), then the debug seam's forward hook if a
    forward observer is installed (registered last: the outermost wrapper). Every SwiftCache
    server steps its tree once a loop: a plain tree only to push its counters to /metrics."""
    hooks: list[tuple[TouchPoint, Callable]] = []
    if config is not None:
        hooks.append((tp.SCHEDULER_STEP, _before_scheduler_step))
        if config.borrows or config.host_tier:
            hooks += [(tp.BATCH_BUILT, _after_batch_built), (tp.BATCH_RAN, _after_batch_ran)]
        if config.lends:
            from .shared_kv_pool import (
                create_buffers_in_shared_region,
                create_latent_buffers_in_shared_region,
            )

            hooks += [(tp.KV_POOL_BUFFERS, create_buffers_in_shared_region),
                      (tp.KV_POOL_LATENT_BUFFERS, create_latent_buffers_in_shared_region)]
        if config.streams_layers:
            from ..layer_stream import hooks as ls

            hooks += [(tp.CONFIG_FROM_BUDGET, ls.around_config_from_budget),
                      (tp.BUILD_MHA_POOL, ls.around_build_mha_kv_pool),
                      (tp.MODEL_FORWARD, ls.around_model_forward),
                      (tp.VALIDATE_INPUT, ls.after_validate_input_length)]
            if config.layer_stream_resident_fraction > 0:
                hooks.append((tp.BUILD_ALLOCATOR, ls.after_build_allocator))
    if observers.step is not None:
        hooks.append((tp.STEP_MARK, debug_seam.before_step))
    if observers.forward is not None:
        hooks.append((tp.MODEL_FORWARD, debug_seam.around_forward))
    return hooks


def _short(point: TouchPoint) -> str:
    """`Class.method (KIND)` of a hook's target, for the registration line."""
    return ".".join(point.target.split(".")[-2:]) + f" ({point.kind.name})"


def register(*, sglang_version: str | None = None, points: Sequence[TouchPoint] = tp.ALL,
             environ: Mapping[str, str] | None = None) -> list[str]:
    """Called by SGLang's plugin loader in every process; returns the problems found (if any).

    The launcher registers the flag's two hooks (it parses the flag; its `from_cli_args` hook
    exports CONFIG_ENV); a spawned process (multiprocessing's child: scheduler, detokenizer)
    never parses a command line and does not register them. A process whose environment carries an
    enabled SwiftConfig (the spawned processes of a server started with the flag) registers the
    `swiftcache` backend and the hooks its configuration uses (`server_hooks`), so a spawned
    process of a server without the flag registers nothing. The launcher needs no more: SGLang
    0.5.23 runs every scheduler in a spawned process (also with --tp 1), and neither the
    backend registry nor any other hooked target is used in the launcher. Each process prints
    one line saying what it registered (`REGISTERED`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ..cpu_compat.server_defaults import register_cpu_defaults

    cpu_defaults = register_cpu_defaults(HookRegistry, HookType)  # CPU venv only, with or
    version = installed_sglang_version() if sglang_version is None else sglang_version  # without
    problems = check_sglang(version, points)
    spawned = multiprocessing.parent_process() is not None
    can_parse = not spawned and all(target_exists(p.target) for p in FLAG_POINTS)
    if problems:
        _shout(problems)
        if can_parse:
            HookRegistry.register(tp.ADD_CLI_ARGS.target, _after_add_cli_args, HookType.AFTER)
            HookRegistry.register(tp.FROM_CLI_ARGS.target, _refuse_from_cli_args(problems),
                                  HookType.AFTER)
        return problems

    hooks = [] if spawned else [(tp.ADD_CLI_ARGS, _after_add_cli_args),
                                (tp.FROM_CLI_ARGS, _after_from_cli_args)]
    config = config_in_process(environ)
    try:
        instruments = debug_seam.install_from_env(environ)
    except debug_seam.InstrumentsUnavailable as exc:
        _shout([str(exc)], consequence="the server runs without them.")
        instruments = None
    hooks += server_hooks(config, debug_seam.OBSERVERS)
    for point, hook in hooks:
        HookRegistry.register(point.target, hook, getattr(HookType, point.kind.name))
    names = [_short(point) for point, _ in hooks]
    if config is not None:
        from sglang.srt.mem_cache.registry import (
            get_radix_cache_factory,
            register_radix_cache_backend,
        )

        if get_radix_cache_factory(BACKEND_NAME) is None:
            register_radix_cache_backend(BACKEND_NAME, swiftcache_backend_factory)
        names.append(f"radix cache backend '{BACKEND_NAME}'")
    extra = [f"CPU stand-in: {_short(tp.CPU_DEFAULTS)}"] if cpu_defaults else []
    extra += [f"instruments {instruments}"] if instruments else []
    print(f"{REGISTERED} {os.getpid()}: {', '.join(names) or NOTHING}"
          + (f" [{'; '.join(extra)}]" if extra else ""), file=sys.stderr, flush=True)
    return []
