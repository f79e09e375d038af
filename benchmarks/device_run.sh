#!/usr/bin/env bash
# One full device call: install, the 200-step graph-replay check + end-to-end decode bench,
# every GPU test, then the kernel benchmarks. Each stage has its own time limit and is
# packed into $OUT/<stage>.tgz as soon as it ends, so a call cut short keeps what finished.
#   run: bash benchmarks/device_run.sh   (carry [".aiter"] to include the AITER provider tests)
#   STAGES="tests e2e" bash benchmarks/device_run.sh   runs only those stages, in that order
set -u
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
stage() { echo "=== $1 ($(date +%T))" | tee -a $LOG; }
pack() { tar czf $OUT/$1.tgz -C $OUT $1 && rm -rf $OUT/$1; }
stage install
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >>$LOG 2>&1; then
  echo "editable install failed: mapping passes/ and lowering/ by links" | tee -a $LOG
  ln -sfn ../passes inductor_rocm_attn/passes; ln -sfn ../lowering inductor_rocm_attn/lowering
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >>$LOG 2>&1
run_e2e() {
  stage e2e; mkdir -p $OUT/e2e
  timeout ${E2E_S:-140} python3 benchmarks/bench_decode_e2e.py --out $OUT/e2e --deadline-s 110 >>$LOG 2>&1
  echo "rc=$?" >>$LOG
  pack e2e
}
run_tests() {
  stage gpu-tests
  # One pytest per file, each with its own limit, so one slow file cannot starve the rest.
  for f in test_compile_e2e test_graph_capture test_triton_attention; do
    timeout ${TESTS_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --durations=5 \
      tests/$f.py >>$LOG 2>&1; echo "rc=$? ($f)" >>$LOG
  done
  AITER_PP=""; [ -d .aiter ] && AITER_PP="$PWD/.aiter:"
  AITER_TRITON_ONLY=1 PYTHONPATH="$AITER_PP${PYTHONPATH:-$PWD}" timeout ${WRITERS_S:-60} \
    python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_triton_writers.py >>$LOG 2>&1
  echo "rc=$? (test_triton_writers)" >>$LOG
}
run_bench() {
  local b=$1
  stage $b-bench; mkdir -p $OUT/$b
  case $b in
    decode) args="benchmarks/bench_decode.py --batch 1 16 64 128 --ctx 4096";;
    prefill) args="benchmarks/bench_prefill.py";;
    writers) args="benchmarks/bench_fused_writers.py";;
  esac
  timeout ${BENCH_S:-35} python3 $args --out $OUT/$b >>$LOG 2>&1; echo "rc=$?" >>$LOG
  pack $b
}
# STAGES picks and orders the work (default: everything, tests first).
for st in ${STAGES:-tests e2e decode prefill writers}; do
  case $st in
    tests) run_tests;;
    e2e) run_e2e;;
    *) run_bench $st;;
  esac
done
stage done
grep -E "passed|failed|error|TB/s|TFLOP|rc=|===" $LOG | tail -70
