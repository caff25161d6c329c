#!/usr/bin/env python3
"""What the HTTP front costs, and how many streams one replica holds.

One stack (`moeline stack up --http-port 0`), then in the same run, alternating:
  (a) `moeline load --endpoint EP` (the ZeroMQ client) and `moeline load --http URL` (streamed
      /v1/completions through `moeline http`) at the same concurrency, same request shape:
      TTFT and inter-token latency percentiles side by side, and what HTTP adds;
  (b) `moeline load --http URL` at rising concurrency (default 64, 256, 1000 streams): the
      inter-token p99 with that many streaming connections open on one HTTP replica, beside the
      ZeroMQ client's at the same concurrency (what the machine itself gives).
Both also report what the HTTP stage itself adds per token: its moeline_http_token_delay_seconds
histogram (a token's event received from the gateway to its chunk written to the client) over
each HTTP run, as the upper bound of the bucket that holds the p50 and the p99.
Prints markdown tables (docs/PERFORMANCE.md, "HTTP front").

  http_bench.py --moeline BIN --model DIR --workdir DIR [--rounds 2] [--concurrency 8]
                [--duration-s 10] [--streams 64,256,1000] [--prompt-tokens 32] [--max-tokens 64]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from stack_harness import Stack  # noqa: E402


def load(args, target, concurrency, duration_s, max_tokens):
    cmd = [args.moeline, "load", "--model", args.model, "--concurrency", str(concurrency),
           "--duration-s", str(duration_s), "--prompt-tokens", str(args.prompt_tokens),
           "--max-tokens", str(max_tokens), "--request-timeout-s", "300", "--json"] + target
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"moeline load failed: {out.stderr[-600:]}")
    return json.loads(lines[-1])


def delay_buckets(stack):
    """The HTTP stage's token-delay histogram: {upper bound (s): cumulative count}."""
    out = {}
    for (name, labels), value in stack.metrics("http").items():
        if name == "moeline_http_token_delay_seconds_bucket":
            out[float(dict(labels)["le"])] = value
    return out


def delay_quantiles(before, after):
    """(p50, p99) in ms of the tokens observed between two snapshots: bucket upper bounds."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan"), float("nan")

    def at(q):
        for bound, count in zip(bounds, counts):
            if count >= q * counts[-1]:
                return bound * 1e3
        return float("inf")
    return at(0.5), at(0.99)


def load_http(args, stack, target, concurrency, duration_s, max_tokens):
    before = delay_buckets(stack)
    result = load(args, target, concurrency, duration_s, max_tokens)
    result["http_token_delay_ms"] = delay_quantiles(before, delay_buckets(stack))
    return result


def p(result, key, q):
    value = result.get(key)
    return value[q] if value else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=10)
    ap.add_argument("--streams", default="64,256,1000")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    streams = [int(x) for x in args.streams.split(",") if x]
    config = {"http": {"max-connections": max(streams + [64]) + 64},
              "decode": {"max-batch": 64}}
    with Stack(args.moeline, args.model, os.path.join(args.workdir, "stack"), http_port=0,
               config=config) as stack:
        url = stack.state()["http"]
        targets = {"zeromq": ["--endpoint", stack.endpoint], "http": ["--http", url]}
        side = {"zeromq": [], "http": []}
        for r in range(args.rounds):
            for name, target in targets.items():
                print(f"http bench: round {r + 1} {name}", file=sys.stderr)
                run = load_http if name == "http" else lambda a, s_, *rest: load(a, *rest)
                side[name].append(run(args, stack, target, args.concurrency, args.duration_s,
                                      args.max_tokens))
        held = []
        for n in streams:
            print(f"http bench: {n} streams", file=sys.stderr)
            held.append((n, load_http(args, stack, targets["http"], n, args.duration_s,
                                      args.max_tokens),
                         load(args, targets["zeromq"], n, args.duration_s, args.max_tokens)))

    def med(name, key, q):
        return statistics.median(p(x, key, q) for x in side[name])

    print(f"| at {args.concurrency} streams (median of {args.rounds} rounds) | ZeroMQ client | "
          f"HTTP front | added by HTTP |")
    print("| --- | --- | --- | --- |")
    for label, key, q in [("TTFT p50 (ms)", "ttft_ms", "p50"), ("TTFT p99 (ms)", "ttft_ms", "p99"),
                          ("inter-token p50 (ms)", "tpot_ms", "p50"),
                          ("inter-token p99 (ms)", "tpot_ms", "p99")]:
        z, h = med("zeromq", key, q), med("http", key, q)
        print(f"| {label} | {z:.2f} | {h:.2f} | {h - z:+.2f} |")
    z = statistics.median(x["output_tokens_per_s"] for x in side["zeromq"])
    h = statistics.median(x["output_tokens_per_s"] for x in side["http"])
    print(f"| output tokens/s | {z:.0f} | {h:.0f} | {100 * (h - z) / z:+.1f}% |")
    for label, i in (("p50", 0), ("p99", 1)):
        worst = max(x["http_token_delay_ms"][i] for x in side["http"])
        print(f"| HTTP stage's own delay per token, {label} (ms, bucket bound; worst round) | | "
              f"<= {worst:g} | |")
    print()
    print("| streams open on one HTTP replica | completed | errors | inter-token p50 (ms) | "
          "inter-token p99 (ms) | the same through the ZeroMQ client: p99 (ms) | TTFT p50 (ms) | "
          "output tokens/s | HTTP stage's delay per token p50 / p99 (ms, bucket bound) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, result, zeromq in held:
        print(f"| {n} | {result['completed']} | {result['errors']} | {p(result, 'tpot_ms', 'p50'):.2f} "
              f"| {p(result, 'tpot_ms', 'p99'):.2f} | {p(zeromq, 'tpot_ms', 'p99'):.2f} | "
              f"{p(result, 'ttft_ms', 'p50'):.0f} | {result['output_tokens_per_s']:.0f} | "
              f"<= {result['http_token_delay_ms'][0]:g} / <= {result['http_token_delay_ms'][1]:g} |")
    print(json.dumps({"side_by_side": side, "streams": held}), file=sys.stderr)


if __name__ == "__main__":
    main()
