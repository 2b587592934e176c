"""Watching the servers while the traffic runs: their Prometheus `/metrics`, sampled on a thread.

A SwiftCache server with `--enable-metrics` exports the gauges in GAUGES (updated once a second
by its scheduler) and the histogram `swiftcache_reclaim_latency_seconds`; stock SGLang exports
none of them, so a stock server's samples hold only what it has (nothing of ours).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

GAUGES = ("swiftcache_kv_pool_tokens", "swiftcache_lent_tokens", "swiftcache_borrowed_tokens",
          "swiftcache_usable_tokens", "swiftcache_donor_tier_tokens")
RECLAIM = "swiftcache_reclaim_latency_seconds"
COUNTERS = ("swiftcache_stored_tokens_total", "swiftcache_loaded_tokens_total",
            "swiftcache_revoked_tokens_total", "swiftcache_refused_loads_total",
            "swiftcache_own_pages_wait_seconds_total")
WANTED = GAUGES + COUNTERS + (RECLAIM + "_sum", RECLAIM + "_count")


def parse_metrics(text: str, names: tuple[str, ...] = WANTED) -> dict[str, float]:
    """Each metric in `names` summed over its label sets (one agent per server: its value).
    A name with no sample is absent from the result, not 0."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name in wanted:
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue  # not a sample line
    return out


def scrape(base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """One server's wanted metrics now, or None when it did not answer in time."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return parse_metrics(r.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, TimeoutError):
        return None


class CapacitySampler:
    """Scrapes every server in `urls` ({role: base URL}) each `interval_s` on a daemon thread;
    `samples[role]` is a list of (seconds since `t0`, metrics) in time order."""

    def __init__(self, urls: dict[str, str], interval_s: float, t0: float) -> None:
        self.urls = dict(urls)
        self.interval_s = interval_s
        self.t0 = t0
        self.samples: dict[str, list[tuple[float, dict[str, float]]]] = {k: [] for k in urls}
        self.missed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "CapacitySampler":
        """Starts sampling; a sampler can be entered again after it exited (the samples of each
        period are appended to the same series)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="capacity-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            tick = time.perf_counter()
            for role, url in self.urls.items():
                values = scrape(url)
                if values is None:
                    self.missed += 1
                else:
                    self.samples[role].append((time.perf_counter() - self.t0, values))
            # pacing of the sampling clock; stop() interrupts it at once
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - tick)))

    def series(self, role: str, name: str) -> list[tuple[float, float]]:
        """(t, value) of one metric of one server, where sampled."""
        return [(t, v[name]) for t, v in self.samples.get(role, []) if name in v]

    def peak(self, role: str, name: str) -> float | None:
        values = [v for _, v in self.series(role, name)]
        return max(values) if values else None

    def last(self, role: str, name: str) -> float | None:
        values = self.series(role, name)
        return values[-1][1] if values else None


def thread_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every thread of a server's process tree, keyed
    "process name/thread name/thread id". For --diagnose: a difference of two readings says
    which process and thread did the work, whatever else shared the cores."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            pname = proc.name()
            threads = proc.threads()
        except psutil.Error:
            continue
        for t in threads:
            try:
                with open(f"/proc/{proc.pid}/task/{t.id}/comm", encoding="utf-8") as f:
                    tname = f.read().strip()
            except OSError:
                tname = "?"
            out[f"{pname}/{tname}/{t.id}"] = t.user_time + t.system_time
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per thread key (keys of either), rounded to ms, largest first."""
    keys = set(before) | set(after)
    delta = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in keys}
    return dict(sorted(delta.items(), key=lambda kv: -kv[1]))
