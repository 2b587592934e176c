#!/usr/bin/env python3
"""Node benchmark with capacity-equal baselines; see benchmarks/nodebench/cli.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nodebench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
