#!/usr/bin/env bash
# The context-extension workflow on the CPU, on the demo's own checkpoint (README, "Extending the
# context"): export the 256-token demo model as a plain Hugging Face directory, measure loss by
# position at 2048 tokens and passkey retrieval, extend it with yarn (configs/tiny-extend-2048.yaml:
# init_from the directory, factor 8, a few minutes of training at 2048), and measure both again.
# Run scripts/demo.sh first (it trains runs/tiny to step 300 and prepares the data); the newest
# checkpoint of runs/tiny is the one extended.
# Usage: scripts/extend-demo.sh [BUILD_DIR]      (results in runs/tiny-extend-report/)
# EXTEND_LAUNCH (e.g. "build/tools/longtrain-run/longtrain-run --nproc-per-node 8 --") and
# EXTEND_SETS (e.g. "--set train.batch_size=1 --set parallel.sp_size=4 --set train.threads=2") run the
# training step over several CPU processes: data and sequence parallelism compute the same training
# as one process up to the order of sums (distributed_train_test), on more cores than one process
# of this small model keeps busy.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
longtrain=${LONGTRAIN_BIN:-$build/tools/longtrain/longtrain}
demo=$(ls -d runs/tiny/checkpoints/step_* 2>/dev/null | sort -t_ -k2 -n | tail -n1)
[ -n "$demo" ] && [ -f "$demo/model.safetensors" ] || { echo "extend-demo: runs/tiny has no checkpoint: run scripts/demo.sh first" >&2; exit 1; }
echo "extend-demo: starting from $demo"
report=runs/tiny-extend-report
mkdir -p "$report"

# 1. Export: a checkpoint is a Hugging Face directory already (config.json, model.safetensors); the
#    copy without longtrain's MANIFEST.json is what any HF Llama looks like.
rm -rf runs/tiny-hf && mkdir -p runs/tiny-hf
cp "$demo/config.json" "$demo/model.safetensors" "$demo/tokenizer.model" runs/tiny-hf/

passkey=(--passkey --lengths 256,1024,2048 --depths 0,0.5,1 --trials 5 --seed 1)
loss=(--data data-cache/austen-shards --seq-len 2048 --buckets 8 --batches 20)
# 2. Before: the 256-token model at 2048 tokens (plain RoPE, extrapolating).
"$longtrain" eval --checkpoint runs/tiny-hf "${loss[@]}" --json "$report/before.json" | tee "$report/before.txt"
"$longtrain" eval --checkpoint runs/tiny-hf "${passkey[@]}" --out "$report/passkey-before" | tee "$report/passkey-before.txt"

# 3. Extend: init_from the directory with yarn, train at 2048 tokens.
rm -rf runs/tiny-extend-2048
${EXTEND_LAUNCH:-} "$longtrain" train configs/tiny-extend-2048.yaml ${EXTEND_SETS:-}
after=$(ls -d runs/tiny-extend-2048/checkpoints/step_* | sort -t_ -k2 -n | tail -n1)

# 4. After.
"$longtrain" eval --checkpoint "$after" "${loss[@]}" --json "$report/after.json" | tee "$report/after.txt"
"$longtrain" eval --checkpoint "$after" "${passkey[@]}" --out "$report/passkey-after" | tee "$report/passkey-after.txt"

# 5. Side by side: loss per 256-position bucket, before and after.
echo
echo "loss by position at 2048 tokens (validation, 20 windows): before -> after"
paste <(grep -o '"loss": [0-9.]*' "$report/before.json" | tail -n +2 | cut -d' ' -f2) \
      <(grep -o '"loss": [0-9.]*' "$report/after.json" | tail -n +2 | cut -d' ' -f2) |
  awk '{ printf "  positions %4d-%-4d  %.4f -> %.4f\n", (NR-1)*256, NR*256-1, $1, $2 }'
echo "overall: $(grep -o '"loss": [0-9.]*' "$report/before.json" | head -1 | cut -d' ' -f2) -> $(grep -o '"loss": [0-9.]*' "$report/after.json" | head -1 | cut -d' ' -f2)"
