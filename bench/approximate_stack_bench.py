#!/usr/bin/env python3
"""Approximate reuse through a real stack: TTFT with it off and on for a workload with
near-duplicates, and what it served (markdown on stdout, JSON with --json-out).

The workload comes from the evaluation set (tests/eval/approximate_pairs.jsonl): long prompts
(three dictionary entries as context, then a lemma to define). For each of two tenants, "off" and
"on", with the same requests in the same order:
  1. the donors: every pair's first prompt, once (computed in full, cached);
  2. calibration: near-duplicates (a formatting change inside the context) — in "on", each is a
     candidate the decision rule has not proven, so it is computed in full and shadow-checked:
     this is how a running stack learns;
  3. measured: fresh near-duplicates of other donors, mixed one to one with same-template,
     different-question prompts (which must not be served another prompt's answer).
"off" sends everything with exact reuse only; "on" opts into approximate reuse. TTFT is the
gateway's (request received to first token), greedy, 8 tokens per answer.

usage: approximate_stack_bench.py --moeline BIN --model DIR [--pairs FILE] [--delta 0.1]
                                  [--shadow-tokens 1] [--calibration 200] [--measured 100]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from stack_harness import Stack, add_python_paths, percentile  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", default=os.path.join(HERE, "..", "tests", "eval",
                                                        "approximate_pairs.jsonl"))
    parser.add_argument("--python-build", default=os.path.join(HERE, "..", "build", "python"))
    parser.add_argument("--delta", default="0.1")
    parser.add_argument("--reuse", default="approximate", choices=["approximate", "response", "blend"],
                        help="what the 'on' requests opt into")
    parser.add_argument("--shadow-tokens", default="1")
    parser.add_argument("--calibration", type=int, default=200)
    parser.add_argument("--measured", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    add_python_paths(args.python_build, os.path.join(HERE, "..", "sdk", "python"))
    from moeline_client import Client

    rows = [json.loads(line) for line in open(args.pairs) if line.strip()]
    near = [r for r in rows if r["kind"] == "context-format"]
    other = {r["a"]: r["b"] for r in rows if r["kind"] == "context-question"}
    calibration = near[:args.calibration]
    measured_near = near[args.calibration:args.calibration + args.measured]
    measured = []
    for r in measured_near:
        measured.append(("near-duplicate", r["a"], r["b"]))
        if r["a"] in other:
            measured.append(("other question", r["a"], other[r["a"]]))

    config = {"gateway": {"reuse-levels": "all", "shadow-tokens": args.shadow_tokens},
              "probe": {"approximate-max-error": args.delta}}
    results = {}
    with tempfile.TemporaryDirectory(prefix="moeline-approx-", dir="/tmp") as workdir:
        with Stack(args.moeline, args.model, os.path.join(workdir, "s"), config=config,
                   threads=args.threads) as stack:
            with Client(stack.endpoint, timeout=300) as client:
                for mode in ("off", "on"):
                    reuse = args.reuse if mode == "on" else "exact"
                    tenant = f"bench-{mode}"
                    donors = {r["a"] for r in calibration + measured_near}
                    for prompt in sorted(donors):
                        client.generate(prompt=prompt, max_tokens=8, tenant=tenant)
                    served_in_calibration = 0
                    for r in calibration:
                        result = client.generate(prompt=r["b"], max_tokens=8, tenant=tenant,
                                                 reuse=reuse)
                        served_in_calibration += result.usage.get("approximate") in ("response",
                                                                                 "blend")
                    by_kind = {}
                    for kind, donor, prompt in measured:
                        result = client.generate(prompt=prompt, max_tokens=8, tenant=tenant,
                                                 reuse=reuse)
                        entry = by_kind.setdefault(kind, {"ttft": [], "served": 0, "wrong": 0,
                                                          "wrong_first": 0, "n": 0})
                        entry["n"] += 1
                        entry["ttft"].append(result.timings["ttft_ms"])
                        outcome = result.usage.get("approximate") or "exact"
                        entry.setdefault("ttft_by_outcome", {}).setdefault(outcome, []).append(
                            result.timings["ttft_ms"])
                        if result.usage.get("approximate") in ("response", "blend"):
                            entry["served"] += 1
                            # Wrong: not what the prompt itself gets (computed without reuse).
                            own = client.generate(prompt=prompt, max_tokens=8,
                                                  tenant="bench-truth", reuse="none")
                            entry["wrong"] += own.ids != result.ids
                            entry["wrong_first"] += own.ids[:1] != result.ids[:1]
                    results[mode] = {"served_in_calibration": served_in_calibration,
                                     "by_kind": by_kind}
            state = json.loads(subprocess.run(
                [args.moeline, "client", "status", "--endpoint", stack.endpoint],
                capture_output=True, text=True, check=True).stdout)["approximate"]
            results["controller"] = state
            results["metrics"] = {
                "shadow_agreed": stack.metric("probe", "moeline_probe_shadow_checks_total",
                                              result="agreed"),
                "shadow_disagreed": stack.metric("probe", "moeline_probe_shadow_checks_total",
                                                 result="disagreed")}

    print(f"Opt-in: {args.reuse}; δ = {args.delta}, shadow check on the first "
          f"{args.shadow_tokens} token(s); "
          f"{len(calibration)} calibration near-duplicates, then {len(measured)} measured "
          f"requests. TTFT in ms (gateway).\n")
    print("| reuse | requests | n | TTFT mean | p50 | p90 | p99 | served approximately | "
          "served: first token differs | served: any of 8 tokens differs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in ("off", "on"):
        for kind, e in sorted(results[mode]["by_kind"].items()):
            t = e["ttft"]
            print(f"| {mode} | {kind} | {e['n']} | {statistics.fmean(t):.1f} | "
                  f"{percentile(t, 0.5):.1f} | {percentile(t, 0.9):.1f} | "
                  f"{percentile(t, 0.99):.1f} | {e['served']} | {e['wrong_first']} | "
                  f"{e['wrong']} |")
    print("\nTTFT p50 (ms) of the 'on' requests by what the probe did with them:")
    for kind, e in sorted(results["on"]["by_kind"].items()):
        parts = [f"{o} {percentile(t, 0.5):.1f} (n={len(t)})"
                 for o, t in sorted(e["ttft_by_outcome"].items())]
        print(f"- {kind}: " + ", ".join(parts))
    print(f"\nShadow checks during the run: {int(results['metrics']['shadow_agreed'])} agreed, "
          f"{int(results['metrics']['shadow_disagreed'])} disagreed; served during calibration "
          f"(on): {results['on']['served_in_calibration']} of {len(calibration)}. Rollback "
          f"controller at the end: {'on' if results['controller']['enabled'] else 'off'} "
          f"({results['controller']['reason']}).")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
