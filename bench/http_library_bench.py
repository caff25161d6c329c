#!/usr/bin/env python3
"""Runs moeline_http_library_bench for each server and stream count, alternating the servers in
one run, and prints the markdown table of docs/PERFORMANCE.md ("HTTP library").

  http_library_bench.py --bench build/bench/moeline_http_library_bench
                        [--streams 64,256,1000] [--rate 20] [--seconds 10]
"""

import argparse
import json
import subprocess
import sys

SERVERS = ("httplib-direct", "httplib-handoff", "beast")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", required=True)
    ap.add_argument("--streams", default="64,256,1000")
    ap.add_argument("--rate", type=float, default=20)
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    rows = []
    for streams in [int(x) for x in args.streams.split(",") if x]:
        for server in SERVERS:
            print(f"http library bench: {server} {streams} streams", file=sys.stderr)
            out = subprocess.run([args.bench, "--server", server, "--streams", str(streams),
                                  "--rate", str(args.rate), "--seconds", str(args.seconds)],
                                 capture_output=True, text=True, timeout=args.seconds + 120)
            if out.returncode != 0:
                raise RuntimeError(f"{server} {streams}: {out.stderr[-600:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"| server | streams | tokens/s (all streams) | received | closed early | delivery p50 (ms) "
          f"| delivery p99 (ms) | max (ms) | server CPU (cores) | server peak RSS (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        latency = r.get("latency_ms", {})
        print(f"| {r['server']} | {r['streams']} | {r['streams'] * r['rate_per_stream']:.0f} | "
              f"{r.get('received', 0)} | {r.get('closed_early', 0)} | "
              f"{latency.get('p50', float('nan')):.2f} | {latency.get('p99', float('nan')):.2f} | "
              f"{latency.get('max', float('nan')):.1f} | {r['server_cpu_per_s']:.2f} | "
              f"{r['server_peak_rss_mib']:.0f} |")
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
