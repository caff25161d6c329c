#!/usr/bin/env python3
"""`moeline signature`: activation signatures as the approximate-reuse probe computes them. Same
prompt, same signature (bit for bit, across runs); unit length; the first k MoE layers' experts
(or the projected dimension when that is smaller); bad input is a clear error."""

import argparse
import json
import math
import subprocess
import sys


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def run(moeline, model, lines, *flags):
    return subprocess.run([moeline, "signature", "--model", model, "--threads", "1", *flags],
                          input="".join(lines), capture_output=True, text=True, timeout=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    with open(f"{args.model}/config.json") as f:
        experts = json.load(f)["num_experts"]
    lines = [json.dumps({"prompt": p}) + "\n" for p in ("to swim:", "a large dog:", "to swim:")]
    first = run(args.moeline, args.model, lines)
    check(first.returncode == 0, first.stderr)
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    check(len(rows) == 3, rows)
    for k, dimension in ((1, 256), (2, 256), (2, 4)):
        out = run(args.moeline, args.model, lines, "--signature-layers", str(k), "--signature-dimension", str(dimension))
        check(out.returncode == 0, out.stderr)
        signature = json.loads(out.stdout.splitlines()[0])["signature"]
        check(len(signature) == min(k * experts, dimension), (k, dimension, len(signature)))
        check(abs(math.sqrt(sum(x * x for x in signature)) - 1) < 1e-5, "not unit length")
    check(rows[0]["signature"] == rows[2]["signature"], "same prompt, different signature")
    check(rows[0]["signature"] != rows[1]["signature"], "different prompts, same signature")
    again = run(args.moeline, args.model, lines)
    check(again.stdout == first.stdout, "signatures differ between runs")
    print("ok signature: deterministic, unit length, k layers of experts or the projection")
    bad = run(args.moeline, args.model, ["not json\n"])
    check(bad.returncode == 1 and "JSON object" in bad.stderr, bad.stderr)
    flag = run(args.moeline, args.model, lines, "--signature-layers", "0")
    check(flag.returncode == 2 and "--signature-layers" in flag.stderr, flag.stderr)
    print("ok signature: bad input and bad flags are clear errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
