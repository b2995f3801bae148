#!/bin/bash
# One GPU call for [hopper-attention]: our sm_90a attention kernels' GPU tests first (each in its own
# process with a timeout: a kernel fault poisons the CUDA context of the process it happens in), the
# rest of gpu_test under the default policy, the attention and model tests again with every block
# call on our kernels (LONGTRAIN_ATTENTION_KERNEL=hopper), then attention_bench beside
# bench/anchors/attn_anchor.py (torch's cuDNN SDPA) at head dim 64 (32/4 heads) and 128 (32/8).
# Run with .device carried (devroot, run/bin.tar.xz, commit, anchors/); everything comes back in
# $OUT/all.tar.gz. STAGES picks what runs (default "tests bench"; also "dram" and "ab", below); KERNELS, LENGTHS and SHAPES override
# the bench's --kernel list (default: cuDNN and every forward variant), --lengths (16384,65536) and
# head dims (default "64:4 128:8", head dim:kv heads).
# Stage "dram" profiles our kernels' DRAM traffic with Nsight Compute (ncu, locked clocks): for each
# item of AB_ENV (or the defaults when unset), the forward (twice) and the backward per head dim at the
# first of LENGTHS: bytes read and written, L2 hit rate, duration (what the launch order was measured
# by: bench/results/attention-hopper-launch-order-h100-2026-12-06.json).
# Stage "ab" compares settings of an environment switch in one call (a variant under trial on a
# branch, say): for each item of AB_ENV (space-separated VAR=value) the backward tests under it, then
# our backward timed under each item at SHAPES and LENGTHS, e.g.
#   STAGES=ab AB_ENV="LONGTRAIN_HOPPER_BWD_DQ=red LONGTRAIN_HOPPER_BWD_DQ=bulk" LENGTHS=8192,16384,65536
set -u
source scripts/device/session.sh
STAGES=${STAGES:-tests bench}
HOPPER_TESTS='*Hopper*:ScheduleBlocksInSequence.*:KernelChoiceAuto.*'
for stage in $STAGES; do
  case $stage in
    tests)
      timeout 300 $B/tests/gpu/gpu_test --gtest_filter="$HOPPER_TESTS" --gtest_output=json:$W/hopper_tests.json \
        > $W/hopper_tests.log 2>&1
      stamp "hopper tests rc $?"; grep -E "^\[  (FAILED|PASSED) |tests ran" $W/hopper_tests.log | tail -30
      timeout 200 $B/tests/gpu/gpu_test --gtest_filter="-$HOPPER_TESTS" > $W/gpu_rest.log 2>&1
      stamp "gpu_test (the rest) rc $?"; grep -E "^\[  (FAILED|PASSED) |tests ran" $W/gpu_rest.log | tail -12
      LONGTRAIN_ATTENTION_KERNEL=hopper timeout 150 $B/tests/gpu/gpu_test \
        --gtest_filter='GpuAttention*:GpuModel.*:*Schedule*:MemoryPlan*' > $W/gpu_hopper_policy.log 2>&1
      stamp "gpu_test under the hopper policy rc $?"; grep -E "^\[  (FAILED|PASSED) |tests ran" $W/gpu_hopper_policy.log | tail -12
      if [ -x $B/tests/gpu/ulysses_gpu_test ]; then
        timeout 60 $B/tests/gpu/ulysses_gpu_test > $W/ulysses_gpu_test.log 2>&1
        stamp "ulysses_gpu_test rc $?"; grep -E "^\[  (FAILED|PASSED) " $W/ulysses_gpu_test.log | tail -3
      fi
      ;;
    bench)
      for shape in ${SHAPES:-64:4 128:8}; do
        D=${shape%%:*}; KV=${shape#*:}
        OUT=$W HEAD_DIM=$D KV_HEADS=$KV timeout 150 python3 .device/anchors/attn_anchor.py > $W/attn_anchor_d$D.log 2>&1
        stamp "attn anchor d$D rc $?"; tail -c 300 $W/attn_anchor_d$D.log
        anchor=$W/attn_anchor_h32_d$D.json; [ $D = 128 ] && anchor=$W/attn_anchor.json  # the anchor's own names
        # Every forward variant (each with our backward, which is also timed alone), beside cuDNN with
        # the largest differences from it.
        kernels=${KERNELS:-cudnn,hopper-overlap,hopper-baseline}
        timeout 240 $B/bench/attention_bench --kernel $kernels --lengths ${LENGTHS:-16384,65536} --head-dim $D --kv-heads $KV \
          --reps 5 --commit $COMMIT $( [ -f $anchor ] && echo --anchor $anchor ) --out $W/attention_d$D.json \
          > $W/attention_d$D.log 2>&1
        stamp "attention_bench d$D rc $?"; grep -vE "^\s*$" $W/attention_d$D.log | tail -16
      done
      ;;
    dram)
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
      [ -n "$NCU" ] || { stamp "dram: no ncu on this machine"; continue; }
      for shape in ${SHAPES:-64:4 128:8}; do
        D=${shape%%:*}; KV=${shape#*:}; L=${LENGTHS:-65536}; L=${L%%,*}
        for setting in ${AB_ENV:-LONGTRAIN_HOPPER_DEFAULTS=1}; do
          tag=${setting//[^A-Za-z0-9_.-]/_}
          env "$setting" timeout 150 $NCU --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
            -k regex:'fwd_overlap|bwd_kernel' -c 3 --csv --page details \
            $B/bench/attention_bench --kernel hopper-overlap --lengths $L --head-dim $D --kv-heads $KV --reps 1 --warmup 0 \
            > "$W/dram_d${D}_$tag.csv" 2> "$W/dram_d${D}_$tag.err"
          stamp "ncu d$D S$L under $setting rc $?"
          grep -E "dram__bytes|hit_rate|gpu__time" "$W/dram_d${D}_$tag.csv" | awk -F'","' '{print $(NF-3), $(NF-1), $NF}'
        done
      done
      ;;
    ab)
      for setting in ${AB_ENV:?stage ab needs AB_ENV}; do
        tag=${setting//[^A-Za-z0-9_.-]/_}
        env "$setting" timeout 120 $B/tests/gpu/gpu_test --gtest_filter='*HopperAttentionBackward*' \
          > "$W/ab_tests_$tag.log" 2>&1
        stamp "backward tests under $setting rc $?"; grep -E "^\[  (FAILED|PASSED) " "$W/ab_tests_$tag.log" | tail -8
      done
      for shape in ${SHAPES:-64:4 128:8}; do
        D=${shape%%:*}; KV=${shape#*:}
        for setting in $AB_ENV; do
          tag=${setting//[^A-Za-z0-9_.-]/_}
          env "$setting" timeout 120 $B/bench/attention_bench --kernel hopper-overlap --lengths ${LENGTHS:-16384,65536} \
            --head-dim $D --kv-heads $KV --reps 3 --commit $COMMIT --out "$W/ab_d${D}_$tag.json" \
            > "$W/ab_d${D}_$tag.log" 2>&1
          stamp "attention_bench d$D under $setting rc $?"; grep -E "hopper backward" "$W/ab_d${D}_$tag.log"
        done
      done
      ;;
  esac
done
stamp end
