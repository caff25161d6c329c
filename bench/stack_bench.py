#!/usr/bin/env python3
"""The pipeline's cost, measured against the in-process engine in the same run (prints markdown
tables, and the raw JSON with --json-out):

  TTFT        a P-token prompt through the stack (client -> gateway -> probe -> prefill -> first
              token back) vs the in-process prefill of the same prompt (moeline_bench)
  per token   added latency per streamed token over ipc://: the stack's median time between a
              single stream's tokens minus the in-process decode time per token at batch 1
  throughput  decode tokens/s of 16 concurrent streams through the stack (16 / mean time between
              a stream's tokens) vs the in-process engine decoding a batch of 16
  load        `moeline load` tables: prefill alone, decode alone, the whole stack

usage: stack_bench.py --moeline BIN --bench BIN --model DIR [--threads T] [--prompt P]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run_json(cmd, timeout=1200):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"stack_bench: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_steps(run_dir):
    """(sum of seconds, count) of decode-0's step histogram."""
    import urllib.request
    with open(os.path.join(run_dir, "decode-0.port")) as f:
        port = int(f.read())
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("moeline_decode_step_seconds_sum ") or \
                line.startswith("moeline_decode_step_seconds_count "):
            name, value = line.split()
            values[name] = float(value)
    return values["moeline_decode_step_seconds_sum"], values["moeline_decode_step_seconds_count"]


def load(args, extra, endpoint=None):
    cmd = [args.moeline, "load", "--model", args.model, "--json", "--threads", str(args.threads)]
    if endpoint:
        cmd += ["--endpoint", endpoint]
    return run_json(cmd + [str(x) for x in extra])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--bench", required=True, help="moeline_bench (in-process engine)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    with open(os.path.join(args.model, "config.json")) as f:
        context = json.load(f).get("max_position_embeddings", 32768)
    prompt = min(args.prompt, context - 2)
    decode = min(args.decode, context - 20)
    t = str(args.threads)
    results = {"model": args.model, "threads": args.threads, "prompt_tokens": prompt}

    engine_prefill = run_json([args.bench, "--model", args.model, "--threads", t, "--prompt",
                               str(prompt), "--decode", "1", "--repeat", "5"])
    engine_decode1 = run_json([args.bench, "--model", args.model, "--threads", t, "--prompt", "16",
                               "--decode", str(decode), "--repeat", "3"])
    engine_decode16 = run_json([args.bench, "--model", args.model, "--threads", t, "--prompt", "16",
                                "--decode", str(decode), "--repeat", "3", "--batch", "16"])
    results["engine"] = {"prefill": engine_prefill, "decode_batch1": engine_decode1,
                         "decode_batch16": engine_decode16}

    results["prefill_alone"] = load(args, ["--target", "prefill", "--concurrency", 4,
                                           "--duration-s", args.duration, "--prompt-tokens", prompt,
                                           "--max-tokens", 1])
    results["decode_alone"] = load(args, ["--target", "decode", "--concurrency", 16,
                                          "--duration-s", args.duration, "--prompt-tokens", 16,
                                          "--max-tokens", decode])

    with tempfile.TemporaryDirectory(prefix="moeline-bench-", dir="/tmp") as run_dir:
        # Reuse off: the stack must do the same work as the engine it is compared with.
        config = os.path.join(run_dir, "stages.json")
        with open(config, "w") as f:
            json.dump({"gateway": {"reuse-levels": "none"}}, f)
        up = subprocess.run([args.moeline, "stack", "up", "--model", args.model, "--run-dir",
                             run_dir, "--threads", t, "--timeout-s", "300", "--config", config],
                            capture_output=True, text=True)
        if up.returncode != 0:
            sys.exit(f"stack_bench: stack up failed: {up.stderr}")
        endpoint = up.stdout.strip().splitlines()[-1]
        try:
            # Warm-up (faults the weights in), then the measured runs.
            load(args, ["--concurrency", 1, "--duration-s", 1, "--prompt-tokens", prompt,
                        "--max-tokens", 2], endpoint)
            results["stack_ttft"] = load(args, ["--concurrency", 1, "--duration-s", args.duration,
                                                "--prompt-tokens", prompt, "--max-tokens", 1],
                                         endpoint)
            # The decode stage's own step time over the same run, from its /metrics: what the
            # client sees on top of it is what the pipeline adds per token.
            before = decode_steps(run_dir)
            results["stack_stream1"] = load(args, ["--concurrency", 1, "--duration-s",
                                                   args.duration, "--prompt-tokens", 16,
                                                   "--max-tokens", decode], endpoint)
            after = decode_steps(run_dir)
            results["decode_step_mean_ms"] = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
            results["stack_stream16"] = load(args, ["--concurrency", 16, "--duration-s",
                                                    args.duration, "--prompt-tokens", 16,
                                                    "--max-tokens", decode], endpoint)
            results["stack_load4"] = load(args, ["--concurrency", 4, "--duration-s", args.duration,
                                                 "--prompt-tokens", 128, "--max-tokens", 64],
                                          endpoint)
        finally:
            subprocess.run([args.moeline, "stack", "down", "--run-dir", run_dir],
                           capture_output=True)

    prefill_ms = prompt / engine_prefill["prefill_tokens_per_second"] * 1e3
    ttft_ms = results["stack_ttft"]["ttft_ms"]["p50"]
    token_ms = 1e3 / engine_decode1["decode_tokens_per_second"]
    tpot_ms = results["stack_stream1"]["tpot_ms"]["p50"]
    stack16 = 16 / (results["stack_stream16"]["tpot_ms"]["mean"] / 1e3)
    engine16 = engine_decode16["decode_tokens_per_second"]
    print(f"### Pipeline cost ({os.path.basename(args.model.rstrip('/'))}, {args.threads} threads "
          "per compute process, ipc://)\n")
    print("| measure | in-process engine | through the stack | ratio / difference | target |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(f"| TTFT, {prompt}-token prompt (median) | {prefill_ms:.1f} ms prefill | {ttft_ms:.1f} ms | "
          f"{ttft_ms / prefill_ms:.3f}x | within 5% (1.05x) |")
    step_ms = results["decode_step_mean_ms"]
    tpot_mean_ms = results["stack_stream1"]["tpot_ms"]["mean"]
    print(f"| time per token, 1 stream (median) | {token_ms * 1e3:.0f} µs | {tpot_ms * 1e3:.0f} µs | "
          f"{(tpot_ms - token_ms) * 1e3:+.0f} µs | ≤ 100 µs added |")
    print(f"| time per token, 1 stream (mean), same run | {step_ms * 1e3:.0f} µs decode step | "
          f"{tpot_mean_ms * 1e3:.0f} µs | {(tpot_mean_ms - step_ms) * 1e3:+.0f} µs | ≤ 100 µs added |")
    print(f"| decode tokens/s, 16 streams | {engine16:.0f} (batch 16) | {stack16:.0f} | "
          f"{stack16 / engine16:.1%} | ≥ 90% |")
    print()
    print("### Stage-level load (`moeline load`)\n")
    print("| target | load | prompt / output tokens | req/s | output tok/s | TTFT p50 / p99 ms | "
          "per-token p50 / p99 ms | end-to-end p50 / p99 ms |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for key in ("prefill_alone", "decode_alone", "stack_stream1", "stack_stream16", "stack_load4"):
        r = results[key]

        def pct(name):
            p = r.get(name)
            return f"{p['p50']:.2f} / {p['p99']:.2f}" if p else "–"
        print(f"| {r['target']} | concurrency {r['concurrency']} | {r['prompt_tokens']} / "
              f"{r['max_tokens']} | {r['requests_per_s']:.1f} | {r['output_tokens_per_s']:.0f} | "
              f"{pct('ttft_ms')} | {pct('tpot_ms')} | {pct('e2e_ms')} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
