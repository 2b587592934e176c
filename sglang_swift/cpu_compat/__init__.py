"""CPU compatibility layer: what it takes to run SGLang 0.5.23 on a CPU-only machine.

Active only where the project itself runs SGLang on CPU (the demo, the tests), never on a GPU.
Three obstacles, each removed by one piece (facts measured in shared/notes/cpu-serving.md):

1. `SGLANG_USE_CPU_ENGINE=1` must be set, or SGLang takes GPU code paths (`cpu_env()` sets it).
2. SGLang's CPU engine imports ops from `sgl_kernel`, whose PyPI build is CUDA-only; the stand-in
   package in `shim/` (put first on PYTHONPATH by `cpu_env()`) provides the one op a dense Llama
   calls, in plain torch, and makes every other name importable but raise if called.
3. torchvision's PyPI wheels here are CUDA builds whose meta registrations fail beside CPU torch;
   `torchvision_fix` defines the two missing operator schemas just before those registrations run.
   `site_hook` installs it (and, on the CPU engine, the stand-in's path) from a `.pth` file that
   scripts/setup_cpu.sh writes into the CPU venv only, so spawned SGLang processes get it too.
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

    from . import torchvision_fix

    os.environ.update({k: v for k, v in cpu_env().items() if k != "PYTHONPATH"})
    os.environ["PYTHONPATH"] = cpu_env()["PYTHONPATH"]
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    torchvision_fix.install()
