# Sourced first by every one-call GPU script (scripts/device/run-*.sh, bench/million_tokens_bench.sh),
# on the GPU machine in the repository root: a work folder $W whose contents come back as one archive
# ($OUT/all.tar.gz, also when a step hangs and the call ends: the device returns only a few files),
# `stamp` for a timeline with seconds since the start, the sysroot and wheels' environment
# (env.sh), the programs built here (unpack-build.sh), B (their build folder) and COMMIT.
W=$OUT/w; mkdir -p $W
trap 'cd $OUT && tar -czf all.tar.gz -C w . && rm -rf w && ls -la all.tar.gz' EXIT
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $W/timeline.txt; }
source scripts/device/env.sh
source scripts/device/unpack-build.sh || exit 1
B=build-carry; COMMIT=$(cat .device/commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $W/gpu.txt 2>&1
