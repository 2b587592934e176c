"""The CPU-safe parts of the transfer scripts: scripts/gpu_check.py parses, formats and refuses
cleanly without CUDA and runs its whole flow on CPU; scripts/bench_transfer.py runs end to end
at toy size and ends with JSON."""

from __future__ import annotations

import json

import bench_transfer
import gpu_check
import pytest
import torch

import swift_kernels as sk

ROW = {
    "page_size": 16,
    "donor_page_size": 8,
    "donor_layers": 36,
    "bytes": 2**30,
    "copy_gbps": 4000.0,
    "store_gbps": 3600.0,
    "load_gbps": 3000.0,
    "load_ms_per_layer": 0.01,
    "unit": 1024,
    "backend": "triton",
}


def test_gpu_check_arguments():
    args = gpu_check.parse_args([])
    assert args.tokens == 32768 and args.page_sizes == [16, 64] and args.target == 0.85
    quick = gpu_check.parse_args(["--quick", "--page-sizes", "32"])
    assert quick.tokens == 4096 and quick.repeats == 5 and quick.page_sizes == [32]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--tokens", "0"])


def test_gpu_check_table_and_summary():
    table = gpu_check.format_table([ROW], target=0.85)
    lines = table.splitlines()
    assert "store GB/s" in lines[0] and len(lines) == 3
    assert "0.90" in lines[2] and "0.75" in lines[2] and "below 0.85x" in lines[2]
    assert "36L/p8" in lines[2] and "triton" in lines[2]
    s = gpu_check.summarize([ROW], {"kernels": True}, 0.85)
    assert s["ok"] and s["store_ratio"] == 0.9 and s["load_ratio"] == 0.75
    assert not gpu_check.summarize([], {"kernels": False}, 0.85)["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit only")
def test_gpu_check_exits_clearly_without_cuda(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.integration  # starts the borrower as a second process
@pytest.mark.timeout(240)
@pytest.mark.skipif(not sk.triton_available(), reason="the dry run interprets the Triton kernels")
def test_gpu_check_whole_flow_dry_run_on_cpu(capsys):
    """The GPU script's flow end to end on CPU at toy size: the row copy vs its reference
    (interpreted); per page size a live pool region of another shape lent to a second process
    (shm standing in for CUDA IPC), layer-wise round trip through the engine and counter,
    packing rule, both copy paths, an exchange, the cross-device path with both devices "cpu",
    the donor seeing the borrower's bytes; the table and the JSON line; and the layer-streamed
    load under per-layer attention, bit-identical, with its timing ratio."""
    rc = gpu_check.main(
        [
            "--dry-run-cpu",
            "--tokens",
            "20",
            "--layers",
            "2",
            "--page-sizes",
            "4,8",
            "--repeats",
            "1",
            "--kv-heads",
            "1",
            "--head-dim",
            "16",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert rc == 0 and summary["ok"], out
    checks = summary["checks"]
    assert all(checks[f"row_copy_{t}"] for t in ("uint8", "int16", "int32", "int64"))
    for name in ("pool_ipc_roundtrip", "pool_stream_matches_rule", "pool_backends_agree",
                 "pool_exchange", "pool_cross_device", "pool_donor_sees_bytes"):
        assert checks[name] is True, name
    assert summary["pool"]["backend"] == "triton" and summary["path"] == "pool-lease"
    assert summary["store_ratio"] is not None and summary["load_ratio"] is not None
    assert checks["stream_load_bit_identical"] is True and summary["stream"]["ratio"] > 0
    assert any(line.startswith("pool lease:") and "cross-device: borrower pool on cpu" in line
               for line in out)
    assert any(line.strip().startswith("4 ") for line in out)
    assert any(line.strip().startswith("8 ") for line in out)


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
