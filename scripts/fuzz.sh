#!/usr/bin/env bash
# Fuzzes every parser of outside input with libFuzzer, ASan and UBSan (clang from Debian): builds the
# targets of tests/fuzz and runs each for LONGTRAIN_FUZZ_SECONDS (default 20) over its committed seed
# corpus (tests/fuzz/corpus/TARGET). Any crash, leak, undefined behaviour or exception other than
# longtrain's own error fails the run; the reproducer is left in BUILD_DIR/findings/TARGET.
# Prints executions per second and coverage per target.
# Usage: scripts/fuzz.sh [BUILD_DIR] [TARGET ...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-fuzz}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config safetensors hf_config shards store launcher_args megatron hf_tokenizer)
seconds=${LONGTRAIN_FUZZ_SECONDS:-20}

if ! command -v clang++ >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "fuzz: installing clang and its sanitizer runtimes"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-dev ||
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev
fi

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DLONGTRAIN_CUDA=OFF -DLONGTRAIN_BUILD_TESTS=OFF -DLONGTRAIN_FUZZ=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"

failed=0
for t in "${targets[@]}"; do
  corpus=tests/fuzz/corpus/$t
  [ -d "$corpus" ] || { echo "fuzz: $corpus is missing (every target has a committed seed corpus)"; exit 1; }
  work="$build/corpus/$t"        # grows during the run; the committed seeds stay as they are
  findings="$build/findings/$t"
  mkdir -p "$work" "$findings"
  log="$build/fuzz_$t.log"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$findings/" "$work" "$corpus" >"$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
    echo "fuzz $t: ok, $execs runs in ${seconds} s ($speed exec/s), coverage $cov edges"
  else
    echo "fuzz $t: FAILED (reproducer in $findings/; log $log):"
    tail -40 "$log"
    failed=1
  fi
done
exit $failed
