#!/usr/bin/python3
"""Markdown table from the JSON lines of bench/tokenizer_bench.cpp and bench/tokenizer_reference.js
(one pair per tokenizer, each line prefixed by the tokenizer's name and a tab)."""
import json
import sys

rows = {}
for line in open(sys.argv[1], encoding="utf-8"):
    name, _, payload = line.rstrip("\n").partition("\t")
    r = json.loads(payload)
    rows.setdefault(name, {})[r["engine"]] = r

print("| tokenizer | vocab | engine | load ms | encode MB/s (1 MB, cold) | encode MB/s (1 MB) "
      "| encode MB/s (per line) | tokens |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for name, engines in rows.items():
    for engine, r in engines.items():
        print(f"| {name} | {r['vocab']} | {engine} | {r['load_ms']:.1f} | {r['encode_cold_mb_s']:.2f} "
              f"| {r['encode_mb_s']:.2f} | {r['encode_lines_mb_s']:.2f} | {r['tokens']} |")
    counts = {r["tokens"] for r in engines.values()}
    if len(counts) > 1:
        print(f"\nWARNING: {name}: token counts differ between engines: {counts}", file=sys.stderr)
