#!/usr/bin/env bash
# Everything that needs a GPU, in one command, on a CUDA machine without internet access. See usage() below and
# benchmarks/README.md. Each phase is time-limited and logs into RESULTS_DIR; a failing phase does not stop the next
# one. Every run appends to RESULTS_DIR/phases.tsv and rewrites RESULTS_DIR/summary.md from it (suite_summary.py),
# so phases split over several runs into one folder end up in one summary.
# Exit status: 0 when every phase of this run passed, 1 when one did not, 2 for a usage error.
set -uo pipefail
# empty arrays under set -u, and the name references of split_words below
((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404)) || { echo "gpu_suite.sh needs bash 4.4 or later" >&2; exit 2; }

PHASES=(info build tests sanitize bench models train)
# seconds per phase (PHASE_TIMEOUT sets them all, TIMEOUT_<PHASE> one of them), small enough that info+build+tests
# (60+150+390 = 600), sanitize+train (300+240 = 540), bench and models each fit into a run of 10 minutes.
#   build: 44-60 s on the H100s of 2026-11-23 and 2026-11-26 (16 cores), so 150.
#   bench: run in parts only (ResNet-18's whole step without the per-tensor rows: 160 s on an H100). Its whole step
#     steps every contender of a set and base optimizer in turn within one test; it also compiles our step (cpp,
#     triton) and the compiled foreach SAM (and its reduce-overhead form on the CUDA-graph sets) for every set x 2
#     base optimizers (7-60 s each on an H100 up to 292 tensors; on the two sets of about 2000 tensors 4-8 minutes
#     each on 2 CPU cores, so a part of their own, e.g. BENCH_ARGS="-- -k 'whole_step and tensors_4096'", or without
#     the compiled rows there, BENCH_ARGS="-- --compile-sets=resnet18,wrn28_10,vit_b16,gpt2_medium") and captures
#     10 CUDA graphs (quick to capture): if 540 s is too short, TIMEOUT_BENCH=590 or BENCH_ARGS="--quick".
#   tests: that run took 150 s for 549 cuda-marked tests on 8 processes; on 2026-11-27 `pytest -m cuda
#     --collect-only tests` counts 2047, so 150 x 2047 / 549 = 559 s: 390 does not finish them all, so the README
#     splits them in two runs, PYTEST_ARGS="--part 1/2" and "--part 2/2" (tests/conftest.py), about 280 s each; -v
#     names the tests that did not finish, and PYTEST_ARGS can also select a file or a -k word.
#   models: bench_models.py on CUDA, 4 models x 7 rows, stepped in turn. One forward+backward pass (f) of ResNet-50
#     b128, ViT-B/16 b64 or GPT-2 small 8x1024 in bf16 is about 0.1-0.15 s on an H100, the CIFAR ResNet-18 about
#     0.01 s. A round is 13 f (5 SAM steps of 2 f, 2 base rows of 1 f, one pass of its own), 20 rounds 260 f, the
#     warm-ups (3 steps a row) and memory steps about 50 f: about 310 f per model, so 31 + 40 + 40 + 4 = 115 s of
#     steps; plus compiling the compiled contender, about 45 s per model (180 s), and imports and model set-up
#     (40 s): about 340 s; 540 for room.
declare -A LIMITS=([info]=60 [build]=150 [tests]=390 [sanitize]=300 [bench]=540 [models]=540 [train]=240)

usage() {
  cat <<'EOF'
usage: benchmarks/gpu_suite.sh [RESULTS_DIR] [--only PHASE[,PHASE...]] [--dry-run]

Runs the suite's phases on a CUDA machine, in this order:
  info      GPU, driver, python, torch, CUDA, triton and nvcc versions     -> environment.txt
  build     pip install --no-build-isolation --no-deps --use-pep517 -e . with GEARSAM_BUILD_CUDA=1,
            then checks that gearsam_fused._C has its CUDA kernels          -> build.log
  tests     the cpp backend's CPU tests with the extension built here      -> cpp-cpu-tests.log
            python -m pytest --full -m cuda tests (the full tier), with a
            per-test timeout                                              -> cuda-tests.log, cuda-tests.xml
  sanitize  compute-sanitizer memcheck and racecheck over kernels_once.py   -> kernels.txt, sanitize-TOOL.log
  bench     benchmarks/run.py on CUDA                                       -> bench.log, bench-runs.jsonl, bench.md
  models    benchmarks/bench_models.py: training steps of ResNet-50, ViT-B/16, GPT-2 small and the CIFAR
            ResNet-18 with each SAM contender                               -> models.log, models-runs.jsonl, models.md
  train     a short CUDA training run (SGD, SAM, GEAR-SAM, bf16)            -> train.log, train-run/
Then it writes RESULTS_DIR/summary.md, covering every phase run into RESULTS_DIR so far, and prints it.

  RESULTS_DIR   where everything goes (default: benchmarks/results/gpu-YYYY-MM-DD, today's date)
  --only LIST   only these phases, comma-separated (repeatable); they still run in the order above
  --dry-run     print the phases and their commands, run nothing
  -h, --help    this text

Environment:
  PYTHON            interpreter (default: python3)
  PHASE_TIMEOUT     seconds for every phase (default: info 60, build 150, tests 390, sanitize 300, bench 540,
                    models 540, train 240); TIMEOUT_<PHASE>, e.g. TIMEOUT_BENCH=300, for one phase
  WORKERS           pytest-xdist processes sharing the GPU in tests (default 8; 0: a single process)
  TEST_TIMEOUT      seconds per test (pytest-timeout; default 300)
  PYTEST_ARGS       extra pytest arguments for tests, e.g. "-k amp" or "-k 'mix or exchange'" (quotes honoured)
  SANITIZE_TOOLS    compute-sanitizer tools (default "memcheck racecheck"; initcheck and synccheck also work)
  SANITIZE_BIG      1: also the bfloat16 buffer of more than 2**31 elements, about 13 GiB (default 0)
  BENCH_ARGS        extra arguments for benchmarks/run.py, e.g. --quick
  MODELS_ARGS       extra pytest arguments for bench_models.py, e.g. --quick or "-k gpt2_small"
  SANITIZER         compute-sanitizer to use (default: the one on PATH, else $CUDA_HOME/bin, else /usr/local/cuda/bin)
EOF
}

usage_error() {  # usage_error MESSAGE: exit 2 before anything runs
  echo "gpu_suite.sh: $1" >&2
  echo "run benchmarks/gpu_suite.sh --help for usage" >&2
  exit 2
}

declare -A SELECTED=()
select_phases() {  # select_phases "a,b": validates every name before any phase runs
  local name known phase names
  [ -n "$1" ] || usage_error "--only needs at least one phase; valid phases: ${PHASES[*]}"
  IFS=, read -r -a names <<<"$1"
  for name in "${names[@]}"; do
    known=0
    for phase in "${PHASES[@]}"; do [ "$name" = "$phase" ] && known=1; done
    [ "$known" = 1 ] || usage_error "unknown phase '$name'; valid phases: ${PHASES[*]}"
    SELECTED[$name]=1
  done
}

DRY_RUN=0
RESULTS_ARG=
parse_args() {
  while [ $# -gt 0 ]; do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --only) [ $# -ge 2 ] && [[ $2 != -* ]] || usage_error "--only needs a list of phases; valid phases: ${PHASES[*]}"
        select_phases "$2"; shift ;;
      --only=*) select_phases "${1#--only=}" ;;
      -*) usage_error "unknown option '$1'" ;;
      *) [ -z "$RESULTS_ARG" ] || usage_error "one RESULTS_DIR only, got '$RESULTS_ARG' and '$1'"
        # phases used to be positional: a bare phase name is far more likely that than a results folder
        [[ " ${PHASES[*]} " != *" $1 "* ]] || usage_error "'$1' is a phase: use --only $1 (./$1 for a folder)"
        RESULTS_ARG=$1 ;;
    esac
    shift
  done
  if [ ${#SELECTED[@]} -eq 0 ]; then
    for phase in "${PHASES[@]}"; do SELECTED[$phase]=1; done
  fi
}

parse_args "$@"
# a relative RESULTS_DIR is the caller's, not the repository root's, where the script moves to
case $RESULTS_ARG in
  "") RESULTS_DIR= ;;
  /*) RESULTS_DIR=$RESULTS_ARG ;;
  *) RESULTS_DIR=$PWD/${RESULTS_ARG#./} ;;
esac
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
RESULTS_DIR=${RESULTS_DIR:-$ROOT/benchmarks/results/gpu-$(date +%Y-%m-%d)}
RESULTS_DIR=${RESULTS_DIR%/}
RECORDS=$RESULTS_DIR/phases.tsv

PYTHON=${PYTHON:-python3}
WORKERS=${WORKERS:-8}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
PYTEST_ARGS=${PYTEST_ARGS:-}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}
SANITIZE_BIG=${SANITIZE_BIG:-0}
BENCH_ARGS=${BENCH_ARGS:-}
MODELS_ARGS=${MODELS_ARGS:-}

split_words() {  # split_words NAME VALUE: array NAME holds VALUE's words, quotes honoured as xargs does them
  local -n into=$1
  local words
  into=()
  [ -n "$2" ] || return 0
  # xargs prints the words it read before a quoting error: the value is refused whole, not cut short
  words=$(printf '%s' "$2" | xargs -r printf '%s\n' 2>/dev/null) \
    || usage_error "cannot split ${1%_WORDS} into words (an unmatched quote?): $2"
  [ -z "$words" ] || mapfile -t into <<<"$words"
}
# so that PYTEST_ARGS="-k 'amp or mix'" passes one -k expression, not three words
split_words PYTEST_ARGS_WORDS "$PYTEST_ARGS"
split_words BENCH_ARGS_WORDS "$BENCH_ARGS"
split_words MODELS_ARGS_WORDS "$MODELS_ARGS"
# compute-sanitizer ships with the toolkit, which is not always on PATH
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
RUN_ID=$(date -u +%Y-%m-%dT%H:%M:%SZ)
SUITE_FAILED=0
TAIL_LINES=3

dry() { [ "$DRY_RUN" = 1 ]; }

quote() {  # quote WORD...: the words as a shell line, single-quoting only those that need it
  local word out=()
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then out+=("$word"); else out+=("'${word//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

phase_limit() {  # phase_limit PHASE: seconds the phase may take
  local override="TIMEOUT_${1^^}"
  echo "${!override:-${PHASE_TIMEOUT:-${LIMITS[$1]}}}"
}

record() {  # record PHASE STEP STATUS SECONDS LOG NOTE: one line of phases.tsv
  [ -s "$RECORDS" ] || printf 'run\tphase\tstep\tstatus\tseconds\tlog\tnote\n' >"$RECORDS"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$RUN_ID" "$1" "$2" "$3" "$4" "$5" "$6" >>"$RECORDS"
}

declare -A TOUCHED=()
step() {  # step NAME LOG COMMAND...: COMMAND, given what is left of the phase's time, output appended to LOG
  local name=$1 log=$2 left start status took note=${STEP_NOTE:-}
  shift 2
  if dry; then
    echo "   $(quote "$@")  >> $log"
    return 0
  fi
  left=$((PHASE_DEADLINE - $(date +%s)))
  if [ "$left" -le 0 ]; then
    record "$PHASE" "$name" TIMEOUT 0 "$log" "not started: no time left in the phase"
    PHASE_FAILED=1
    echo "   $name: not started, no time left in the phase"
    return 1
  fi
  # a log holds this run's output only: a phase run again replaces the earlier result, and its log with it
  [ -n "${TOUCHED[$log]:-}" ] || : >"$RESULTS_DIR/$log"
  TOUCHED[$log]=1
  echo "== $PHASE $name ($RUN_ID): $(quote "$@")" >>"$RESULTS_DIR/$log"
  echo "   $name: $(quote "$@")"
  start=$(date +%s)
  timeout --kill-after=10 "$left" "$@" >>"$RESULTS_DIR/$log" 2>&1
  status=$?
  took=$(($(date +%s) - start))
  # 124: timeout stopped it; 137 (SIGKILL) is timeout's --kill-after only when the time was up
  if [ "$status" = 0 ]; then
    record "$PHASE" "$name" ok "$took" "$log" "$note"
  elif [ "$status" = 124 ] || { [ "$status" = 137 ] && [ "$took" -ge "$left" ]; }; then
    record "$PHASE" "$name" TIMEOUT "$took" "$log" "stopped at the phase's limit${note:+; $note}"
  else
    record "$PHASE" "$name" FAIL "$took" "$log" "exit $status${note:+; $note}"
  fi
  [ "$status" = 0 ] || PHASE_FAILED=1
  tail -n "$TAIL_LINES" "$RESULTS_DIR/$log" | sed 's/^/   | /'
  return "$status"
}

phase_info() {
  local TAIL_LINES=40
  step environment environment.txt "$PYTHON" benchmarks/suite_summary.py environment
}

gpu_capability() {  # "9.0" for an H100: the build then compiles for this GPU only, not for setup.py's default list
  timeout 60 "$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null
}

phase_build() {
  local arch=${TORCH_CUDA_ARCH_LIST:-}
  if [ -z "$arch" ]; then
    if dry; then arch='<capability of GPU 0>'; else arch=$(gpu_capability); fi
  fi
  # --use-pep517: pip's legacy develop path re-invoked pip with build isolation, which needs the network
  step "pip install" build.log env GEARSAM_BUILD_CPP=1 GEARSAM_BUILD_CUDA=1 ${arch:+"TORCH_CUDA_ARCH_LIST=$arch"} \
    MAX_JOBS="$(nproc)" "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index --use-pep517 -e .
  step "CUDA kernels" build.log "$PYTHON" -c \
    'from gearsam_fused import _C; assert _C.built_with_cuda(), "the extension was built without its CUDA kernels"'
}

phase_tests() {
  local parallel=()
  [ "$WORKERS" -gt 0 ] && parallel=(-n "$WORKERS")
  # the extension built here may link differently from a CPU machine's build (the C++ standard library statically,
  # as on the H200 of 2026-11-26, where its CPU kernels crashed): its CPU side runs here too, first, as it is quick
  step "cpp on this CPU" cpp-cpu-tests.log "$PYTHON" -m pytest --full -m "not cuda" tests/kernels/test_cpp_ops.py \
    tests/kernels/test_cpp_extension.py -k "not hopper" -q -rfEs "${parallel[@]}" -p no:cacheprovider --timeout="$TEST_TIMEOUT"
  # an XML left by an earlier run would be counted if this one stops before writing its own
  dry || rm -f "$RESULTS_DIR/cuda-tests.xml"
  # xunit1 keeps record_property: the AMP tests write the errors they measured into the XML. -v: each test's name is
  # logged as it finishes, so a phase stopped at its limit still says which tests did not finish (no XML then)
  step "pytest -m cuda" cuda-tests.log "$PYTHON" -m pytest --full -m cuda tests -v -rfEs "${parallel[@]}" \
    -p no:cacheprovider --timeout="$TEST_TIMEOUT" --durations=15 -o junit_family=xunit1 \
    --junitxml="$RESULTS_DIR/cuda-tests.xml" "${PYTEST_ARGS_WORDS[@]}"
}

phase_sanitize() {
  local tool big=()
  [ "$SANITIZE_BIG" = 1 ] && big=(--big)
  # the kernels launched, by the profiler: it does not run under the sanitizer
  step "kernels --list" kernels.txt "$PYTHON" benchmarks/kernels_once.py --list
  for tool in $SANITIZE_TOOLS; do
    # no caching allocator: every tensor is its own allocation, so an access past its end is out of bounds
    step "$tool" "sanitize-$tool.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" \
      --error-exitcode 99 "$PYTHON" benchmarks/kernels_once.py "${big[@]}"
  done
}

peer_note() {  # the note of a phase whose benchmarks skip pytorch_optimizer's contender ("" when it is installed)
  dry || "$PYTHON" -c 'import pytorch_optimizer' 2>/dev/null \
    || echo "pytorch_optimizer is not installed: its contender is skipped"
}

phase_bench() {
  # the peer contender is optional: without it the suite skips its rows, and the summary says why
  local STEP_NOTE
  STEP_NOTE=$(peer_note)
  step "run.py" bench.log "$PYTHON" benchmarks/run.py --results "$RESULTS_DIR/bench-runs.jsonl" \
    --report "$RESULTS_DIR/bench.md" "${BENCH_ARGS_WORDS[@]}"
}

phase_models() {
  # its own phase, not part of run.py: on CUDA it takes minutes of its own (see LIMITS), and run.py's report does not
  # render its rows; a model whose package (torchvision, timm, transformers) is missing is skipped, -rs says why
  local STEP_NOTE
  STEP_NOTE=$(peer_note)
  dry || rm -f "$RESULTS_DIR/models.md"  # the tables of an earlier run are not this run's
  step "bench_models.py" models.log "$PYTHON" -m pytest -q -rs -p no:cacheprovider benchmarks/bench_models.py \
    --results="$RESULTS_DIR/models-runs.jsonl" --benchmark-quiet --benchmark-disable-gc \
    --benchmark-storage="file://${TMPDIR:-/tmp}/gearsam-bench-models" -W ignore::DeprecationWarning "${MODELS_ARGS_WORDS[@]}"
  STEP_NOTE=
  step "tables" models.log "$PYTHON" benchmarks/bench_models.py "$RESULTS_DIR/models-runs.jsonl" \
    "$RESULTS_DIR/models.md"
}

phase_train() {
  step "gearsam train" train.log "$PYTHON" -m gearsam_fused train --device cuda --amp bf16 --channels-last \
    --dataset synthetic --synthetic-size 512 --epochs 2 --optimizers sgd sam gear-sam --out "$RESULTS_DIR/train-run"
}

run_phase() {  # run_phase PHASE: its commands between a "started" and a "finished" record
  local start
  PHASE=$1
  PHASE_DEADLINE=$(($(date +%s) + $(phase_limit "$PHASE")))
  PHASE_FAILED=0
  if dry; then
    echo "== $PHASE (limit $(phase_limit "$PHASE") s)"
    "phase_$PHASE"
    return
  fi
  echo "== $PHASE (limit $(phase_limit "$PHASE") s, logs in $RESULTS_DIR)"
  start=$(date +%s)
  record "$PHASE" - started 0 "" ""
  "phase_$PHASE"
  record "$PHASE" - finished $(($(date +%s) - start)) "" ""
  [ "$PHASE_FAILED" = 0 ] || SUITE_FAILED=1
}

if dry; then
  echo "gpu_suite.sh dry run, nothing is run; results would go to $RESULTS_DIR"
else
  mkdir -p "$RESULTS_DIR" || exit 1
fi
for phase in "${PHASES[@]}"; do
  if [ -n "${SELECTED[$phase]:-}" ]; then
    run_phase "$phase"
  elif dry; then
    echo "== $phase: not selected"
  fi
done

summary=("$PYTHON" benchmarks/suite_summary.py summary "$RESULTS_DIR" --phases "$(IFS=,; echo "${PHASES[*]}")")
if dry; then
  echo "then: $(quote "${summary[@]}")"
  exit 0
fi
echo
"${summary[@]}" || { echo "suite_summary.py failed; the records are in $RECORDS"; cat "$RECORDS"; SUITE_FAILED=1; }
exit "$SUITE_FAILED"
