#!/bin/bash
# One GPU call for data.document_mask (scripts/device/): the GPU tests (segmented cuDNN attention
# against the CPU, the model with packed documents at P = 1), then bench/anchors/docmask_anchor.py
# (flex_attention, torch.compile'd) and docmask_bench on the same windows, then llama_bench at the
# 1.1B shape with and without the anchor's documents. Run in the repository root on the GPU machine
# with .device carried (devroot, bin.tar.xz, anchors/docmask_anchor.py); everything comes back in
# $OUT/all.tar.gz.
set -u
source scripts/device/session.sh
stamp start
B=build-carry
timeout ${GPU_TEST_TIMEOUT:-200} $B/tests/gpu/gpu_test --gtest_filter="${GPU_TEST_FILTER:-*}" --gtest_print_time=1 \
  --gtest_output=json:$W/gpu_test.json > $W/gpu_test.log 2>&1
stamp "gpu_test rc $?"; grep -E "FAILED|PASSED|SKIPPED \]" $W/gpu_test.log | tail -25
if grep -q "FAILED" $W/gpu_test.log; then
  CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=$W/cudnn.log timeout 60 $B/tests/gpu/gpu_test --gtest_filter='Documents/GpuSegments.*' \
    > $W/gpu_segments_dbg.log 2>&1
  stamp "segments with cuDNN log rc $?"; gzip -f $W/cudnn.log 2>/dev/null
  exit 1  # no benchmark of a path that fails its tests
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=$W timeout 240 python3 .device/anchors/docmask_anchor.py ${DOC_LENGTHS:-65536 131072} > $W/anchor.log 2>&1
stamp "docmask anchor rc $?"; tail -4 $W/anchor.log | cut -c1-400
COMMIT=$(cat .device/commit 2>/dev/null || echo unknown)
timeout 120 $B/bench/docmask_bench --anchor $W/docmask_anchor.json --out $W/docmask.json --commit $COMMIT > $W/docmask_bench.log 2>&1
stamp "docmask_bench rc $?"; cat $W/docmask_bench.log | tail -6
for mode in plain documents; do
  extra=""; [ $mode = documents ] && extra="--documents $W/docmask_anchor.json"
  timeout 200 $B/bench/llama_bench --lengths ${LLAMA_LENGTHS:-65536,131072} --policies remat_aware --warmup 1 --steps 3 --commit $COMMIT \
    --out $W/llama-$mode.json $extra > $W/llama-$mode.log 2>&1
  stamp "llama_bench $mode rc $?"; grep -E "tok/s|tok_per_s|S=" $W/llama-$mode.log | tail -4
done
stamp end
