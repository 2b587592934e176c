#!/usr/bin/env bash
# Lint: ruff with the project's rules (pyproject.toml [tool.ruff]); exits non-zero on any finding.
#   bash scripts/lint.sh [ruff check args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
.venv/bin/ruff check "$@" .
