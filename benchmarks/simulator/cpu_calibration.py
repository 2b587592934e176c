"""The CPU node's measured parameters (written by scripts/calibrate_cpu.py), and the step-cost
model the simulator builds from them for `simulate.py --validate`.

Nothing here is fitted to a benchmark result: every number comes from the calibration run's own
requests (synthetic prompts, not bench_node's traffic) and copies.

Per model server:
- prefill: the client-side TTFT of one streamed chat request, t = a + b x new + c x new x ctx,
  with ctx = cached prefix + new / 2 (the mean attention span of a new token), least squares over
  the calibration requests; `a` is the fixed cost of a request (HTTP, template, tokenizer,
  scheduler, first streamed token), `b` the per-token matmul cost, `c` attention.
- decode: one decode step of one request, t = d0 + d1 x context, from (stream end - first token)
  / steps of streamed requests.
Copies: the donor-tier load and store time of `PoolTransferEngine` between the busy model's pool
and the donor's pool (the dataplane engine the live servers use), latency + bytes / bandwidth.

The calibration's trace part is the workload, not a measurement of it: the token ids of every
prompt and greedy answer of bench_node's traffic (same conversations, same turn order), so the
simulated prefix caches match the tokens the live servers saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCHEMA = 1


def _lstsq_nonneg(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (drop a negative term and refit): a cost
    model's terms are costs, and noise must not make one of them a rebate."""
    cols = list(range(len(rows[0])))
    while True:
        a = np.array([[r[c] for c in cols] for r in rows], dtype=float)
        coef, *_ = np.linalg.lstsq(a, np.array(y, dtype=float), rcond=None)
        neg = [c for c, v in zip(cols, coef) if v < 0]
        if not neg:
            out = [0.0] * len(rows[0])
            for c, v in zip(cols, coef):
                out[c] = float(v)
            return out
        cols.remove(neg[-1])
        if not cols:
            return [0.0] * len(rows[0])


def fit_prefill(points: list[dict]) -> dict:
    """`points`: {"new": tokens computed, "cached": prefix tokens, "ttft_s"}; returns
    {"a_s", "b_s_per_token", "c_s_per_token_ctx"} of t = a + b new + c new (cached + new / 2)."""
    if len(points) < 3:
        raise ValueError(f"need at least 3 prefill points to fit 3 terms, got {len(points)}")
    rows = [[1.0, p["new"], p["new"] * (p["cached"] + p["new"] / 2)] for p in points]
    a, b, c = _lstsq_nonneg(rows, [p["ttft_s"] for p in points])
    return {"a_s": a, "b_s_per_token": b, "c_s_per_token_ctx": c}


def fit_decode(points: list[dict]) -> dict:
    """`points`: {"context": tokens attended, "step_s"}; returns {"d0_s", "d1_s_per_token"}."""
    if len(points) < 2:
        raise ValueError(f"need at least 2 decode points, got {len(points)}")
    d0, d1 = _lstsq_nonneg([[1.0, p["context"]] for p in points], [p["step_s"] for p in points])
    return {"d0_s": d0, "d1_s_per_token": d1}


@dataclass(frozen=True)
class CpuModel:
    """What the simulator's server needs of a model: layers and KV bytes per token."""

    name: str
    layers: int
    kv_bytes_per_token: int


class CalibratedCompute:
    """`Roofline`'s interface (`step_time`, `model`) with measured CPU costs. A prefill batch
    costs the sum of its requests' fitted times (one request at a time on a CPU server here);
    a decode batch one step of the fit, at the batch's total context. `hbm_bw_taken` is
    ignored: a copy's CPU cost is in the copy bandwidth, not charged to compute."""

    def __init__(self, model: CpuModel, prefill: dict, decode: dict) -> None:
        self.model, self.prefill, self.decode = model, prefill, decode

    def prefill_time(self, new: int, cached: int) -> float:
        p = self.prefill
        return (p["a_s"] + p["b_s_per_token"] * new
                + p["c_s_per_token_ctx"] * new * (cached + new / 2))

    def decode_time(self, context: int) -> float:
        return self.decode["d0_s"] + self.decode["d1_s_per_token"] * context

    def step_time(self, items, hbm_bw_taken: float = 0.0) -> float:
        """A prefill (extend) batch: `items` are (new tokens, cached prefix) per request."""
        return sum(self.prefill_time(n, c) for n, c in items)

    def decode_step_time(self, items, hbm_bw_taken: float = 0.0) -> float:
        """One decode step of a batch: `items` are (1, context) per running request."""
        items = list(items)
        return self.decode_time(sum(c for _, c in items)) if items else 0.0


def load(path: Path, roles: tuple = ("busy", "donor")) -> dict:
    """The calibration JSON, checked for the parts the validation reads; `roles`: the models
    whose costs it needs (bench_tiers' donor serves nothing simulated: geometry only)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no CPU calibration; run `.venv/bin/python "
                                f"scripts/calibrate_cpu.py --out {path}` first (about 3 min)")
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: calibration schema {data.get('schema')}, this simulator reads "
                         f"{SCHEMA}; rerun scripts/calibrate_cpu.py")
    for key in ("models", "copy", "trace"):
        if key not in data:
            raise ValueError(f"{path}: no {key!r} section; rerun scripts/calibrate_cpu.py")
    for role in ("busy", "donor"):
        m = data["models"].get(role) or {}
        parts = ("prefill_fit", "decode_fit") if role in roles else ()
        for part in parts + ("layers", "kv_bytes_per_token"):
            if part not in m:
                raise ValueError(f"{path}: models.{role} has no {part!r}; "
                                 f"rerun scripts/calibrate_cpu.py")
    return data


def compute_for(data: dict, role: str) -> CalibratedCompute:
    m = data["models"][role]
    return CalibratedCompute(CpuModel(m["name"], m["layers"], m["kv_bytes_per_token"]),
                             m["prefill_fit"], m["decode_fit"])
