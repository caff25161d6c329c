#!/usr/bin/python3
"""BF16 weights on the CPU: moeline in its exact mode (the default) and its fast mode
(--bf16-math fast), and llama.cpp on the same weights as a BF16 GGUF (`moeline quantize --type
bf16`), alternated within each round so that the VM's drift touches all three alike. Prints a
markdown table per model: best of the rounds for each, the read bandwidth and decode's share of
its roofline, and the ratios to llama.cpp both from the best figures and as the median of each
round's own ratio ("paired").

  bench/bf16_bench.py --moeline BUILD/stages/moeline --bench BUILD/bench/moeline_bench
                      --model DIR [--model DIR ...] --workdir DIR [--threads 1,2] [--rounds 3]
                      [--llama-node DIR]

--llama-node: a folder with node-llama-cpp installed (bench/package.json): llama.cpp's prebuilt CPU
build, timed by bench/llama_cpp_node.mjs as llama-bench times pp512 and tg128. Every file is
dropped from the page cache before its runs, so each mapping is read back in huge pages.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from quant_bench import drop_cache, llama_cpp  # noqa: E402


def moeline(args, model, threads, mode):
    drop_cache(model)
    out = subprocess.run([args.bench, "--model", model, "--threads", str(threads), "--prompt",
                          "512", "--decode", "128", "--repeat", "3", "--bf16-math", mode],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout)


def gguf_of(args, model):
    path = os.path.join(args.workdir, os.path.basename(os.path.normpath(model)) + ".bf16.gguf")
    if not os.path.exists(path):
        print(f"bf16_bench: moeline quantize --type bf16 {model}", file=sys.stderr)
        subprocess.run([args.moeline, "quantize", "--model", model, "--type", "bf16", "--out",
                        path], check=True, timeout=3600)
    return path


def table(args, model):
    gguf = gguf_of(args, model) if args.llama_node else None
    print(f"{os.path.basename(os.path.normpath(model))}:")
    print("| threads | run | prefill t/s | decode t/s | read GB/s | decode / roofline "
          "| prefill vs llama.cpp | decode vs llama.cpp | paired prefill | paired decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        runs = {"exact": [], "fast": [], "llama.cpp": []}
        for round_ in range(args.rounds):
            print(f"bf16_bench: {model} threads={threads} round {round_ + 1}", file=sys.stderr)
            for mode in ("exact", "fast"):
                runs[mode].append(moeline(args, model, threads, mode))
            if gguf:
                theirs = llama_cpp(args, gguf, threads)
                if theirs:
                    runs["llama.cpp"].append(theirs)
        best_llama = ({k: max(r[k] for r in runs["llama.cpp"]) for k in ("prefill", "decode")}
                      if runs["llama.cpp"] else None)
        for mode in ("exact", "fast"):
            mine = runs[mode]
            prefill = max(r["prefill_tokens_per_second"] for r in mine)
            decode = max(r["decode_tokens_per_second"] for r in mine)
            # The roofline of the run that decoded fastest, against the bandwidth it measured.
            best = max(mine, key=lambda r: r["decode_tokens_per_second"])
            bandwidth = max(r["read_bandwidth_gb_per_second"] for r in mine)
            cells = [threads, f"moeline {mode}", f"{prefill:.1f}", f"{decode:.1f}",
                     f"{bandwidth:.1f}",
                     f"{decode * best.get('decode_bytes_per_token', best['weight_bytes_per_decoded_token']) / (bandwidth * 1e9):.0%}"]
            if best_llama and len(runs["llama.cpp"]) == len(mine):
                paired = [(m["prefill_tokens_per_second"] / t["prefill"],
                           m["decode_tokens_per_second"] / t["decode"])
                          for m, t in zip(mine, runs["llama.cpp"])]
                cells += [f"{prefill / best_llama['prefill']:.2f}×",
                          f"{decode / best_llama['decode']:.2f}×",
                          f"{statistics.median(p for p, _ in paired):.2f}×",
                          f"{statistics.median(d for _, d in paired):.2f}×"]
            else:
                cells += ["–"] * 4
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        if best_llama:
            print(f"| {threads} | llama.cpp | {best_llama['prefill']:.1f} | "
                  f"{best_llama['decode']:.1f} | – | – | – | – | – | – |", flush=True)
    print()


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--model", required=True, action="append")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-node")
    args = ap.parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    if args.llama_node:
        args.llama_node = os.path.abspath(args.llama_node)  # its script runs from that folder
        subprocess.run(["cp", os.path.join(HERE, "llama_cpp_node.mjs"), args.llama_node],
                       check=True)
    for model in args.model:
        table(args, os.path.abspath(model))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
