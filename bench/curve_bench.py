#!/usr/bin/env python3
"""What CurveZMQ costs: the same stack over loopback tcp:// with Curve off and on, in one run,
alternating (off, on, off, on, ...) so that drift in the machine hits both alike.

Each round starts a stack (`moeline stack up --transport tcp --curve off|on`), warms it up, then
measures (a) TTFT and per-token time of sequential single requests (the SDK's timings: the
gateway's clock, so client overhead is out) and (b) `moeline load` at --concurrency streams
(its TTFT and per-token percentiles). Prints a markdown table of medians and the overhead of on
over off.

  curve_bench.py --moeline BIN --model DIR --workdir DIR [--rounds 3] [--requests 40]
                 [--concurrency 8] [--duration-s 10] [--prompt-tokens 32] [--max-tokens 32]
                 [--variants off,on,on/io2]

A variant is `off` or `on`, optionally with `/ioN`: the stages' ZeroMQ I/O threads
(--io-threads, through MOELINE_IO_THREADS).
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


def one_round(args, variant):
    from moeline_client import Client
    curve, _, io = variant.partition("/")
    if io:
        os.environ["MOELINE_IO_THREADS"] = io.removeprefix("io")
    else:
        os.environ.pop("MOELINE_IO_THREADS", None)
    run = os.path.join(args.workdir, f"curve-{variant.replace('/', '-')}")
    extra = ["--transport", "tcp", "--curve", curve]
    with Stack(args.moeline, args.model, run, extra_args=extra, endpoint_prefix="tcp://",
               threads=1) as stack:
        server_key = stack.state().get("server_key", "")
        ttft, per_token = [], []
        with Client(stack.endpoint, timeout=120, server_key=server_key) as client:
            for i in range(args.requests + 5):
                tokens = [(i * 13 + j) % 500 + 3 for j in range(args.prompt_tokens)]
                result = client.generate(tokens=tokens, max_tokens=args.max_tokens, ignore_eos=True,
                                         reuse="none")
                if i < 5:
                    continue  # warm-up
                t = result.timings
                ttft.append(t["ttft_ms"])
                per_token.append((t["total_ms"] - t["ttft_ms"]) / max(1, len(result.ids) - 1))
        cmd = [args.moeline, "load", "--endpoint", stack.endpoint, "--model", args.model,
               "--concurrency", str(args.concurrency), "--duration-s", str(args.duration_s),
               "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
               "--json"]
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
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--variants", default="off,on",
                    help="comma-separated: off, on, optionally /ioN (the first is the baseline)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        curve, _, io = v.partition("/")
        if curve not in ("off", "on") or (io and not (io.startswith("io") and io[2:].isdigit())):
            ap.error(f"--variants: {v!r} is not off|on[/ioN]")
    add_python_paths(args.python_build, os.path.join(ROOT, "sdk", "python"))
    results = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            print(f"curve bench: round {r + 1} variant {v}", file=sys.stderr)
            results[v].append(one_round(args, v))

    def med(curve, get):
        return statistics.median(get(x) for x in results[curve])

    rows = [
        ("single request TTFT (ms)", lambda x: x["ttft_ms"]),
        ("single request per-token (ms)", lambda x: x["tpot_ms"]),
        (f"load x{args.concurrency}: TTFT p50 (ms)", lambda x: x["load"]["ttft_ms"]["p50"]),
        (f"load x{args.concurrency}: per-token p50 (ms)", lambda x: x["load"]["tpot_ms"]["p50"]),
        (f"load x{args.concurrency}: output tokens/s", lambda x: x["load"]["output_tokens_per_s"]),
    ]
    def name(v):
        curve, _, io = v.partition("/")
        return f"tcp, Curve {curve}" + (f", {io[2:]} I/O threads" if io else "")

    base = variants[0]
    header = [f"measure (median of {args.rounds} rounds)", name(base)]
    for v in variants[1:]:
        header += [name(v), f"vs {base}"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for label, get in rows:
        b = med(base, get)
        cells = [label, f"{b:.2f}"]
        for v in variants[1:]:
            x = med(v, get)
            cells += [f"{x:.2f}", f"{100 * (x - b) / b:+.1f}%"]
        print("| " + " | ".join(cells) + " |")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
