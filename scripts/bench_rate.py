#!/usr/bin/env python3
"""P99 TTFT against session rate, stock SGLang vs SwiftCache; see nodebench/rate_cli.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nodebench.rate_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
