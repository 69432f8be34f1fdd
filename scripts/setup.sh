#!/usr/bin/env bash
# Install tensorsocket (editable) with its test tools into the current Python environment.
# A torch you already have (e.g. a CUDA build) is kept; without one we install torch 2.13.0
# first, so pip does not pick the newest multi-GB build on its own.
#
# torchvision (the GPU JPEG pipeline's decoder, producer/imagefolder_gpu.py; models in the
# benchmarks) is installed when missing, in the version made for the installed torch: torch
# 2.X.Y pairs with torchvision 0.(X+15).Y. --no-deps, so pip cannot replace torch. A wheel that
# then fails to import (a CUDA build of torchvision next to a CPU torch, as on the CPU VM) is
# removed again: a broken torchvision raises RuntimeError on import, which breaks code that only
# expects ImportError. Without it the pipeline runs with decoder="pillow" and its tests skip
# what needs torchvision.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"

if ! "$PYTHON" -c "import torchvision.io" >/dev/null 2>&1; then
    vision=$("$PYTHON" -c "
import re, torch
major, minor, patch = re.match(r'(\d+)\.(\d+)\.(\d+)', torch.__version__).groups()
print(f'0.{int(minor) + 15}.{patch}' if major == '2' else '')")
    if [[ -z $vision ]]; then
        echo "setup: no torchvision pairing known for this torch; install torchvision yourself" >&2
    elif ! "$PYTHON" -m pip install --quiet --no-deps "torchvision==$vision"; then
        echo "setup: torchvision $vision could not be installed; producer/imagefolder_gpu.py needs it" >&2
    elif ! problem=$("$PYTHON" -c "import torchvision.io" 2>&1); then
        echo "setup: torchvision $vision does not import with this torch ($(tail -n 1 <<<"$problem")); removed it" >&2
        "$PYTHON" -m pip uninstall --quiet --yes torchvision
    fi
fi
