#!/bin/bash
# One GPU call for [gpu-speed]: the GPU tests, then attention at head dim 64 (TinyLlama's shape: 32
# query heads, 4 KV heads) beside bench/anchors/attn_anchor.py in the same run, and the 1.1B step at
# 64K. Run with .device carried (anchors/attn_anchor.py); everything comes back in $OUT/all.tar.gz.
set -u
source scripts/device/session.sh
timeout 200 $B/tests/gpu/gpu_test --gtest_print_time=1 --gtest_output=json:$W/gpu_test.json > $W/gpu_test.log 2>&1
stamp "gpu_test rc $?"; grep -E "FAILED|PASSED" $W/gpu_test.log | tail -8
grep -q FAILED $W/gpu_test.log && exit 1
OUT=$W HEAD_DIM=64 KV_HEADS=4 timeout 150 python3 .device/anchors/attn_anchor.py > $W/attn_anchor.log 2>&1
stamp "attn anchor rc $?"; [ -f $W/attn_anchor_h32_d64.json ] && cp $W/attn_anchor_h32_d64.json $W/attn_anchor.json
tail -c 400 $W/attn_anchor.log
timeout 150 $B/bench/attention_bench --lengths 16384,65536 --kv-heads 4 --head-dim 64 --commit $COMMIT \
  $( [ -f $W/attn_anchor.json ] && echo --anchor $W/attn_anchor.json ) --out $W/attention.json > $W/attention.log 2>&1
stamp "attention_bench rc $?"; grep -E "S=|ratio" $W/attention.log | tail -6
timeout 120 $B/bench/llama_bench --lengths 65536 --policies remat_aware --warmup 1 --steps 3 --commit $COMMIT \
  --out $W/llama.json > $W/llama.log 2>&1
stamp "llama_bench rc $?"; grep -E "S=" $W/llama.log | tail -2
