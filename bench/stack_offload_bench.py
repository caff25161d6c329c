#!/usr/bin/env python3
"""The shared expert pool under a serving load: a stack of 1 prefill and 2 decode processes
sharing one host pool, driven by `moeline load`, every compute process recording its expert
trace. For each budget and prompt length it reports what the pool did (hit ratio, loads, load
time p50/p95 from the offload manager's histogram, stall per output token, decode tokens/s) and
what the merged multi-process trace allows offline (`moeline experts replay`: the pool's policy,
its candidates and Belady's bound, each overall and per process kind).

  stack_offload_bench.py --moeline BIN --model DIR --workdir DIR [--budgets 50%,25%]
                         [--prompts 32,256] [--streams 8] [--duration-s 15] [--max-tokens 64]
                         [--decode 2] [--prefetch-depth N] [--json]

With two or more decode processes it also replays the same accesses as if the decoders had
stepped in phase ("in phase" columns): each decode step of decode-1, decode-2, ... is re-timed to
run layer by layer beside decode-0's step that started nearest to it (within one median step), the
prefill's accesses and every unmatched step left where they were. That is what a setting aligning
the decoders' steps could gain at best, before paying for it in latency.
"""

import argparse
import bisect
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from stack_harness import Stack  # noqa: E402

POLICIES = ("lru,distance,distance-stream,distance-all,distance-area,distance-layer,distance-hinted,"
            "step-oracle")
REPORTED = POLICIES.split(",") + ["belady"]  # what each replay's row gives


def processes(decoders):
    return ["prefill-0"] + [f"decode-{i}" for i in range(decoders)]


def read_trace(path):
    """(header line, [(layer, expert, t_ns, streaming, hint), ...]) of a v3 trace."""
    with open(path) as f:
        header = f.readline()
        rows = [tuple(int(v) for v in line.split()) for line in f
                if line.strip() and not line.startswith("#")]
    return header, rows


def acquisitions(rows):
    """The rows that are acquisitions, not predictions (hint 0)."""
    return [row for row in rows if row[4] == 0]


def decode_steps(rows):
    """Index lists of a trace's decode steps: runs of decode accesses whose layer never falls."""
    steps, current, last = [], [], -1
    for i, (layer, _, _, streaming, _) in enumerate(rows):
        if streaming:
            continue
        if current and layer < last:
            steps.append(current)
            current = []
        current.append(i)
        last = layer
    if current:
        steps.append(current)
    return steps


def write_in_phase(traces, out_dir):
    """The decoders' traces re-timed as if stepped in phase with decode-0 (module docstring);
    returns the new paths (prefill's unchanged) and the share of steps that found a partner."""
    os.makedirs(out_dir, exist_ok=True)
    prefill, leader, followers = traces[0], traces[1], traces[2:]
    _, rows0 = read_trace(leader)
    rows0 = acquisitions(rows0)
    steps0 = decode_steps(rows0)
    starts0 = [rows0[s[0]][2] for s in steps0]
    spans = sorted(rows0[s[-1]][2] - rows0[s[0]][2] for s in steps0)
    median_step = spans[len(spans) // 2] if spans else 0
    paths, matched, total_steps = [prefill, leader], 0, 0
    for path in followers:
        header, rows = read_trace(path)
        rows = acquisitions(rows)  # a follower's predictions are not re-timed: dropped
        taken = set()
        for step in decode_steps(rows):
            total_steps += 1
            t = rows[step[0]][2]
            k = bisect.bisect_left(starts0, t)
            near = [c for c in (k - 1, k) if 0 <= c < len(steps0) and c not in taken]
            if not near:
                continue
            partner = min(near, key=lambda c: abs(starts0[c] - t))
            if abs(starts0[partner] - t) > median_step:
                continue
            taken.add(partner)
            matched += 1
            layer_start = {}
            for i in steps0[partner]:
                layer_start.setdefault(rows0[i][0], rows0[i][2])
            for n, i in enumerate(step):
                layer, expert, _, streaming, hint = rows[i]
                if layer in layer_start:
                    rows[i] = (layer, expert, layer_start[layer] + 1 + n, streaming, hint)
        out = os.path.join(out_dir, os.path.basename(path))
        with open(out, "w") as f:
            f.write(header)
            for row in sorted(rows, key=lambda r: r[2]):
                f.write(" ".join(map(str, row)) + "\n")
        paths.append(out)
    return paths, matched / total_steps if total_steps else None


def replay(args, traces, budget):
    done = subprocess.run([args.moeline, "experts", "replay", "--trace", ",".join(traces),
                           "--budgets", budget, "--policies", POLICIES, "--json"],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"stack_offload_bench: replay failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)["budgets"][0]


def histogram_quantile(metrics, name, q):
    """The q-quantile of a Prometheus histogram, linear within the bucket (as PromQL does)."""
    buckets = sorted((float(dict(labels)["le"]), value) for (sample, labels), value in metrics.items()
                     if sample == name + "_bucket")
    if not buckets or buckets[-1][1] == 0:
        return None
    want = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= want:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (want - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def total(metrics, name):
    return sum(value for (sample, _), value in metrics.items() if sample == name)


def one_case(args, budget, prompt):
    run = os.path.join(args.workdir, f"stack-{budget.rstrip('%')}-{prompt}")
    pattern = os.path.join(run + "-traces", "{replica}.trace")
    os.makedirs(os.path.dirname(pattern), exist_ok=True)
    for name in processes(args.decode):
        path = pattern.replace("{replica}", name)
        if os.path.exists(path):
            os.remove(path)
    config = {"prefill": {"expert-trace": pattern}, "decode": {"expert-trace": pattern}}
    if args.prefetch_depth is not None:
        config["offload"] = {"prefetch-depth": args.prefetch_depth}
    with Stack(args.moeline, args.model, run, prefill=1, decode=args.decode, config=config,
               expert_budget=budget) as stack:
        before = stack.metrics("offload")
        load = subprocess.run(
            [args.moeline, "load", "--endpoint", stack.endpoint, "--model", args.model,
             "--concurrency", str(args.streams), "--duration-s", str(args.duration_s),
             "--prompt-tokens", str(prompt), "--max-tokens", str(args.max_tokens), "--json"],
            capture_output=True, text=True, timeout=args.duration_s + 300)
        if load.returncode != 0 and not load.stdout.strip():
            sys.exit(f"stack_offload_bench: moeline load failed: {load.stderr[-2000:]}")
        report = json.loads(load.stdout.strip().splitlines()[-1])
        after = stack.metrics("offload")
    hits = total(after, "moeline_offload_expert_hits_total") - total(
        before, "moeline_offload_expert_hits_total")
    misses = total(after, "moeline_offload_expert_misses_total") - total(
        before, "moeline_offload_expert_misses_total")
    joined = total(after, "moeline_offload_expert_joined_total") - total(
        before, "moeline_offload_expert_joined_total")
    stall = total(after, "moeline_offload_stall_seconds_total") - total(
        before, "moeline_offload_stall_seconds_total")
    out_tokens = report["output_tokens_per_s"] * report["duration_s"]
    traces = [pattern.replace("{replica}", name) for name in processes(args.decode)]
    missing = [t for t in traces if not os.path.exists(t)]
    if missing:
        sys.exit(f"stack_offload_bench: no trace from {missing}")
    row = replay(args, traces, budget)
    in_phase, paired = None, None
    if args.decode >= 2:
        phased, paired = write_in_phase(traces, run + "-in-phase")
        in_phase = replay(args, phased, budget)
    load_p50 = histogram_quantile(after, "moeline_offload_expert_load_seconds", 0.5)
    load_p95 = histogram_quantile(after, "moeline_offload_expert_load_seconds", 0.95)
    return {
        "budget": budget, "prompt_tokens": prompt, "streams": args.streams,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        # A miss that waited for another caller's load read nothing: a replay counts it a hit.
        "hit_or_joined_ratio": (hits + joined) / (hits + misses) if hits + misses else None,
        "requests": report["completed"], "errors": report["errors"],
        "output_tokens_per_s": report["output_tokens_per_s"],
        "tpot_p50_ms": (report["tpot_ms"] or {}).get("p50"),
        "ttft_p50_ms": (report["ttft_ms"] or {}).get("p50"),
        "stall_ms_per_token": 1e3 * stall / out_tokens if out_tokens else None,
        "load_p50_ms": load_p50 * 1e3 if load_p50 is not None else None,
        "load_p95_ms": load_p95 * 1e3 if load_p95 is not None else None,
        "replay": {policy: row[policy] for policy in REPORTED},
        "replay_by_kind": row.get("by_kind", {}),
        "in_phase": {policy: in_phase[policy] for policy in REPORTED} if in_phase else None,
        "in_phase_steps_paired": paired,
    }


def fmt(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--budgets", default="50%,25%")
    ap.add_argument("--prompts", default="32,256")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=15)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode", type=int, default=2, help="decode processes")
    ap.add_argument("--prefetch-depth", type=int)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.decode < 1:
        ap.error("--decode must be at least 1")
    os.makedirs(args.workdir, exist_ok=True)
    rows = [one_case(args, budget, int(prompt)) for budget in args.budgets.split(",")
            for prompt in args.prompts.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| budget | prompt | pool hit ratio (with joined loads) | replay: distance | distance-stream | distance-all "
          "| distance-area | distance-layer (the pool's) | distance-hinted | step-oracle bound | Belady | Belady decode / prefill | in phase: distance-all / Belady (steps paired) "
          "| decode tok/s | stall ms/token | load p50 / p95 ms |")
    print("| --- " * 16 + "|")
    for r in rows:
        rp, kind, phased = r["replay"], r["replay_by_kind"], r["in_phase"] or {}
        print(f"| {r['budget']} | {r['prompt_tokens']} | {fmt(r['hit_ratio'])} "
              f"({fmt(r['hit_or_joined_ratio'])}) | "
              f"{fmt(rp['distance'])} | {fmt(rp['distance-stream'])} | {fmt(rp['distance-all'])} | "
              f"{fmt(rp['distance-area'])} | {fmt(rp['distance-layer'])} | "
              f"{fmt(rp['distance-hinted'])} | "
              f"{fmt(rp['step-oracle'])} | "
              f"{fmt(rp['belady'])} | {fmt(kind.get('decode', {}).get('belady'))} / "
              f"{fmt(kind.get('prefill', {}).get('belady'))} | "
              f"{fmt(phased.get('distance-all'))} / {fmt(phased.get('belady'))} "
              f"({fmt(r['in_phase_steps_paired'], 2)}) | {fmt(r['output_tokens_per_s'], 1)} | "
              f"{fmt(r['stall_ms_per_token'])} | {fmt(r['load_p50_ms'])} / {fmt(r['load_p95_ms'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
