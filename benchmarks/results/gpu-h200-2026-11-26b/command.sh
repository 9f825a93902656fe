#!/usr/bin/env bash
# The two device calls of 2026-11-26 (14:16 and 14:27 UTC), from the repository root. The scripts under gpu/ were
# the files below; gpu/two_devices.py and gpu/cpu_ops.py are two_devices.py and cpu_ops.py beside this file.

# ---- call 1: BUDGET=525 bash gpu/run.sh (pytorch_optimizer 4.1.0 carried as a wheel in .whl/)
# One device call (from the repository root, pytorch_optimizer 4.1.0 carried as a wheel in .whl/): build; in the
# background the cpp crash triage and compute-sanitizer (memcheck, racecheck); in the foreground the cuda tests that
# did not finish last time and those of the new kernel variant; then the whole step on CUDA with what is left.
START=$(date +%s); END=$((START + ${BUDGET:-530}))
R=/tmp/gpu-r; mkdir -p $R
export PYTHONUNBUFFERED=1
left() { echo $((END - $(date +%s) - ${1:-0})); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
  lscpu; for i in 0 1 2 3 4; do d=/sys/devices/system/cpu/cpu0/cache/index$i; echo "index$i level $(cat $d/level 2>&1) size $(cat $d/size 2>&1)"; done
} > $R/machine.txt 2>&1
CFLAGS=-g TIMEOUT_BUILD=120 bash benchmarks/gpu_suite.sh $R --only info,build | tail -4
timeout 230 bash gpu/triage.sh $R &
TRIAGE=$!
( TIMEOUT_SANITIZE=200 SANITIZE_TOOLS="memcheck racecheck" bash benchmarks/gpu_suite.sh $R --only sanitize > $R/sanitize-out.txt 2>&1 ) &
SAN=$!
timeout --kill-after=5 $(left 290) python3 -m pytest -m cuda -n 12 --timeout 150 -p no:cacheprovider -q -rfEs --durations=10 \
  -o junit_family=xunit1 --junitxml=$R/cuda-tests.xml tests/test_family.py tests/test_flat.py tests/test_optim.py \
  tests/test_robustness.py tests/test_library_ops.py tests/test_triton_ops.py -k "not (test_triton_ops and not (other or energy or compiled_perturb)) and not (test_library_ops and not (other or energy))" \
  > $R/cuda-tests.log 2>&1
echo "tests exit $? at $(( $(date +%s) - START )) s"
wait $TRIAGE $SAN; echo "triage+sanitize done at $(( $(date +%s) - START )) s"
B="python3 benchmarks/run.py --results $R/bench-runs.jsonl --report"
timeout --kill-after=5 $(left 170) $B $R/bench-compiled.md -- -k "test_whole_step and compiled and resnet18" > $R/bench-compiled.log 2>&1
echo "compiled exit $? at $(( $(date +%s) - START )) s"
timeout --kill-after=5 $(left 8) $B $R/bench-big.md -- -k "test_whole_step and (SGD or AdamW) and (wrn28_10 or gpt2_medium) and not compiled" > $R/bench-big.log 2>&1
echo "big exit $? at $(( $(date +%s) - START )) s"
tar czf $OUT/gpu-results.tgz -C /tmp gpu-r
tail -3 $R/cuda-tests.log; grep -E "^(FAILED|ERROR)" $R/cuda-tests.log | head -20
for m in cpu cuda split; do tail -2 $R/two-devices-$m.log; done; grep -A12 "^#0\|SIGSEGV" $R/two-devices-gdb.log | head -40
tail -3 $R/cpu-cpp-tests.log; tail -12 $R/sanitize-out.txt; grep -c '"name"' $R/bench-runs.jsonl
echo "total $(( $(date +%s) - START )) s"

# ---- gpu/triage.sh
# The cpp crash on a model split over the CPU and CUDA: the repro per placement, a native backtrace, the cpp CPU tests
R=$1
for m in cpu cuda split; do timeout 40 python3 gpu/two_devices.py $m > $R/two-devices-$m.log 2>&1; echo "exit $?" >> $R/two-devices-$m.log; done
timeout 100 cuda-gdb -batch -ex "set pagination off" -ex "set cuda api_failures ignore" \
  -ex "handle SIGPIPE nostop noprint" -ex run -ex "bt 40" -ex "info registers rip rsp rdi rsi rdx rcx" -ex "x/8i \$pc" \
  --args python3 gpu/two_devices.py split > $R/two-devices-gdb.log 2>&1
echo "gdb exit $?" >> $R/two-devices-gdb.log
timeout 80 python3 -m pytest -q -p no:cacheprovider -m "not cuda" -n 3 tests/test_library_ops.py tests/test_base_step.py \
  -k "cpp or cpu" > $R/cpu-cpp-tests.log 2>&1
echo "exit $?" >> $R/cpu-cpp-tests.log

# ---- call 2: bash gpu/run2.sh
# Second device call: which CPU operator crashes, where (kernel log + addr2line, cuda-gdb), and why our compiled rows fail.
START=$(date +%s)
R=/tmp/gpu-r2; mkdir -p $R
export PYTHONUNBUFFERED=1
CFLAGS=-g TIMEOUT_BUILD=100 bash benchmarks/gpu_suite.sh $R --only build > /dev/null 2>&1
so=$(python3 -c "import gearsam_fused._C as m; print(m.__file__)")
{ echo "so $so"; g++ --version | head -1; ldd $so | grep -E "gomp|stdc|torch_cpu|c10.so"; dmesg -C && echo dmesg cleared; } > $R/info.txt 2>&1
for w in threshold energy restore perturb sgd; do
  CUDA_VISIBLE_DEVICES= timeout 30 python3 gpu/cpu_ops.py $w > $R/op-$w.log 2>&1; echo "exit $?" >> $R/op-$w.log
done
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 30 python3 gpu/cpu_ops.py perturb > $R/op-perturb-1thread.log 2>&1; echo "exit $?" >> $R/op-perturb-1thread.log
dmesg > $R/dmesg.txt 2>&1
grep -o "ip [0-9a-f]*.*" $R/dmesg.txt | head -5 >> $R/info.txt
echo "built at $(( $(date +%s) - START )) s"
CUDA_VISIBLE_DEVICES= timeout 70 cuda-gdb -batch -ex "set pagination off" -ex run -ex "bt 30" -ex "info sharedlibrary _C" \
  -ex "x/6i \$pc" --args python3 gpu/cpu_ops.py perturb > $R/gdb.log 2>&1; echo "gdb exit $?" >> $R/gdb.log
echo "gdb done at $(( $(date +%s) - START )) s"
cd benchmarks && timeout 50 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -x bench_whole_step.py \
  -k "test_whole_step and resnet18 and cpp and compiled and SGD" --benchmark-disable-gc > $R/compiled.log 2>&1; cd ..
tar czf $OUT/r2.tgz -C /tmp gpu-r2; gzip -c $so > $OUT/C.so.gz; ls -la $OUT
for w in threshold energy restore perturb sgd perturb-1thread; do echo "$w: $(tail -1 $R/op-$w.log)"; done
cat $R/info.txt; grep -E "segfault|traps" $R/dmesg.txt | tail -5
grep -v "^\[New\|^\[Thread\|Detaching\|^\[Inferior" $R/gdb.log | tail -45
grep -E "^E |Error|assert" $R/compiled.log | head -20; tail -2 $R/compiled.log
echo "total $(( $(date +%s) - START )) s"
