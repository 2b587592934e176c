"""Could SGLang in this venv use an accelerator? Answered without importing torch.

The CPU venv decides SGLang's engine when `sglang` is first imported (see `engine_choice`), which
can be in any process, so the answer must cost milliseconds: it reads torch's build record
(`torch/version.py`, parsed, never imported), looks for device nodes under /dev, and checks which
vendor packages and SGLang platform plugins are installed. It errs towards "there is one": a wrong
"none" would silently put a GPU host on the CPU engine, a wrong "some" only leaves stock SGLang
behaviour, which an operator fixes with SGLANG_USE_CPU_ENGINE=1.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

# Modules whose presence means a vendor's torch backend is installed (SGLang checks the same ones).
VENDOR_MODULES = {"torch_npu": "an Ascend NPU (torch_npu)",
                  "habana_frameworks": "an Intel Gaudi HPU (habana_frameworks)",
                  "torchada": "a Moore Threads MUSA GPU (torchada)"}
PLATFORM_PLUGINS_GROUP = "sglang.srt.platforms"  # SGLang's out-of-tree platform plugins
HIDDEN = ("", "-1", "none", "NoDevFiles")  # *_VISIBLE_DEVICES values that hide every device


@dataclass(frozen=True)
class HostFacts:
    """What this host and venv offer, as far as SGLang's device choice is concerned."""

    torch_version: str | None  # None: torch is not installed in this venv
    torch_cuda: str | None  # CUDA version torch was built for (None: not a CUDA build)
    torch_hip: str | None  # ROCm/HIP version torch was built for
    torch_xpu: str | None  # Intel XPU (SYCL) version torch was built for
    nvidia_device: bool  # /dev/nvidiactl or /dev/nvidia0 exists
    amd_kfd: bool  # /dev/kfd exists (ROCm compute)
    dri_render: bool  # a /dev/dri/renderD* node exists (Intel GPUs, among others)
    vendor_modules: tuple[str, ...] = ()  # installed names from VENDOR_MODULES
    platform_plugins: tuple[str, ...] = ()  # installed SGLang platform plugin names
    apple_silicon: bool = False  # macOS on arm64 (torch's MPS backend)


def read_torch_build(search_path: list[str] | None = None) -> dict[str, str | None] | None:
    """The literal assignments of `torch/version.py` (`__version__`, `cuda`, `hip`, `xpu`, ...);
    None when torch is not installed. torch itself is not imported."""
    spec = importlib.util.find_spec("torch") if search_path is None else None
    locations = search_path if search_path is not None else (
        list(spec.submodule_search_locations or []) if spec else [])
    for location in locations:
        path = Path(location) / "version.py"
        if path.is_file():
            return _literal_assignments(path.read_text())
    return None


def _literal_assignments(source: str) -> dict[str, str | None]:
    values: dict[str, str | None] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value if isinstance(value.value, str) else None
    return values


def read_host_facts(dev: Path = Path("/dev")) -> HostFacts:
    """Gather HostFacts from this machine and the running interpreter's venv (milliseconds)."""
    from importlib.metadata import entry_points

    build = read_torch_build() or {}
    return HostFacts(
        torch_version=build.get("__version__") if build else None,
        torch_cuda=build.get("cuda"),
        torch_hip=build.get("hip"),
        torch_xpu=build.get("xpu"),
        nvidia_device=(dev / "nvidiactl").exists() or (dev / "nvidia0").exists(),
        amd_kfd=(dev / "kfd").exists(),
        dri_render=any((dev / "dri").glob("renderD*")) if (dev / "dri").is_dir() else False,
        vendor_modules=tuple(m for m in VENDOR_MODULES if importlib.util.find_spec(m) is not None),
        platform_plugins=tuple(ep.name for ep in entry_points(group=PLATFORM_PLUGINS_GROUP)),
        apple_silicon=sys.platform == "darwin" and _machine() == "arm64",
    )


def _machine() -> str:
    import platform

    return platform.machine().lower()


def find_accelerator(facts: HostFacts, environ: Mapping[str, str]) -> str | None:
    """The accelerator SGLang could use here, in words; None when SGLang would find none.

    A device counts only with a torch build that can drive it (a CPU torch beside an NVIDIA GPU
    cannot), and not when the *_VISIBLE_DEVICES variable its runtime reads hides every device.
    An explicit SGLANG_PLATFORM or any installed SGLang platform plugin counts as one: SGLang's
    own platform discovery decides there, not this layer.
    """
    if environ.get("SGLANG_PLATFORM"):
        return f"the platform plugin SGLANG_PLATFORM={environ['SGLANG_PLATFORM']}"
    if facts.platform_plugins:
        return "the SGLang platform plugin(s) " + ", ".join(facts.platform_plugins)
    if facts.torch_cuda and facts.nvidia_device and not _hidden(environ, "CUDA_VISIBLE_DEVICES"):
        return f"an NVIDIA GPU (torch {facts.torch_version}, CUDA {facts.torch_cuda})"
    if facts.torch_hip and facts.amd_kfd and not (_hidden(environ, "HIP_VISIBLE_DEVICES")
                                                  or _hidden(environ, "ROCR_VISIBLE_DEVICES")):
        return f"an AMD GPU (torch {facts.torch_version}, HIP {facts.torch_hip})"
    if facts.torch_xpu and facts.dri_render and not _hidden(environ, "ZE_AFFINITY_MASK"):
        return f"an Intel XPU (torch {facts.torch_version}, XPU {facts.torch_xpu})"
    if facts.vendor_modules:
        return VENDOR_MODULES[facts.vendor_modules[0]]
    if facts.apple_silicon:
        return "Apple MPS (macOS on arm64)"
    return None


def _hidden(environ: Mapping[str, str], name: str) -> bool:
    return name in environ and environ[name].strip() in HIDDEN


def why_none(facts: HostFacts) -> str:
    """Why find_accelerator found nothing, in a few words (for the one log line)."""
    if facts.torch_version is None:
        return "torch is not installed"
    if facts.torch_cuda or facts.torch_hip or facts.torch_xpu:
        return (f"torch {facts.torch_version} is an accelerator build but no usable device is "
                f"visible")
    if facts.nvidia_device or facts.amd_kfd:
        return (f"torch {facts.torch_version} is a CPU-only build "
                "(a GPU is present: install a torch build for it to use it)")
    return f"torch {facts.torch_version} is a CPU-only build and no accelerator device is present"
