#!/usr/bin/env python3
"""One markdown row of scripts/bench's structured-output table from moeline_structured_output_bench's
JSON on stdin: `structured_report.py NAME`; with --reasoning, a row of the table of answers that
think first (the steps inside the <think> block in a column of their own)."""
import json
import sys

d = json.load(sys.stdin)
s, b, r = d["in_string"], d["structural"], d["in_reasoning"]
if "--reasoning" in sys.argv[2:]:
    row = (f"| {sys.argv[1]} | {d['vocab']} | {d['document_tokens']} | {d['all']['mean_us']:.0f} "
           f"| {r['steps'] // d['repeat']} | {r['mean_us']:.0f} / {r['p99_us']:.0f} ")
else:
    row = f"| {sys.argv[1]} | {d['vocab']} | {d['vocabulary_build_ms']:.0f} | {d['all']['mean_us']:.0f} "
print(row + f"| {s['mean_us']:.0f} / {s['p99_us']:.0f} | {b['mean_us']:.0f} / {b['p99_us']:.0f} |")
