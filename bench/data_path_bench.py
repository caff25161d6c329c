#!/usr/bin/env python3
"""What the gateway carries and costs per request, before and after bulk data went peer to peer,
in one run: the same stack (tcp:// with Curve, 1 prefill and 4 decode replicas, the demo model
with an 8k context) driven by 16 concurrent streams of 4096-token prompts, for each `moeline`
binary given, alternating rounds so that drift in the machine hits both alike.

Per binary (median of the rounds): bytes through the gateway per request (sent and received on
the gateway process's TCP connections, from `ss -ti`: whichever build), and that less the idle
stack's background traffic (heartbeats; its rate measured after the run with nothing in flight,
times the run's length), gateway CPU time per request
(/proc/PID/stat), TTFT p50 and p99 (the gateway's clock, from each request's timings) and output
tokens per second. Then, for the last binary only (the first with --probe), the probe's load with
1 and 2 probe replicas over 8 tenants: lookups and lookup time per replica.

  data_path_bench.py --moeline NAME=BIN [--moeline NAME=BIN ...] --workdir DIR [--rounds 2]
                     [--requests 48] [--concurrency 16] [--prompt-tokens 4096] [--max-tokens 16]
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from stack_harness import Stack, add_python_paths, percentile, process_cpu_seconds  # noqa: E402,E501


def long_context_model(workdir, context):
    """The demo model with a longer context (RoPE positions go on; the weights are the same)."""
    out = os.path.join(workdir, f"demo-{context}")
    if not os.path.isdir(out):
        shutil.copytree(os.path.join(ROOT, "models", "demo-qwen3-moe"), out)
        path = os.path.join(out, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["max_position_embeddings"] = context
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return out


def process_counters(pid):
    """The bytes on the process's TCP connections (ss's per-socket counters: every stage and
    client connection of a tcp:// stack) and its CPU time, all threads."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
        elif mine:
            for field in line.split():
                if field.startswith(("bytes_sent:", "bytes_received:")):
                    total += int(field.split(":", 1)[1])
    return {"bytes": total, "cpu_s": process_cpu_seconds(pid)}


def process_cpu_s(pid):
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return 0.0


def cpu_by_kind(before, after, n):
    kinds = {}
    for name, start in before.items():
        kind = name.rstrip("0123456789").rstrip("-_")
        kinds[kind] = kinds.get(kind, 0.0) + (after.get(name, start) - start) / n
    return {kind: round(seconds, 3) for kind, seconds in sorted(kinds.items())}


def drive(client, requests, concurrency):
    """Keeps `concurrency` requests in flight; returns (ttft ms list, output tokens, seconds)."""
    pending = list(requests)
    in_flight, ttft, tokens = {}, [], 0
    start = time.time()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            request = pending.pop()
            in_flight[client.start(**request)] = True
        event = client.next_event(timeout=300)
        if event.kind == "delta":
            tokens += len(event.token_ids)
        if event.kind == "error":
            raise RuntimeError(f"request failed: {event.error_message}")
        if event.terminal:
            ttft.append(event.timings["ttft_ms"])
            in_flight.pop(event.client_request_id, None)
    return ttft, tokens, time.time() - start


def one_round(args, name, binary, model, probes=1, tenants=1, requests=None):
    from moeline_client import Client
    run = os.path.join(args.workdir, f"{name}-p{probes}")
    extra = ["--transport", "tcp", "--curve", "on"]
    if probes > 1:
        extra += ["--probe", str(probes)]
    rng = random.Random(7)
    with Stack(binary, model, run, decode=4, extra_args=extra, endpoint_prefix="tcp://",
               threads=1) as stack:
        server_key = stack.state().get("server_key", "")
        gateway = stack.stage("gateway")["pid"]
        with Client(stack.endpoint, timeout=300, server_key=server_key) as client:
            def requests_of(n):
                return [{"tokens": [rng.randrange(3, 4000) for _ in range(args.prompt_tokens)],
                         "max_tokens": args.max_tokens, "ignore_eos": True,
                         "tenant": f"t{i % tenants}"} for i in range(n)]
            drive(client, requests_of(4), args.concurrency)  # warm-up
            stages = {stage["name"]: stage["pid"] for stage in stack.state()["stages"]}
            cpu_before = {name: process_cpu_s(pid) for name, pid in stages.items()}
            before = process_counters(gateway)
            n = requests or args.requests
            ttft, tokens, seconds = drive(client, requests_of(n), args.concurrency)
            after = process_counters(gateway)
            cpu_after = {name: process_cpu_s(pid) for name, pid in stages.items()}
            # The stack's own traffic with nothing to do (heartbeats both ways, every process,
            # twice a second), measured for as long as --idle-seconds: what the loaded run carried
            # of it grows with the run's length, not with the requests.
            time.sleep(1)
            idle_start = process_counters(gateway)
            time.sleep(args.idle_seconds)
            idle_end = process_counters(gateway)
        probe_rows = []
        for stage in stack.state()["stages"]:
            if stage["name"].startswith("probe"):
                metrics = stack.metrics(stage["name"])
                lookups = metrics.get(("moeline_probe_lookups_total", frozenset()), 0)
                busy = metrics.get(("moeline_probe_latency_seconds_sum", frozenset()), 0)
                probe_rows.append((stage["name"], lookups, busy))
    idle_rate = (idle_end["bytes"] - idle_start["bytes"]) / args.idle_seconds
    total = (after["bytes"] - before["bytes"]) / n
    background = idle_rate * seconds / n
    return {"bytes_per_request": total, "background_bytes_per_request": background,
            "request_bytes_per_request": total - background, "idle_bytes_per_s": idle_rate,
            "gateway_cpu_ms_per_request": 1000 * (after["cpu_s"] - before["cpu_s"]) / n,
            "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            "tokens_per_s": tokens / seconds, "probes": probe_rows,
            # CPU seconds per request of each kind of process (replicas summed): where the
            # machine's two cores went.
            "cpu_s_per_request": cpu_by_kind(cpu_before, cpu_after, n)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", action="append", required=True, help="NAME=BINARY")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--python-build", default=os.path.join(ROOT, "build", "python"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--probe-requests", type=int, default=16,
                    help="requests of the probe table's runs")
    ap.add_argument("--idle-seconds", type=float, default=20,
                    help="how long the idle stack's background traffic is measured, per round")
    args = ap.parse_args()
    binaries = [tuple(b.split("=", 1)) for b in args.moeline]
    add_python_paths(args.python_build, os.path.join(ROOT, "sdk", "python"))
    os.makedirs(args.workdir, exist_ok=True)
    model = long_context_model(args.workdir, 8192)
    results = {name: [] for name, _ in binaries}
    for r in range(args.rounds):
        for name, binary in binaries:
            print(f"data path bench: round {r + 1} {name}", file=sys.stderr)
            results[name].append(one_round(args, name, binary, model))
            print(json.dumps({name: results[name][-1]}), file=sys.stderr, flush=True)

    rows = [("bytes through the gateway per request", "bytes_per_request", "{:.0f}"),
            ("of which the idle stack's background (rate x run time / requests)",
             "background_bytes_per_request", "{:.0f}"),
            ("bytes per request less the background", "request_bytes_per_request", "{:.0f}"),
            ("gateway CPU per request (ms)", "gateway_cpu_ms_per_request", "{:.2f}"),
            ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
            (f"output tokens/s at {args.concurrency} streams", "tokens_per_s", "{:.1f}")]
    kinds = sorted({k for name, _ in binaries for x in results[name]
                    for k in x["cpu_s_per_request"]})
    for kind in kinds:
        rows.append((f"CPU per request, {kind} (s)", ("cpu_s_per_request", kind), "{:.3f}"))
    print(f"| {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, median of "
          f"{args.rounds} rounds | " + " | ".join(name for name, _ in binaries) + " |")
    print("|" + " --- |" * (len(binaries) + 1))
    for label, key, fmt in rows:
        def value(x, key=key):
            return x[key[0]].get(key[1], 0.0) if isinstance(key, tuple) else x[key]
        cells = [fmt.format(statistics.median(value(x) for x in results[name]))
                 for name, _ in binaries]
        print(f"| {label} | " + " | ".join(cells) + " |")

    # The probe's load with 1 and 2 replicas (the last binary: the one with --probe).
    name, binary = binaries[-1]
    print()
    print("| probes | replica | lookups | lookup time, total (ms) | mean per lookup (ms) | "
          "TTFT p50 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for probes in (1, 2):
        result = one_round(args, f"{name}-probes", binary, model, probes=probes, tenants=8,
                           requests=args.probe_requests)
        print(json.dumps({f"probes={probes}": result}), file=sys.stderr, flush=True)
        for replica, lookups, busy in result["probes"]:
            mean = 1000 * busy / lookups if lookups else 0
            print(f"| {probes} | {replica} | {lookups:.0f} | {1000 * busy:.1f} | {mean:.2f} | "
                  f"{result['ttft_p50_ms']:.0f} |")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
