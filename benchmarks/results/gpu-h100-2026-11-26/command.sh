#!/usr/bin/env bash
# The two parts of the run of 2026-11-26 (17:11 and 17:23 UTC, one NVIDIA H100), from the repository root, with
# pytorch_optimizer 4.1.0 installed from a wheel in .whl/ and these scripts in gpu/ (gpu/recomp.py is recomp.py beside
# this file; gpu/setup_orig.py was setup.py as of commit 13ad128). $OUT is the folder the results were kept from. Of
# part 1's 19 files, 8 were kept (not its models rows, the memcheck log or the timeline); part 2 packs one tarball.

# ---- part 1: BUDGET=580 bash gpu/run.sh
# Everything goes straight into $OUT/gpu-r, so a step stopped at its limit still leaves what it wrote.
# build; then side by side: the cpp CPU tests, the cuda tests of the crash fix and the new kernels, memcheck;
# then alone: the whole step at ResNet-18 shapes with the compiled rows; then alone: bench_models ResNet-50.
START=$(date +%s); END=$((START + ${BUDGET:-585}))
R=$OUT/gpu-r; mkdir -p $R
export PYTHONUNBUFFERED=1
left() { echo $((END - $(date +%s) - ${1:-0})); }
stamp() { echo "$1 at $(( $(date +%s) - START )) s" | tee -a $R/timeline.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  lscpu | head -20; g++ --version | head -1; } > $R/machine.txt 2>&1
TIMEOUT_BUILD=130 bash benchmarks/gpu_suite.sh $R --only info,build > $R/suite-build.txt 2>&1
stamp built
( TIMEOUT_SANITIZE=$(left 345) SANITIZE_TOOLS=memcheck bash benchmarks/gpu_suite.sh $R --only sanitize > $R/suite-sanitize.txt 2>&1 ) &
SAN=$!
( timeout $(left 350) python3 -m pytest -m "not cuda" tests/test_library_ops.py tests/test_cpp.py -k "not hopper" -q -rfEs \
    -n 5 -p no:cacheprovider --timeout 120 > $R/cpp-cpu-tests.log 2>&1; echo "exit $?" >> $R/cpp-cpu-tests.log ) &
CPU=$!
timeout $(left 350) python3 -m pytest -m cuda tests -k "two_devices or mix or exchange" -v -rfEs -n 8 -p no:cacheprovider \
  --timeout 150 -o junit_family=xunit1 --junitxml=$R/cuda-tests.xml > $R/cuda-tests.log 2>&1; echo "exit $?" >> $R/cuda-tests.log
stamp "cuda tests done"
wait $CPU; stamp "cpu tests done"; wait $SAN; stamp "sanitize done"
timeout --kill-after=5 $(left 170) python3 benchmarks/run.py --results $R/bench-runs.jsonl --report $R/bench-r18.md \
  -- -k "test_whole_step and resnet18 and not per" > $R/bench-r18.log 2>&1
stamp "bench exit $?"
TIMEOUT_MODELS=$(left 3) MODELS_ARGS="-k resnet50" bash benchmarks/gpu_suite.sh $R --only models > $R/suite-models.txt 2>&1
stamp "models exit $?"
tail -3 $R/cpp-cpu-tests.log; tail -4 $R/cuda-tests.log; grep -E "^(FAILED|ERROR)" $R/cuda-tests.log | head
tail -8 $R/suite-sanitize.txt; grep -c '"name"' $R/bench-runs.jsonl; tail -3 $R/bench-r18.log; tail -5 $R/suite-models.txt
cat $R/timeline.txt

# ---- part 2: BUDGET=345 bash gpu/run2.sh (with -lstdc++ added to setup.py's link flags, which changed nothing)
# Part 2: why the extension carries its own libstdc++ here (link line, flags), the -lstdc++ fix built and the
# cpp CPU tests on it; dynamo's recompiles under this torch; bench_models ResNet-50 and GPT-2 small. One tarball.
START=$(date +%s); END=$((START + ${BUDGET:-360}))
R=/tmp/gpu-r2; mkdir -p $R
export PYTHONUNBUFFERED=1
left() { echo $((END - $(date +%s) - ${1:-0})); }
stamp() { echo "$1 at $(( $(date +%s) - START )) s" >> $R/timeline.txt; }
pack() { tar czf $OUT/r2.tgz -C /tmp gpu-r2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
{ env | grep -iE "flags|^cc=|^cxx=|^ld|cuda_home|torch_cuda" ; which c++ g++ gcc; ls -la $(which c++) $(which g++)
  python3 -c "import sysconfig as s; [print(k, '=', s.get_config_var(k)) for k in ('CC','CXX','LDSHARED','LDCXXSHARED','LDFLAGS','CFLAGS')]"
  g++ -dumpspecs | grep -n -i "static" | head; grep -n "static-lib" /opt/torch/.venv/lib/python3.12/site-packages/torch/utils/cpp_extension.py | head
} > $R/toolchain.txt 2>&1
# the extension as committed (CPU only, verbose, aside) for its link line
( mkdir -p /tmp/orig && cp -r csrc gearsam_fused triton_kernels pyproject.toml README.md /tmp/orig/ && cp gpu/setup_orig.py /tmp/orig/setup.py && rm -f /tmp/orig/gearsam_fused/_C*.so && cd /tmp/orig && GEARSAM_BUILD_CUDA=0 MAX_JOBS=6 timeout 150 \
  python3 setup.py -v build_ext --build-lib /tmp/b0 --build-temp /tmp/t0 > $R/link-orig.log 2>&1
  so=$(ls /tmp/b0/gearsam_fused/_C*.so); readelf -d $so | grep NEEDED > $R/needed-orig.txt; nm -C --defined-only $so | grep -c "std::basic_istream" >> $R/needed-orig.txt ) &
ORIG=$!
TIMEOUT_BUILD=130 bash benchmarks/gpu_suite.sh $R --only build > $R/suite-build.txt 2>&1
so=$(python3 -c "import gearsam_fused._C as m; print(m.__file__)")
{ readelf -d $so | grep NEEDED; nm -C --defined-only $so | grep -c "std::basic_istream"; } > $R/needed-fixed.txt 2>&1
stamp built
( timeout $(left 250) python3 gpu/recomp.py > $R/recomp.log 2>&1; echo "exit $?" >> $R/recomp.log ) &
timeout $(left 250) python3 -m pytest -m "not cuda" tests/test_library_ops.py tests/test_cpp.py -k "not hopper" -q -rfEs \
  -n 8 -p no:cacheprovider --timeout 100 > $R/cpp-cpu-tests.log 2>&1; echo "exit $?" >> $R/cpp-cpu-tests.log
stamp "cpu tests"
wait; stamp "orig+recomp"; pack
timeout $(left 20) python3 -m pytest -q -rs -p no:cacheprovider benchmarks/bench_models.py --results=$R/models-runs.jsonl \
  --benchmark-quiet --benchmark-disable-gc --benchmark-storage=file:///tmp/gbm -W ignore::DeprecationWarning \
  -k "resnet50 or gpt2_small" > $R/models.log 2>&1
stamp "models exit $?"
timeout 15 python3 benchmarks/bench_models.py $R/models-runs.jsonl $R/models.md >> $R/models.log 2>&1
pack
cat $R/timeline.txt; cat $R/toolchain.txt | head -30; grep -E "\-shared|static" $R/link-orig.log | tail -3 | cut -c1-2500
cat $R/needed-orig.txt $R/needed-fixed.txt; tail -4 $R/cpp-cpu-tests.log; cat $R/recomp.log | tail -6; tail -5 $R/models.log
