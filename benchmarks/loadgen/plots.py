"""PNG plots (matplotlib, Agg): TTFT CDF, a P99 latency against request rate, per-turn TTFT."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _finish(fig, ax, path: Path, title: str) -> Path:
    """Title, grid and legend; write the figure to `path` and close it."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def ttft_cdf(series: dict[str, list[float]], path: Path, title: str = "TTFT CDF") -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, vals in series.items():
        v = np.sort(np.asarray([x for x in vals if x is not None]) * 1e3)
        if len(v):
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    return _finish(fig, ax, path, title)


def p99_vs_rate(curves: dict[str, list[tuple[float, float]]], path: Path,
                title: str = "P99 TTFT vs request rate", xlabel: str = "session arrival rate (1/s)",
                logy: bool = False, ylabel: str = "P99 TTFT (ms)") -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in curves.items():
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, np.asarray(ys) * 1e3, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    return _finish(fig, ax, path, title)


def per_turn_ttft(per_turn: dict[str, dict[int, dict]], path: Path,
                  title: str = "TTFT by turn index") -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, turns in per_turn.items():
        turns = {int(k): v for k, v in turns.items()}
        ts = sorted(turns)
        ys = [turns[t]["ttft_p50"] * 1e3 if turns[t]["ttft_p50"] is not None else np.nan
              for t in ts]
        ax.plot(ts, ys, marker="o", label=f"{label} P50")
    ax.set_xlabel("turn index")
    ax.set_ylabel("TTFT (ms)")
    return _finish(fig, ax, path, title)
