#!/usr/bin/env bash
# The test command: set up (if needed), then run the whole test suite on this CPU machine.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
export TRITON_INTERPRET=1   # read when @triton.jit decorates: must be set before triton is imported
set +e
.venv/bin/python -m pytest --timeout 900 --durations=20 "$@"  # the 20 slowest tests last
rc=$?
set -e
if [[ $rc == 5 ]]; then
    echo "test.sh: pytest collected no tests; that is a failure here" >&2
fi
exit $rc
