#!/usr/bin/env bash
# One full device call: install, the 200-step graph-replay check + end-to-end decode bench,
# every GPU test, then the kernel benchmarks. Each stage has its own time limit and is
# packed into $OUT/<stage>.tgz as soon as it ends, so a call cut short keeps what finished.
#   run: bash benchmarks/device_run.sh   (carry [".aiter"] to include the AITER provider tests)
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
stage e2e; mkdir -p $OUT/e2e
timeout ${E2E_S:-140} python3 benchmarks/bench_decode_e2e.py --out $OUT/e2e --deadline-s 110 >>$LOG 2>&1; echo "rc=$?" >>$LOG
pack e2e
stage gpu-tests
timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --durations=10 \
  tests/test_triton_attention.py tests/test_graph_capture.py tests/test_compile_e2e.py >>$LOG 2>&1; echo "rc=$?" >>$LOG
AITER_PP=""; [ -d .aiter ] && AITER_PP="$PWD/.aiter:"
AITER_TRITON_ONLY=1 PYTHONPATH="$AITER_PP${PYTHONPATH:-$PWD}" timeout ${WRITERS_S:-60} \
  python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_triton_writers.py >>$LOG 2>&1; echo "rc=$?" >>$LOG
for b in decode prefill writers; do
  stage $b-bench; mkdir -p $OUT/$b
  case $b in
    decode) args="benchmarks/bench_decode.py --batch 1 16 64 128 --ctx 4096";;
    prefill) args="benchmarks/bench_prefill.py";;
    writers) args="benchmarks/bench_fused_writers.py";;
  esac
  timeout ${BENCH_S:-35} python3 $args --out $OUT/$b >>$LOG 2>&1; echo "rc=$?" >>$LOG
  pack $b
done
stage done
grep -E "passed|failed|error|TB/s|TFLOP|rc=|===" $LOG | tail -70
