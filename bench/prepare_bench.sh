#!/usr/bin/env bash
# Benchmark (not a test): `longtrain prepare` throughput, in MB of input text per second, over the
# demo corpus (Jane Austen's six novels, 4.0 MB), with 1 and 2 tokenizer threads (the CI machine
# has 2 cores). Fetches the corpus and trains its tokenizer when missing, runs each setting
# REPEATS times and writes bench/results/prepare-<commit>.json with the machine, the commit, the
# commands and every run's MB/s (best and median are what to compare).
#
# Usage: bench/prepare_bench.sh [BUILD_DIR] [REPEATS]     (defaults: build, 3)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-build}"
repeats="${2:-3}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
longtrain="$build/tools/longtrain/longtrain"
[ -x "$longtrain" ] || { echo "prepare_bench: build longtrain first ($longtrain not found)" >&2; exit 1; }

"$root/scripts/fetch-corpus.sh" --longtrain "$longtrain" >/dev/null
corpus="$root/data-cache/janeausten"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$longtrain" tokenizer train --input "$corpus" --vocab-size 4096 --output "$work/austen4k" --threads 2 >/dev/null

bytes=$(cat "$corpus"/*.txt | wc -c)
runs_json=""
load_start="$(cut -d" " -f1-3 /proc/loadavg)"
for threads in 1 2; do
  for i in $(seq 1 "$repeats"); do
    cmd=("$longtrain" prepare --tokenizer "$work/austen4k.model" --input "$corpus" --output "$work/shards"
         --val-fraction 0.1 --threads "$threads" --overwrite --no-progress)
    start=$(date +%s.%N)
    "${cmd[@]}" >/dev/null
    end=$(date +%s.%N)
    mbps=$(python3 -c "print(round($bytes / 1e6 / ($end - $start), 3))")
    echo "prepare: threads=$threads run $i: $mbps MB/s"
    runs_json+="{\"threads\": $threads, \"seconds\": $(python3 -c "print(round($end - $start, 3))"), \"mb_per_s\": $mbps},"
  done
done

commit="$(git -C "$root" rev-parse HEAD)"
dirty=False
[ -z "$(git -C "$root" status --porcelain -- data tools parallel/layout.h)" ] || dirty=True
mkdir -p "$root/bench/results"
out="$root/bench/results/prepare-$(git -C "$root" rev-parse --short HEAD).json"
python3 - "$out" <<PY
import json, os, platform, statistics, sys
runs = [${runs_json%,}]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
summary = {}
for t in sorted({r["threads"] for r in runs}):
    v = [r["mb_per_s"] for r in runs if r["threads"] == t]
    summary[f"threads_{t}"] = {"best_mb_per_s": max(v), "median_mb_per_s": statistics.median(v)}
result = {
    "benchmark": "longtrain prepare throughput (MB of input text per second)",
    "corpus": "Jane Austen's six novels (Debian r-cran-janeaustenr), 6 documents",
    "corpus_bytes": $bytes,
    "tokenizer": "SentencePiece BPE, vocabulary 4096, byte fallback (longtrain tokenizer train)",
    "command": "longtrain prepare --tokenizer austen4k.model --input data-cache/janeausten --output DIR --val-fraction 0.1 --threads T --overwrite --no-progress",
    "machine": {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
                "load_average_at_start": "$load_start", "load_average_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                "note": "the machine is shared; a load above 2 means other work competed for the 2 cores"},
    "commit": "$commit",
    "uncommitted_changes_in_data_or_tools": $dirty,
    "runs": runs,
    "summary": summary,
}
json.dump(result, open(sys.argv[1], "w"), indent=2)
print(f"wrote {sys.argv[1]}: " + ", ".join(f"{k}: best {v['best_mb_per_s']} MB/s" for k, v in summary.items()))
PY
