#!/usr/bin/env python3
"""What CurveZMQ costs: the same stack over loopback tcp:// with Curve off and on, in one run,
alternating (off, on, off, on, ...) so that drift in the machine hits both alike.

Each round starts a stack (`moeline stack up --transport tcp --curve off|on`), warms it up, then
measures (a) TTFT and per-token time of sequential single requests (the SDK's timings: the
gateway's clock, so client overhead is out) and (b) `moeline load` at --concurrency streams
(its TTFT and per-token percentiles). Prints a markdown table of medians and the overhead of on
over off.

  curve_bench.py --moeline BIN --model DIR --workdir DIR [--rounds 3] [--requests 40]
                 [--concurrency 8] [--duration-s 10]
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
from stack_harness import Stack, add_python_paths  # noqa: E402


def one_round(args, curve):
    from moeline_client import Client
    run = os.path.join(args.workdir, f"curve-{curve}")
    extra = ["--transport", "tcp", "--curve", curve]
    with Stack(args.moeline, args.model, run, extra_args=extra, endpoint_prefix="tcp://",
               threads=1) as stack:
        server_key = stack.state().get("server_key", "")
        ttft, per_token = [], []
        with Client(stack.endpoint, timeout=120, server_key=server_key) as client:
            for i in range(args.requests + 5):
                tokens = [(i * 13 + j) % 500 + 3 for j in range(32)]
                result = client.generate(tokens=tokens, max_tokens=32, ignore_eos=True,
                                         reuse="none")
                if i < 5:
                    continue  # warm-up
                t = result.timings
                ttft.append(t["ttft_ms"])
                per_token.append((t["total_ms"] - t["ttft_ms"]) / max(1, len(result.ids) - 1))
        cmd = [args.moeline, "load", "--endpoint", stack.endpoint, "--model", args.model,
               "--concurrency", str(args.concurrency), "--duration-s", str(args.duration_s),
               "--prompt-tokens", "32", "--max-tokens", "32", "--json"]
        env = dict(os.environ, MOELINE_SERVER_KEY=server_key) if server_key else None
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if out.returncode != 0 and not out.stdout.strip():
            raise RuntimeError(f"moeline load failed: {out.stderr[-400:]}")
        load = json.loads(out.stdout.strip().splitlines()[-1])
    return {"ttft_ms": statistics.median(ttft), "tpot_ms": statistics.median(per_token),
            "load": load}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--python-build", default=os.path.join(ROOT, "build", "python"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=10)
    args = ap.parse_args()
    add_python_paths(args.python_build, os.path.join(ROOT, "sdk", "python"))
    results = {"off": [], "on": []}
    for r in range(args.rounds):
        for curve in ("off", "on"):
            print(f"curve bench: round {r + 1} curve {curve}", file=sys.stderr)
            results[curve].append(one_round(args, curve))

    def med(curve, get):
        return statistics.median(get(x) for x in results[curve])

    rows = [
        ("single request TTFT (ms)", lambda x: x["ttft_ms"]),
        ("single request per-token (ms)", lambda x: x["tpot_ms"]),
        (f"load x{args.concurrency}: TTFT p50 (ms)", lambda x: x["load"]["ttft_ms"]["p50"]),
        (f"load x{args.concurrency}: per-token p50 (ms)", lambda x: x["load"]["tpot_ms"]["p50"]),
        (f"load x{args.concurrency}: output tokens/s", lambda x: x["load"]["output_tokens_per_s"]),
    ]
    print(f"| measure (median of {args.rounds} rounds) | tcp, Curve off | tcp, Curve on | on vs off |")
    print("| --- | --- | --- | --- |")
    for label, get in rows:
        off, on = med("off", get), med("on", get)
        print(f"| {label} | {off:.2f} | {on:.2f} | {100 * (on - off) / off:+.1f}% |")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
