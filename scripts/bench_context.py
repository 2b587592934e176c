#!/usr/bin/env python3
"""Longest context served at equal local KV memory (stock SGLang vs SwiftCache layer streaming)
and the cost of streaming per decode step and prefill token; see
benchmarks/layer_stream/context_bench.py. The last line printed is a JSON object.
`--resident-fraction F` runs the streamed server with resident rows (its pool sized to the same
local memory) and adds a short request, one that fits in the resident slots, to the costs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.layer_stream.context_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
