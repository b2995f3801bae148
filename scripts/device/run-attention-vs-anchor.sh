#!/bin/bash
# One GPU call: attention_bench between two runs of bench/anchors/attn_anchor.py (before and after it,
# so both sides see the GPU warm and cool alike; the two torch times' mean is the reference), at head
# dim 128 (8 KV heads, the anchor's default) and 64 (4 KV heads, TinyLlama's), 16K and 64K. Prints
# fwd+bwd ratios to torch's cuDNN SDPA: ours (the training run's default policy) and the bare cuDNN
# graphs; writes $W/attention-vs-anchor.json. Run with .device carried (anchors/attn_anchor.py); env
# GPU_TESTS='gtest filter' runs those gpu_test tests first; SHAPES='128x8' (head dim x KV heads) and
# LENGTHS=16384 narrow the rows; ROUNDS (default 2) is attention_bench's --rounds.
set -u
source scripts/device/session.sh
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 150 $B/tests/gpu/gpu_test --gtest_filter="$GPU_TESTS" > $W/gpu_test.log 2>&1
  stamp "gpu_test rc $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) " $W/gpu_test.log | tail -6
fi
LENGTHS=${LENGTHS:-16384,65536}
anchor() {  # head dim, kv heads, folder
  mkdir -p $3
  OUT=$3 HEAD_DIM=$1 KV_HEADS=$2 timeout 120 python3 .device/anchors/attn_anchor.py > $3/anchor.log 2>&1
  stamp "attn_anchor.py head dim $1 -> $(basename $3) rc $?"
}
for cfg in ${SHAPES:-128x8 64x4}; do
  cfg=${cfg/x/ }
  set -- $cfg
  anchor $1 $2 $W/d$1-before
  timeout 240 $B/bench/attention_bench --lengths $LENGTHS --kv-heads $2 --head-dim $1 --rounds ${ROUNDS:-2} --commit $COMMIT \
    --out $W/attention-d$1.json > $W/attention-d$1.log 2>&1
  stamp "attention_bench head dim $1 rc $?"; grep -E "ours under auto" $W/attention-d$1.log
  anchor $1 $2 $W/d$1-after
done
python3 - $W <<'PY'
import glob, json, sys
W = sys.argv[1]
summary = {"reference": "torch cuDNN SDPA fwd+bwd: the mean of attn_anchor.py before and after attention_bench",
           "rows": []}
for D, kv in ((128, 8), (64, 4)):
    if not glob.glob(f"{W}/d{D}-before"):
        continue
    try:
        ours = json.load(open(f"{W}/attention-d{D}.json"))
        anchors = [json.load(open(glob.glob(f"{W}/d{D}-{t}/*.json")[0])) for t in ("before", "after")]
    except (OSError, IndexError, ValueError) as e:
        print(f"head dim {D}: a result is missing or unreadable: {e}")
        continue
    for row in ours["rows"]:
        key = f"cudnn_hkv{kv}_S{row['S']}"
        torch_ms = [a[key]["fwdbwd_ms"] for a in anchors]
        mean = sum(torch_ms) / 2
        r = {"head_dim": D, "kv_heads": kv, "S": row["S"], "torch_cudnn_fwdbwd_ms": torch_ms,
             "ours_fwdbwd_ms": row["ours"]["fwdbwd_ms"], "ours_rounds": row["ours"]["fwdbwd_round_ms"],
             "cudnn_only_fwdbwd_ms": row["ours_cudnn_only"]["fwdbwd_ms"],
             "ratio_ours": round(mean / row["ours"]["fwdbwd_ms"], 3),
             "ratio_cudnn_only": round(mean / row["ours_cudnn_only"]["fwdbwd_ms"], 3),
             "ours_choices": [f"{c['shape']} -> {c['kernel']}" for c in row["ours"]["auto_choices"]]}
        summary["rows"].append(r)
        print(f"head dim {D} S={row['S']}: torch {torch_ms} ms, ours {r['ours_fwdbwd_ms']} ms {r['ours_rounds']} "
              f"-> {r['ratio_ours']}x; cuDNN-only {r['cudnn_only_fwdbwd_ms']} -> {r['ratio_cudnn_only']}x")
json.dump(summary, open(f"{W}/attention-vs-anchor.json", "w"), indent=1)
PY
