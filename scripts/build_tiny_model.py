"""Build the tiny Llama used by the demo and the tests (see sglang_swift/tiny_model.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_swift.tools.tiny_model import DEFAULT_DIR, STAMP, ensure_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if a build is present")
    args = ap.parse_args()
    if args.force:
        (args.out / STAMP).unlink(missing_ok=True)
    out = ensure_tiny_model(args.out, args.seed)
    print(json.dumps(json.loads((out / STAMP).read_text())))


if __name__ == "__main__":
    main()
