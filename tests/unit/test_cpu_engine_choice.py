"""The CPU venv's automatic engine choice and its ServerArgs defaults (pure functions, no SGLang).

Invariants: an accelerator counts only when this venv's torch can drive it; the user's
SGLANG_USE_CPU_ENGINE, then an explicit --device, win over detection; an automatic choice is
recorded so children inherit it and a user's value is never rewritten; the CPU defaults fill only
unset arguments, touch nothing off the CPU engine, and produce exactly one line.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_swift.cpu_compat import SHIM_DIR, accelerator, server_defaults
from sglang_swift.cpu_compat.accelerator import HostFacts, find_accelerator, why_none
from sglang_swift.cpu_compat.engine_choice import (
    CHOICE_ENV,
    ENGINE_ENV,
    apply_engine_choice,
    choose_engine,
    explicit_device,
)

CPU_HOST = HostFacts(torch_version="2.13.0+cpu", torch_cuda=None, torch_hip=None, torch_xpu=None,
                     nvidia_device=False, amd_kfd=False, dri_render=False)
CUDA_TORCH = dict(torch_version="2.14.1", torch_cuda="13.0")


@pytest.mark.parametrize("facts, environ, found", [
    (CPU_HOST, {}, None),
    (replace(CPU_HOST, nvidia_device=True), {}, None),  # a GPU, but torch cannot drive it
    (replace(CPU_HOST, **CUDA_TORCH), {}, None),  # a CUDA torch, but no device
    (replace(CPU_HOST, **CUDA_TORCH, nvidia_device=True), {}, "NVIDIA GPU"),
    (replace(CPU_HOST, **CUDA_TORCH, nvidia_device=True), {"CUDA_VISIBLE_DEVICES": ""}, None),
    (replace(CPU_HOST, **CUDA_TORCH, nvidia_device=True), {"CUDA_VISIBLE_DEVICES": "1"}, "NVIDIA"),
    (replace(CPU_HOST, torch_hip="6.4", amd_kfd=True), {}, "AMD GPU"),
    (replace(CPU_HOST, torch_xpu="20250101", dri_render=True), {}, "Intel XPU"),
    (replace(CPU_HOST, dri_render=True), {}, None),  # an iGPU render node beside CPU torch
    (replace(CPU_HOST, vendor_modules=("torch_npu",)), {}, "Ascend NPU"),
    (replace(CPU_HOST, platform_plugins=("my_chip",)), {}, "my_chip"),
    (CPU_HOST, {"SGLANG_PLATFORM": "my_chip"}, "SGLANG_PLATFORM=my_chip"),
    (replace(CPU_HOST, apple_silicon=True), {}, "Apple MPS"),
])
def test_an_accelerator_counts_only_where_sglang_could_use_it(facts, environ, found):
    """A device needs a torch build for it and must not be hidden; plugins and vendors count."""
    result = find_accelerator(facts, environ)
    assert (result is None) if found is None else (found in result), result


def test_why_none_names_the_cpu_build_and_a_present_gpu():
    assert "CPU-only build" in why_none(CPU_HOST)
    assert "install a torch build" in why_none(replace(CPU_HOST, nvidia_device=True))


def test_torch_build_is_read_from_its_file_as_torch_reports_it(tmp_path):
    """read_torch_build parses torch/version.py without importing torch, and agrees with torch."""
    import torch

    build = accelerator.read_torch_build()
    assert build["__version__"] == torch.__version__
    assert build["cuda"] == torch.version.cuda and build["hip"] == torch.version.hip
    (tmp_path / "version.py").write_text("from typing import Optional\n__version__ = '9.9'\n"
                                         "cuda: Optional[str] = '13.0'\nhip = None\n")
    assert accelerator.read_torch_build([str(tmp_path)]) == {"__version__": "9.9", "cuda": "13.0",
                                                            "hip": None}
    assert accelerator.read_torch_build([str(tmp_path / "absent")]) is None


def test_host_facts_see_device_nodes(tmp_path):
    """A /dev with nvidiactl or kfd or a render node is seen as such; an empty one shows none."""
    empty = accelerator.read_host_facts(dev=tmp_path)
    assert not (empty.nvidia_device or empty.amd_kfd or empty.dri_render)
    (tmp_path / "nvidiactl").touch()
    (tmp_path / "kfd").touch()
    (tmp_path / "dri").mkdir()
    (tmp_path / "dri" / "renderD128").touch()
    seen = accelerator.read_host_facts(dev=tmp_path)
    assert seen.nvidia_device and seen.amd_kfd and seen.dri_render


def _never_probe() -> HostFacts:
    raise AssertionError("detection ran although the environment or the command line decided")


@pytest.mark.parametrize("argv, device", [
    (["--model-path", "m", "--device", "cuda"], "cuda"), (["--device=cpu"], "cpu"),
    (["--device", "cpu", "--device", "cuda:1"], "cuda:1"), (["--device-fraction", "0.3"], None),
    (["--model-path", "m"], None), (["--device"], None),
])
def test_explicit_device_is_read_like_argparse(argv, device):
    assert explicit_device(argv) == device


@pytest.mark.parametrize("environ, argv, cpu_engine, automatic", [
    ({ENGINE_ENV: "0"}, ["--device", "cpu"], False, False),  # the user's variable wins over all
    ({ENGINE_ENV: "1"}, ["--device", "cuda"], True, False),
    ({}, ["--device", "cuda"], False, True),  # then an explicit --device
    ({}, ["--device=cpu"], True, True),
])
def test_user_env_then_explicit_device_win_without_probing(environ, argv, cpu_engine, automatic):
    """SGLANG_USE_CPU_ENGINE, then --device, decide; the host is not even probed."""
    choice = choose_engine(environ, argv, read_facts=_never_probe)
    assert (choice.cpu_engine, choice.automatic) == (cpu_engine, automatic)


def test_detection_decides_when_nothing_is_explicit():
    """No variable, no --device: the CPU engine exactly when no accelerator is found."""
    on_cpu = choose_engine({}, ["--model-path", "m"], read_facts=lambda: CPU_HOST)
    assert on_cpu.cpu_engine and on_cpu.automatic and "no accelerator found" in on_cpu.reason
    gpu = replace(CPU_HOST, **CUDA_TORCH, nvidia_device=True)
    on_gpu = choose_engine({}, [], read_facts=lambda: gpu)
    assert not on_gpu.cpu_engine and "NVIDIA GPU" in on_gpu.reason


def test_automatic_choice_is_recorded_for_children_and_user_values_are_never_rewritten(monkeypatch):
    """apply writes the value and its reason once; a copied environment (a spawned scheduler) reads
    the same automatic choice back; a value the user set, or edited since, is theirs."""
    monkeypatch.setattr(accelerator, "read_host_facts", lambda: CPU_HOST)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(SHIM_DIR)])
    environ: dict[str, str] = {}
    first = apply_engine_choice(environ, ["--model-path", "m"])
    assert environ[ENGINE_ENV] == "1" and environ[CHOICE_ENV] == "1 " + first.reason
    assert sys.path[0] == str(SHIM_DIR)  # the stand-in, for this process's own imports
    child = choose_engine(dict(environ), ["--device", "cuda"], read_facts=_never_probe)
    assert child == first  # inherited: a child's own argv no longer matters
    edited = dict(environ, **{ENGINE_ENV: "0"})
    assert apply_engine_choice(edited, []).automatic is False and edited[ENGINE_ENV] == "0"
    user = {ENGINE_ENV: "1"}
    apply_engine_choice(user, [])
    assert user == {ENGINE_ENV: "1"}


AUTO_CPU = {ENGINE_ENV: "1", CHOICE_ENV: "1 no accelerator found: test"}


def _raw_args(**given) -> SimpleNamespace:
    return SimpleNamespace(**{"device": None, "attention_backend": None, **given})


def test_cpu_defaults_fill_only_unset_arguments_in_one_line():
    """Unset device and attention backend get cpu / torch_native; one line names each and why."""
    args = _raw_args()
    line = server_defaults.fill_cpu_defaults(args, AUTO_CPU)
    assert (args.device, args.attention_backend) == ("cpu", "torch_native")
    assert "\n" not in line and "no accelerator found" in line
    assert "--device cpu (auto)" in line and "--attention-backend torch_native (auto)" in line


def test_an_explicit_flag_wins_over_the_cpu_defaults():
    """A given attention backend or device is kept as given, and the line says so."""
    args = _raw_args(attention_backend="triton", device="cpu")
    line = server_defaults.fill_cpu_defaults(args, AUTO_CPU)
    assert (args.device, args.attention_backend) == ("cpu", "triton")
    assert "--attention-backend triton (given)" in line and "--device cpu (given)" in line
    user_engine = _raw_args(device="cuda")
    assert server_defaults.fill_cpu_defaults(user_engine, {ENGINE_ENV: "1"}) is None
    assert user_engine.device == "cuda"


def test_off_the_cpu_engine_nothing_is_touched():
    for environ in ({}, {ENGINE_ENV: "0"}, {ENGINE_ENV: "0", CHOICE_ENV: "0 an NVIDIA GPU"}):
        args = _raw_args()
        assert server_defaults.fill_cpu_defaults(args, environ) is None
        assert (args.device, args.attention_backend) == (None, None)


def test_a_non_cpu_device_after_an_automatic_cpu_engine_stops_with_the_fix():
    """Engine(device='cuda') in a process that already chose the CPU engine: a clear refusal."""
    with pytest.raises(SystemExit, match=f"{ENGINE_ENV}=0"):
        server_defaults.fill_cpu_defaults(_raw_args(device="cuda"), AUTO_CPU)


def test_the_hook_acts_once_per_record_before_resolution(monkeypatch, caplog):
    """Resolved (or failed) records are left alone: children and repeated resolve_once calls."""
    monkeypatch.setattr(server_defaults.os, "environ", dict(AUTO_CPU))
    resolved = _raw_args(_resolution_finished=True)
    server_defaults.before_resolve_once(resolved)
    assert resolved.device is None
    with caplog.at_level("INFO", logger=server_defaults.__name__):
        fresh = _raw_args()
        server_defaults.before_resolve_once(fresh)
    assert fresh.device == "cpu"
    assert len([r for r in caplog.records if "SwiftCache CPU compat" in r.getMessage()]) == 1


def test_defaults_are_registered_only_where_the_compat_layer_is_on(monkeypatch):
    """A GPU install (no .pth, no cpu_env) registers nothing; the CPU venv registers one hook."""
    calls = []
    registry = SimpleNamespace(register=lambda *a: calls.append(a))
    hook_type = SimpleNamespace(BEFORE="before")
    from sglang_swift.cpu_compat import site_hook

    monkeypatch.setattr(server_defaults, "_registered", False)
    monkeypatch.setattr(site_hook, "_activated", False)
    monkeypatch.delenv("SWIFTCACHE_CPU_COMPAT", raising=False)
    assert server_defaults.register_cpu_defaults(registry, hook_type) is False and calls == []
    monkeypatch.setattr(site_hook, "_activated", True)
    assert server_defaults.register_cpu_defaults(registry, hook_type) is True
    assert server_defaults.register_cpu_defaults(registry, hook_type) is True
    assert calls == [(server_defaults.RESOLVE_ONCE, server_defaults.before_resolve_once, "before")]


def test_site_hook_probes_nothing_until_sglang_is_imported():
    """The .pth must stay cheap: activating it imports neither torch nor the detection, and sets
    nothing; the first `import sglang` then makes (and records) the choice."""
    import subprocess

    watched = ("torch", "sglang", "sglang_swift.cpu_compat.accelerator", "dataclasses", "ast")
    code = ("import os, sys; from sglang_swift.cpu_compat import site_hook; site_hook.activate(); "
            f"print(sorted(m for m in {watched!r} if m in sys.modules), "
            f"os.environ.get({ENGINE_ENV!r}))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin",
                                          "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] None", out.stdout
