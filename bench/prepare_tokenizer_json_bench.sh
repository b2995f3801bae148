#!/usr/bin/env bash
# Benchmark (not a test): `longtrain prepare` throughput with a Hugging Face tokenizer.json
# (byte-level BPE, data/hf_tokenizer.h) against HF tokenizers' batch encode of the same text.
#
# The text is every non-empty line of the demo corpus (Jane Austen's six novels), one document per
# line, exactly what tests/fixtures/hf_tokenizer/make_fixture.py batch-encodes for its anchor; the
# tokenizers are that fixture's two (Llama 3-style and GPT-2-style). prepare runs with --no-eos, so
# its token count must equal HF's: a parity check over the whole corpus, not only the fixture cases.
#
# The anchor (HF tokenizers' encode_batch, RAYON_NUM_THREADS = our thread count) is measured in the
# same run when python3 can import `tokenizers` (the GPU machine; Debian has no package of it).
# Where it cannot, the result file carries the anchor the fixture recorded on the GPU machine, marked
# as measured elsewhere: a same-run comparison must then be made there.
#
# Usage: bench/prepare_tokenizer_json_bench.sh [BUILD_DIR] [REPEATS]     (defaults: build, 3)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-build}"
repeats="${2:-3}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
longtrain="$build/tools/longtrain/longtrain"
[ -x "$longtrain" ] || { echo "prepare_tokenizer_json_bench: build longtrain first ($longtrain not found)" >&2; exit 1; }
fixture="$root/tests/fixtures/hf_tokenizer"

"$root/scripts/fetch-corpus.sh" --longtrain "$longtrain" >/dev/null
corpus="$root/data-cache/janeausten"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# One JSON record per non-empty line, as the anchor splits the corpus.
python3 - "$corpus" "$work/lines.jsonl" <<'PY'
import glob, json, os, sys
lines = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.txt"))):
    with open(f, encoding="utf-8") as fh:
        lines += [l for l in fh.read().split("\n") if l]
with open(sys.argv[2], "w", encoding="utf-8") as out:
    for l in lines:
        out.write(json.dumps({"text": l}, ensure_ascii=False) + "\n")
print(len(lines), sum(len(l.encode("utf-8")) for l in lines))
PY
read -r lines bytes < <(python3 -c "
import json,sys
n=b=0
for l in open('$work/lines.jsonl', encoding='utf-8'):
    t=json.loads(l)['text']; n+=1; b+=len(t.encode('utf-8'))
print(n, b)")

have_hf=False
python3 -c "import tokenizers" 2>/dev/null && have_hf=True
load_start="$(cut -d" " -f1-3 /proc/loadavg)"
runs_json=""
for name in llama3_style gpt2_style; do
  for threads in 1 2; do
    for i in $(seq 1 "$repeats"); do
      start=$(date +%s.%N)
      "$longtrain" prepare --tokenizer "$fixture/$name/tokenizer.json" --input "$work/lines.jsonl" \
        --output "$work/shards" --threads "$threads" --no-eos --overwrite --no-progress >/dev/null
      end=$(date +%s.%N)
      tokens=$(python3 -c "import json; print(json.load(open('$work/shards/manifest.json'))['splits']['train']['tokens'])")
      mbps=$(python3 -c "print(round($bytes / 1e6 / ($end - $start), 3))")
      echo "prepare $name threads=$threads run $i: $mbps MB/s, $tokens tokens"
      runs_json+="{\"tool\": \"longtrain prepare\", \"tokenizer\": \"$name\", \"threads\": $threads, \"seconds\": $(python3 -c "print(round($end - $start, 3))"), \"mb_per_s\": $mbps, \"tokens\": $tokens},"
      if [ "$have_hf" = True ]; then
        hf=$(RAYON_NUM_THREADS=$threads python3 - "$fixture/$name/tokenizer.json" "$work/lines.jsonl" <<'PY'
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
lines = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
start = time.perf_counter()
enc = tok.encode_batch(lines, add_special_tokens=False)
seconds = time.perf_counter() - start
print(seconds, sum(len(e.ids) for e in enc))
PY
)
        read -r hs ht <<<"$hf"
        hmbps=$(python3 -c "print(round($bytes / 1e6 / $hs, 3))")
        echo "HF tokenizers $name threads=$threads run $i: $hmbps MB/s, $ht tokens"
        runs_json+="{\"tool\": \"HF tokenizers encode_batch\", \"tokenizer\": \"$name\", \"threads\": $threads, \"seconds\": $(python3 -c "print(round($hs, 3))"), \"mb_per_s\": $hmbps, \"tokens\": $ht},"
      fi
    done
  done
done

# BENCH_COMMIT names the commit where the tree is a copy without .git (the lent GPU machine).
commit="${BENCH_COMMIT:-$(git -C "$root" rev-parse HEAD)}"
dirty=False
if [ -z "${BENCH_COMMIT:-}" ]; then
  [ -z "$(git -C "$root" status --porcelain -- data tools)" ] || dirty=True
fi
mkdir -p "$root/bench/results"
out="$root/bench/results/prepare-tokenizer-json-${commit:0:7}.json"
python3 - "$out" "$fixture/throughput.json" <<PY
import json, os, platform, statistics, sys
runs = [${runs_json%,}]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
summary = {}
for r in runs:
    key = f'{r["tool"]} / {r["tokenizer"]} / threads_{r["threads"]}'
    summary.setdefault(key, []).append(r["mb_per_s"])
summary = {k: {"best_mb_per_s": max(v), "median_mb_per_s": statistics.median(v)} for k, v in summary.items()}
result = {
    "benchmark": "longtrain prepare with a tokenizer.json, MB of input text per second, against HF tokenizers",
    "corpus": "every non-empty line of Jane Austen's six novels, one document per line",
    "lines": $lines,
    "corpus_bytes": $bytes,
    "tokenizers": "tests/fixtures/hf_tokenizer/{llama3_style,gpt2_style}/tokenizer.json",
    "command": "longtrain prepare --tokenizer T/tokenizer.json --input lines.jsonl --output DIR --threads N --no-eos --overwrite --no-progress",
    "machine": {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
                "load_average_at_start": "$load_start", "load_average_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                "note": "a shared machine; a load above the core count means other work competed"},
    "commit": "$commit",
    "uncommitted_changes_in_data_or_tools": $dirty,
    "hf_tokenizers_in_this_run": $have_hf,
    "runs": runs,
    "summary": summary,
}
if not $have_hf:
    result["anchor_measured_elsewhere"] = {
        "source": "tests/fixtures/hf_tokenizer/throughput.json (make_fixture.py on the GPU machine, another CPU)",
        "note": "HF tokenizers is not installable here (no Debian package); compare in one run on the GPU "
                "machine, where this script measures both",
        "data": json.load(open(sys.argv[2])),
    }
json.dump(result, open(sys.argv[1], "w"), indent=2)
open(sys.argv[1], "a").write("\n")
print("wrote", sys.argv[1])
PY
