"""What the CPU venv's `swiftcache_cpu_compat.pth` runs at every interpreter start (kept cheap).

scripts/setup_cpu.sh writes that .pth file only into the CPU venv it creates; a GPU install never
has it. At start-up it imports nothing heavy and probes nothing; it only installs three meta-path
finders that act when their module is first imported:
1. the torchvision schema fix (acts on `torchvision._meta_registrations`, a no-op where
   torchvision's own ops load);
2. the engine choice (acts on `sglang`): SGLang's CPU engine when no accelerator is found, unless
   SGLANG_USE_CPU_ENGINE or `--device` says otherwise (see engine_choice).
3. the HiCache stand-ins (act on the HiCache modules of SGLang right after they are imported,
   and only on SGLang's CPU engine; see hicache).
A process that inherited SGLANG_USE_CPU_ENGINE=1 (a scheduler the launcher spawned, or `cpu_env()`)
gets the `sgl_kernel` stand-in on sys.path right away. SWIFTCACHE_CPU_COMPAT=0 turns all of it off,
and with it the ServerArgs defaults (server_defaults), which act only where this ran.
"""

from __future__ import annotations

import os

_activated = False


def activate() -> None:
    global _activated
    if os.environ.get("SWIFTCACHE_CPU_COMPAT") == "0":
        return
    from . import engine_choice, hicache, torchvision_fix

    torchvision_fix.install()
    engine_choice.install_import_trigger()
    hicache.install()
    if os.environ.get(engine_choice.ENGINE_ENV) == "1":
        engine_choice.put_stand_in_first()
    _activated = True


def activated() -> bool:
    """Whether the CPU compatibility layer is on in this process (the .pth ran, not opted out)."""
    return _activated
