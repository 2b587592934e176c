#!/usr/bin/env bash
# Create .venv and install everything SwiftCache needs to run SGLang 0.5.23 on a CPU-only machine.
#
#   bash scripts/setup_cpu.sh          # idempotent: a second run only checks a stamp
#
# Route (see README "Install"): torch 2.13.0 CPU; sglang==0.5.23 without its CUDA-only dependencies;
# every other dependency pinned in requirements/cpu.lock (generated from requirements/cpu.in);
# this project in editable mode; the CPU compatibility hook (.pth); the tiny local model.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SWIFTCACHE_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
STAMP=$VENV/.swiftcache-setup

want=$(cat requirements/cpu.lock pyproject.toml scripts/setup_cpu.sh | sha256sum | cut -c1-16)
if [[ -f $STAMP && $(cat "$STAMP") == "$want" && -x $VENV/bin/python ]]; then
    echo "setup: .venv is up to date ($want)"
    exit 0
fi

t0=$(date +%s)
if [[ ! -x $VENV/bin/python ]]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
        || { echo "setup: Python >= 3.10 needed (set PYTHON=...)" >&2; exit 1; }
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# The lock is complete (every transitive dependency, exact versions), so no resolver run is needed:
# --no-deps keeps pip from pulling sglang's CUDA requirements (torch 2.14.1 CUDA, flashinfer, ...).
"${PIP[@]}" install --no-deps -r requirements/cpu.lock 2>&1 | grep -v "is ignored: it is neither" || true
"${PIP[@]}" install --no-deps -e . 2>&1 | grep -v "is ignored: it is neither" || true

# CPU compatibility hook for every interpreter of this venv (see sglang_swift/cpu_compat/site_hook.py).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A venv whose directory was removed under a running setup answers with the base interpreter's
# site-packages: never write the hooks there.
if [[ $(realpath "$SITE") != "$(realpath "$VENV")"/* ]]; then
    echo "setup: $VENV/bin/python is not a venv interpreter (site-packages $SITE); remove $VENV" \
         "and run again" >&2
    exit 1
fi
echo "import sglang_swift.cpu_compat.site_hook as _swift_site; _swift_site.activate()" \
    > "$SITE/swiftcache_cpu_compat.pth"
# Development checkout: the measuring apparatus (benchmarks/) and tests/ import from the repository
# root; they are not part of the installed package.
echo "$ROOT" > "$SITE/swiftcache_dev.pth"
"$VENV/bin/python" -c 'import torch, sglang, transformers, zmq, msgspec' \
    || { echo "setup: dependency install failed (see pip output above)" >&2; exit 1; }

"$VENV/bin/python" scripts/build_tiny_model.py >/dev/null
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - t0 ))s; venv $(du -sh "$VENV" | cut -f1)"
