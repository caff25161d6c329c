#!/usr/bin/python3
"""The fast quantized arithmetic on the demo model, against the exact one and against BF16.

  test_quant_modes.py --moeline PATH --convert PATH --model DIR --workdir DIR

The demo model (a trained Qwen3-MoE, BF16) is converted to Q8_0 and to the Q4_K_M mix
(scripts/gguf_convert.py). Then:
  * greedy decoding of the first 32 tokens of several prompts (--ignore-eos) is identical in the
    fast mode (8-bit activations, integer dot products) and the exact mode (weights dequantized to
    F32) on Q8_0, up to the first step where the exact mode's top two choices are within NEAR_TIE
    of each other (there the two may legitimately part: fast moves logits by ~0.5%, a few
    hundredths of a nat on this model, and after such a step the texts are different texts);
  * `moeline perplexity` on the model's held-out sample (eval/heldout.txt, 128-token chunks as the
    model was trained): Q8_0 within 0.5% and Q4_K_M within 3% of BF16, both in the fast mode (the
    issue's bounds; measured +0.0% and +0.7% on the full held-out split, docs/PERFORMANCE.md).
"""

import argparse
import json
from math import exp as math_exp
import os
import subprocess
import sys

PROMPTS = ["volcano:", "to swim:", "bread:", "mountain: a land mass", "ocean:",
           "the router sends each token to"]
STEPS = 32
NEAR_TIE = 0.1  # nats between the exact mode's best and second-best token
BOUNDS = {"q8_0": 0.005, "q4_k_m": 0.03}
TIMEOUT_S = 300


def run(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-800:]}")
    return done.stdout


def greedy(args, model, prompt, math):
    """(ids, each step's margin between the best and second-best log-probability)."""
    out = json.loads(run([args.moeline, "run", "--model", model, "--prompt", prompt,
                          "--max-tokens", str(STEPS), "--ignore-eos", "--json", "--logprobs", "2",
                          "--quant-math", math]))
    margins = [step["top"][0][1] - step["top"][1][1] for step in out["logprobs"]]
    return out["ids"], margins


def perplexity(args, model, math="fast"):
    out = json.loads(run([args.moeline, "perplexity", "--model", model, "--text",
                          os.path.join(args.model, "eval", "heldout.txt"), "--context", "128",
                          "--json", "--quant-math", math]))
    # llama.cpp's definition: each chunk of 128 scores the tokens after its first half, the last
    # position having no next token (63 a chunk); the final figure is the last running estimate,
    # and exp of the mean negative log-likelihood.
    context = out["context"]
    if (out["scored_tokens"] != out["chunks"] * (context - context // 2 - 1) or
            abs(out["ppl"] - out["per_chunk"][-1]) > 1e-9 * out["ppl"] or
            abs(out["ppl"] - math_exp(out["mean_nll"])) > 1e-9 * out["ppl"]):
        raise AssertionError(f"perplexity of {model}: inconsistent figures {out}")
    return out["ppl"]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--convert", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    files = {}
    for kind in BOUNDS:
        files[kind] = os.path.join(args.workdir, f"demo.{kind}.gguf")
        run([sys.executable, args.convert, "--model", args.model, "--out", files[kind], "--type",
             kind])
    failures = []
    identical = 0
    for prompt in PROMPTS:
        exact, margins = greedy(args, files["q8_0"], prompt, "exact")
        fast, _ = greedy(args, files["q8_0"], prompt, "fast")
        if len(exact) != STEPS:
            failures.append(f"{prompt!r}: {len(exact)} tokens, expected {STEPS}")
        parted = next((i for i, (a, b) in enumerate(zip(exact, fast)) if a != b), None)
        if parted is None:
            identical += 1
            print(f"ok greedy Q8_0 {prompt!r}: {STEPS} identical tokens", flush=True)
        elif margins[parted] <= NEAR_TIE:
            print(f"ok greedy Q8_0 {prompt!r}: identical for {parted} tokens, then a near tie "
                  f"(exact margin {margins[parted]:.3f} nats)", flush=True)
        else:
            failures.append(f"{prompt!r}: fast and exact part at token {parted} where the exact "
                            f"margin is {margins[parted]:.3f} nats\n  exact {exact}\n  fast  {fast}")
            print(f"FAIL greedy Q8_0 {prompt!r}", flush=True)
    print(f"{identical} of {len(PROMPTS)} prompts identical for all {STEPS} tokens")
    base = perplexity(args, args.model)
    print(f"BF16 perplexity {base:.4f}")
    for kind, bound in BOUNDS.items():
        ppl = perplexity(args, files[kind])
        change = ppl / base - 1
        status = "ok" if abs(change) <= bound else "FAIL"
        print(f"{status} {kind} fast perplexity {ppl:.4f} ({change:+.2%}, bound {bound:.1%})")
        if abs(change) > bound:
            failures.append(f"{kind}: perplexity {ppl:.4f} is {change:+.2%} from BF16 {base:.4f}")
    for failure in failures:
        print("FAIL " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
