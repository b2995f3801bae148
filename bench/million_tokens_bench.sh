#!/bin/bash
# The memory-frontier measurements of issue 18 on one H200, as one GPU call (scripts/device/): the GPU
# tests of tiling and offload, the longest lengths by plan for every policy and offload, the step speed
# of each policy with and without offload (and auto) at 64K and 128K, then one step at 512K under
# remat_aware without offload (past the 384K measured before), all with the plan beside the measured
# peak. Run in the repository root on the GPU machine with .device (devroot + bin.tar.xz from
# `PROGRAMS="bench/llama_bench tests/gpu/gpu_test tools/longtrain/longtrain" scripts/device/pack-build.sh`)
# carried; everything comes back in $OUT/all.tar.gz. STAGES picks stages (default "tests longest speed";
# expected ~6 minutes); run STAGES=512k as a second call (~4-5 minutes).
#
# Step times to expect (from bench/results/llama-h200-2026-11-30.json, attention growing as S²): 4.3 s
# at 64K and ~12 s at 128K under remat_aware; ~220 s at 512K; ~15 min at 1M (remat_aware) and ~18 min
# under full, which is past one call's 10 minutes: 1M and 2M are shown by plan here (--longest) and
# need a longer call to train.
set -u
source scripts/device/session.sh
B=build-carry
COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STAGES=${STAGES:-tests longest speed}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $W/gpu.txt 2>&1
grep -E "MemTotal|MemAvailable" /proc/meminfo > $W/meminfo.txt
stamp start
for stage in $STAGES; do
  case $stage in
    tests)
      timeout 120 $B/tests/gpu/gpu_test --gtest_filter='GpuModel.*:MemoryPlan*' --gtest_print_time=1 \
        --gtest_output=json:$W/gpu_test.json > $W/gpu_test.log 2>&1
      stamp "gpu_test rc $?"; grep -E "offloaded vs kept|tiled \+ offloaded|FAILED|PASSED" $W/gpu_test.log | tail -12 ;;
    longest)
      # By plan against this GPU's free memory and this host's MemAvailable (the check train makes).
      timeout 60 $B/bench/llama_bench --longest --policies none,remat_aware,full --offload none,checkpoints \
        --out $W/longest.json --commit $COMMIT > $W/longest.log 2>&1
      stamp "longest rc $?"; grep "longest by plan" $W/longest.log
      timeout 60 $B/bench/llama_bench --longest --shape llama3.2-3b --policies remat_aware,full \
        --offload none,checkpoints --out $W/longest-3b.json --commit $COMMIT > $W/longest-3b.log 2>&1
      stamp "longest 3B rc $?"; grep "longest by plan" $W/longest-3b.log
      timeout 60 $B/bench/llama_bench --plan-only --lengths 1048576,2097152 --policies auto > $W/plan-1m-2m.log 2>&1
      stamp "plans 1M 2M rc $?"; grep -E "^memory:|total|host \(pinned\)" $W/plan-1m-2m.log ;;
    speed)
      # Offload's cost and auto against the fixed policies (issue: offload <= 5%, auto as fast as the best).
      timeout 420 $B/bench/llama_bench --lengths 65536,131072 --policies remat_aware,full,auto \
        --offload none,checkpoints --warmup 1 --steps 2 --out $W/speed.json --commit $COMMIT > $W/speed.log 2>&1
      stamp "speed rc $?"; grep -E "^S=" $W/speed.log | tail -12 ;;
    512k)
      timeout 420 $B/bench/llama_bench --lengths 524288 --policies remat_aware --offload none --warmup 0 --steps 1 \
        --out $W/512k.json --commit $COMMIT > $W/512k.log 2>&1
      stamp "512k rc $?"; grep -E "^S=" $W/512k.log | tail -3 ;;
    *) stamp "unknown stage $stage" ;;
  esac
done
stamp end
