#!/usr/bin/env bash
# Set up (as scripts/setup.sh, plus matplotlib for the plot), then run the side-by-side
# benchmark: N independent DataLoaders vs tensorsocket vs PyPI tensorsocket 0.0.5, N = 1, 2, 4, 8.
# Writes benchmarks/results/<machine>-<date>.json and .png; options: python -m benchmarks.compare --help
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
"$PYTHON" -m pip install --quiet -e ".[bench]"
"$PYTHON" -m benchmarks.compare "$@"
