"""Chaos run against live SwiftCache servers; see benchmarks/tools/chaos.py and docs/chaos.md.

    python scripts/chaos.py --quick          # one fault cycle (about 5 minutes on 2 cores)
    python scripts/chaos.py --cycles 10      # a longer soak
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.tools.chaos import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
