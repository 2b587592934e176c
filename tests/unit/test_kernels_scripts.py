"""The transfer scripts on CPU: scripts/gpu_check.py refuses cleanly without CUDA and runs every
one of its checks through the emulated asynchronous device (`--emulate`, the same code the GPU
runs); scripts/bench_transfer.py runs end to end at toy size and ends with JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import bench_transfer
import gpu_check
import pytest
import torch


def test_gpu_check_arguments():
    args = gpu_check.parse_args([])
    assert args.tokens == 65536 and args.repeats == 5 and not args.emulate
    quick = gpu_check.parse_args(["--quick"])
    assert quick.tokens == 16384 and quick.repeats == 3
    assert gpu_check.parse_args(["--emulate"]).tokens == 16384
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--tokens", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit only")
def test_gpu_check_exits_clearly_without_cuda(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def _emulated_run(tmp_path) -> dict:
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--emulate", "--json-out",
                           str(out)], capture_output=True, text=True, timeout=300, env=env)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last  # the file holds what the last line says
    return {"rc": proc.returncode, **last}


@pytest.mark.timeout(600)
def test_gpu_check_runs_every_check_on_the_emulated_device(tmp_path):
    """Invariant: the GPU check's own code passes on the emulated device: a two-process lease
    round trip bit for bit, the Triton row copy (interpreted) against its reference, a streamed
    load whose copy is at least half hidden under the forward stand-in, no poisoned byte
    accepted after a fence, no host wait on the scheduler-thread hooks, and no load accepted
    after the donor was SIGKILLed. The overlap is a timing: one rerun is allowed for it alone
    (two cores shared with other tests), never for a correctness key."""
    run = _emulated_run(tmp_path)
    parts = run["parts"]
    for name in ("ipc_lease", "kernels", "fence", "syncs", "donor_killed"):
        assert parts[name]["ok"], (name, parts[name])
    assert parts["ipc_lease"]["wrong_bytes"] == 0 and parts["ipc_lease"]["exchanged"]
    assert run["poisoned_bytes_accepted"] == 0 and parts["fence"]["loads_after_poison"] >= 3
    assert run["syncs_on_scheduler_path"] == 0 and parts["syncs"]["syncs_found"] == []
    # the one wait left, on the exception path, is named with its reason
    assert [n.split(":")[0] for n in run["syncs_named"]] == ["confirm (copy running)"]
    assert "judged once it finished" in run["syncs_named"][0]
    assert parts["donor_killed"]["loads_accepted_after_kill"] == 0
    if run["overlap_ratio"] < 0.5:
        run = _emulated_run(tmp_path)
    assert run["overlap_ratio"] >= 0.5 and run["parts"]["stream"]["wrong_bytes"] == 0, run
    assert run["ok"] and run["rc"] == 0 and run["emulated"] is True


def test_bench_transfer_toy_run_ends_with_json(capsys):
    rc = bench_transfer.main(
        ["--tokens", "40", "--layers", "2", "--page-sizes", "8,16", "--repeats", "1"]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    summary = json.loads(out[-1])
    assert {"store_ratio", "load_ratio", "path", "verified"} <= set(summary)
    assert summary["verified"] and summary["path"] == "cpu-pool-lease"
    assert "PoolTransferEngine" in out[0]
