"""Build a small local Llama used by the demo, tests and benchmarks (see
benchmarks/tools/tiny_model.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tools.tiny_model import (  # noqa: E402
    MODEL_SHAPES,
    STAMP,
    ensure_tiny_model,
    model_dir,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="tiny")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: artifacts/<shape>-llama (tiny-<shape> for mla, swa, moe)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if a build is present")
    args = ap.parse_args()
    out_dir = args.out or model_dir(args.shape)
    if args.force:
        (out_dir / STAMP).unlink(missing_ok=True)
    out = ensure_tiny_model(out_dir, args.seed, args.shape)
    print(json.dumps(json.loads((out / STAMP).read_text())))


if __name__ == "__main__":
    main()
