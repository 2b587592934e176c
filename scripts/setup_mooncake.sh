#!/usr/bin/env bash
# Optional: Mooncake's store on this machine, for `--hicache-storage-backend mooncake` below the
# host tier and for its live test (tests/integration/test_l3_lending_e2e.py, which skips without it).
#
#   bash scripts/setup_mooncake.sh
#
# Installs into .venv the non-CUDA transfer engine from PyPI (its Python store client and the
# `mooncake_master` binary) and, where it is missing, libibverbs.so.1, which the engine loads
# even over TCP (Debian/Ubuntu: libibverbs1; needs root and apt-get, else it says what to install).
set -euo pipefail
cd "$(dirname "$0")/.."
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1
bash scripts/setup_cpu.sh
timeout 600 .venv/bin/python -m pip --disable-pip-version-check -q install "$MOONCAKE"
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        timeout 300 apt-get install -y -q libibverbs1 >/dev/null \
            || { timeout 300 apt-get update -q >/dev/null \
                 && timeout 300 apt-get install -y -q libibverbs1 >/dev/null; }
    else
        echo "setup_mooncake: libibverbs.so.1 is missing; install libibverbs1 (Debian/Ubuntu)" \
             "or rdma-core (Fedora/RHEL)" >&2
        exit 1
    fi
fi
.venv/bin/python -c 'import mooncake.store' && [[ -x .venv/bin/mooncake_master ]]
echo "setup_mooncake: $MOONCAKE ready (.venv/bin/mooncake_master)"
