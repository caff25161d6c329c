#!/usr/bin/python3
"""Quantized weights: moeline on the `mini` model as BF16 safetensors and as GGUF Q8_0 and Q4_K_M
(written by `moeline quantize`), and llama.cpp on the same GGUF files, side by side, at each
thread count. Prints a markdown table.

  bench/quant_bench.py --moeline BUILD/stages/moeline --bench BUILD/bench/moeline_bench
                       --model MINI_DIR --workdir DIR [--threads 1,2] [--llama-node DIR]
                       [--fp8-model MINI_FP8_DIR] [--depths 0] [--types bf16,q8_0,q4_k_m]

--depths: tokens already in the context before prefill and decode (llama-bench's -d): decode at
depth 1024 reads 1024 tokens of keys and values per layer besides the weights (the roofline
column counts the weights only).

--fp8-model: the same model as an FP8 checkpoint (make-model --dtype fp8), timed beside the others
(llama.cpp does not read FP8 checkpoints).

--llama-node: a folder with node-llama-cpp installed (bench/package.json; scripts/bench installs
it): llama.cpp's prebuilt CPU build, timed by bench/llama_cpp_node.mjs as llama-bench times it.
Every file is dropped from the page cache before its runs, so each mapping is read back in large
folios (huge pages), as a freshly started server reads it.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def drop_cache(path):
    paths = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
    for p in paths:
        if p.endswith((".gguf", ".safetensors")):
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def moeline(args, model, threads, depth):
    drop_cache(model)
    out = subprocess.run([args.bench, "--model", model, "--threads", str(threads), "--prompt",
                          "512", "--decode", "128", "--repeat", "3", "--depth", str(depth)],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout)


def llama_cpp(args, model, threads, depth=0):
    if not args.llama_node:
        return None
    drop_cache(model)
    env = dict(os.environ, NODE_PATH=os.path.join(args.llama_node, "node_modules"))
    script = os.path.join(args.llama_node, "llama_cpp_node.mjs")
    out = subprocess.run(["node", script, model, str(threads), "512", "128", "3", str(depth)],
                         capture_output=True, text=True, timeout=1800, env=env,
                         cwd=args.llama_node)
    if out.returncode != 0:
        print(f"quant_bench: llama.cpp failed: {out.stderr[-400:]}", file=sys.stderr)
        return None
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in runs}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--llama-node")
    ap.add_argument("--fp8-model")
    ap.add_argument("--depths", default="0")
    ap.add_argument("--types", default="bf16,q8_0,q4_k_m")
    args = ap.parse_args(argv)
    types = args.types.split(",")
    # llama.cpp's driver runs from its own folder, so every path it is given must be absolute.
    args.model, args.workdir = os.path.abspath(args.model), os.path.abspath(args.workdir)
    if args.fp8_model:
        args.fp8_model = os.path.abspath(args.fp8_model)
    os.makedirs(args.workdir, exist_ok=True)
    if args.llama_node:
        args.llama_node = os.path.abspath(args.llama_node)  # its script runs from that folder
        subprocess.run(["cp", os.path.join(HERE, "llama_cpp_node.mjs"), args.llama_node],
                       check=True)
    files = [("BF16 (safetensors)", args.model)] if "bf16" in types else []
    for kind in [t for t in ("q8_0", "q4_k_m") if t in types]:
        path = os.path.join(args.workdir, f"mini.{kind}.gguf")
        if not os.path.exists(path):
            print(f"quant_bench: moeline quantize --type {kind}", file=sys.stderr)
            subprocess.run([args.moeline, "quantize", "--model", args.model, "--type", kind,
                            "--out", path], check=True, timeout=3600)
        files.append((kind.upper(), path))
    if args.fp8_model:
        files.append(("FP8 (safetensors)", args.fp8_model))
    print("| weights | threads | depth | file GB | bytes/token MB | prefill t/s | decode t/s "
          "| read GB/s | decode / roofline | llama.cpp prefill t/s | llama.cpp decode t/s "
          "| prefill ratio | decode ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = [(t, d, f) for t in map(int, args.threads.split(","))
            for d in map(int, args.depths.split(",")) for f in files]
    for threads, depth, (label, path) in runs:
        print(f"quant_bench: {label} threads={threads} depth={depth}", file=sys.stderr)
        mine = moeline(args, path, threads, depth)
        theirs = llama_cpp(args, path, threads, depth) if path.endswith(".gguf") else None

        cells = [label, threads, depth, f"{mine['mapped_weight_bytes'] / 1e9:.2f}",
                 # Weights and, at depth, the KV cache a token reads (the roofline's bytes).
                 f"{mine.get('decode_bytes_per_token', mine['weight_bytes_per_decoded_token']) / 1e6:.1f}",
                 f"{mine['prefill_tokens_per_second']:.1f}",
                 f"{mine['decode_tokens_per_second']:.1f}",
                 f"{mine['read_bandwidth_gb_per_second']:.1f}",
                 f"{mine['decode_fraction_of_roofline']:.0%}"]
        if theirs:
            cells += [f"{theirs['prefill']:.1f}", f"{theirs['decode']:.1f}",
                      f"{mine['prefill_tokens_per_second'] / theirs['prefill']:.2f}×",
                      f"{mine['decode_tokens_per_second'] / theirs['decode']:.2f}×"]
        else:
            cells += ["–"] * 4
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
