#!/usr/bin/env python3
"""Time per scheduler step, SwiftCache against stock SGLang; see benchmarks/sched_overhead.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sched_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
