#!/usr/bin/env python3
"""SGLang's benchmark/hicache/bench_multiturn.py traffic against stock SGLang, a SwiftCache
borrower and the ideal, with every request's phases; see benchmarks/nodebench/multiturn_cli.py
and docs/node_bench.md ("bench_multiturn's traffic, request by request").

    python scripts/bench_multiturn.py --quick     # 8 and 16 clients, seeds 1 and 2
    python scripts/bench_multiturn.py             # 8, 16 and 32 clients, seeds 1-3
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.nodebench.multiturn_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
