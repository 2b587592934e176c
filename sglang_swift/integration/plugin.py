"""SGLang plugin: adds --enable-swiftcache and registers the `swiftcache` radix cache backend.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in every process it starts
(launcher, scheduler, detokenizer). Nothing else in this package touches SGLang at import time.

What it does, through official extension points only:
- AFTER-hooks `ServerArgs.add_cli_args` to add `--enable-swiftcache` and the `--swiftcache-*` options
  derived from `SwiftConfig` (a bad value is an argparse error naming the option);
- AFTER-hooks `ServerArgs.from_cli_args`: with the flag on, builds the one frozen `SwiftConfig`, carries
  it to the spawned processes (a bookkeeping attribute that pickles with ServerArgs, plus an env var),
  and selects the `swiftcache` backend; without the flag, leaves ServerArgs exactly as stock;
- registers the `swiftcache` factory with `register_radix_cache_backend`;
- BEFORE-hooks `Scheduler.get_next_batch_to_run` so the tree handles control events once per loop;
- AFTER-hooks `Scheduler.get_new_batch_prefill` (a borrower starts the donor loads its batch
  queued and sets the batch's layer-counter consumer index) and `Scheduler.run_batch` (after the
  forward, requests whose load failed are aborted before their output is used): SGLang 0.5.23
  drives its own layer-wise loads this way only for HiCache and the external linker;
- AROUND-hooks `MHATokenToKVPool._create_buffers_normal` so a lending server's pool is allocated
  in shareable memory (`shared_kv_pool.py`); every other server's pool is SGLang's own;
- registers the layer stream cache's hooks (`layer_stream/hooks.py`: pool sizing and class, the
  per-forward stream, the too-long-prompt message), each a no-op unless the server streams layers.

Before any of that it checks the installed sglang version and that every hook target exists. On a
mismatch it prints a loud message (logging is not configured yet in the launcher) and installs only
a refusal: `--enable-swiftcache` then stops the server with that message instead of half-applying.
"""

from __future__ import annotations

import argparse
import logging
import os
import pkgutil
import sys
from typing import Any, Callable, Sequence

from ..layer_stream.hooks import HOOK_TARGETS as LAYER_STREAM_TARGETS
from ..config import CONFIG_ENV, SwiftConfig, cli_options

logger = logging.getLogger(__name__)

PINNED_SGLANG = "0.5.23"
BACKEND_NAME = "swiftcache"
CONFIG_ATTR = "_swiftcache_config"  # bookkeeping attribute on ServerArgs (pickled into children)
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
REGISTER_BACKEND = "sglang.srt.mem_cache.registry.register_radix_cache_backend"
SCHEDULER_STEP = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
BATCH_BUILT = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
BATCH_RAN = "sglang.srt.managers.scheduler.Scheduler.run_batch"
KV_POOL_BUFFERS = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
HOOK_TARGETS = (ADD_CLI_ARGS, FROM_CLI_ARGS, REGISTER_BACKEND, SCHEDULER_STEP, BATCH_BUILT,
                BATCH_RAN, KV_POOL_BUFFERS, "sglang.srt.mem_cache.radix_cache.RadixCache",
                *LAYER_STREAM_TARGETS)


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
    module_path, _, attr = dotted.rpartition(".")
    try:
        obj = pkgutil.resolve_name(module_path)
    except Exception:  # an ImportError or anything a broken import raises
        return False
    return hasattr(obj, attr)


def check_sglang(version: str, targets: Sequence[str]) -> list[str]:
    """Problems that stop SwiftCache from running on this SGLang (empty when all is well)."""
    problems = []
    if version != PINNED_SGLANG:
        problems.append(
            f"sglang {version} is installed, SwiftCache supports exactly sglang=={PINNED_SGLANG}; "
            f"install it with `pip install sglang=={PINNED_SGLANG}`")
    missing = [t for t in targets if not target_exists(t)]
    if missing:
        problems.append("SGLang extension points not found: " + ", ".join(missing))
    return problems


def _shout(problems: list[str]) -> None:
    bar = "!" * 78
    print(f"{bar}\nSwiftCache plugin DISABLED (pid {os.getpid()}):", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    print(f"--enable-swiftcache will refuse to start the server.\n{bar}", file=sys.stderr, flush=True)


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


def _after_from_cli_args(server_args: Any, cls: Any, args: argparse.Namespace, *a: Any, **kw: Any):
    if not getattr(args, "enable_swiftcache", False):
        given = [flag for flag, f in cli_options() if getattr(args, "swiftcache_" + f.name, None) is not None]
        if given:
            raise SystemExit(f"{', '.join(given)} given without --enable-swiftcache")
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
    server_args.radix_cache_backend = BACKEND_NAME
    setattr(server_args, CONFIG_ATTR, config.to_json())
    os.environ[CONFIG_ENV] = config.to_json()  # inherited by spawned scheduler processes
    return None


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
    """A batch's forward ran: a SwiftCache borrower aborts the requests whose load failed,
    before SGLang processes their output."""
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
def register(*, sglang_version: str | None = None, targets: Sequence[str] = HOOK_TARGETS) -> list[str]:
    """Called by SGLang's plugin loader in every process; returns the problems found (if any)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ..cpu_compat.server_defaults import register_cpu_defaults

    register_cpu_defaults(HookRegistry, HookType)  # CPU venv only, with or without the flag
    version = installed_sglang_version() if sglang_version is None else sglang_version
    problems = check_sglang(version, targets)
    can_parse = target_exists(ADD_CLI_ARGS) and target_exists(FROM_CLI_ARGS)
    if problems:
        _shout(problems)
        if can_parse:
            HookRegistry.register(ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
            HookRegistry.register(FROM_CLI_ARGS, _refuse_from_cli_args(problems), HookType.AFTER)
        return problems

    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    HookRegistry.register(ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, _after_from_cli_args, HookType.AFTER)
    HookRegistry.register(SCHEDULER_STEP, _before_scheduler_step, HookType.BEFORE)
    HookRegistry.register(BATCH_BUILT, _after_batch_built, HookType.AFTER)
    HookRegistry.register(BATCH_RAN, _after_batch_ran, HookType.AFTER)
    # A lending server's KV pool goes into shareable memory (a no-op for every other server).
    from .shared_kv_pool import create_buffers_in_shared_region

    HookRegistry.register(KV_POOL_BUFFERS, create_buffers_in_shared_region, HookType.AROUND)
    from ..layer_stream.hooks import register_layer_stream_hooks

    register_layer_stream_hooks(HookRegistry, HookType)  # no-ops unless layers are streamed
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, swiftcache_backend_factory)
    return []
