#!/usr/bin/env bash
# One full device call: install, the 200-step graph-replay check + model decode-step bench,
# every GPU test, then the kernel benchmarks. Each stage has its own time limit and is
# packed into $OUT/<stage>.tgz as soon as it ends, so a call cut short keeps what finished.
#   run: bash benchmarks/device_run.sh   (carry [".aiter"] to include the AITER provider tests)
#   STAGES="tests model_step" bash benchmarks/device_run.sh   runs only those stages, in order
#   (stages: native_build tests model_step memcheck decode decode_grid prefill cache_writers decode_seq
#    decode_bs64 decode_model_shape decode_stages decode_keys compile_time peers decode_ab
#    verify native layer_overhead compile_piecewise
#    decode_fp8 decode_softcap decode_d512 prefill_d512 native_writers probe_gluon; the old names e2e, writers,
#    decode_e2e_shape still work)
#   peers: FlashInfer beside ours and SDPA (carry [".whl"]: its wheels, installed into .site):
#   the decode grid with the split-rule A/B, prefill, and verify batches; the tables are
#   printed last (and kept in $OUT/tables.md)
#   TEST_FILES=tests/kernels/test_paged_attention.py limits the tests stage to those files;
#   TEST_FILTER="512|gemma4" further to the test ids matching that extended regex
#   TEST_SHARDS / WRITER_SHARDS: parallel pytest processes (default 6 / 2 for the AITER-op writers)
#   MEMCHECK_FILTER="dense_paths|plain" limits the memcheck stage to test ids matching it;
#   MEMCHECK_SHARDS / MEMCHECK_S: its processes and per-process limit (default TEST_SHARDS / TESTS_S)
#   FP8_ARGS replaces decode_fp8's arguments (e.g. "--batch 64 --ctx 4096 --fp8-cfgs 16,1,4,rows3 16,1,3,rows3,2")
#   NATIVE_ARGS passes bench_native.py arguments (e.g. "--variants all --batch 1 16 64 --ctx 4096"),
#   WRITER_ARGS more of them to native_writers (e.g. "--tokens 1 128 8192 --warm-l2")
#   stage transformers: benchmarks/bench_transformers.py; TRANSFORMERS_ARGS="--model llama-3.2-1b"
#   passes it arguments, TRANSFORMERS_DEADLINE_S / TRANSFORMERS_S its deadline and time limit
set -u
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
stage() { echo "=== $1 ($(date +%T))" | tee -a $LOG; }
pack() { tar czf $OUT/$1.tgz -C $OUT $1 && rm -rf $OUT/$1; }
stage install
# Carried wheels (.whl/: expecttest, which the device image lacks; peers) into a target dir.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target $PWD/.site .whl/*.whl >>$LOG 2>&1 \
    && export PYTHONPATH=$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
fi
# The native (csrc) provider's build cache stays inside the checkout.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_ext}
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >>$LOG 2>&1; then
  echo "editable install failed (see above): nothing can run without it" | tee -a $LOG
  exit 1
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >>$LOG 2>&1
run_model_step() {
  stage model_step; mkdir -p $OUT/model_step
  timeout ${E2E_S:-140} python3 benchmarks/bench_model_decode_step.py --out $OUT/model_step --deadline-s 110 >>$LOG 2>&1
  echo "rc=$?" >>$LOG
  pack model_step
}
shard() {  # shard <name> <ids file> <count> [env...]: parallel pytest processes over the ids
  local name=$1 ids=$2 n=$3; shift 3
  [ -s $ids ] || return 0  # no tests of this kind selected (TEST_FILES)
  for i in $(seq 0 $((n - 1))); do
    awk -v n=$n -v i=$i 'NR % n == i' $ids > $OUT/tests/$name$i.txt
    # SIGINT at the limit: pytest stops and still prints the failures so far (-rf, tracebacks)
    ( env "$@" timeout -s INT -k 30 ${TESTS_S:-300} ${RUNNER:-} python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
        --durations=3 $(cat $OUT/tests/$name$i.txt) > $OUT/tests/$name$i.log 2>&1
      echo "rc=$? ($name $i)" >> $OUT/tests/$name$i.log ) &
  done
}
run_tests() {
  stage gpu-tests
  # Every GPU test, sharded over parallel pytest processes (Triton compiles are CPU-bound;
  # the device has 16 cores); each shard has its own limit so a slow one cannot starve the
  # rest. The tests of the ops AITER implements (tests/kernels/test_rope_and_cache.py,
  # test_qk_norm_rope_and_cache.py) also run the aiter provider (its Triton kernels) when
  # .aiter/ is carried; the other files must not see it, or it would be picked before Triton.
  mkdir -p $OUT/tests
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider ${TEST_FILES:-tests} 2>/dev/null \
    | grep '::' | grep -E "${TEST_FILTER:-.}" > $OUT/tests/ids.txt
  AITER_OPS='tests/kernels/test_(rope_and_cache|qk_norm_rope_and_cache)\.py'
  grep -Ev "$AITER_OPS" $OUT/tests/ids.txt > $OUT/tests/main.ids
  grep -E "$AITER_OPS" $OUT/tests/ids.txt > $OUT/tests/writers.ids
  echo "$(wc -l < $OUT/tests/ids.txt) GPU tests" | tee -a $LOG
  local pp=${PYTHONPATH:-$PWD}
  [ -d .aiter ] && pp="$PWD/.aiter:$pp"
  shard main $OUT/tests/main.ids ${TEST_SHARDS:-6}
  shard writers $OUT/tests/writers.ids ${WRITER_SHARDS:-2} AITER_TRITON_ONLY=1 PYTHONPATH=$pp
  wait
  cat $OUT/tests/*.log >> $LOG
  pack tests
}
run_memcheck() {
  stage memcheck
  # compute-sanitizer memcheck over every GPU test of our own kernels (the shape sweep of the
  # attention and writer matrices; AITER's kernels excluded). No caching allocator, so an
  # access past any tensor is outside its cudaMalloc and is reported.
  mkdir -p $OUT/tests
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/kernels 2>/dev/null \
    | grep '::' | grep -v aiter \
    | grep -E "${MEMCHECK_FILTER:-.}" > $OUT/tests/memcheck.ids
  echo "memcheck over $(wc -l < $OUT/tests/memcheck.ids) GPU tests" | tee -a $LOG
  RUNNER="compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10" \
    TESTS_S=${MEMCHECK_S:-${TESTS_S:-300}} \
    shard memcheck $OUT/tests/memcheck.ids ${MEMCHECK_SHARDS:-${TEST_SHARDS:-6}} PYTORCH_NO_CUDA_MEMORY_CACHING=1
  wait
  cat $OUT/tests/memcheck*.log >> $LOG
  grep -h "ERROR SUMMARY" $OUT/tests/memcheck*.log | sort | uniq -c | tee -a $LOG
  tar czf $OUT/memcheck.tgz -C $OUT tests/memcheck.ids $(cd $OUT && ls tests/memcheck*.log)
}
run_transformers() {
  # transformers models (Qwen3-0.6B / Llama-3.2-1B shapes): ours vs sdpa / static+compile /
  # transformers' continuous batching; the bench writes its JSON after every variant and skips
  # variants that would start past its deadline, so the outer limit only catches a hang.
  stage transformers; mkdir -p $OUT/transformers
  timeout ${TRANSFORMERS_S:-300} python3 benchmarks/bench_transformers.py --out $OUT/transformers \
    --deadline-s ${TRANSFORMERS_DEADLINE_S:-230} ${TRANSFORMERS_ARGS:-} >>$LOG 2>&1; echo "rc=$?" >>$LOG
  pack transformers
}
run_bench() {
  local b=$1
  stage $b-bench; mkdir -p $OUT/$b
  case $b in
    decode) args="benchmarks/bench_decode.py ${DECODE_ARGS:---batch 1 16 64 128 --ctx 4096 --k-rows 0}";;
    # the full B x L grid with the default config
    # fp8 e4m3 cache beside bf16, same cases, same run (goal: >= 1.8x at B=64 L=4096)
    decode_fp8) args="benchmarks/bench_decode.py --fp8 ${FP8_ARGS:---batch 16 64 128 --ctx 4096 16384}";;
    decode_grid) args="benchmarks/bench_decode.py --batch 1 16 64 128 --ctx 1024 4096 16384";;
    # the logit soft cap (Gemma2's 50) timed beside the uncapped kernel, same cases
    decode_softcap) args="benchmarks/bench_decode.py --batch 1 16 64 --ctx 4096 --soft-cap 50";;
    # Gemma4's full-attention geometry: head 512, 32 query / 4 KV heads
    decode_d512) args="benchmarks/bench_decode.py --head-size 512 --kv-heads 4 ${D512_ARGS:---batch 1 16 64 --ctx 4096 16384}";;
    prefill) args="benchmarks/bench_prefill.py ${PREFILL_ARGS:-}";;
    # Gemma4's full-attention geometry in prefill: head 512, 32 query / 4 KV heads, B=1
    prefill_d512) args="benchmarks/bench_prefill.py --head-size 512 --kv-heads 4 --batch 1 ${PREFILL_D512_ARGS:-}";;
    cache_writers|writers) args="benchmarks/bench_cache_writers.py";;
    compile_time) args="benchmarks/bench_compile_time.py";;
    # compile_piecewise (what serving uses): cold and warm starts, trace cache off and on
    compile_piecewise) args="benchmarks/bench_compile_time.py --piecewise ${PIECEWISE_ARGS:-}";;
    # the per-call checks on the eager path: us per layer, checks on / bypassed / opt-in index reads
    layer_overhead) args="benchmarks/bench_layer_overhead.py ${LAYER_OVERHEAD_ARGS:-}";;
    # diagnostics of the decode kernel: placement and block size at B=64, L=4096 (both print
    # the gather peers: the pages read with no math, 1-D and with the kernel's tile addressing)
    decode_seq) args="benchmarks/bench_decode.py --batch 64 --ctx 4096 --sequential";;
    decode_bs64) args="benchmarks/bench_decode.py --batch 64 --ctx 4096 --block-size 64";;
    # the end-to-end model's decode shape (GQA 2, interleaved V), configs side by side
    decode_model_shape|decode_e2e_shape) args="benchmarks/bench_decode.py --batch 64 --ctx 2048 --q-heads 16 --interleaved-v --k-rows 0";;
    # cp.async pipeline (stages 3) against loads to registers (stages 1: LDG + STS, sm_90 SASS)
    # at more resident warps (forced splits): is the shared-memory pipeline the decode cap?
    decode_stages) args="benchmarks/bench_decode.py --batch 64 --ctx 4096 --sweep --cfgs 16,1,3,rows3,1 16,1,3,rows3,4 16,1,1,rows3,1 16,1,1,rows3,4 16,1,1,rows3,8 16,2,1,rows3,4";;
    # keys-major decode (paged_decode.py) against the default, B x L of the Triton issue
    decode_keys) args="benchmarks/bench_decode.py --batch 1 16 64 128 --ctx 4096 --sweep --cfgs 16,1,3,rows3 16,1,3,keys3 32,1,3,keys3 16,1,4,keys3 16,1,3,keys";;
  esac
  timeout ${BENCH_S:-120} python3 $args --out $OUT/$b >>$LOG 2>&1; echo "rc=$?" >>$LOG
  pack $b
}
peer_env() {  # FlashInfer's wheels (.whl/, carried) into .site; its modules are prebuilt
  if [ ! -d .site/flashinfer ]; then
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target "$PWD/.site" .whl/*.whl >>$LOG 2>&1 \
        || echo "peers: installing .whl/*.whl failed (see the log): FlashInfer rows say why" | tee -a $LOG
    else
      echo "peers: no .whl/ carried: FlashInfer rows say why" | tee -a $LOG
    fi
  fi
  PEER_PP="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
}
run_peer() {  # run_peer <stage/part> <seconds> <bench args...>: one bench with the peers on
  local dir=$OUT/$1 secs=$2; shift 2
  mkdir -p $dir
  PYTHONPATH=$PEER_PP FLASHINFER_DISABLE_JIT=1 timeout $secs python3 "$@" --out $dir >>$LOG 2>&1
  echo "rc=$? (${dir#$OUT/}: $*)" | tee -a $LOG
  cat $dir/*.md >> $OUT/tables.md 2>/dev/null
}
run_peers() {
  stage peers; peer_env
  # the B x L grid: ours, SDPA, FlashInfer (tensor and CUDA cores), and the A/B of the
  # split rule and pipeline depth at B=16 and B=128 (benchmarks/bench_decode.py CANDIDATES)
  run_peer peers/decode ${PEERS_DECODE_S:-270} benchmarks/bench_decode.py --batch 1 16 64 128 \
    --ctx 1024 4096 16384 --peers flashinfer --candidates
  # prefix prefill, B=4 x 4096 new tokens, no prefix and a 4096-token prefix: FlashInfer fa3/fa2
  run_peer peers/prefill ${PEERS_PREFILL_S:-120} benchmarks/bench_prefill.py --peers flashinfer
  # verify batches of 4 query tokens: the verify kernel vs the prefill kernel vs a decode step
  run_peer peers/verify ${PEERS_VERIFY_S:-120} benchmarks/bench_decode.py --verify 4 --batch 16 64 \
    --ctx 4096 --peers flashinfer
  pack peers
}
# STAGES picks and orders the work (default: everything, tests first).
for st in ${STAGES:-tests model_step decode prefill cache_writers}; do
  case $st in
    tests) run_tests;;
    model_step|e2e) run_model_step;;
    transformers) run_transformers;;
    memcheck) run_memcheck;;
    native_build) stage native_build
      timeout ${BUILD_S:-300} python3 -m inductor_rocm_attn build-native --quiet >>$LOG 2>&1; echo "rc=$?" >>$LOG
      python3 -m inductor_rocm_attn info >>$LOG 2>&1;;
    peers) run_peers;;
    # native (csrc) decode vs Triton vs SDPA over the B x L grid, native vs Triton writer
    native) stage native; mkdir -p $OUT/native
      timeout ${NATIVE_S:-200} python3 benchmarks/bench_native.py --out $OUT/native ${NATIVE_ARGS:-} >>$LOG 2>&1; echo "rc=$?" >>$LOG
      pack native;;
    # the native writer's launch variants (scatter / tile8 / tile16 / tile32) against Triton's
    native_writers) stage native_writers; mkdir -p $OUT/native_writers
      timeout ${NATIVE_S:-200} python3 benchmarks/bench_native.py --out $OUT/native_writers --writer-variants \
        ${WRITER_ARGS:-} >>$LOG 2>&1; echo "rc=$?" >>$LOG
      pack native_writers;;
    # the split-rule A/B alone (B=16 and 128, every L), with FlashInfer where carried
    decode_ab) stage decode_ab; peer_env
      run_peer decode_ab ${BENCH_S:-200} benchmarks/bench_decode.py --batch 16 128 \
        --ctx 1024 4096 16384 --peers flashinfer --candidates; pack decode_ab;;
    # explicit FA3-style warp specialization in Gluon, each config checked and timed in its own
    # process, beside SDPA and our prefill (GLUON_ARGS: e.g. "--cfgs 128,2,1,2 64,3,1,2")
    probe_gluon) stage probe_gluon; mkdir -p $OUT/probe_gluon
      timeout ${GLUON_S:-480} python3 benchmarks/probe_prefill_gluon.py --out $OUT/probe_gluon ${GLUON_ARGS:-} \
        >>$LOG 2>&1; echo "rc=$?" >>$LOG
      pack probe_gluon;;
    verify) stage verify; peer_env
      run_peer verify ${BENCH_S:-150} benchmarks/bench_decode.py --verify 4 --batch 16 64 \
        --ctx 4096 --peers flashinfer; pack verify;;
    *) run_bench $st;;
  esac
done
stage done
grep -E "passed|failed|error|TB/s|TFLOP|rc=|===" $LOG | tail -70
# the peer stages' tables last, so that they end the output
[ -s $OUT/tables.md ] && cat $OUT/tables.md
