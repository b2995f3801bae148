#!/bin/bash
# One GPU call: the kernel variants scripts/device/pack-variants.sh packed (.device/variants, carried
# with the rest of .device), each tested first (its gpu_test under TESTS, default every Hopper
# attention test; "none" skips them), then our attention timed by each variant's attention_bench in
# processes in the order v0 v1 .. vn vn .. v0 (REPEATS times; a GPU that heats or throttles in the
# course of the call then favours no variant), at every SHAPES item (head dim:kv heads, default
# "64:4 128:8") and LENGTHS (16384,65536). Prints each variant's forward, fwd+bwd and backward per
# shape (the median over its processes of their means of rounds) and the ratios to v0's, and writes
# $W/variants-ab.json (everything comes back in $OUT/all.tar.gz). ONLY picks variants (below).
#   scripts/device/pack-variants.sh main regs-split    # here
#   SHAPES=64:4 scripts/device/run-variants-ab.sh      # on the GPU machine, .device carried
set -u
source scripts/device/session.sh
V=.device/variants
[ -f $V/list ] || { stamp "no $V/list: run scripts/device/pack-variants.sh first"; exit 1; }
mapfile -t variants < $V/list
# ONLY (space-separated numbers, e.g. "0 2 3") keeps those variants of the list; the first kept is the
# baseline.
if [ -n "${ONLY:-}" ]; then
  kept=()
  for i in $ONLY; do
    [[ $i =~ ^[0-9]+$ ]] && [ $i -lt ${#variants[@]} ] || { stamp "ONLY: no variant $i in $V/list"; exit 1; }
    kept+=("${variants[$i]}")
  done
  variants=("${kept[@]}")
fi
for v in "${variants[@]}"; do
  mkdir -p /tmp/variants/$v && tar -xJf $V/$v.tar.xz -C /tmp/variants/$v || { stamp "cannot unpack $V/$v.tar.xz"; exit 1; }
done
failed=0
if [ "${TESTS:-}" != none ]; then
  for v in "${variants[@]}"; do
    timeout 240 /tmp/variants/$v/gpu_test --gtest_filter="${TESTS:-*Hopper*}" > $W/tests-$v.log 2>&1
    rc=$?; stamp "$v: gpu_test rc $rc"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran" $W/tests-$v.log | tail -6
    [ $rc = 0 ] || failed=1
  done
fi
order=()
for ((r = 0; r < ${REPEATS:-1}; ++r)); do
  order+=("${variants[@]}")
  for ((i = ${#variants[@]} - 1; i >= 0; --i)); do order+=("${variants[$i]}"); done
done
n=0
for shape in ${SHAPES:-64:4 128:8}; do
  D=${shape%%:*}; KV=${shape#*:}
  for v in "${order[@]}"; do
    n=$((n + 1))
    timeout 150 /tmp/variants/$v/attention_bench --kernel ${KERNEL:-hopper} --lengths ${LENGTHS:-16384,65536} \
      --head-dim $D --kv-heads $KV --rounds ${ROUNDS:-2} --commit ${v##*-} --out $W/ab-d$D-$n-$v.json \
      > $W/ab-d$D-$n-$v.log 2>&1
    stamp "d$D $v rc $?"
  done
done
python3 - $W ${KERNEL:-hopper} "${variants[@]}" <<'PY'
import glob, json, re, statistics, sys
W, variants = sys.argv[1], sys.argv[3:]
kernel = sys.argv[2].split(",")[0].replace("-", "_")  # attention_bench's row key (hopper, hopper_overlap, ...)
summary = {"variants": variants, "baseline": variants[0], "kernel": kernel,
           "reading": "per variant, head dim and length: the median over its processes of each process's mean "
                      "of rounds (fwd, fwd+bwd, and the backward alone); ratio = the baseline's time / the variant's",
           "rows": []}
runs = {}
for f in glob.glob(f"{W}/ab-d*.json"):
    D, n, v = re.match(r".*/ab-d(\d+)-(\d+)-(.*)\.json$", f).groups()
    try:
        rows = json.load(open(f))["rows"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{f}: unreadable: {e}")
        continue
    for row in rows:
        if kernel not in row or "hopper_bwd" not in row:
            print(f"{f}: no '{kernel}' rows (is KERNEL one of ours?)")
            continue
        r = runs.setdefault((int(D), row["S"], v), {"fwd": [], "fwdbwd": [], "bwd": [], "order": []})
        r["fwd"].append(row[kernel]["fwd_ms"])
        r["fwdbwd"].append(row[kernel]["fwdbwd_ms"])
        r["bwd"].append(row["hopper_bwd"]["bwd_ms"])
        r["order"].append(int(n))
for D, S in sorted({(k[0], k[1]) for k in runs}):
    base = runs.get((D, S, variants[0]))
    for v in variants:
        r = runs.get((D, S, v))
        if r is None:
            print(f"head dim {D} S={S} {v}: no result")
            continue
        order = sorted(range(len(r["order"])), key=lambda i: r["order"][i])
        fw, fb, bw = (statistics.median(r[k]) for k in ("fwd", "fwdbwd", "bwd"))
        out = {"head_dim": D, "S": S, "variant": v, "fwd_ms": round(fw, 3), "fwdbwd_ms": round(fb, 3), "bwd_ms": round(bw, 3),
               "fwdbwd_ms_by_process": [r["fwdbwd"][i] for i in order], "bwd_ms_by_process": [r["bwd"][i] for i in order]}
        if base:
            out["fwd_ratio"] = round(statistics.median(base["fwd"]) / fw, 4)
            out["fwdbwd_ratio"] = round(statistics.median(base["fwdbwd"]) / fb, 4)
            out["bwd_ratio"] = round(statistics.median(base["bwd"]) / bw, 4)
        summary["rows"].append(out)
        print(f"head dim {D} S={S} {v}: fwd {fw:.3f} ms -> {out.get('fwd_ratio')}x; fwd+bwd {fb:.3f} ms {out['fwdbwd_ms_by_process']} -> {out.get('fwdbwd_ratio')}x; "
              f"bwd {bw:.3f} {out['bwd_ms_by_process']} -> {out.get('bwd_ratio')}x")
json.dump(summary, open(f"{W}/variants-ab.json", "w"), indent=1)
PY
exit $failed
