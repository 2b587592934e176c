"""CPU compatibility layer: what it takes to run SGLang 0.5.23 on a CPU-only machine.

Active only in the CPU venv that scripts/setup_cpu.sh creates (its `.pth` runs `site_hook`), or
where the project asks for it explicitly (`cpu_env()`, `activate_in_process()`); never on a GPU
install. Six pieces (facts measured in shared/notes/cpu-serving.md):

1. `engine_choice`: SGLang needs SGLANG_USE_CPU_ENGINE=1 before its modules import, or it takes
   GPU code paths. When `sglang` is first imported, the CPU engine is chosen if `accelerator` finds
   nothing SGLang could use (an explicit SGLANG_USE_CPU_ENGINE or `--device` wins), and the choice
   is written to the environment so spawned schedulers inherit it.
2. `server_defaults`: with the CPU engine on, `--device cpu` and `--attention-backend torch_native`
   when not given, and one log line saying what runs and why (a hook on ServerArgs.resolve_once,
   registered from the plugin's entry point).
3. `shim/`: SGLang's CPU engine imports ops from `sgl_kernel`, whose PyPI build is CUDA-only; the
   stand-in (first on sys.path on the CPU engine) provides the one op a dense Llama calls, in plain
   torch, and makes every other name importable but raise if called.
4. `torchvision_fix`: torchvision's PyPI wheels here are CUDA builds whose meta registrations fail
   beside CPU torch; it defines the two missing operator schemas just before they run.
5. `hicache`: CPU stand-ins for the CUDA-only pieces of HiCache (`--enable-hierarchical-cache`):
   unpinned host pools, torch index copies for the host<->device transfers, immediate streams and
   events; patched into SGLang's HiCache modules as they are imported, on the CPU engine only.
6. `window_reads`: SGLang's CPU attention backend reads a hybrid sliding-window model's window
   layers at full-pool slots; the stand-in reads them at their window-pool slots (installed with
   the HiCache stand-ins, on the CPU engine only).

`cpu_env()` and `activate_in_process()` force the CPU engine explicitly (the demo, tests, scripts
that predate the automatic choice); the automatic path needs neither.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"
ACTIVATE_ENV = "SWIFTCACHE_CPU_COMPAT"


def cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) set up to run SGLang on this CPU machine."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env[ACTIVATE_ENV] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SHIM_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *parts])
    return env


def activate_in_process() -> None:
    """Make this interpreter ready to import SGLang on CPU (tests that use SGLang in-process).

    Must run before anything imports torchvision or sglang.
    """
    import sys

    from . import hicache, torchvision_fix

    os.environ.update({k: v for k, v in cpu_env().items() if k != "PYTHONPATH"})
    os.environ["PYTHONPATH"] = cpu_env()["PYTHONPATH"]
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    torchvision_fix.install()
    hicache.install()
