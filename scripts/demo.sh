#!/usr/bin/env bash
# The README's demo command: installs what is missing, builds, fetches the demo corpus (Jane Austen's
# novels from Debian's archive), trains a 4096-piece tokenizer, prepares the token shards, trains
# configs/tiny.yaml on the CPU (or resumes it, if a run was interrupted), evaluates the last
# checkpoint against the unigram baseline and prints a generated sample.
# Usage: scripts/demo.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}

scripts/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${LONGTRAIN_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc)" --target longtrain
longtrain="$build/tools/longtrain/longtrain"

scripts/fetch-corpus.sh --longtrain "$longtrain"
if [ ! -f data-cache/austen-4k.model ]; then
  "$longtrain" tokenizer train --input data-cache/janeausten --vocab-size 4096 --output data-cache/austen-4k
fi
if [ ! -f data-cache/austen-shards/manifest.json ]; then
  # One novel of six is held out for validation.
  "$longtrain" prepare --tokenizer data-cache/austen-4k.model --input data-cache/janeausten \
    --output data-cache/austen-shards --val-fraction 0.15
fi

"$longtrain" train configs/tiny.yaml --resume auto
last=$(ls -d runs/tiny/checkpoints/step_* | sort -t_ -k2 -n | tail -n1)
"$longtrain" eval --checkpoint "$last"
echo
echo "Sample from $last:"
"$longtrain" generate --checkpoint "$last" --prompt "It is a truth universally acknowledged" --max-new-tokens 80 --seed 1
