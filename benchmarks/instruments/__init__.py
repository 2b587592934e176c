"""Instruments the benchmarks attach to a server through the product's one debug seam
(`sglang_swift.integration.debug_seam`): per-forward and per-batch-load JSON-line traces and the
reclaim fence's thread split. A server gets them only when its environment asks
(`instruments_env`); every other server pays nothing for them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from sglang_swift.integration.debug_seam import INSTRUMENTS_ENV

from .traces import FORWARD_TRACE_ENV, LOAD_TRACE_ENV, RECLAIM_SPLIT_ENV, STEP_TRACE_ENV

INSTALL = "benchmarks.instruments.traces:install"
REPO_ROOT = Path(__file__).resolve().parents[2]  # where `benchmarks` imports from

__all__ = ["FORWARD_TRACE_ENV", "LOAD_TRACE_ENV", "RECLAIM_SPLIT_ENV", "STEP_TRACE_ENV", "INSTALL",
           "instruments_env"]


def instruments_env(base: Mapping[str, str] | None = None, *, forward_trace: str | None = None,
                    load_trace: str | None = None, reclaim_split: bool = False,
                    step_trace: str | None = None) -> dict:
    """`base` (default: this process's environment) plus what makes a server started with it
    install the instruments asked for: one JSON line per forward appended to `forward_trace`,
    one per borrower batch load to `load_trace`, and where a reclaim fence's time went in its
    log line (`reclaim_split`). Nothing asked: `base` unchanged."""
    env = dict(os.environ if base is None else base)
    asked = {FORWARD_TRACE_ENV: forward_trace, LOAD_TRACE_ENV: load_trace,
             RECLAIM_SPLIT_ENV: "1" if reclaim_split else None, STEP_TRACE_ENV: step_trace}
    asked = {k: str(v) for k, v in asked.items() if v}
    if not asked:
        return env
    path = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(asked, PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
    env[INSTRUMENTS_ENV] = INSTALL
    return env
