#!/usr/bin/env python3
"""What CurveZMQ costs: the same stack over loopback tcp:// with Curve off and on, in one run,
alternating (off, on, on, off, off, on, ...: every other round reversed, so neither variant always
runs after the other) so that drift in the machine hits both alike.

Each round starts a stack (`moeline stack up --transport tcp --curve off|on`), warms it up, then
measures (a) TTFT and per-token time of sequential single requests (the SDK's timings: the
gateway's clock, so client overhead is out) and (b) `moeline load` at --concurrency streams
(its TTFT and per-token percentiles). Each TTFT is also split, from the stages' own histograms,
into prefill's part (its compute, and under load its queue) and the rest (gateway, probe and the
hops between them: where Curve acts), and the stages' CPU time per request is read from /proc.
Prints a markdown table of medians and the overhead of on over off.

  curve_bench.py --moeline BIN --model DIR --workdir DIR [--rounds 3] [--requests 40]
                 [--concurrency 8 | --rate R] [--duration-s 10] [--prompt-tokens 32] [--max-tokens 32]
                 [--variants off,on,on/io2] [--interleave WINDOWS] [--from-json LOG [LOG ...]]

Besides the medians, each variant gets the geometric mean of its rounds' ratios to the baseline's
run of the same round and a 95% bootstrap interval of it: on this 2-vCPU VM a saturated
percentile moves by a third between rounds, and the interval says what a run can resolve.
--from-json prints the table again from the results that earlier runs printed last (their whole
stderr logs will do), pooling their rounds; the variants must match.

--interleave WINDOWS starts every variant's stack at once and measures them in turn in short
windows (ABBA), each window's pair then a "round" of the table: the VM's slow spells, which last
minutes, hit both sides of a pair alike, so a small difference is resolved in fewer minutes.

A variant is `off` or `on`, optionally with `/ioN`: the stages' ZeroMQ I/O threads
(--io-threads, through MOELINE_IO_THREADS), and optionally `@alt`: the stack and the load client
of another build (--alt-moeline BIN), to compare two builds round by round in one run.
"""

import argparse
import contextlib
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from stack_harness import Stack, add_python_paths, process_cpu_seconds  # noqa: E402


def start_stack(args, variant):
    """The stack of one variant, not yet entered."""
    variant, _, build = variant.partition("@")
    moeline = args.alt_moeline if build == "alt" else args.moeline
    curve, _, io = variant.partition("/")
    if io:
        os.environ["MOELINE_IO_THREADS"] = io.removeprefix("io")
    else:
        os.environ.pop("MOELINE_IO_THREADS", None)
    run = os.path.join(args.workdir, f"curve-{variant.replace('/', '-')}{'-alt' if build else ''}")
    extra = ["--transport", "tcp", "--curve", curve]
    return Stack(moeline, args.model, run, extra_args=extra, endpoint_prefix="tcp://", threads=1)


def one_round(args, variant):
    with start_stack(args, variant) as stack:
        return measure(args, stack, args.requests, args.duration_s)


def measure(args, stack, requests, duration_s):
    """Sequential single requests, then the stack's own build's `moeline load`, on a stack that
    is up."""
    from moeline_client import Client
    server_key = stack.state().get("server_key", "")
    ttft, per_token = [], []
    with Client(stack.endpoint, timeout=120, server_key=server_key) as client:
        for i in range(requests + 5):
            tokens = [(i * 13 + j) % 500 + 3 for j in range(args.prompt_tokens)]
            if i == 5:
                single_before = server_side(stack)
            result = client.generate(tokens=tokens, max_tokens=args.max_tokens, ignore_eos=True,
                                     reuse="none")
            if i < 5:
                continue  # warm-up
            t = result.timings
            ttft.append(t["ttft_ms"])
            per_token.append((t["total_ms"] - t["ttft_ms"]) / max(1, len(result.ids) - 1))
        single = difference(server_side(stack), single_before)
    pace = ["--rate", str(args.rate)] if args.rate else ["--concurrency", str(args.concurrency)]
    cmd = [stack.moeline, "load", "--endpoint", stack.endpoint, "--model", args.model, *pace,
           "--duration-s", str(duration_s),
           "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
           "--json"]
    env = dict(os.environ, MOELINE_SERVER_KEY=server_key) if server_key else None
    before = server_side(stack)
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    after = server_side(stack)
    if out.returncode != 0 and not out.stdout.strip():
        raise RuntimeError(f"moeline load failed: {out.stderr[-400:]}")
    load = json.loads(out.stdout.strip().splitlines()[-1])
    load["server"] = difference(after, before)
    # The load client shares the two cores with the stack: its CPU is part of what saturates them.
    load["server"]["client_cpu_s"] = (client_after.ru_utime + client_after.ru_stime -
                                      client_before.ru_utime - client_before.ru_stime)
    return {"ttft_ms": statistics.median(ttft), "tpot_ms": statistics.median(per_token),
            "server": single, "load": load}


def interleaved_windows(args, variants, results):
    """Every variant's stack up at once, idle but for the one measured: short windows, each
    variant in turn (ABBA order, so neither always follows the other). A slow spell of the VM
    (they last minutes) then hits both sides of a pair alike, which whole rounds a minute apart
    do not."""
    with contextlib.ExitStack() as stacks:
        up = {v: stacks.enter_context(start_stack(args, v)) for v in variants}
        for v in variants:  # warm every stack before the first window counts
            measure(args, up[v], 2, min(args.duration_s, 2))
        for w in range(args.interleave):
            order = variants if w % 2 == 0 else variants[::-1]
            for v in order:
                print(f"curve bench: window {w + 1} variant {v}", file=sys.stderr)
                results[v].append(measure(args, up[v], args.requests, args.duration_s))


# The stages' own clocks, differenced over a window: the gateway's TTFT (so the load client's
# share of the two cores is out of the figure) and prefill's (job received to first token, in
# the stage: its compute and batching, which Curve does not touch). Their difference is the time
# a first token spends outside prefill's compute (gateway, probe, the hops): the part of TTFT
# that Curve acts on. Compute moves by 5-10% between rounds on this VM and takes the rest of
# TTFT with it, so the split shows Curve's share apart from that drift.
HISTOGRAMS = {"gw_ttft": ("gateway", "moeline_gateway_ttft_seconds"),
              "gw_queue": ("gateway", "moeline_gateway_queue_seconds"),
              "prefill_ttft": ("prefill-", "moeline_prefill_ttft_seconds"),
              # Decode's steps: a step's cost, and how many sequences share it, so that a change
              # in per-token time reads as slower steps or as smaller batches.
              "decode_step": ("decode-", "moeline_decode_step_seconds"),
              "decode_batch": ("decode-", "moeline_decode_batch_size")}


def difference(after, before):
    return {key: after[key] - before[key] for key in after}


def server_side(stack):
    stages = [stage["name"] for stage in stack.state()["stages"]]
    metrics = {name: stack.metrics(name) for name in stages
               if name == "gateway" or name.startswith(("prefill-", "decode-"))}
    out = {}
    for key, (stage_prefix, name) in HISTOGRAMS.items():
        for part in ("sum", "count"):
            out[f"{key}_{part}"] = sum(
                v for stage, samples in metrics.items() if stage.startswith(stage_prefix)
                for (sample, _), v in samples.items() if sample == f"{name}_{part}")
    # Messages through the gateway: to and from the stages (the hub, heartbeats included), and to
    # the clients (stream events, single or batched); each an encryption or a decryption under
    # Curve.
    gateway = metrics["gateway"]
    out["gw_hub_messages"] = sum(v for (sample, _), v in gateway.items()
                                 if sample == "moeline_hub_messages_total")
    out["gw_client_messages"] = sum(v for (sample, _), v in gateway.items()
                                    if sample == "moeline_gateway_stream_messages_total")
    for stage in stack.state()["stages"]:
        try:
            out[f"cpu_s_{stage['name']}"] = process_cpu_seconds(stage["pid"])
        except (OSError, IndexError, ValueError):
            out[f"cpu_s_{stage['name']}"] = 0.0
    return out


def server_mean_ms(server, key):
    return 1000 * server_ratio(server, key)


def server_ratio(server, key):
    """A histogram's mean over the window (NaN where an older run did not record it: such rounds
    are left out of that measure when runs are pooled)."""
    if f"{key}_count" not in server:
        return math.nan
    return server[f"{key}_sum"] / max(1, server[f"{key}_count"])


def outside_prefill_ms(server):
    return server_mean_ms(server, "gw_ttft") - server_mean_ms(server, "prefill_ttft")


def cpu_ms_per_request(load, prefix="cpu_s_"):
    server = load["server"]
    return 1000 * sum(v for k, v in server.items() if k.startswith(prefix)) / max(
        1, server["gw_ttft_count"])


def per_request(load, key):
    server = load["server"]
    return server.get(key, 0.0) / max(1, server["gw_ttft_count"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline")
    ap.add_argument("--model")
    ap.add_argument("--workdir")
    ap.add_argument("--python-build", default=os.path.join(ROOT, "build", "python"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rate", type=float, default=0,
                    help="requests per second, open loop, instead of --concurrency streams")
    ap.add_argument("--duration-s", type=float, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--variants", default="off,on",
                    help="comma-separated: off, on, optionally /ioN, optionally @alt (the first "
                         "is the baseline)")
    ap.add_argument("--alt-moeline", help="the build that variants ending in @alt run")
    ap.add_argument("--interleave", type=int, metavar="WINDOWS",
                    help="instead of rounds that each start a stack: every variant's stack up at "
                         "once and WINDOWS short measurements of each in turn (use a small "
                         "--requests and --duration-s)")
    ap.add_argument("--fixed-order", action="store_true",
                    help="run the variants in the order given in every round (before 2026-12-06 "
                         "the only order) instead of reversing it every other round")
    ap.add_argument("--from-json", nargs="+", metavar="LOG",
                    help="no runs: pool the rounds that these earlier runs printed")
    args = ap.parse_args()
    if not args.from_json and not (args.moeline and args.model and args.workdir):
        ap.error("--moeline, --model and --workdir are required (except with --from-json)")
    variants = args.variants.split(",")
    for v in variants:
        spec, _, build = v.partition("@")
        curve, _, io = spec.partition("/")
        if curve not in ("off", "on") or (io and not (io.startswith("io") and io[2:].isdigit())) \
                or build not in ("", "alt"):
            ap.error(f"--variants: {v!r} is not off|on[/ioN][@alt]")
        if build and not args.alt_moeline:
            ap.error(f"--variants: {v!r} needs --alt-moeline")
    add_python_paths(args.python_build, os.path.join(ROOT, "sdk", "python"))
    results = {v: [] for v in variants}
    if args.from_json:
        for path in args.from_json:
            with open(path) as f:
                saved = json.loads(next(line for line in f if line.startswith('{"')))
            if sorted(saved) != sorted(variants):
                ap.error(f"--from-json: {path} has variants {sorted(saved)}, not {variants}")
            for v in variants:
                results[v] += saved[v]
        args.rounds = len(results[variants[0]])
    if args.interleave and not args.from_json:
        interleaved_windows(args, variants, results)
        args.rounds = args.interleave
    for r in range(0 if args.from_json or args.interleave else args.rounds):
        # ABBA: a variant that always ran second would always meet the state the first one's
        # stack left behind (its exit, the page cache, the VM's drift within a round).
        order = variants if args.fixed_order or r % 2 == 0 else variants[::-1]
        for v in order:
            print(f"curve bench: round {r + 1} variant {v}", file=sys.stderr)
            results[v].append(one_round(args, v))

    load_label = f"load at {args.rate:g}/s" if args.rate else f"load x{args.concurrency}"

    def med(curve, get):
        values = [value for value in map(get, results[curve]) if not math.isnan(value)]
        return statistics.median(values) if values else math.nan

    rows = [
        ("single request TTFT (ms)", lambda x: x["ttft_ms"]),
        ("single: in prefill's compute, mean (ms)",
         lambda x: server_mean_ms(x["server"], "prefill_ttft")),
        ("single: outside prefill's compute, mean (ms)", lambda x: outside_prefill_ms(x["server"])),
        ("single request per-token (ms)", lambda x: x["tpot_ms"]),
        (f"{load_label}: TTFT p50 (ms)", lambda x: x["load"]["ttft_ms"]["p50"]),
        (f"{load_label}: gateway TTFT mean (ms)",
         lambda x: server_mean_ms(x["load"]["server"], "gw_ttft")),
        (f"{load_label}: in prefill (queue + compute), mean (ms)",
         lambda x: server_mean_ms(x["load"]["server"], "prefill_ttft")),
        (f"{load_label}: outside prefill, mean (ms)",
         lambda x: outside_prefill_ms(x["load"]["server"])),
        (f"{load_label}: per-token p50 (ms)", lambda x: x["load"]["tpot_ms"]["p50"]),
        (f"{load_label}: decode step, mean (ms)",
         lambda x: server_mean_ms(x["load"]["server"], "decode_step")),
        (f"{load_label}: sequences per decode step, mean",
         lambda x: server_ratio(x["load"]["server"], "decode_batch")),
        # A closed loop's whole request: where TTFT and per-token time trade places (the two
        # cores shared between prefill and decode), this is what a stream waits in all.
        (f"{load_label}: request latency p50 (ms)", lambda x: x["load"]["e2e_ms"]["p50"]),
        (f"{load_label}: request latency mean (ms)", lambda x: x["load"]["e2e_ms"]["mean"]),
        (f"{load_label}: output tokens/s", lambda x: x["load"]["output_tokens_per_s"]),
        (f"{load_label}: stages' CPU per request (ms)",
         lambda x: cpu_ms_per_request(x["load"])),
        (f"{load_label}: prefill CPU per request (ms)",
         lambda x: cpu_ms_per_request(x["load"], "cpu_s_prefill-")),
        (f"{load_label}: decode CPU per request (ms)",
         lambda x: cpu_ms_per_request(x["load"], "cpu_s_decode-")),
        (f"{load_label}: gateway CPU per request (ms)",
         lambda x: cpu_ms_per_request(x["load"], "cpu_s_gateway")),
        (f"{load_label}: load client CPU per request (ms)",
         lambda x: cpu_ms_per_request(x["load"], "client_cpu_s")),
        (f"{load_label}: gateway's messages to and from stages per request",
         lambda x: per_request(x["load"], "gw_hub_messages")),
        (f"{load_label}: gateway's messages to clients per request",
         lambda x: per_request(x["load"], "gw_client_messages")),
    ]
    def name(v):
        spec, _, build = v.partition("@")
        curve, _, io = spec.partition("/")
        return (f"tcp, Curve {curve}" + (f", {io[2:]} I/O threads" if io else "") +
                (" (--alt-moeline)" if build else ""))

    # "vs" compares the medians; "paired" is the median of each round's ratio to the baseline's
    # run of the same round, which the VM's slow periods (they last minutes, and hit a whole
    # round) move less.
    def paired(v, get):
        ratios = [get(x) / get(b) for x, b in zip(results[v], results[base])
                  if get(b) != 0 and not math.isnan(get(b) + get(x))]
        return statistics.median(ratios) - 1 if ratios else float("nan")

    # The geometric mean of the rounds' ratios and its 95% bootstrap interval (fixed seed, so a
    # table printed again from the same results is the same table).
    def interval(v, get):
        logs = [math.log(get(x) / get(b)) for x, b in zip(results[v], results[base])
                if get(b) > 0 and get(x) > 0]
        if not logs:
            return "–"
        rng = random.Random(1)
        means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(10000))
        pct = lambda x: f"{100 * (math.exp(x) - 1):+.1f}%"  # noqa: E731
        return (f"{pct(statistics.fmean(logs))} ({pct(means[249])} to {pct(means[9749])})")

    base = variants[0]
    unit = "windows" if args.interleave else "rounds"
    header = [f"measure (median of {args.rounds} {unit})", name(base)]
    for v in variants[1:]:
        header += [name(v), f"vs {base}", "paired", "paired mean (95% interval)"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for label, get in rows:
        b = med(base, get)
        if math.isnan(b):
            continue  # no pooled run recorded it
        cells = [label, f"{b:.2f}"]
        for v in variants[1:]:
            x = med(v, get)
            # (b is 0 for a measure that runs of an older curve_bench did not record.)
            versus = f"{100 * (x - b) / b:+.1f}%" if b else "–"
            pair = paired(v, get)
            cells += [f"{x:.2f}", versus, "–" if math.isnan(pair) else f"{100 * pair:+.1f}%",
                      interval(v, get)]
        print("| " + " | ".join(cells) + " |")
    if not args.from_json:
        print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
