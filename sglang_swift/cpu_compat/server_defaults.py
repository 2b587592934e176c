"""CPU defaults for SGLang's server arguments, filled in where SGLang resolves them.

With the CPU engine on (see engine_choice), a BEFORE hook on `ServerArgs.resolve_once` fills the
arguments the user left unset:
  --device cpu                      SGLang would otherwise look for an accelerator and raise;
  --attention-backend torch_native  SGLang's CPU default, intel_amx, needs sgl_kernel's AMX ops,
                                    which the stand-in does not provide;
and logs exactly one line saying what runs and why. A value the user gave is never changed.

`resolve_once` is the one place where every launch path (`launch_server`, `sglang serve`,
`sglang.Engine`) turns raw arguments into resolved ones, once, in the launching process, after
SGLang configured logging; children receive the resolved record and never resolve again. The hook
is registered from the SwiftCache plugin's entry point, so it applies with or without
--enable-swiftcache, but only in a process where the CPU venv's compatibility layer is on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .engine_choice import ENGINE_ENV, recorded_choice

logger = logging.getLogger(__name__)

# listed, with how the plugin checks it, in integration/touchpoints.py (CPU_DEFAULTS)
RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"
# (ServerArgs field, its flag, the value that works on SGLang's CPU engine with the stand-in)
CPU_DEFAULTS = (("device", "--device", "cpu"),
                ("attention_backend", "--attention-backend", "torch_native"))
OVERRIDE_HINT = "an explicit flag, SGLANG_USE_CPU_ENGINE=0 or SWIFTCACHE_CPU_COMPAT=0 overrides"
_registered = False


def fill_cpu_defaults(server_args: Any, environ: dict[str, str] | None = None) -> str | None:
    """Fill unset CPU_DEFAULTS on a raw ServerArgs when the CPU engine is on; returns the log line
    (None when the CPU engine is off: SGLang runs as stock and nothing is touched).

    A non-CPU device beside a CPU engine the user set is the user's call (nothing is touched).
    Raises SystemExit when the engine was turned on automatically but the caller asked for a
    non-CPU device (possible only through `sglang.Engine(device=...)`: the command line's
    `--device` is seen before the choice), since SGLang cannot switch engines after import.
    """
    environ = os.environ if environ is None else environ
    choice = recorded_choice(environ)
    if choice is None or not choice.cpu_engine:
        return None
    device = getattr(server_args, "device", None)
    if device is not None and str(device).split(":")[0] != "cpu":
        if not choice.automatic:
            return None
        raise SystemExit(
            f"device={device} was asked for, but this process already runs SGLang's CPU engine "
            f"({choice.reason}). To use {device}, start the process with {ENGINE_ENV}=0.")
    parts = [f"{ENGINE_ENV}=1 ({'auto' if choice.automatic else 'given'})"]
    for field, flag, value in CPU_DEFAULTS:
        given = getattr(server_args, field, None)
        if given is None:
            setattr(server_args, field, value)
            parts.append(f"{flag} {value} (auto)")
        else:
            parts.append(f"{flag} {given} (given)")
    return (f"SwiftCache CPU compat: {choice.reason} -> SGLang's CPU engine with "
            + ", ".join(parts) + f"; {OVERRIDE_HINT}")


def before_resolve_once(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """The hook: once per record, before its first resolution (later calls return early in
    SGLang). Reads two private attributes of ServerArgs (`touchpoints.RESOLUTION_STATE`)."""
    if getattr(server_args, "_resolution_finished", False) or \
            getattr(server_args, "_resolution_failed", False):
        return None
    line = fill_cpu_defaults(server_args)
    if line is not None:
        logger.info(line)
    return None


def register_cpu_defaults(registry: Any, hook_type: Any) -> bool:
    """Register the hook when the CPU compatibility layer is on in this process; True if it was.

    `registry` and `hook_type` are SGLang's HookRegistry and HookType (passed in so this module
    imports without SGLang). A GPU install has no .pth, so nothing is registered there.
    """
    from . import site_hook

    in_process = os.environ.get("SWIFTCACHE_CPU_COMPAT") == "1"  # activate_in_process() / cpu_env()
    if not (site_hook.activated() or in_process) or os.environ.get("SWIFTCACHE_CPU_COMPAT") == "0":
        return False
    global _registered
    if not _registered:  # register() may run more than once in a process (tests)
        registry.register(RESOLVE_ONCE, before_resolve_once, hook_type.BEFORE)
        _registered = True
    return True
