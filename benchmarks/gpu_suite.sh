#!/usr/bin/env bash
# Everything that needs a GPU, in one command: build the extension with its CUDA kernels, run the cuda-marked tests,
# run every kernel under compute-sanitizer, and a short CUDA training run. Each stage writes its log (and the tests a
# JUnit XML) into the results folder and the script goes on to the next stage when one fails; the last lines are a
# summary table, and the exit status is non-zero when any stage failed.
#
#   benchmarks/gpu_suite.sh [STAGE ...]        stages: build tests sanitize train (default: all four, in that order)
#
# Environment:
#   RESULTS_DIR       where logs and XML go (default: benchmarks/results/gpu-raw, which git ignores)
#   PYTEST_ARGS       extra pytest arguments for the tests stage, e.g. "-k amp" or "-x"
#   WORKERS           pytest-xdist processes sharing the GPU (default 8; 0 runs the tests in one process)
#   SANITIZE_TOOLS    compute-sanitizer tools (default "memcheck racecheck initcheck synccheck")
#   SANITIZE_BIG      1 (default) also runs the > 2**31-element bfloat16 buffer under each tool
#   STAGE_TIMEOUT     seconds before a stage is stopped (default 420)
set -uo pipefail
cd "$(dirname "$0")/.."

RESULTS_DIR=${RESULTS_DIR:-benchmarks/results/gpu-raw}
WORKERS=${WORKERS:-8}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
SANITIZE_BIG=${SANITIZE_BIG:-1}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS_DIR"
summary=()
failed=0

record() {  # record STAGE STATUS SECONDS [NOTE]
  summary+=("$(printf '%-22s %-6s %5ss  %s' "$1" "$2" "$3" "${4:-}")")
  [ "$2" = ok ] || failed=1
}

run_stage() {  # run_stage NAME LOG COMMAND...: time-limited, logged, recorded
  local name=$1 log=$2 start status
  shift 2
  start=$(date +%s)
  echo "== $name: $*" | tee -a "$log"
  timeout --kill-after=10 "$STAGE_TIMEOUT" "$@" >>"$log" 2>&1
  status=$?
  local took=$(($(date +%s) - start))
  case $status in
    0) record "$name" ok "$took" ;;
    124 | 137) record "$name" TIMEOUT "$took" "see $log" ;;
    *) record "$name" FAIL "$took" "exit $status, see $log" ;;
  esac
  tail -n 3 "$log"
}

stage_build() {
  local arch
  arch=$($PYTHON -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || return 1
  $PYTHON - <<'EOF' >"$RESULTS_DIR/environment.txt" 2>&1
import platform, subprocess, torch
import triton
p = torch.cuda.get_device_properties(0)
print(f"gpu: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, python {platform.python_version()}")
print(subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
print(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
EOF
  cat "$RESULTS_DIR/environment.txt"
  run_stage build "$RESULTS_DIR/build.log" env GEARSAM_BUILD_CPP=1 GEARSAM_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" \
    MAX_JOBS="$(nproc)" $PYTHON -m pip install --no-build-isolation --no-deps --no-index --use-pep517 -e .
  $PYTHON -c 'from gearsam_fused import _C; assert _C.built_with_cuda(), "the extension has no CUDA kernels"' \
    || record "build: CUDA kernels" FAIL 0 "the extension was built without them"
}

stage_tests() {
  local parallel=()
  [ "$WORKERS" -gt 0 ] && parallel=(-n "$WORKERS")
  # xunit1 keeps record_property: the AMP tests write the errors they measured into the XML
  # shellcheck disable=SC2086
  run_stage "tests (-m cuda)" "$RESULTS_DIR/cuda-tests.log" $PYTHON -m pytest tests -m cuda -q -rfEs "${parallel[@]}" \
    -p no:cacheprovider --timeout=300 --durations=15 -o junit_family=xunit1 \
    --junitxml="$RESULTS_DIR/cuda-tests.xml" ${PYTEST_ARGS:-}
}

stage_sanitize() {
  $PYTHON benchmarks/kernels_once.py --list >"$RESULTS_DIR/kernels.txt" 2>&1 || record "kernels_once --list" FAIL 0
  local tool big=()
  [ "$SANITIZE_BIG" = 1 ] && big=(--big)
  for tool in $SANITIZE_TOOLS; do
    # no caching allocator: every tensor is its own allocation, so an access past its end is out of bounds
    run_stage "sanitize $tool" "$RESULTS_DIR/sanitize-$tool.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      compute-sanitizer --tool "$tool" --error-exitcode 99 $PYTHON benchmarks/kernels_once.py "${big[@]}"
  done
}

stage_train() {
  run_stage "train (cuda, bf16)" "$RESULTS_DIR/train.log" $PYTHON -m gearsam_fused train --device cuda --amp bf16 \
    --channels-last --dataset synthetic --synthetic-size 512 --epochs 2 --optimizers sgd sam gear-sam \
    --out "$RESULTS_DIR/train-run"
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build tests sanitize train)
for stage in "${stages[@]}"; do
  case $stage in
    build | tests | sanitize | train) "stage_$stage" ;;
    *) echo "unknown stage '$stage'; expected build, tests, sanitize or train" >&2; exit 2 ;;
  esac
done

echo
echo "== gpu_suite summary ($(date -u +%Y-%m-%dT%H:%MZ), results in $RESULTS_DIR)"
printf '%s\n' "${summary[@]}"
grep -h -E '^[0-9]+ (passed|failed)|passed|failed' "$RESULTS_DIR/cuda-tests.log" 2>/dev/null | tail -n 1
exit $failed
