#!/usr/bin/python3
"""The BF16 fast mode (--bf16-math fast: activations rounded to BF16, AVX512_BF16 dot products)
against the NumPy reference and against the exact mode.

  test_bf16_modes.py --moeline PATH --make-model PATH --models DIR --demo DIR --workdir DIR

  * last-position logits of tiny BF16 models (Mixtral, Qwen3-MoE, Qwen2-MoE and GLM-4.5 from
    tests/CMakeLists.txt's --models, a DeepSeek-V3 generated here) for prompts of 5, 17 and 40 tokens: the exact mode within 1e-4 of the float64 reference (as test_logits.py), the fast mode
    within FAST_RTOL and further from it than the exact mode (the mode is in use);
  * the demo model (a trained Qwen3-MoE, BF16): greedy decoding of the first 32 tokens of several
    prompts identical in both modes up to the first step where the exact mode's best two tokens
    are within NEAR_TIE nats; `moeline perplexity` on its held-out sample within PPL_BOUND of the
    exact mode's.
Exits 77 (skipped) on a CPU without AVX512_BF16, where the fast mode runs the exact kernels.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference as ref  # noqa: E402
from test_quant_modes import run  # noqa: E402

EXACT_RTOL = 1e-4
# Every BF16-weight matmul's input rounded to BF16 (2^-9 relative per value): through a few layers
# the logits move by about that much relative to their norm (measured 2-4e-3 on these models), more
# where the rounding flips a routing choice between near-equal experts (DeepSeek-V3, 17 tokens:
# 1.8e-2). 5e-2 still catches a kernel that drops a chunk or a row (errors of order 1e-1 to 1).
FAST_RTOL = 5e-2
NEAR_TIE = 0.1
PPL_BOUND = 0.005
MODELS = ("mixtral-bf16", "qwen3-bf16", "deepseek3-bf16", "glm4-bf16", "qwen2-bf16")
LENGTHS = (5, 17, 40)
PROMPTS = ["volcano:", "to swim:", "bread:", "mountain: a land mass", "ocean:",
           "the router sends each token to"]
STEPS = 32


def logits(args, model_dir, tokens, math, path):
    run([args.moeline, "run", "--model", model_dir, "--tokens", ",".join(map(str, tokens)),
         "--max-tokens", "1", "--logits-out", path, "--bf16-math", math])
    return np.load(path).reshape(-1).astype(np.float64)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def greedy(args, prompt, math):
    out = json.loads(run([args.moeline, "run", "--model", args.demo, "--prompt", prompt,
                          "--max-tokens", str(STEPS), "--ignore-eos", "--json", "--logprobs", "2",
                          "--bf16-math", math]))
    return out["ids"], [step["top"][0][1] - step["top"][1][1] for step in out["logprobs"]]


def perplexity(args, math):
    out = run([args.moeline, "perplexity", "--model", args.demo, "--text",
               os.path.join(args.demo, "eval", "heldout.txt"), "--context", "128", "--json",
               "--bf16-math", math])
    return json.loads(out)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--demo", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    with open("/proc/cpuinfo") as f:
        if " avx512_bf16" not in f.read():
            print("skipped: this CPU has no AVX512_BF16 (the fast mode runs the exact kernels)")
            return 77
    failures = []
    # The reference reads experts one tensor each (the shared test models' DeepSeek is fused).
    deepseek = os.path.join(args.workdir, "deepseek3-bf16")
    run([sys.executable, args.make_model, "--arch", "deepseek_v3", "--preset", "tiny", "--seed",
         "16", "--dtype", "bf16", "--out", deepseek])
    for name in MODELS:
        model_dir = deepseek if name == "deepseek3-bf16" else os.path.join(args.models, name)
        model = ref.load_model(model_dir)
        for length in LENGTHS:
            tokens = [(i * 37 + length * 11 + 3) % model.config["vocab_size"]
                      for i in range(length)]
            want = ref.forward_logits(model, tokens)[-1]
            path = os.path.join(args.workdir, f"{name}-{length}.npy")
            exact = rel_l2(logits(args, model_dir, tokens, "exact", path), want)
            fast = rel_l2(logits(args, model_dir, tokens, "fast", path), want)
            case = f"{name} len={length}: exact {exact:.2e}, fast {fast:.2e}"
            if exact > EXACT_RTOL or fast > FAST_RTOL or not fast > exact:
                failures.append(case)
                print(f"FAIL  {case} (bounds {EXACT_RTOL}, {FAST_RTOL}; fast must exceed exact)")
            else:
                print(f"ok    {case}", flush=True)
    for prompt in PROMPTS:
        exact, margins = greedy(args, prompt, "exact")
        fast, _ = greedy(args, prompt, "fast")
        parted = next((i for i, (a, b) in enumerate(zip(exact, fast)) if a != b), None)
        if parted is None:
            print(f"ok    greedy {prompt!r}: {STEPS} identical tokens", flush=True)
        elif margins[parted] <= NEAR_TIE:
            print(f"ok    greedy {prompt!r}: identical for {parted} tokens, then a near tie "
                  f"({margins[parted]:.3f} nats)", flush=True)
        else:
            failures.append(f"greedy {prompt!r}: parted at step {parted} with margin "
                            f"{margins[parted]:.3f} > {NEAR_TIE}")
            print(f"FAIL  {failures[-1]}")
    exact_ppl, fast_ppl = perplexity(args, "exact"), perplexity(args, "fast")
    change = fast_ppl["ppl"] / exact_ppl["ppl"] - 1
    if fast_ppl["bf16_math"] != "fast" or abs(change) > PPL_BOUND:
        failures.append(f"perplexity exact {exact_ppl['ppl']:.4f}, fast {fast_ppl['ppl']:.4f} "
                        f"({change:+.3%}; bound {PPL_BOUND:.1%}), mode {fast_ppl['bf16_math']}")
        print(f"FAIL  {failures[-1]}")
    else:
        print(f"ok    perplexity exact {exact_ppl['ppl']:.4f}, fast {fast_ppl['ppl']:.4f} "
              f"({change:+.3%})")
    if failures:
        print(f"{len(failures)} failures")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
