#!/usr/bin/env python3
"""Expert offload: decode speed, hit ratio, stalls and prefetch quality at host-pool budgets, with
every expert read cold from disk (a fresh pool per run, O_DIRECT reads), next to the hit ratio of
the optimal policy (Belady's MIN, replayed on the same run's access trace) at the same budget.

usage: offload_bench.py --moeline BIN --model DIR [--model DIR ...] [--budgets 100%,50%,25%]
                        [--prefetch 0,1] [--max-tokens 256] [--threads 2] [--json FILE]

Each row is one `moeline run --expert-budget B --prefetch-depth D` (a pool of its own, so each
starts cold) on one prompt, decoding --max-tokens tokens. The disk's bandwidth is measured once
per model by reading its checkpoint with O_DIRECT (dd iflag=direct), for the load times to be read
against.

Prefetch quality, from the pool's counters:
  precision  prefetched experts used before eviction / prefetched experts loaded
  recall     prefetched experts used / experts that were needed and not resident when the
             prefetch could have been issued (misses + used prefetches - late ones, which are
             counted in both)
  late       demand accesses that found their expert still loading for a prefetch
  over-fetch prefetched experts loaded / prefetched experts used
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

PROMPT = ("volcano: a mountain or hill, typically conical, having a crater or vent through which "
          "lava, rock fragments, hot vapour and gas are being or have been erupted")


def disk_bandwidth(path):
    """MB/s of an O_DIRECT sequential read of `path` (None when O_DIRECT is refused)."""
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
                         capture_output=True, text=True)
    match = re.search(r"([\d.,]+) (kB|MB|GB)/s", out.stderr)
    if out.returncode != 0 or not match:
        return None
    value = float(match.group(1).replace(",", "."))
    return value * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[match.group(2)]


def run(args, model, budget=None, prefetch=0, trace=None):
    cmd = [args.moeline, "run", "--model", model, "--prompt", PROMPT, "--max-tokens",
           str(args.max_tokens), "--ignore-eos", "--threads", str(args.threads), "--json"]
    if budget:
        cmd += ["--expert-budget", budget, "--prefetch-depth", str(prefetch)]
    if trace:
        cmd += ["--expert-trace", trace]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"offload_bench: {' '.join(cmd)} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def belady(args, trace, budgets):
    out = subprocess.run([args.moeline, "experts", "replay", "--trace", trace, "--budgets",
                          ",".join(budgets), "--policies", "lru,distance", "--json"],
                         capture_output=True, text=True, check=True)
    return {row["budget"]: row for row in json.loads(out.stdout)["budgets"]}


def bench_model(args, model):
    name = os.path.basename(os.path.normpath(model))
    # A checkpoint folder's weights, or a GGUF file itself.
    checkpoint = model if os.path.isfile(model) else os.path.join(model, "model.safetensors")
    bandwidth = disk_bandwidth(checkpoint) if os.path.exists(checkpoint) else None
    budgets = args.budgets.split(",")
    with tempfile.TemporaryDirectory() as work:
        trace = os.path.join(work, "trace.txt")
        # All resident: the best of three (a short decode on a shared VM is noisy), the first of
        # which also records the access trace.
        resident = max((run(args, model, trace=trace if i == 0 else None) for i in range(3)),
                       key=lambda r: r["timings"]["decode_tokens_per_second"])
        bound = belady(args, trace, budgets)
    resident_rate = resident["timings"]["decode_tokens_per_second"]
    rows = []
    for budget in budgets:
        for depth in [int(d) for d in args.prefetch.split(",")]:
            result = run(args, model, budget, depth)
            e = result["experts"]
            tokens = max(1, len(result["ids"]))
            rate = result["timings"]["decode_tokens_per_second"]
            needed = e["misses"] + e["prefetch_used"] - e["prefetch_late"]
            rows.append({
                "model": name, "budget": budget, "prefetch_depth": depth, "slots": e["slots"],
                "decode_tokens_per_second": rate,
                "share_of_resident": rate / resident_rate if resident_rate else 0.0,
                "hit_ratio": e["hit_ratio"],
                "belady_hit_ratio": bound[budget]["belady"],
                "lru_hit_ratio": bound[budget]["lru"],
                "policy_replay_hit_ratio": bound[budget]["distance"],
                "stall_ms_per_token": 1e3 * e["stall_seconds"] / tokens,
                "bytes_per_token": e["bytes_loaded"] / tokens,
                "load_p50_us": e["load_p50_us"], "load_p95_us": e["load_p95_us"],
                "prefetch_precision": e["prefetch_used"] / e["prefetch_loads"]
                if e["prefetch_loads"] else None,
                "prefetch_recall": e["prefetch_used"] / needed if depth and needed else None,
                "prefetch_late": e["prefetch_late"],
                "over_fetch": e["prefetch_loads"] / e["prefetch_used"] if e["prefetch_used"]
                else None,
                "direct_io": e["direct_io"],
            })
            print(f"offload_bench: {name} {budget} prefetch {depth}: {rate:.1f} tok/s, hit "
                  f"{e['hit_ratio']:.3f}", file=sys.stderr)
    return {"model": name, "resident_decode_tokens_per_second": resident_rate,
            "disk_mb_per_s": bandwidth, "rows": rows}


def pct(x):
    return "–" if x is None else f"{100 * x:.1f}%"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--budgets", default="100%,50%,25%")
    parser.add_argument("--prefetch", default="0,1")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = [bench_model(args, model) for model in args.model]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for r in results:
        disk = f"{r['disk_mb_per_s']:.0f} MB/s" if r["disk_mb_per_s"] else "not measured"
        print(f"{r['model']}: all experts resident {r['resident_decode_tokens_per_second']:.1f} "
              f"tok/s (best of 3); disk (O_DIRECT sequential read of the checkpoint) {disk}; "
              f"{args.max_tokens} tokens decoded, {args.threads} threads, every run from a cold "
              "pool.\n")
        print("| budget | prefetch | slots | decode tok/s | of resident | hit ratio | Belady | "
              "LRU (replay) | stall ms/token | MB read/token | load p50 / p95 (µs) | precision | "
              "recall | late | over-fetch |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for x in r["rows"]:
            over = "–" if x["over_fetch"] is None else f"{x['over_fetch']:.2f}×"
            print(f"| {x['budget']} | {x['prefetch_depth'] or 'off'} | {x['slots']} | "
                  f"{x['decode_tokens_per_second']:.1f} | {pct(x['share_of_resident'])} | "
                  f"{pct(x['hit_ratio'])} | {pct(x['belady_hit_ratio'])} | "
                  f"{pct(x['lru_hit_ratio'])} | {x['stall_ms_per_token']:.2f} | "
                  f"{x['bytes_per_token'] / 1e6:.2f} | {x['load_p50_us']:.0f} / "
                  f"{x['load_p95_us']:.0f} | {pct(x['prefetch_precision'])} | "
                  f"{pct(x['prefetch_recall'])} | {x['prefetch_late']} | {over} |")
        print()


if __name__ == "__main__":
    main()
