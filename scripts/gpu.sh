#!/usr/bin/env bash
# On a GPU machine, in one call, each step after the other, a failing step not stopping the rest:
#
#   step          what                                                          estimate (H100, 16 cores)
#   install       .whl/*.whl (pyzmq: the image lacks it) into /tmp/site         ~5 s
#   gpu           nvidia-smi: the GPU's name, driver, memory                    ~1 s
#   gpu-tests     pytest -m gpu tests/ (the GPU-marked tests)                   ~60 s (limit 150 s)
#   cuda-tests    pytest of the CUDA-path test files in CUDA_PATH_TESTS, with   ~90 s (limit 150 s)
#                 TENSORSOCKET_GPU_REAL=1 (the real backend, not the stand-in)
#   gpu-path      python3 -m benchmarks.gpu_path: next() latency, publish      ~75 s (limit 150 s)
#                 latency vs a pinned host-to-device copy, producer CPU, GPU
#                 memory per consumer (JSON into $OUT); the loader's batches in
#                 pageable memory
#   gpu-path-pinned  the same with the loader's batches pinned (what a           ~75 s (limit 150 s)
#                 DataLoader with pin_memory=True yields)
#   cuda-ipc      python3 -m benchmarks.cuda_ipc (JSON into $OUT)               ~15 s (limit 60 s)
#   compare       python3 -m benchmarks.compare: 4 trainers training ResNet-18 ~200 s (the rest of the
#                 on 4 CPU cores, 1024 images, 1 epoch, 3 runs each of          budget; 45 s per run at
#                 independent, tensorsocket, tensorsocket-gpu, PyPI 0.0.5      most, partial JSON kept)
#                 (+ the loader alone); JSON and plot into $OUT
#   decode-tests  pytest -m "not gpu" tests/test_imagefolder_gpu.py: the GPU    ~40 s (limit 90 s)
#                 JPEG pipeline with torchvision's CPU decoder (torchvision does
#                 not import on the CPU VM), on the CUDA stand-in; its nvJPEG
#                 tests are gpu-marked and run in gpu-tests
#   decode-rate   python3 -m producer.imagefolder_gpu: the GPU JPEG pipeline's   ~35 s (limit 60 s)
#                 samples/s (nvJPEG + augment), 4 file-reading workers, 1, 2
#                 and 4 batches made at once (threads)
#   gpu-decode    python3 -m benchmarks.gpu_decode: 4 ResNet-18 trainers on 4  ~150 s (limit 300 s; 8 runs
#                 cores: 4 private GPU decode pipelines vs one shared (GPU path) of 20 s or less, + the
#                 in a process of its own and hosted in trainer 0's, vs the      references)
#                 shared CPU pipeline, 2 runs each; JSON into $OUT
#   decode-contention  python3 -m benchmarks.decode_contention: the GPU pipeline's  ~100 s (limit 150 s)
#                 rate alone, beside 4 ResNet-18 trainers on other cores and on
#                 its own (GPU or CPU contention?); JSON into $OUT
#   mps           decode-contention and gpu-decode (its three GPU pipeline ways, ~240 s (limit 330 s)
#                 2 runs each) again under NVIDIA MPS (one GPU context for every
#                 process, no time-slicing between them), where the image has
#                 nvidia-cuda-mps-control; JSON (tagged <gpu>-mps) into $OUT
#
# compare takes what is left of the budget, so the steps after it need a call of their own.
# With 15 minutes of device time a session (machine start included), one call is what fits;
# what is open comes first. Issue 17 on 2026-12-01 (H200): the shared GPU pipeline ran at a
# fifth of its rate beside training trainers, on other cores too (GPU time-slicing between
# processes), and the producer's own process (a CUDA context) cost more GPU memory than the
# three private pipelines it saved. Next, in one call, ~460 s: the GPU tests (the labels' copy
# from pinned memory is new), gpu-decode with the producer hosted in a trainer's process (a
# context fewer: the memory target) beside the others, whether batches made in threads raise
# the pipeline's own rate (its main thread was a core's worth of CPU, 12.8 ms a batch), and
# whether MPS lifts the rate beside training, ~500 s:
#   GPU_SH_STEPS="gpu-tests decode-rate gpu-decode mps" bash scripts/gpu.sh
# then, if device time is left, decode-contention (0.21x before the pinned labels; a batch is
# still waited for once, here as in the producer, so this may change nothing), ~110 s, and
# again with the best --threads of decode-rate (several batches in flight may ride out the
# other contexts' turns).
# Fetch the wheels first, here: bash scripts/gpu_wheels.sh (and carry .whl).
#
# The whole script keeps to $GPU_SH_BUDGET seconds (default 540: the device tool allows 600 per
# command); a step's limit is cut to what is left. $GPU_SH_STEPS (default: all of them) names
# the steps to run, space-separated, e.g. "gpu-tests cuda-tests gpu-path" in one call and
# "compare" in the next when one call cannot hold them all. $OUT (default ./gpu-results) gets at most 8
# files: logs.tar.gz (every step's log, the JUnit XML of the test runs, nvidia-smi's answer),
# steps.txt (each step's exit status and seconds), gpu_path-*.json, cuda_ipc-*.json, the
# compare benchmark's <gpu>-<date>.json and .png, gpu_decode-*.json and decode_contention-*.json
# (more than 8 only when every step runs, which one call cannot hold).
#
# Wheels (scripts/gpu_wheels.sh): .whl/*.whl are installed into /tmp/site (pyzmq); .whl/upstream/
# holds tensorsocket 0.0.5 and tornado, installed only into 0.0.5's own environment by compare.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_SH_BUDGET:-540}
LOGS=$(mktemp -d /tmp/gpu-sh-logs.XXXXXX)
MARK="$LOGS/.start"
touch "$MARK"
export PYTHONUNBUFFERED=1

# The non-gpu-marked test files that exercise the CUDA path, run again on the real CUDA backend
# (TENSORSOCKET_GPU_REAL=1); space-separated paths, e.g. "tests/test_device_backend.py".
CUDA_PATH_TESTS="tests/test_cuda_path.py tests/test_transport.py"

failed=()
step() { # step NAME LIMIT_S COMMAND...: run it under a time limit, log into $LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    if [[ -n "${GPU_SH_STEPS:-}" && $name != install && $name != gpu && " $GPU_SH_STEPS " != *" $name "* ]]; then
        echo "== $name: not run, not in GPU_SH_STEPS" | tee -a "$LOGS/steps.txt"
        return
    fi
    local left=$((BUDGET - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 15)); then
        echo "== $name: not run, the ${BUDGET} s budget is spent" | tee -a "$LOGS/steps.txt"
        failed+=("$name")
        return
    fi
    echo "== $name (limit ${limit} s, at ${SECONDS} s): $*"
    local t0=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    tail -n 30 "$LOGS/$name.log"
    local note=""
    ((rc == 124 || rc == 137)) && note=" (stopped at its ${limit} s limit)"
    echo "== $name: exit $rc$note, $((SECONDS - t0)) s (elapsed ${SECONDS} s)" | tee -a "$LOGS/steps.txt"
    ((rc == 0)) || failed+=("$name")
}

if ls .whl/*.whl >/dev/null 2>&1; then
    step install 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

step gpu 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
cp "$LOGS/gpu.log" "$LOGS/gpu.csv" 2>/dev/null

step gpu-tests 200 python3 -m pytest -v -p no:cacheprovider --timeout 90 -m gpu tests/ --junitxml="$LOGS/gpu-tests.xml"

if [[ -n "${CUDA_PATH_TESTS// /}" ]]; then
    # shellcheck disable=SC2086  # a list of paths
    step cuda-tests 150 env TENSORSOCKET_GPU_REAL=1 python3 -m pytest -q -p no:cacheprovider -m "not gpu" \
        $CUDA_PATH_TESTS --junitxml="$LOGS/cuda-tests.xml"
else
    echo "== cuda-tests: not run, CUDA_PATH_TESTS is empty" | tee -a "$LOGS/steps.txt"
fi

step gpu-path 150 python3 -m benchmarks.gpu_path --out "$OUT"
step gpu-path-pinned 150 python3 -m benchmarks.gpu_path --pinned --out "$OUT"

step cuda-ipc 60 python3 -m benchmarks.cuda_ipc
find benchmarks/results -name 'cuda_ipc-*.json' -newer "$MARK" -exec cp {} "$OUT/" \;

upstream=()
if ls .whl/upstream/*.whl >/dev/null 2>&1; then upstream=(--upstream-wheels .whl/upstream); fi
step compare $((BUDGET - SECONDS - 5)) python3 -m benchmarks.compare --trainers 4 --model resnet18 --cpus 4 \
    --repeat 3 --images 1024 --epochs 1 --timeout 45 \
    --systems independent,tensorsocket,tensorsocket-gpu,tensorsocket-0.0.5 "${upstream[@]}" --out "$OUT"

step decode-tests 90 python3 -m pytest -v -p no:cacheprovider -m "not gpu" tests/test_imagefolder_gpu.py \
    --junitxml="$LOGS/decode-tests.xml"
step decode-rate 60 python3 -m producer.imagefolder_gpu --seconds 24 --workers 4 --threads 1 2 4
step gpu-decode 300 python3 -m benchmarks.gpu_decode --repeat 2 --out "$OUT"
step decode-contention 150 python3 -m benchmarks.decode_contention --out "$OUT"

under_mps() { # the two decode benchmarks with an MPS control daemon of our own, quit however this ends
    command -v nvidia-cuda-mps-control >/dev/null || { echo "nvidia-cuda-mps-control is not installed here"; return 3; }
    local gpu rc=0
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | awk '{print tolower($2)}')
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/ts-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ts-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # A daemon left by an earlier call on this machine answers; a fresh -d would fail.
    timeout 10 nvidia-cuda-mps-control <<<get_server_list >/dev/null 2>&1 || nvidia-cuda-mps-control -d || return 4
    # The daemon runs in a session of its own, beyond timeout's reach: quit it on any exit
    # (quit waits for clients; the benchmarks' own processes are gone by then, or killed).
    trap 'timeout 20 nvidia-cuda-mps-control <<<quit; tail -n 20 "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null' EXIT
    # Each benchmark waited for in the background: bash runs a trap only once a foreground
    # child ends, and the inner timeout's process group is beyond the step's signal.
    local child=
    trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null; wait; exit 143' TERM INT
    timeout -k 5 110 python3 -m benchmarks.decode_contention --tag "$gpu-mps" --out "$OUT" &
    child=$!
    wait "$child" || rc=$?
    timeout -k 5 170 python3 -m benchmarks.gpu_decode --repeat 2 --tag "$gpu-mps" --out "$OUT" \
        --ways private-gpu-pipelines,shared-gpu-pipeline,shared-gpu-pipeline-hosted &
    child=$!
    wait "$child" || rc=$?
    return $rc
}
export -f under_mps
export OUT
step mps 330 bash -c 'under_mps; exit $?'

cp "$LOGS/steps.txt" "$OUT/steps.txt"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude .start .
rm -rf "$LOGS"
echo "== done in ${SECONDS} s; failed: ${failed[*]:-none}; files in $OUT:"
ls -la "$OUT"
((${#failed[@]} == 0))
