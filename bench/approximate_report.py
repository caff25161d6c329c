#!/usr/bin/env python3
"""Runs moeline_approximate_bench (the decision rule of approximate reuse against the fixed
threshold alone, on tests/eval/approximate_pairs.jsonl) for each shadow-check length and prints
markdown tables for docs/PERFORMANCE.md.

usage: approximate_report.py --bench BIN --model DIR --pairs FILE [--shadow-tokens 1,8]
                             [--deltas 0.01,0.05,0.1,0.2] [--passes 4] [--modes response,blend]

Response reuse is judged on the first n greedy tokens (one table per --shadow-tokens); blended KV
reuse as the gateway judges a blend shadow (first-token top-1 and KL).
"""

import argparse
import json
import subprocess


def pct(x):
    return f"{100 * x:.1f}%"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", required=True)
    parser.add_argument("--shadow-tokens", default="1,8")
    parser.add_argument("--deltas", default="0.01,0.05,0.1,0.2")
    parser.add_argument("--passes", default="4")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--modes", default="response,blend")
    args = parser.parse_args()
    runs = []
    for mode in args.modes.split(","):
        for n in (args.shadow_tokens.split(",") if mode == "response" else ["1"]):
            runs.append((mode, n))
    for mode, n in runs:
        cmd = [args.bench, "--model", args.model, "--pairs", args.pairs, "--shadow-tokens", n,
               "--deltas", args.deltas, "--passes", args.passes, "--threads", args.threads,
               "--mode", mode]
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        first = out["runs"][0]["threshold_only"]
        if mode == "blend":
            check = (f"Blended KV reuse (recompute fraction {out['recompute_fraction']}, "
                     f"{pct(out['blend_recomputed_share'])} of tokens recomputed); a served blend "
                     f"is wrong when its first-token top-1 differs from a full prefill's or "
                     f"KL > {out['blend_max_kl']}; only the pairs the probe would blend (a block "
                     f"of the donor's aligned KV past the exact prefix hit): "
                     f"{out['pairs_not_blended_by_the_probe']} of the set's pairs are not")
            same, wrong = "blend passes the check", "served blends that fail it"
        else:
            check = f"Response reuse; shadow check: the first {n} greedy token(s)"
            same, wrong = "same answer", "served answers that differ"
        print(f"{check}; {out['pairs']} pairs, "
              f"{out['pairs'] - out['calibration_pairs']} held out "
              f"({first['pairs_match']} should match, {first['pairs_must_not']} must not; "
              f"{first['pairs_same_answer']} where reuse is right: {same}); calibration "
              f"share seen {out['passes']}x; threshold {out['threshold']}.\n")
        print("| policy | δ | hit rate (should match) | false reuse (must not) | "
              f"hit rate ({same}) | {wrong} |")
        print("|---|---|---|---|---|---|")
        t = first
        print(f"| threshold alone | – | {pct(t['hit_rate_label'])} | {pct(t['false_reuse_label'])} | "
              f"{pct(t['hit_rate_output'])} | {pct(t['false_reuse_output'])} ({t['served_wrong']} of "
              f"{t['served']}) |")
        for run in out["runs"]:
            r = run["rule"]
            print(f"| decision rule | {run['delta']} | {pct(r['hit_rate_label'])} | "
                  f"{pct(r['false_reuse_label'])} | {pct(r['hit_rate_output'])} | "
                  f"{pct(r['false_reuse_output'])} ({r['served_wrong']} of {r['served']}) |")
        print()
        last = out["runs"][-1]
        print(f"By kind (δ = {last['delta']}): pairs where reuse is right ({same}), served by the "
              "threshold alone (wrong), served by the rule (wrong).\n")
        print(f"| kind | should match | {same} | threshold: served (wrong) | "
              "rule: served (wrong) |")
        print("|---|---|---|---|---|")
        for kind, v in sorted(last["by_kind"].items()):
            t, r = v["threshold"], v["rule"]
            print(f"| {kind} | {'yes' if t['pairs_match'] else 'no'} | {t['pairs_same_answer']} of "
                  f"{t['pairs_match'] + t['pairs_must_not']} | {t['served']} ({t['served_wrong']}) | "
                  f"{r['served']} ({r['served_wrong']}) |")
        print()


if __name__ == "__main__":
    main()
