#!/usr/bin/env bash
# Here, before a GPU session: fetch what the GPU machine's image lacks into .whl/ (git-ignored),
# for scripts/gpu.sh to install there. The image has torch, torchvision, CuPy, nvidia-ml-py and
# msgpack for Python 3.12 but not pyzmq; compare's PyPI tensorsocket 0.0.5 (and its tornado) go
# into .whl/upstream/, installed only into 0.0.5's own environment. Then, with the device tool:
#   run(command="OUT=$OUT GPU_SH_STEPS='...' bash scripts/gpu.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
get() { # get DIR SPEC...: wheels for CPython 3.12 on x86-64 Linux, no dependencies
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dir" "$@"
}
mkdir -p .whl/upstream
get .whl "pyzmq>=25"
get .whl/upstream "tensorsocket==0.0.5" tornado
ls -la .whl .whl/upstream
