#!/usr/bin/env python3
"""scripts/bench's sampling table rows from moeline_sampling_bench's JSON lines on stdin."""
import json
import sys

for line in sys.stdin:
    d = json.loads(line)
    every = d.get("every_token_sorted_us")
    print(f"| {d['vocab']} | {d['logits']} | {d['params']} | {d['draw_us']:.0f} | "
          + (f"{every:.0f} |" if every else "- |"))
