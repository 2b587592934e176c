#!/usr/bin/env python3
"""The cache hierarchy against HiCache and an upper bound; see benchmarks/tiers/cli.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tiers.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
