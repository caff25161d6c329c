#!/usr/bin/env python3
"""Endurance: one stack kept up under `moeline load` for a long time, watched for what grows.

A stack that serves its first thousand requests well can still get slower with every request it
has served (a store whose upkeep grows with what it holds, an index that is never pruned, a map
that is never emptied). This bench keeps one stack up (unlike the other stack benches, which
start a fresh one per round), drives it in back-to-back windows of `moeline load` with prompts
that never repeat, and records per window each stage's CPU time per request, its resident
memory, the probe's store on disk, and the load's TTFT and throughput. It prints a table of the
first and last quarter of the windows (the first window is warm-up and left out) with the ratio
of the two: a stage whose CPU per request or memory keeps rising shows there.

  endurance.py --moeline BIN --model DIR --workdir DIR [--minutes 10] [--window-s 10]
               [--concurrency 8] [--prompt-tokens 32] [--max-tokens 32] [--threads 1] [--http]
               [--decode 1] [--expert-budget 50%]

--http drives the stack through its OpenAI-compatible front (`moeline load --http`) instead of
the ZeroMQ client, so the HTTP stage is watched too.

Each window is also printed to stderr as one JSON line as it ends.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from stack_harness import Stack, process_cpu_seconds  # noqa: E402


def stage_usage(stack):
    """{stage: (pid, cpu seconds, resident MiB)} from /proc."""
    out = {}
    for stage in stack.state()["stages"]:
        pid = stage["pid"]
        try:
            cpu = process_cpu_seconds(pid)
            with open(f"/proc/{pid}/status") as f:
                rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
        out[stage["name"]] = (pid, cpu, rss_kib / 1024)
    return out


def directory_mib(path):
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total / (1 << 20)


def one_window(args, stack):
    before = stage_usage(stack)
    target = ["--http", stack.state()["http"]] if args.http else ["--endpoint", stack.endpoint]
    cmd = [args.moeline, "load", *target, "--model", args.model,
           "--concurrency", str(args.concurrency), "--duration-s", str(args.window_s),
           "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
           "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.window_s + 300)
    if not out.stdout.strip():
        raise RuntimeError(f"moeline load failed: {out.stderr[-400:]}")
    load = json.loads(out.stdout.strip().splitlines()[-1])
    after = stage_usage(stack)
    completed = max(1, load["completed"])
    window = {"completed": load["completed"], "errors": load["errors"],
              "requests_per_s": load["requests_per_s"], "ttft_p50_ms": load["ttft_ms"]["p50"],
              "tpot_p50_ms": load["tpot_ms"]["p50"],
              "store_disk_mib": directory_mib(os.path.join(stack.run_dir, "store"))}
    for name, (pid, cpu, rss) in after.items():
        # A stage the supervisor replaced meanwhile has no CPU figure for this window.
        if name in before and before[name][0] == pid:
            window[f"cpu_ms_per_request:{name}"] = 1000 * (cpu - before[name][1]) / completed
        window[f"rss_mib:{name}"] = rss
    return window


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--window-s", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1, help="decode replicas")
    ap.add_argument("--expert-budget", help="the shared expert pool's budget (e.g. 50%%)")
    ap.add_argument("--http", action="store_true",
                    help="load through the OpenAI-compatible front instead of the ZeroMQ client")
    args = ap.parse_args()

    windows = []
    with Stack(args.moeline, args.model, os.path.join(args.workdir, "stack"),
               threads=args.threads, http_port=0 if args.http else "off", decode=args.decode,
               expert_budget=args.expert_budget) as stack:
        end = time.monotonic() + 60 * args.minutes
        while time.monotonic() < end or len(windows) < 5:
            window = one_window(args, stack)
            windows.append(window)
            print(json.dumps(window), file=sys.stderr, flush=True)

    measured = windows[1:]  # the first window warms the stack up
    quarter = max(1, len(measured) // 4)
    first, last = measured[:quarter], measured[-quarter:]
    served = sum(w["completed"] for w in windows)
    print(f"{len(windows)} windows of {args.window_s:g} s, {served} requests, "
          f"{sum(w['errors'] for w in windows)} errors; first and last {quarter} windows "
          f"(after one of warm-up):\n")
    print("| measure | first quarter | last quarter | last / first |")
    print("| --- | ---: | ---: | ---: |")
    keys = ["requests_per_s", "ttft_p50_ms", "tpot_p50_ms", "store_disk_mib"]
    keys += sorted(k for k in measured[-1] if k.startswith("cpu_ms_per_request:"))
    keys += sorted(k for k in measured[-1] if k.startswith("rss_mib:"))
    for key in keys:
        a = [w[key] for w in first if key in w]
        b = [w[key] for w in last if key in w]
        if not a or not b:
            continue
        x, y = statistics.fmean(a), statistics.fmean(b)
        ratio = f"{y / x:.2f}" if x > 0 else "–"
        print(f"| {key} | {x:.2f} | {y:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
