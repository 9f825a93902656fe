#!/usr/bin/env bash
# Run on the GPU machine from the repository root, pytorch_optimizer 4.1.0 carried as a wheel in .whl/.
# one device call: build, the cuda tests, the whole step on CUDA (AdamW, three sets), memcheck with what is left
START=$(date +%s); END=$((START + 565))
R=/tmp/gpu-r; mkdir -p $R
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv > $R/nvidia-smi.csv 2>&1
TIMEOUT_BUILD=150 TIMEOUT_TESTS=230 WORKERS=16 PYTEST_ARGS="-v -v" bash benchmarks/gpu_suite.sh $R --only info,build,tests | tail -25
left=$((END - $(date +%s) - 80)); echo "bench gets $left s"
timeout --kill-after=5 $left python3 benchmarks/run.py --results $R/bench-runs.jsonl --report $R/bench.md -- \
  -k "test_whole_step and AdamW and (resnet18 or small_tensors or vit_b16) and not compiled" > $R/bench.log 2>&1
echo "bench exit $?"
left=$((END - $(date +%s) - 5)); echo "sanitize gets $left s"
[ $left -gt 10 ] && TIMEOUT_SANITIZE=$left SANITIZE_TOOLS=memcheck bash benchmarks/gpu_suite.sh $R --only sanitize | tail -8
tar czf $OUT/gpu-results.tgz -C /tmp gpu-r
grep -E "passed|failed" $R/cuda-tests.log | tail -2; grep -c PASSED $R/cuda-tests.log; grep -E "FAILED|ERROR" $R/cuda-tests.log | head -30
head -c 3000 $R/bench.md; tail -c 1500 $R/bench.log; cat $R/phases.tsv
echo "total $(( $(date +%s) - START )) s"

# The four shorter calls that followed on the same machine, each from the repository root:
# 2. the crash alone, then the whole step with SGD:
#   python3 -m pytest -m cuda tests/test_robustness.py -k test_parameters_on_two_devices -q -p no:cacheprovider
#   python3 benchmarks/run.py --results whole-step-sgd-runs.jsonl --report whole-step-sgd.md -- \
#     -k "test_whole_step and SGD and (resnet18 or small_tensors or vit_b16) and not compiled"
# 3. the training step (cd benchmarks):
#   python3 -m pytest -q bench_train_step.py --results=train-step-runs.jsonl --benchmark-quiet --benchmark-disable-gc \
#     -k "not compiled"
# 4. the SAM family's whole step (cd benchmarks):
#   python3 -m pytest -q bench_whole_step.py --results=family-runs.jsonl --benchmark-quiet --benchmark-disable-gc \
#     -k test_family_whole_step
# 5. the new kernels' test files again, stopped at 135 s:
#   python3 -m pytest -m cuda tests/test_base_step.py tests/test_capturable.py tests/test_family.py -n 16 -q
