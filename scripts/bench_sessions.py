#!/usr/bin/env python3
"""Session load generator (chat from ShareGPT, agent tool loops); see
benchmarks/loadgen/cli.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loadgen.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
