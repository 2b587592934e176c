#!/usr/bin/env python3
"""The donor burst TTFT's noise, nothing changed; see benchmarks/nodebench/burst_noise.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nodebench.burst_noise import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
