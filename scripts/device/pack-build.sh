#!/usr/bin/env bash
# Packs the GPU programs of a CUDA build made on this (dev) machine into .device/run/bin.tar.xz, so a
# lent GPU machine with the same CUDA 13.0 / cuDNN 9.19 / NCCL 2.28 runs them without building
# (saving its build minutes). Binaries are stripped; paths inside the archive keep the build folder,
# because tests have the paths of their helper programs compiled in (see .device/run/common.sh,
# which unpacks the archive and links /work/main to the checkout there).
# Usage: scripts/device/pack-build.sh [BUILD_DIR]   (default build-carry, configured with
#   -DLONGTRAIN_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-carry}
programs=(
  bench/llama_bench bench/attention_bench bench/cp_bench bench/comm_bench
  tests/gpu/gpu_test tests/gpu/distributed_attention_gpu_test tests/gpu/distributed_attention_gpu_worker
  tests/parallel/parallel_nccl_test tests/parallel/parallel_nccl_worker
  tools/longtrain/longtrain tools/longtrain-run/longtrain-run
)
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
