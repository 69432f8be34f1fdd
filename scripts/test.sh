#!/usr/bin/env bash
# Set up, then run the linter and the whole test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
"$PYTHON" -m ruff check .
# Two processes, a test file to each at a time (most tests wait on child processes; the CI
# machine has 2 cores): ~10 min instead of ~16. `bash scripts/test.sh -n 0` runs it in one.
"$PYTHON" -m pytest -q -n 2 --dist loadfile "$@"
