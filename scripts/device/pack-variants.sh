#!/usr/bin/env bash
# Packs the attention programs of several commits (kernel variants under trial: a branch against main,
# or two branches against it) for scripts/device/run-variants-ab.sh, which tests and times them against
# each other in one GPU call. Variants that differ at compile time (register splits, unrolling, tile
# shapes) cannot be switched by an environment variable in one binary; this builds each.
# Every ref is built in one git worktree and build folder (build-variants/, ignored; the first build
# is a full one, later refs rebuild what they change), stripped and packed as
# .device/variants/<n>-<ref>-<sha>.tar.xz, and .device/variants/list names them in order: the first
# is the baseline the others are compared with.
# Usage: scripts/device/pack-variants.sh main regs-split other-branch
# PROGRAMS (paths in the build folder) overrides bench/attention_bench tests/gpu/gpu_test. The
# worktree's path is compiled into tests that read fixtures; the attention tests read none.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
[ $# -ge 2 ] || { echo "pack-variants: give two or more commits or branches (the first is the baseline)" >&2; exit 2; }
read -r -a programs <<< "${PROGRAMS:-bench/attention_bench tests/gpu/gpu_test}"
shas=()
for ref in "$@"; do
  sha=$(git rev-parse --verify --quiet --short "$ref^{commit}") ||
    { echo "pack-variants: '$ref' names no commit here" >&2; exit 2; }
  shas+=("$sha")
done
wt=$root/build-variants/src
bd=$root/build-variants/build
# (A worktree folder deleted by hand stays registered until pruned.)
[ -d "$wt" ] || { git worktree prune && git worktree add --detach "$wt" "${shas[0]}" > /dev/null; }
out=$root/.device/variants
rm -rf "$out.new" && mkdir -p "$out.new"
i=0
for ref in "$@"; do
  sha=${shas[$i]}
  git -C "$wt" checkout -q --detach "$sha"
  if [ ! -f "$bd/build.ninja" ]; then
    cmake -S "$wt" -B "$bd" -G Ninja -DLONGTRAIN_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
      > "$root/build-variants/cmake.log" ||
      { echo "pack-variants: cmake failed (build-variants/cmake.log)" >&2; exit 1; }
  fi
  echo "pack-variants: building $ref ($sha)"
  ninja -C "$bd" "${programs[@]}" > "$root/build-variants/ninja-$sha.log" 2>&1 ||
    { echo "pack-variants: the build of $ref failed (build-variants/ninja-$sha.log)" >&2; tail -20 "$root/build-variants/ninja-$sha.log" >&2; exit 1; }
  label=$i-$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' '_')-$sha
  stage=$(mktemp -d)
  for p in "${programs[@]}"; do strip -o "$stage/$(basename "$p")" "$bd/$p"; done
  tar -C "$stage" -cJf "$out.new/$label.tar.xz" .
  rm -rf "$stage"
  echo "$label" >> "$out.new/list"
  i=$((i + 1))
done
# Replace the previous set only once every variant is packed.
rm -rf "$out" && mv "$out.new" "$out"
ls -la "$out"
