#!/usr/bin/env python3
"""Merges one device run of the long-context benchmarks (issue 8) into a single bench/results JSON.

Inputs (the files the run wrote, in one directory):
  llama_1gpu_*.json     llama_bench on one GPU (rows per length and policy)
  llama_2gpu_*.json     llama_bench under longtrain-run on 2 GPUs (one sequence-parallel group)
  llama_longest*.json   llama_bench at the longest length by plan (one step: does it train?)
  longest_1gpu.json, longest_2gpu.json   llama_bench --longest (the plan's longest lengths)
  llama_anchor.json     bench/anchors/llama_anchor.py timed at some lengths (HF transformers, 1 GPU)
  llama_anchor_probe.json, anchor_probe.log   the same with PROBE=1 at growing lengths (one step each)
  metrics_*.jsonl       training runs of the long-context configs (loss per step)

Derived (all from rows measured in this run):
  remat_over_full   tokens/s of remat_aware over full, per GPU count and length (DistFlashAttn: 1.16-1.31x)
  scaling_2gpu      2-GPU tokens/s over twice the 1-GPU tokens/s at the same tokens per GPU (target >= 0.9),
                    beside the per-GPU model TFLOP/s ratio (attention work per GPU doubles at twice the
                    sequence, so the tokens/s ratio cannot reach 1 where attention dominates)
  vs_anchor         tokens/s over HF's at the lengths both ran
  longest           per policy: the plan's longest (power of two, largest) and the lengths that trained;
                    HF's longest that trained and shortest that failed

Usage: bench/long_context_merge.py RUN_DIR --commit SHA --command "..." --out bench/results/long-context-....json
"""
import argparse
import glob
import json
import os
import re


def load(path):
    with open(path) as f:
        return json.load(f)


def rows_of(run_dir, pattern):
    rows, meta = [], None
    for path in sorted(glob.glob(os.path.join(run_dir, pattern))):
        r = load(path)
        meta = meta or {k: r[k] for k in ("machine", "commit", "date", "benchmark") if k in r}
        for row in r.get("rows", []):
            row = dict(row)
            row["file"] = os.path.basename(path)
            row["command"] = r.get("command")
            rows.append(row)
    return rows, meta


def anchor_results(run_dir):
    """HF rows by length: timed ones, then probe ones (one step) where not timed; failures kept."""
    out = {}
    for name, probe in (("llama_anchor.json", False), ("llama_anchor_probe.json", True)):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        for key, value in load(path).items():
            if key.isdigit() and key not in out:
                out[key] = {"result": value, "probe": probe}
    # A probe killed at its time limit leaves only its log lines: "S {...}" or "S failed: ..."
    log = os.path.join(run_dir, "anchor_probe.log")
    if os.path.exists(log):
        for line in open(log):
            m = re.match(r"^(\d+) (.*)$", line.strip())
            if m and m.group(1) not in out:
                text = m.group(2)
                try:
                    value = json.loads(text.replace("'", '"'))
                except ValueError:
                    value = text
                out[m.group(1)] = {"result": value, "probe": True}
    return out


def losses(path):
    steps = []
    for line in open(path):
        j = json.loads(line)
        if "loss" in j and "step" in j:
            steps.append({k: j[k] for k in ("step", "loss", "tokens_per_s", "tflops", "attention_forwards_per_layer",
                                            "attention_sent_mib_per_layer", "allocated_peak_gib", "plan_gib")
                          if k in j})
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    one, meta = rows_of(a.run_dir, "llama_1gpu_*.json")
    two, _ = rows_of(a.run_dir, "llama_2gpu_*.json")
    longest_runs, _ = rows_of(a.run_dir, "llama_longest*.json")
    anchor = anchor_results(a.run_dir)
    measured = [r for r in one + two + longest_runs if "tok_per_s" in r]

    def find(rows, gpus, S, policy):
        for r in rows:
            if r.get("gpus", 1) == gpus and r["S"] == S and r["policy"] == policy and "tok_per_s" in r:
                return r
        return None

    remat_over_full = []
    for r in measured:
        if r["policy"] != "remat_aware":
            continue
        f = find(measured, r.get("gpus", 1), r["S"], "full")
        if f:
            remat_over_full.append({"gpus": r.get("gpus", 1), "S": r["S"],
                                    "ratio_tok_per_s": round(r["tok_per_s"] / f["tok_per_s"], 3)})

    scaling = []
    for r in two:
        if "tok_per_s" not in r:
            continue
        s1 = find(one, 1, r["tokens_per_gpu"], r["policy"])
        if s1:
            scaling.append({"policy": r["policy"], "S_2gpu": r["S"], "tokens_per_gpu": r["tokens_per_gpu"],
                            "tok_per_s_2gpu": r["tok_per_s"], "tok_per_s_1gpu": s1["tok_per_s"],
                            "ratio_to_twice_1gpu": round(r["tok_per_s"] / (2 * s1["tok_per_s"]), 3),
                            "ratio_tflops_per_gpu": round(r["model_tflops_per_gpu"] / s1["model_tflops"], 3)})

    vs_anchor = []
    for r in measured:
        if r.get("gpus", 1) != 1:
            continue
        h = anchor.get(str(r["S"]))
        if h and isinstance(h["result"], dict) and "tok_per_s" in h["result"]:
            vs_anchor.append({"S": r["S"], "policy": r["policy"], "tok_per_s": r["tok_per_s"],
                              "anchor_tok_per_s": h["result"]["tok_per_s"], "anchor_probe_step": h["probe"],
                              "ratio_tok_per_s": round(r["tok_per_s"] / h["result"]["tok_per_s"], 3)})

    longest = {}
    for gpus in (1, 2):
        path = os.path.join(a.run_dir, f"longest_{gpus}gpu.json")
        plan_rows = load(path)["rows"] if os.path.exists(path) else []
        for p in plan_rows:
            trained = sorted({r["S"] for r in measured if r.get("gpus", 1) == gpus and r["policy"] == p["policy"]})
            failed = sorted({r["S"] for r in one + two + longest_runs
                             if r.get("gpus", 1) == gpus and r["policy"] == p["policy"] and "tok_per_s" not in r})
            longest.setdefault(f"{gpus}gpu", {})[p["policy"]] = {
                "plan_largest_power_of_two": p["largest_power_of_two"],
                "plan_largest_multiple_of_8192P": p["largest_multiple_of_8192P"],
                "longest_trained_in_this_run": trained[-1] if trained else None,
                "skipped_or_failed_in_this_run": failed}
    hf_ok = sorted(int(k) for k, v in anchor.items() if isinstance(v["result"], dict) and "tok_per_s" in v["result"])
    hf_fail = sorted(int(k) for k, v in anchor.items() if not (isinstance(v["result"], dict) and "tok_per_s" in v["result"]))
    longest["hf_1gpu"] = {"longest_trained": hf_ok[-1] if hf_ok else None,
                          "shortest_failed": hf_fail[0] if hf_fail else None,
                          "results": {k: v["result"] for k, v in sorted(anchor.items(), key=lambda kv: int(kv[0]))}}
    ours_1 = max((r["S"] for r in measured if r.get("gpus", 1) == 1), default=None)
    if ours_1 and hf_ok:
        longest["ours_longest_trained_1gpu_over_hf"] = round(ours_1 / hf_ok[-1], 3)
        if hf_fail:
            longest["ours_longest_trained_1gpu_over_hf_shortest_failure"] = round(ours_1 / hf_fail[0], 3)

    configs = {os.path.basename(p): losses(p) for p in sorted(glob.glob(os.path.join(a.run_dir, "metrics_*.jsonl")))}

    result = {
        "benchmark": "long sequences end to end (issue 8): TinyLlama-1.1B shape, bf16, AdamW; 1 GPU and a "
                     "sequence-parallel group of 2 GPUs (zigzag); none / full / remat_aware; HF transformers "
                     "(bench/anchors/llama_anchor.py, 1 GPU) in the same run",
        "machine": (meta or {}).get("machine"),
        "date": (meta or {}).get("date"),
        "commit": a.commit,
        "command": a.command,
        "rows_1gpu": one, "rows_2gpu": two, "rows_longest": longest_runs,
        "remat_over_full": remat_over_full,
        "scaling_2gpu": scaling,
        "vs_anchor": vs_anchor,
        "longest": longest,
        "configs": configs,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for k in ("remat_over_full", "scaling_2gpu", "vs_anchor"):
        print(k)
        for row in result[k]:
            print("  ", row)
    print("longest", json.dumps(longest, indent=1)[:3000])


if __name__ == "__main__":
    main()
