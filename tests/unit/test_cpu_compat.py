"""The CPU compatibility layer: environment, the sgl_kernel stand-in, the torchvision schema fix.

The automatic engine choice and the ServerArgs defaults are in test_cpu_engine_choice.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang_swift.cpu_compat import SHIM_DIR, cpu_env


def test_cpu_env_sets_engine_and_puts_shim_first():
    env = cpu_env({"PYTHONPATH": "/a:/b", "PATH": "/usr/bin"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SWIFTCACHE_CPU_COMPAT"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIM_DIR), "/a", "/b"]
    assert cpu_env(env)["PYTHONPATH"] == env["PYTHONPATH"]  # idempotent


def _stand_in():
    sys.path.insert(0, str(SHIM_DIR))
    try:
        import sgl_kernel
    finally:
        sys.path.remove(str(SHIM_DIR))
    assert getattr(sgl_kernel, "SWIFTCACHE_STAND_IN", False), (
        "a real sgl_kernel shadows the stand-in")
    return sgl_kernel


def test_assign_req_to_token_pool_writes_each_row_slice():
    """Request i's new slots go to req_to_token[row_i, start_i:end_i], in order, nothing else."""
    sk = _stand_in()
    req_to_token = torch.full((4, 10), -1, dtype=torch.int32)
    rows, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    out_cache_loc = torch.tensor([11, 12, 13, 21, 22], dtype=torch.int64)
    sk.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, 10)
    expect = torch.full((4, 10), -1, dtype=torch.int32)
    expect[2, 3:6] = torch.tensor([11, 12, 13])
    expect[0, 0:2] = torch.tensor([21, 22])
    assert torch.equal(req_to_token, expect)
    with pytest.raises(ValueError, match="bad token range"):
        sk.assign_req_to_token_pool_cpu(rows, req_to_token, starts, torch.tensor([11, 2]),
                                        out_cache_loc, 10)


def test_other_ops_import_but_refuse_to_run_by_name():
    sk = _stand_in()
    from_import = sk.copy_all_layer_kv_cache_cpu  # what `from sgl_kernel import X` does
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        from_import()


def test_torchvision_fix_makes_torchvision_importable_in_a_fresh_process():
    """Without the fix the CUDA torchvision wheel fails beside CPU torch; with it, it imports."""
    code = ("from sglang_swift.cpu_compat import torchvision_fix; torchvision_fix.install(); "
            "import torchvision, torch; print('ok', torch.ops.torchvision.nms is not None)")
    env = dict(os.environ, SWIFTCACHE_CPU_COMPAT="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok True" in out.stdout


def test_site_hook_puts_stand_in_first_only_for_the_cpu_engine():
    """The venv's .pth hook: stand-in importable when SGLANG_USE_CPU_ENGINE=1 is inherited; before
    any engine choice (sglang not imported yet) or when opted out, sys.path is untouched."""
    code = ("from sglang_swift.cpu_compat import site_hook; site_hook.activate(); import sys; "
            "import importlib.util as u; s = u.find_spec('sgl_kernel'); "
            "print('standin' if s and 'cpu_compat' in (s.origin or '') else 'none')")
    base = {k: v for k, v in os.environ.items()
            if k not in ("SGLANG_USE_CPU_ENGINE", "SWIFTCACHE_CPU_COMPAT", "PYTHONPATH")}
    path = os.pathsep.join(p for p in sys.path if p != str(SHIM_DIR))
    runs = {}
    cases = {"cpu": {"SGLANG_USE_CPU_ENGINE": "1"}, "undecided": {},
             "opt_out": {"SGLANG_USE_CPU_ENGINE": "1", "SWIFTCACHE_CPU_COMPAT": "0"}}
    for name, extra in cases.items():
        out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                             env={**base, **extra, "PYTHONPATH": path},
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = out.stdout.strip()
    assert runs == {"cpu": "standin", "undecided": "none", "opt_out": "none"}
