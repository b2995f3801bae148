#!/bin/bash
# One GPU call for the Hopper backward's variants (issue #20): the backward GPU tests (every case under
# every BwdVariant, and against cuDNN), the tests that run the default variant through the block calls,
# then attention_bench timing each backward variant alone beside cuDNN's backward (with the largest
# dQ/dK/dV differences from it) at head dim 64 (32/4 heads) and 128 (32/8), 16K and 64K tokens, with
# torch's anchor for the fwd+bwd ratios. Each step in its own process with a timeout (a kernel fault
# or a hang poisons only that process; named-barrier waits cannot time out by themselves). Run with
# .device carried (devroot, run/bin.tar.xz, commit, anchors/); everything comes back in
# $OUT/all.tar.gz. STAGES picks what runs (default "tests bench"); the whole call stays under 10 min.
set -u
source scripts/device/session.sh
STAGES=${STAGES:-tests bench}
for stage in $STAGES; do
  case $stage in
    tests)
      timeout 200 $B/tests/gpu/gpu_test --gtest_filter='*HopperAttentionBackward*' \
        --gtest_output=json:$W/hopper_bwd_tests.json > $W/hopper_bwd_tests.log 2>&1
      stamp "hopper backward tests rc $?"; grep -E "^\[  (FAILED|PASSED) |tests ran" $W/hopper_bwd_tests.log | tail -30
      timeout 120 $B/tests/gpu/gpu_test --gtest_filter='ScheduleBlocksInSequence.*:KernelChoiceAuto.*' \
        > $W/hopper_bwd_users.log 2>&1
      stamp "schedule/auto tests rc $?"; grep -E "^\[  (FAILED|PASSED) |tests ran" $W/hopper_bwd_users.log | tail -8
      ;;
    bench)
      for shape in "64 4" "128 8"; do
        set -- $shape; D=$1; KV=$2
        OUT=$W HEAD_DIM=$D KV_HEADS=$KV timeout 100 python3 .device/anchors/attn_anchor.py > $W/attn_anchor_d$D.log 2>&1
        stamp "attn anchor d$D rc $?"; tail -c 300 $W/attn_anchor_d$D.log
        anchor=$W/attn_anchor_h32_d$D.json; [ $D = 128 ] && anchor=$W/attn_anchor.json  # the anchor's own names
        # alternate-mufu differs from alternate only at head dim 64
        kernels=cudnn,hopper-bwd-alternate,hopper-bwd-alternate-red,hopper-bwd-baseline
        [ $D = 64 ] && kernels=$kernels,hopper-bwd-alternate-mufu
        timeout 150 $B/bench/attention_bench --kernel $kernels --lengths 16384,65536 --head-dim $D --kv-heads $KV \
          --reps 5 --commit $COMMIT $( [ -f $anchor ] && echo --anchor $anchor ) --out $W/attention_bwd_d$D.json \
          > $W/attention_bwd_d$D.log 2>&1
        stamp "attention_bench (backward variants) d$D rc $?"
        grep -E "hopper backward|vs cuDNN backward|bwd .*x cuDNN-only|ours fwd" $W/attention_bwd_d$D.log | tail -24
      done
      ;;
  esac
done
stamp end
