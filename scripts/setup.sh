#!/usr/bin/env bash
# Install tensorsocket (editable) with its test tools into the current Python environment.
# A torch you already have (e.g. a CUDA build) is kept; without one we install torch 2.13.0,
# the version the suite runs on, first (the package index decides the build: the CPU one on
# our CI machines, a CUDA one from PyPI on Linux), so pip does not pick the newest on its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
