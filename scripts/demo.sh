#!/usr/bin/env bash
# The main job: set up (if needed) and run the SwiftCache demo on this machine.
#   bash scripts/demo.sh [demo options, see: .venv/bin/python -m benchmarks.tools.demo --help]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
exec .venv/bin/python -m benchmarks.tools.demo "$@"
