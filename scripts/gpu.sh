#!/usr/bin/env bash
# On a GPU machine, in one call: the GPU test suite, the CUDA IPC benchmark, a GPU demo run and
# the side-by-side benchmark (4 trainers training ResNet-18 on 4 CPU cores: independent
# DataLoaders, tensorsocket, PyPI tensorsocket 0.0.5); everything lands in $OUT (default
# ./gpu-results): the GPU's name, the test log and JUnit XML, the benchmarks' JSON and plot, logs.
# Wheels for what the machine lacks (pyzmq) may be put in .whl/ (see the device notes), and
# tensorsocket 0.0.5 + tornado in .whl/upstream/ (installed only into 0.0.5's own environment).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.csv"
status=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" || status=1
python3 -m benchmarks.cuda_ipc 2>&1 | tail -20 || status=1
cp benchmarks/results/cuda_ipc-*.json "$OUT/" 2>/dev/null
python3 scripts/demo.py --images 256 --epochs 1 2>&1 | tail -12 | tee "$OUT/demo.log" || status=1
upstream=()
if ls .whl/upstream/*.whl >/dev/null 2>&1; then upstream=(--upstream-wheels .whl/upstream); fi
python3 -m benchmarks.compare --trainers 1,4 --model resnet18 --cpus 4 "${upstream[@]}" --out "$OUT" \
    2>&1 | tee "$OUT/compare.log" || status=1
exit $status
