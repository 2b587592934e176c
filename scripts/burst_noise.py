#!/usr/bin/env python3
"""The donor burst TTFT's noise, nothing changed; see sglang_swift/nodebench/burst_noise.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_swift.nodebench.burst_noise import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
