"""Where a SwiftCache server's scheduler thread spent its own time over a stretch of a run:
the `swiftcache_work_<phase>_seconds_total` series of its `/metrics` (`--enable-metrics`;
`sglang_swift.integration.work_clock`), read before and after, as milliseconds by phase."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from sglang_swift.integration.work_clock import PHASES

from ..nodebench.observe import parse_metrics

LOOPS = "swiftcache_scheduler_loops_total"
SERIES = {phase: f"swiftcache_work_{phase}_seconds_total" for phase in PHASES}
# the server pushes its totals to /metrics about once a second (cache.METRICS_INTERVAL_S), and an
# idle scheduler loops about once a second (--sleep-on-idle): wait this long for the last push
SETTLE_S = 2.5


def read_work(base_url: str, settle: bool = False) -> dict[str, float] | None:
    """The server's totals now (`settle`: after its last push), or None when it exposes none
    (stock SGLang, or no --enable-metrics)."""
    if settle:
        time.sleep(SETTLE_S)
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
            got = parse_metrics(r.read().decode(errors="replace"), (*SERIES.values(), LOOPS))
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
    return got or None


def breakdown(before: dict | None, after: dict | None, per: int, unit: str) -> dict | None:
    """Milliseconds per `unit` (`per` of them in the stretch) in each phase between two reads,
    with their total and the loops seen; None without both reads."""
    if not before or not after or per <= 0:
        return None
    ms = {phase: round((after.get(name, 0.0) - before.get(name, 0.0)) * 1e3 / per, 4)
          for phase, name in SERIES.items()}
    return {"unit": unit, "count": per, "ms": ms, "total_ms": round(sum(ms.values()), 4),
            "loops": int(after.get(LOOPS, 0) - before.get(LOOPS, 0))}
