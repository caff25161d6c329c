#!/usr/bin/env python3
"""Exact reuse through a real stack, measured (markdown tables on stdout, JSON with --json-out):

  ttft       a long prompt (default 1024 tokens) cold, as a prefix hit (all but its last block
             cached), and as a full hit; with the snapshot store's RAM tier large, and with it
             tiny so that hits are restored from the RocksDB disk tier (restore vs recomputation)
  workload   Zipf-popular shared system prompts, 30% exact repeats, the rest unique user turns:
             TTFT mean / p50 / p99 with reuse off and on (same requests, same order) and the
             hit rates by level
  isolation  timing side channel: tenant B sends 8-token prompts that tenant A has cached and
             fresh ones; the ROC AUC of telling them apart by TTFT (0.5: indistinguishable). The
             same harness within one tenant is the positive control.

usage: reuse_stack_bench.py --moeline BIN --long-model DIR --model DIR [--threads T]
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from stack_harness import Stack, add_python_paths, percentile, roc_auc  # noqa: E402


def summary(values):
    return {"mean": statistics.fmean(values), "p50": percentile(values, 0.5),
            "p99": percentile(values, 0.99), "n": len(values)}


def vocab_of(model):
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def expect_level(usage, level):
    if usage["reuse_level"] != level:
        raise AssertionError(f"expected reuse level {level}: {usage}")


def ttft(client, **request):
    result = client.generate(**request)
    return result.timings["ttft_ms"], result.usage


def bench_ttft(args, workdir):
    from moeline_client import Client
    vocab = vocab_of(args.long_model)
    out = {}
    for tier, ram in (("ram", "1GiB"), ("disk", "64KiB")):
        config = {"probe": {"store-ram-bytes": ram}}
        with Stack(args.moeline, args.long_model, os.path.join(workdir, f"ttft-{tier}"),
                   config=config, threads=args.threads) as stack:
            rows = {"cold": [], "prefix": [], "full": []}
            with Client(stack.endpoint, timeout=600) as client:
                rng = random.Random(1)
                ttft(client, tokens=[rng.randrange(vocab) for _ in range(64)], max_tokens=1)  # warm
                for _ in range(args.repeat):
                    prompt = [rng.randrange(vocab) for _ in range(args.long)]
                    t, usage = ttft(client, tokens=prompt, max_tokens=1)
                    expect_level(usage, "none")
                    rows["cold"].append(t)
                    other = prompt[:-16] + [rng.randrange(vocab) for _ in range(16)]
                    t, usage = ttft(client, tokens=other, max_tokens=1)
                    expect_level(usage, "prefix")
                    rows["prefix"].append(t)
                    t, usage = ttft(client, tokens=prompt, max_tokens=2)  # not a result hit
                    expect_level(usage, "full")
                    rows["full"].append(t)
            restores = stack.metric("probe", "moeline_probe_store_restores")
        out[tier] = {k: statistics.median(v) for k, v in rows.items()}
        out[tier]["restores"] = restores
    return out


def bench_workload(args, workdir):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    rng = random.Random(2)
    systems = [[rng.randrange(vocab) for _ in range(args.system_tokens)] for _ in range(8)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(systems))]
    requests = []
    for _ in range(args.requests):
        if requests and rng.random() < 0.3:
            requests.append(dict(rng.choice(requests)))
        else:
            system = rng.choices(systems, weights)[0]
            requests.append({"tokens": system + [rng.randrange(vocab) for _ in range(40)],
                             "max_tokens": 8})
    out = {}
    for mode, levels in (("off", "none"), ("on", "prefix,full,result")):
        config = {"gateway": {"reuse-levels": levels}}
        with Stack(args.moeline, args.model, os.path.join(workdir, f"workload-{mode}"),
                   config=config, threads=args.threads) as stack:
            times, levels_seen = [], {}
            with Client(stack.endpoint, timeout=600) as client:
                client.generate(tokens=[1, 2, 3], max_tokens=1)  # warm-up
                for request in requests:
                    t, usage = ttft(client, **request)
                    times.append(t)
                    levels_seen[usage["reuse_level"]] = levels_seen.get(usage["reuse_level"], 0) + 1
        out[mode] = {"ttft_ms": summary(times), "levels": levels_seen}
    return out


def bench_isolation(args, workdir):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    rng = random.Random(3)
    cached = [[rng.randrange(vocab) for _ in range(8)] for _ in range(args.probes)]
    fresh = [[rng.randrange(vocab) for _ in range(8)] for _ in range(args.probes)]
    out = {}
    with Stack(args.moeline, args.model, os.path.join(workdir, "isolation"),
               threads=args.threads) as stack:
        with Client(stack.endpoint, timeout=600) as client:
            for prompt in cached:  # tenant A caches its prompts (blocks, logits and results)
                client.generate(tokens=prompt, max_tokens=4, tenant="a")
            for attacker in ("b", "a"):
                trials = [(p, True) for p in cached] + [(p, False) for p in fresh]
                rng.shuffle(trials)
                hit, miss = [], []
                for prompt, is_cached in trials:
                    t, _ = ttft(client, tokens=prompt, max_tokens=4, tenant=attacker)
                    (hit if is_cached else miss).append(t)
                # A second round of fresh prompts for the control: the first round cached them.
                fresh = [[rng.randrange(vocab) for _ in range(8)] for _ in range(args.probes)]
                out["other tenant" if attacker == "b" else "same tenant (control)"] = {
                    "roc_auc": roc_auc(hit, miss), "cached_ttft_ms": summary(hit),
                    "fresh_ttft_ms": summary(miss)}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", required=True, help="workload and isolation model")
    parser.add_argument("--long-model", help="TTFT model (context >= --long + 16); default --model")
    parser.add_argument("--python-build", required=True)
    parser.add_argument("--python-sdk", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--long", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--probes", type=int, default=60)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    args.long_model = args.long_model or args.model
    add_python_paths(args.python_build, args.python_sdk)
    results = {}
    with tempfile.TemporaryDirectory(prefix="mlrb-", dir="/tmp") as workdir:
        results["ttft"] = bench_ttft(args, workdir)
        results["workload"] = bench_workload(args, workdir)
        results["isolation"] = bench_isolation(args, workdir)

    t = results["ttft"]
    name = os.path.basename(args.long_model.rstrip("/"))
    print(f"### TTFT of a {args.long}-token prompt ({name}, median of {args.repeat})\n")
    print("| store tier serving the hit | cold (ms) | prefix hit (ms) | full hit (ms) | full / cold |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for tier in ("ram", "disk"):
        r = t[tier]
        print(f"| {tier} | {r['cold']:.1f} | {r['prefix']:.1f} | {r['full']:.1f} | "
              f"{r['full'] / r['cold']:.1%} |")
    w = results["workload"]
    print(f"\n### Workload: {args.requests} requests, 8 Zipf-popular system prompts of "
          f"{args.system_tokens} tokens + 40-token user turns, 30% exact repeats\n")
    print("| reuse | mean TTFT ms | p50 | p99 | levels |")
    print("| --- | ---: | ---: | ---: | --- |")
    for mode in ("off", "on"):
        s = w[mode]["ttft_ms"]
        print(f"| {mode} | {s['mean']:.2f} | {s['p50']:.2f} | {s['p99']:.2f} | {w[mode]['levels']} |")
    print(f"\nmean TTFT with reuse: {1 - w['on']['ttft_ms']['mean'] / w['off']['ttft_ms']['mean']:.1%}"
          " lower")
    print(f"\n### Isolation: {args.probes} cached vs {args.probes} fresh 8-token prompts\n")
    print("| who probes | ROC AUC | cached TTFT p50 ms | fresh TTFT p50 ms |")
    print("| --- | ---: | ---: | ---: |")
    for who, r in results["isolation"].items():
        print(f"| {who} | {r['roc_auc']:.3f} | {r['cached_ttft_ms']['p50']:.2f} | "
              f"{r['fresh_ttft_ms']['p50']:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
