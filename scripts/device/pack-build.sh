#!/usr/bin/env bash
# Packs the GPU programs of a CUDA build made on this (dev) machine into .device/run/bin.tar.xz, so a
# lent GPU machine with the same CUDA 13.0 / cuDNN 9.19 / NCCL 2.28 runs them without building
# (saving its build minutes). Binaries are stripped; paths inside the archive keep the build folder,
# because tests have the paths of their helper programs and fixtures compiled in
# (scripts/device/unpack-build.sh unpacks the archive and links this checkout's path to the one there).
# Usage: scripts/device/pack-build.sh [BUILD_DIR]   (default build-carry, configured with
#   -DLONGTRAIN_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-carry}
# PROGRAMS (space-separated, relative to BUILD_DIR) overrides the list, e.g. for a one-GPU run.
if [ -n "${PROGRAMS:-}" ]; then
  read -r -a programs <<< "$PROGRAMS"
else
  programs=(
    bench/llama_bench bench/attention_bench bench/cp_bench bench/comm_bench
    tests/gpu/gpu_test tests/gpu/ulysses_gpu_test tests/trainer/train_test
    tests/gpu/distributed_attention_gpu_test tests/gpu/distributed_attention_gpu_worker
    tests/parallel/parallel_nccl_test tests/parallel/parallel_nccl_worker
    tools/longtrain/longtrain tools/longtrain-run/longtrain-run
  )
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for p in "${programs[@]}"; do
  [ -x "$build/$p" ] || { echo "pack-build: $build/$p is missing: build it first" >&2; exit 1; }
  mkdir -p "$stage/$build/$(dirname "$p")"
  strip -o "$stage/$build/$p" "$build/$p"
done
mkdir -p .device/run
tar -C "$stage" -cJf .device/run/bin.tar.xz "$build"
ls -la .device/run/bin.tar.xz
