#!/bin/bash
# One GPU call for [gpu-speed]: the GPU tests (skipped with SKIP_TESTS=1), then the 1.1B step at each
# LENGTH:POLICIES item (default 8192:none,remat_aware) with a per-op profile, beside
# bench/anchors/compiled_llama_anchor.py (each policy against its PyTorch twin) in the same call, and
# the ratios merged into one result. Run with .device carried (devroot, run/bin.tar.xz, commit,
# anchors/compiled_llama_anchor.py); everything comes back in $OUT/all.tar.gz.
#   scripts/device/run-step-vs-compiled.sh 8192:none,remat_aware
#   SKIP_TESTS=1 SHAPE=3b scripts/device/run-step-vs-compiled.sh 32768:none,remat_aware,full
# KERNELS (default auto, the trainer's attention.kernel default) lists attention kernel policies
# (LONGTRAIN_ATTENTION_KERNEL: cudnn, hopper, auto): our step runs once per policy, each merged with the
# same anchor run. GEMM (default auto, the trainer's train.gemm_algorithm default; or heuristic) is
# LONGTRAIN_GEMM_ALGO for every step. GRAPHS (default off; on, or off,on for both in one process) is
# llama_bench's --cuda-graphs.
set -u
source scripts/device/session.sh
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 $B/tests/gpu/gpu_test --gtest_print_time=1 --gtest_output=json:$W/gpu_test.json > $W/gpu_test.log 2>&1
  stamp "gpu_test rc $?"; grep -E "FAILED|PASSED|SKIPPED \]" $W/gpu_test.log | tail -12
  timeout 60 $B/tests/gpu/ulysses_gpu_test > $W/ulysses_gpu_test.log 2>&1
  stamp "ulysses_gpu_test rc $?"; grep -E "FAILED|PASSED" $W/ulysses_gpu_test.log | tail -3
  # The trainer's own GPU test (train.cuda_graphs against eager training); train_test's other tests are CPU ones.
  if [ -x $B/tests/trainer/train_test ]; then
    timeout 120 $B/tests/trainer/train_test --gtest_filter='*OnTheGpu*' > $W/train_gpu_test.log 2>&1
    stamp "train_test (GPU) rc $?"; grep -E "FAILED|PASSED|SKIPPED|graphs:" $W/train_gpu_test.log | tail -4
    grep -q FAILED $W/train_gpu_test.log && exit 1
  fi
  grep -q FAILED $W/gpu_test.log && exit 1
fi
# SHAPE=3b: the Llama-3.2-3B shape on both sides (the anchor with our vocabulary, 128256).
SHAPE=${SHAPE:-1b}
if [ "$SHAPE" = 3b ]; then BSHAPE=llama3.2-3b; export VOCAB=128256; else BSHAPE=tinyllama; fi
KERNELS=${KERNELS:-auto}
export LONGTRAIN_GEMM_ALGO=${GEMM:-auto}
for item in "${@:-8192:none,remat_aware}"; do
  S=${item%%:*}; P=${item#*:}; N=$SHAPE-$S
  for K in $KERNELS; do
    LONGTRAIN_ATTENTION_KERNEL=$K timeout 200 $B/bench/llama_bench --shape $BSHAPE --lengths $S --policies $P \
      --warmup 1 --steps 3 --profile --cuda-graphs ${GRAPHS:-off} --commit $COMMIT --out $W/ours-$K-$N.json \
      > $W/ours-$K-$N.log 2>&1
    stamp "llama_bench $SHAPE $item kernel $K rc $?"; grep -E "^S=|tok/s|attention kernel" $W/ours-$K-$N.log | tail -8
  done
  OUT=$W SHAPE=$SHAPE timeout 300 python3 .device/anchors/compiled_llama_anchor.py $item > $W/anchor-$N.log 2>&1
  stamp "compiled anchor $SHAPE $item rc $?"; grep -E "^$S:" $W/anchor-$N.log
  [ -f $W/compiled_llama_anchor_$SHAPE.json ] && mv $W/compiled_llama_anchor_$SHAPE.json $W/compiled-$N.json
  for K in $KERNELS; do
    [ -f $W/compiled-$N.json ] && $B/bench/llama_bench --merge $W/ours-$K-$N.json --anchor $W/compiled-$N.json \
      --out $W/merged-$K-$N.json > $W/merge-$K-$N.log 2>&1
    stamp "merge $K $N rc $?"; cat $W/merge-$K-$N.log
  done
done
