#!/bin/bash
# One GPU call for [gpu-speed]: the GPU tests (skipped with SKIP_TESTS=1), then the 1.1B step at each
# LENGTH:POLICIES item (default 8192:none,remat_aware) with a per-op profile, beside
# bench/anchors/compiled_llama_anchor.py (each policy against its PyTorch twin) in the same call, and
# the ratios merged into one result. Run with .device carried (devroot, run/bin.tar.xz, commit,
# anchors/compiled_llama_anchor.py); everything comes back in $OUT/all.tar.gz.
#   scripts/device/run-step-vs-compiled.sh 8192:none,remat_aware
#   SKIP_TESTS=1 SHAPE=3b scripts/device/run-step-vs-compiled.sh 32768:none,remat_aware,full
set -u
source scripts/device/session.sh
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 $B/tests/gpu/gpu_test --gtest_print_time=1 --gtest_output=json:$W/gpu_test.json > $W/gpu_test.log 2>&1
  stamp "gpu_test rc $?"; grep -E "FAILED|PASSED|SKIPPED \]" $W/gpu_test.log | tail -12
  timeout 60 $B/tests/gpu/ulysses_gpu_test > $W/ulysses_gpu_test.log 2>&1
  stamp "ulysses_gpu_test rc $?"; grep -E "FAILED|PASSED" $W/ulysses_gpu_test.log | tail -3
  grep -q FAILED $W/gpu_test.log && exit 1
fi
# SHAPE=3b: the Llama-3.2-3B shape on both sides (the anchor with our vocabulary, 128256).
SHAPE=${SHAPE:-1b}
if [ "$SHAPE" = 3b ]; then BSHAPE=llama3.2-3b; export VOCAB=128256; else BSHAPE=tinyllama; fi
for item in "${@:-8192:none,remat_aware}"; do
  S=${item%%:*}; P=${item#*:}; N=$SHAPE-$S
  timeout 200 $B/bench/llama_bench --shape $BSHAPE --lengths $S --policies $P --warmup 1 --steps 3 --profile \
    --commit $COMMIT --out $W/ours-$N.json > $W/ours-$N.log 2>&1
  stamp "llama_bench $SHAPE $item rc $?"; grep -E "^S=|tok/s" $W/ours-$N.log | tail -4
  OUT=$W SHAPE=$SHAPE timeout 300 python3 .device/anchors/compiled_llama_anchor.py $item > $W/anchor-$N.log 2>&1
  stamp "compiled anchor $SHAPE $item rc $?"; grep -E "^$S:" $W/anchor-$N.log
  [ -f $W/compiled_llama_anchor_$SHAPE.json ] && mv $W/compiled_llama_anchor_$SHAPE.json $W/compiled-$N.json
  S=$N
  [ -f $W/compiled-$S.json ] && $B/bench/llama_bench --merge $W/ours-$S.json --anchor $W/compiled-$S.json \
    --out $W/merged-$S.json > $W/merge-$S.log 2>&1
  stamp "merge $S rc $?"; cat $W/merge-$S.log
done
