#!/usr/bin/python3
"""`moeline quantize` against llama.cpp's own quantizer, from the same checkpoint: both GGUF files
run in moeline, each reported against the BF16 checkpoint. Prints a markdown table.

  bench/quant_compare.py --moeline BUILD/stages/moeline --model HF_DIR --text HELDOUT.txt
                         --llama-node DIR --workdir DIR [--types q8_0,q4_k_m] [--context 128]

The checkpoint is written once as an F32 GGUF by `moeline quantize --type f32` (llama.cpp's
convert_hf_to_gguf.py is Python with torch, not available here; the F32 file only carries the
weights and metadata, every quantization decision is made afterwards). From it llama.cpp's
llama_model_quantize (what its llama-quantize tool calls, from the prebuilt library in
node-llama-cpp: bench/llama_quantize.c, compiled here with `cc`) writes each type; `moeline
quantize` writes the same types from the checkpoint. For each file: perplexity with `moeline
perplexity` (fast mode, the default), and the last-position logits of a few prompts in the exact
mode, as relative L2 distance to the BF16 checkpoint's logits and between the two quantizers'
files.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_FTYPE = {"q8_0": 7, "q4_k_m": 15, "q5_k_m": 17}
PROMPTS = ("volcano: a mountain or hill, typically conical",
           "The committee met on Tuesday to discuss the budget",
           "def fibonacci(n):\n    return")


def run(cmd, **kwargs):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, **kwargs)
    if out.returncode != 0:
        sys.exit(f"quant_compare: {' '.join(cmd)} failed: {out.stderr[-1500:]}")
    return out.stdout


def perplexity(args, model):
    result = json.loads(run([args.moeline, "perplexity", "--model", model, "--text", args.text,
                             "--context", str(args.context), "--json"]))
    return result["ppl"]


def logits(args, model, prompt, path):
    run([args.moeline, "run", "--model", model, "--prompt", prompt, "--max-tokens", "1",
         "--quant-math", "exact", "--logits-out", path])
    return np.load(path).astype(np.float64)


def relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--llama-node", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--types", default="q8_0,q4_k_m")
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    libraries = sorted(glob.glob(os.path.join(
        os.path.abspath(args.llama_node), "node_modules/@node-llama-cpp/linux-x64/bins/*/libllama*.so")))
    if not libraries:
        sys.exit(f"quant_compare: no libllama in {args.llama_node} (scripts/bench installs it)")
    tool = os.path.join(args.workdir, "llama_quantize")
    run(["cc", "-O2", "-o", tool, os.path.join(HERE, "llama_quantize.c"), "-ldl"])
    f32 = os.path.join(args.workdir, "model.f32.gguf")
    run([args.moeline, "quantize", "--model", args.model, "--type", "f32", "--out", f32])

    files = []
    for kind in args.types.split(","):
        ours = os.path.join(args.workdir, f"moeline.{kind}.gguf")
        theirs = os.path.join(args.workdir, f"llama.{kind}.gguf")
        run([args.moeline, "quantize", "--model", args.model, "--type", kind, "--out", ours])
        run([tool, libraries[0], f32, theirs, str(LLAMA_FTYPE[kind]), "2"])
        files.append((kind, ours, theirs))

    reference = {p: logits(args, args.model, p, os.path.join(args.workdir, "ref.npy"))
                 for p in PROMPTS}
    base = perplexity(args, args.model)
    print(f"Checkpoint {os.path.basename(os.path.normpath(args.model))}: perplexity {base:.3f} "
          f"on {os.path.basename(args.text)} (context {args.context}).\n")
    print("| type | written by | file MB | perplexity | vs checkpoint | logits rel. L2 to "
          "checkpoint (mean of prompts) | logits rel. L2 between the two files |")
    print("|---|---|---|---|---|---|---|")
    for kind, ours, theirs in files:
        got = {}
        for label, path in (("moeline quantize", ours), ("llama.cpp llama_model_quantize", theirs)):
            got[label] = {p: logits(args, path, p, os.path.join(args.workdir, "q.npy"))
                          for p in PROMPTS}
        between = np.mean([relative(got["moeline quantize"][p],
                                    got["llama.cpp llama_model_quantize"][p]) for p in PROMPTS])
        for label, path in (("moeline quantize", ours), ("llama.cpp llama_model_quantize", theirs)):
            ppl = perplexity(args, path)
            distance = np.mean([relative(got[label][p], reference[p]) for p in PROMPTS])
            print(f"| {kind.upper()} | {label} | {os.path.getsize(path) / 1e6:.1f} | {ppl:.3f} | "
                  f"{100 * (ppl / base - 1):+.2f}% | {distance:.4f} | {between:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
