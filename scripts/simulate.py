#!/usr/bin/env python3
"""Node-scale simulator (SIMULATED numbers); see benchmarks/simulator/cli.py and
docs/simulation.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.simulator.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
