"""Define torchvision's `nms`/`qnms` operator schemas before its meta registrations need them.

The torchvision wheels reachable here are CUDA builds; beside CPU torch their C extension fails to
load (silently), and `torchvision/_meta_registrations.py` then registers fakes for operators that
were never defined, raising `operator torchvision::nms does not exist` and breaking `import sglang`.
A meta-path finder defines the two schemas the moment that module is about to be imported, so torch
stays out of interpreter start-up. torchvision's C++ ops stay unavailable (text models don't use
them).
"""

from __future__ import annotations

import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # keeps the FRAGMENT library (and so the schemas) alive


def define_schemas() -> None:
    """Define the missing schemas once; a no-op where torchvision's own ops are loaded."""
    global _library
    import torch

    if _library is not None:
        return
    missing = [s for s in _SCHEMAS if not _has_op("torchvision::" + s.split("(")[0])]
    if not missing:
        return
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in missing:
        _library.define(schema)


def _has_op(qualname: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


class _Finder:  # a sys.meta_path finder; no importlib.abc base, to keep interpreter start cheap
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TARGET:
            define_schemas()
        return None  # let the normal finders import the module


def install() -> None:
    """Install the finder (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
