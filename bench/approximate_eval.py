#!/usr/bin/env python3
"""How well activation signatures tell interchangeable prompts from different ones, on the
evaluation set tests/eval/approximate_pairs.jsonl (scripts/make-approximate-eval): for each
signature depth (the first k MoE layers) and metric, the ROC AUC of separating "should match" pairs
from "must not" pairs, and at fixed cosine thresholds the served hit rate (matches at or above the
threshold) and the false-reuse rate (non-matches at or above it), overall and by kind. This is the
fixed threshold alone; the decision rule of approximate reuse (shadow checks, an error bound) is
built on top of it.

usage: approximate_eval.py --moeline BIN [--model DIR] [--pairs FILE] [--layers 1,2,6]
"""

import argparse
import json
import math
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def signatures(moeline, model, prompts, layers):
    lines = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    cmd = [moeline, "signature", "--signature-layers", str(layers)] + (["--model", model] if model else [])
    out = subprocess.run(cmd, input=lines, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    return {row["prompt"]: row for row in rows}


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b))


def euclidean(a, b):
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def jaccard(a, b):
    scores = []
    for x, y in zip(a, b):
        x, y = set(x), set(y)
        scores.append(len(x & y) / len(x | y) if x | y else 1.0)
    return sum(scores) / len(scores) if scores else 1.0


def auc(positives, negatives):
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model")
    parser.add_argument("--pairs", default=os.path.join(HERE, "..", "tests", "eval",
                                                        "approximate_pairs.jsonl"))
    parser.add_argument("--layers", default="1,2,6")
    parser.add_argument("--thresholds", default="0.9,0.93,0.95,0.97,0.99")
    args = parser.parse_args()
    with open(args.pairs) as f:
        pairs = [json.loads(line) for line in f]
    prompts = sorted({p["a"] for p in pairs} | {p["b"] for p in pairs})
    thresholds = [float(t) for t in args.thresholds.split(",")]
    kinds = sorted({p["kind"] for p in pairs})
    counts = ", ".join(f"{k} {sum(p['kind'] == k for p in pairs)}" for k in kinds)
    print(f"### Signature quality on {len(pairs)} pairs ({counts})\n")
    print("| first k MoE layers | cosine AUC | Euclidean AUC (negated) | Jaccard AUC |")
    print("| ---: | ---: | ---: | ---: |")
    tables = []
    for layers in [int(x) for x in args.layers.split(",")]:
        rows = signatures(args.moeline, args.model, prompts, layers)
        scored = []
        for p in pairs:
            a, b = rows[p["a"]], rows[p["b"]]
            scored.append({**p, "cosine": cosine(a["signature"], b["signature"]),
                           "euclidean": euclidean(a["signature"], b["signature"]),
                           "jaccard": jaccard(a["experts"], b["experts"])})
        pos = [s for s in scored if s["match"]]
        neg = [s for s in scored if not s["match"]]
        print(f"| {layers} | {auc([s['cosine'] for s in pos], [s['cosine'] for s in neg]):.3f} | "
              f"{auc([-s['euclidean'] for s in pos], [-s['euclidean'] for s in neg]):.3f} | "
              f"{auc([s['jaccard'] for s in pos], [s['jaccard'] for s in neg]):.3f} |")
        tables.append((layers, scored))
    for layers, scored in tables:
        print(f"\n#### k = {layers}: cosine threshold alone\n")
        print("| threshold | served hit rate (synonyms) | false reuse (all non-matches) | " +
              " | ".join(f"false reuse ({k})" for k in kinds if k != "synonym") + " |")
        print("| ---: | ---: | ---: | " + " | ".join("---:" for k in kinds if k != "synonym") + " |")
        for t in thresholds:
            pos = [s for s in scored if s["match"]]
            neg = [s for s in scored if not s["match"]]
            hit = sum(s["cosine"] >= t for s in pos) / len(pos)
            false = sum(s["cosine"] >= t for s in neg) / len(neg)
            by_kind = []
            for k in kinds:
                if k == "synonym":
                    continue
                group = [s for s in neg if s["kind"] == k]
                by_kind.append(f"{sum(s['cosine'] >= t for s in group) / len(group):.1%}")
            print(f"| {t:.2f} | {hit:.1%} | {false:.1%} | " + " | ".join(by_kind) + " |")


if __name__ == "__main__":
    main()
