#!/usr/bin/python3
"""The embedded demo model (models/demo-qwen3-moe): trained, healthy, and served exactly.

  test_demo_model.py --moeline BIN --model DIR --workdir DIR

* moeline's last-position logits on text prompts equal the independent NumPy reference's
  (moe_reference.py) within LOGITS_RTOL;
* the model is trained: its perplexity on the committed held-out sample (eval/heldout.txt, entries
  never seen in training), computed by the reference, is far below the unigram baseline
  (eval/unigram_logprob.json, training-split frequencies);
* router health: every expert of every layer gets at least MIN_SHARE of the top-2 selections on
  that sample;
* `moeline run --prompt` without --model uses this model and writes words, not bytes.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference as ref  # noqa: E402

# Same reasoning as test_logits.py: both sides read the very same BF16 weights and differ only in
# float32 (moeline) versus float64 (reference) arithmetic over 6 layers of dot products of at most
# a few hundred terms: ~1e-6 relative. 1e-4 keeps two orders of margin and still catches any
# semantic slip, which moves the logits by more than 1e-2.
LOGITS_RTOL = 1e-4
ROUTER_TIE_GAP = 1e-6
# "Clearly below the unigram baseline": less than half of it (the card reports the real ratio).
MAX_PPL_RATIO = 0.5
MIN_SHARE = 0.02
WINDOW = 128
PROMPTS = ["dog:", "a large body of water", "to run: move fast", "happy: "]

failures = []


def check(name, ok, detail=""):
    print(("ok    " if ok else "FAIL  ") + name + (f": {detail}" if detail else ""))
    if not ok:
        failures.append(name)


def run(cmd, stdin=None, env=None):
    r = subprocess.run(cmd, input=stdin, capture_output=True, timeout=300, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.decode(errors='replace')[-2000:]}")
    return r.stdout


# `moeline perplexity` against llama.cpp's definition computed here on the reference's logits:
# the text tokenized whole, cut into chunks of PPL_CONTEXT tokens, each chunk's positions from
# its middle to its next-to-last scored on the token after them; the estimate is exp of the mean
# negative log-likelihood, its error ppl * sqrt(var(nll) / (n - 1)). Both sides' logits agree to
# LOGITS_RTOL, which moves a token's NLL by about 1e-4 nats: 1e-3 on the mean NLL and 1% on the
# error leave a margin, and an NLL scored against the wrong token or an error not carried through
# exp moves them by far more.
PPL_CONTEXT = 64
PPL_CHUNKS = 3


def check_perplexity_command(moeline, model_dir, model):
    text = os.path.join(model_dir, "eval", "heldout.txt")
    with open(text, encoding="utf-8") as f:
        ids = json.loads(run([moeline, "tokenize", "--tokenizer", model_dir], f.read().encode()))
    got = json.loads(run([moeline, "perplexity", "--model", model_dir, "--text", text,
                          "--context", str(PPL_CONTEXT), "--chunks", str(PPL_CHUNKS), "--json"]))
    nlls, running = [], []
    for c in range(PPL_CHUNKS):
        chunk = ids[c * PPL_CONTEXT:(c + 1) * PPL_CONTEXT]
        logits = ref.forward_logits(model, chunk, {})
        logits = logits - logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        for j in range(PPL_CONTEXT // 2, PPL_CONTEXT - 1):
            nlls.append(-float(logp[j, chunk[j + 1]]))
        running.append(math.exp(sum(nlls) / len(nlls)))
    nll = np.array(nlls)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    error = ppl * math.sqrt(float((nll ** 2).mean() - mean ** 2) / (len(nll) - 1))
    check(f"moeline perplexity on {PPL_CHUNKS} chunks of {PPL_CONTEXT}: the figures of its "
          "definition on the reference's logits",
          got["scored_tokens"] == len(nll) and abs(got["mean_nll"] - mean) <= 1e-3 and
          abs(got["ppl_error"] - error) <= 1e-2 * error and
          all(abs(a - b) <= 1e-3 * b for a, b in zip(got["per_chunk"], running)),
          f"moeline ppl {got['ppl']:.4f} +/- {got['ppl_error']:.4f} over {got['scored_tokens']} "
          f"tokens, per chunk {got['per_chunk']}; reference {ppl:.4f} +/- {error:.4f} over "
          f"{len(nll)}, per chunk {running}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    m, model_dir = args.moeline, args.model

    model = ref.load_model(model_dir)
    c = model.config
    check("the demo model is a Qwen3-MoE checkpoint in BF16 with its tokenizer",
          c["model_type"] == "qwen3_moe" and os.path.exists(os.path.join(model_dir, "tokenizer.json")))
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    check(f"the checkpoint stays small ({size / 1e6:.1f} MB)", size < 60e6)

    def tokenize(text):
        return json.loads(run([m, "tokenize", "--tokenizer", model_dir, "--no-special"], text.encode()))

    for prompt in PROMPTS:
        ids = tokenize(prompt)
        npy = os.path.join(args.workdir, "logits.npy")
        run([m, "run", "--model", model_dir, "--prompt", prompt, "--max-tokens", "1", "--logits-out", npy])
        stats = {}
        want = ref.forward_logits(model, ids, stats)[-1]
        got = np.load(npy).astype(np.float64).reshape(-1)
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        tie = stats.get("min_router_gap", 1.0) < ROUTER_TIE_GAP
        check(f"logits of {prompt!r} ({len(ids)} tokens) match the NumPy reference",
              err <= LOGITS_RTOL or tie, f"rel L2 {err:.2e}" + (" (router near-tie)" if tie else ""))

    with open(os.path.join(model_dir, "eval", "heldout.txt"), encoding="utf-8") as f:
        heldout = f.read()
    unigram = np.array(json.load(open(os.path.join(model_dir, "eval", "unigram_logprob.json"))))
    ids = tokenize(heldout)
    nll = uni = 0.0
    n = 0
    stats = {}
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start:start + WINDOW + 1]
        if len(window) < 2:
            break
        logits = ref.forward_logits(model, window[:-1], stats)
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        target = np.array(window[1:])
        nll -= logp[np.arange(len(target)), target].sum()
        uni -= unigram[target].sum()
        n += len(target)
    ppl, uni_ppl = math.exp(nll / n), math.exp(uni / n)
    check(f"held-out perplexity {ppl:.2f} is clearly below the unigram baseline {uni_ppl:.2f} "
          f"({n} tokens)", ppl < MAX_PPL_RATIO * uni_ppl, f"ratio {ppl / uni_ppl:.3f}")

    counts = stats["expert_counts"]
    worst = min(float(np.min(counts[layer] / counts[layer].sum())) for layer in counts)
    for layer in sorted(counts):
        shares = counts[layer] / counts[layer].sum()
        print(f"      layer {layer}: " + " ".join(f"{s * 100:5.1f}%" for s in shares) +
              f"  imbalance {np.std(counts[layer]) / np.mean(counts[layer]):.3f}")
    check(f"every expert gets at least {MIN_SHARE:.0%} of the selections (smallest {worst:.2%})",
          worst >= MIN_SHARE)

    check_perplexity_command(m, model_dir, model)

    # Without --model, moeline runs the embedded model (this one, when the test runs on it) or the
    # one $MOELINE_MODEL names.
    env = {k: v for k, v in os.environ.items() if k != "MOELINE_MODEL"}
    embedded = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "models", "demo-qwen3-moe")
    if os.path.realpath(model_dir) != os.path.realpath(embedded):
        env["MOELINE_MODEL"] = model_dir
    default = run([m, "run", "--prompt", "dog:", "--max-tokens", "24"], env=env).decode()
    explicit = run([m, "run", "--model", model_dir, "--prompt", "dog:", "--max-tokens", "24"]).decode()
    check("moeline run without --model uses the embedded model (or $MOELINE_MODEL)",
          default == explicit, repr(default))
    words = default.split()
    wordy = [w for w in words if re.fullmatch(r"[A-Za-z][A-Za-z'-]*[,;.:]?|\"?[A-Za-z]+\"?[,;.]?", w)]
    check("its greedy text is words", len(words) >= 3 and len(wordy) >= 0.8 * len(words), repr(default))

    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
