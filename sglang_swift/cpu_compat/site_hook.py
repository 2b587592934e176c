"""What the CPU venv's `swiftcache_cpu_compat.pth` runs at every interpreter start (kept cheap).

scripts/setup_cpu.sh writes that .pth file only into the CPU venv it creates; a GPU install never
has it. At start-up it (1) installs the torchvision schema fix, which does nothing until torchvision
is imported and nothing at all where torchvision's own ops load; (2) when SGLang's CPU engine is
requested (`SGLANG_USE_CPU_ENGINE=1`, which SGLang itself requires on CPU), puts the `sgl_kernel`
stand-in on sys.path unless the operator opted out with SWIFTCACHE_CPU_COMPAT=0.
"""

from __future__ import annotations

import os
import sys


def activate() -> None:
    if os.environ.get("SWIFTCACHE_CPU_COMPAT") == "0":
        return
    from . import SHIM_DIR, torchvision_fix

    torchvision_fix.install()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
