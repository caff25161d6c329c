#!/usr/bin/python3
"""`moeline run` as a user drives it: the output contract other tools depend on (ids, --json,
--logits-out .npy), seeded sampling reproducible across processes, and every kind of bad input
answered with exit status 2 and one clear `moeline: error:` line naming what was wrong.

    test_run_cli.py --moeline BIN --model TINY_MODEL_DIR
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

failures = []


def run(moeline, *args):
    return subprocess.run([moeline, "run", *args], capture_output=True, text=True, timeout=120)


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    m, model = args.moeline, args.model
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]

    plain = run(m, "--model", model, "--tokens", "1,2,3", "--max-tokens", "5", "--ignore-eos")
    ids = [int(x) for x in plain.stdout.strip().split(",")] if plain.returncode == 0 else []
    check("plain output is the generated ids, comma-separated", plain.returncode == 0 and len(ids) == 5,
          plain.stdout + plain.stderr)

    # The kernels' report: the path in use, the CPU, the arithmetic and the tuning, on one line.
    kernels = [line for line in plain.stderr.splitlines() if "event=kernels" in line]
    check("the log names the kernel path, the CPU and the tuning",
          len(kernels) == 1 and " isa=" in kernels[0] and " cpu=" in kernels[0]
          and " quant_math=fast" in kernels[0] and " wide_prefetch_bytes=" in kernels[0],
          plain.stderr)
    forced = subprocess.run([m, "run", "--model", model, "--tokens", "1,2,3", "--max-tokens", "5",
                             "--ignore-eos"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, MOELINE_KERNELS="portable"))
    forced_line = next((line for line in forced.stderr.splitlines() if "event=kernels" in line), "")
    check("MOELINE_KERNELS=portable forces the portable path, and the log says so",
          forced.returncode == 0 and " isa=portable " in forced_line
          and " forced=portable " in forced_line and "q4_k_batch_from_tokens" not in forced_line,
          forced.stderr)
    check("the portable path gives the same greedy ids",
          forced.stdout.strip() == plain.stdout.strip(), forced.stdout + plain.stdout)
    bogus = subprocess.run([m, "run", "--model", model, "--tokens", "1,2,3", "--max-tokens", "5",
                            "--ignore-eos"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, MOELINE_KERNELS="avx9000"))
    check("a MOELINE_KERNELS that names no path is warned about, and the best path runs",
          bogus.returncode == 0 and "moeline: warning: MOELINE_KERNELS=avx9000 names no kernel path"
          in bogus.stderr and bogus.stdout.strip() == plain.stdout.strip(), bogus.stderr)

    as_json = run(m, "--model", model, "--tokens", "1,2,3", "--max-tokens", "5", "--ignore-eos", "--json")
    result = json.loads(as_json.stdout) if as_json.returncode == 0 else {}
    check("--json prints one object with the same greedy ids", result.get("ids") == ids, as_json.stdout)
    check("--json reports finish_reason and usage",
          result.get("finish_reason") == "length" and result.get("usage", {}).get("prompt_tokens") == 3,
          as_json.stdout)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "logits.npy")
        out = run(m, "--model", model, "--tokens", "4,5", "--max-tokens", "1", "--logits-out", path)
        logits = np.load(path) if out.returncode == 0 and os.path.exists(path) else None
        check("--logits-out writes float32 [vocab_size]", logits is not None and logits.dtype == np.float32
              and logits.shape == (vocab,), out.stderr)
        first = int(out.stdout.strip()) if out.returncode == 0 else -1
        check("greedy first token is the argmax of the written logits",
              logits is not None and first == int(np.argmax(logits)))

    def sample(seed):
        out = run(m, "--model", model, "--tokens", "7,8,9", "--max-tokens", "12", "--ignore-eos",
                  "--temperature", "1.5", "--top-p", "0.95", "--seed", str(seed))
        return out.stdout.strip()
    check("the same seed gives the same tokens in another process", sample(3) == sample(3))
    check("another seed gives other tokens", sample(3) != sample(4))

    bad_inputs = {
        "negative temperature": (["--tokens", "1", "--temperature", "-1"], "temperature"),
        "top-p of zero": (["--tokens", "1", "--top-p", "0"], "top_p"),
        "top-k below zero": (["--tokens", "1", "--top-k", "-3"], "top_k"),
        "zero max-tokens": (["--tokens", "1", "--max-tokens", "0"], "max_tokens"),
        "non-numeric token": (["--tokens", "1,x,3"], "--tokens"),
        "token outside the vocabulary": (["--tokens", f"1,{vocab}"], "vocabulary"),
        "unknown option": (["--tokens", "1", "--frobnicate"], "--frobnicate"),
        "missing model folder": (["--tokens", "1"], "does not exist"),
    }
    for name, (extra, needle) in bad_inputs.items():
        model_args = ["--model", model] if name != "missing model folder" else ["--model", "/nonexistent/model"]
        out = run(m, *model_args, *extra)
        line = [l for l in out.stderr.splitlines() if l.startswith("moeline: error:")]
        check(f"{name}: exit 2 with a clear error", out.returncode == 2 and line and needle in line[0],
              f"exit {out.returncode}: {out.stderr.strip()[-300:]}")

    print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all run CLI checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
