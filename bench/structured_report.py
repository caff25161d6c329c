#!/usr/bin/env python3
"""One markdown row of scripts/bench's structured-output table from moeline_structured_output_bench's
JSON on stdin: `structured_report.py NAME`."""
import json
import sys

d = json.load(sys.stdin)
s, b = d["in_string"], d["structural"]
print(f"| {sys.argv[1]} | {d['vocab']} | {d['vocabulary_build_ms']:.0f} | {d['all']['mean_us']:.0f} "
      f"| {s['mean_us']:.0f} / {s['p99_us']:.0f} | {b['mean_us']:.0f} / {b['p99_us']:.0f} |")
