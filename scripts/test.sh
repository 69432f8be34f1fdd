#!/usr/bin/env bash
# Set up, then run the linter and the whole test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
"$PYTHON" -m ruff check .
"$PYTHON" -m pytest -q "$@"
