#!/usr/bin/env bash
# The README's test command: installs what is missing, builds (CPU, or CPU+CUDA where the CUDA stack
# is found) and runs the whole ctest suite. GPU tests skip themselves without a GPU.
# Usage: scripts/test.sh [BUILD_DIR] [extra ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
scripts/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${LONGTRAIN_CMAKE_ARGS:-}
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"
