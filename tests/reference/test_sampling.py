#!/usr/bin/python3
"""The engine's sampler against sampling_reference.py, end to end through `moeline run`.

  test_sampling.py --moeline PATH --model DIR --workdir DIR

For each sampling setting (greedy and seeded draws; top-k, top-p, min-p; repetition, frequency
and presence penalties, alone and together; OpenAI's logit_bias, alone and under the penalties) `moeline run --json --logprobs 5 --step-logits-out`
gives the generated ids, their log-probabilities and the raw logits each was drawn from. The
reference, fed the same rows, must draw exactly the same ids (it reproduces the penalised logits
bit for bit and the same mt19937_64 draws, so any difference is a bug, not rounding), and the
log-probabilities must agree within LOGPROB_ATOL. The penalties and the bias must also change the
output of a greedy run, so that a sampler that ignored them cannot pass.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sampling_reference as ref  # noqa: E402

# The engine reports float32 log-probabilities computed in double; at magnitudes below ~20 a
# float32 ulp is <= 2e-6, and the two sides sum the softmax in different orders (~1e-12).
LOGPROB_ATOL = 1e-5
TOP = 5
STEPS = 24
PROMPT = [5, 17, 17, 42, 8, 99, 5, 3, 17, 64, 12, 5]

SETTINGS = [
    ("greedy", {"temperature": 0.0}),
    ("greedy-repetition", {"temperature": 0.0, "repetition_penalty": 1.8}),
    ("greedy-presence-frequency",
     {"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.8}),
    ("greedy-negative", {"temperature": 0.0, "presence_penalty": -1.0, "repetition_penalty": 0.7}),
    ("sampled", {"temperature": 1.0, "seed": 7}),
    ("sampled-min-p", {"temperature": 1.3, "seed": 11, "min_p": 0.1}),
    ("sampled-top-k-top-p", {"temperature": 0.9, "seed": 3, "top_k": 20, "top_p": 0.8}),
    ("sampled-all", {"temperature": 1.1, "seed": 5, "top_k": 50, "top_p": 0.95, "min_p": 0.02,
                     "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                     "presence_penalty": 0.4}),
    ("greedy-bias", {"temperature": 0.0, "logit_bias": {54: -100.0, 64: 1.5, 273: 1.25}}),
    # The penalty applies to the biased logit ((x + b) / r, not x / r + b): the orders draw apart.
    ("greedy-bias-repetition", {"temperature": 0.0, "logit_bias": {64: 3.0, 30: 2.0},
                                "repetition_penalty": 2.0}),
    ("sampled-bias-penalties", {"temperature": 0.9, "seed": 13, "top_k": 40,
                                "logit_bias": {64: 4.0, 99: -3.5}, "repetition_penalty": 1.4,
                                "presence_penalty": 0.6}),
]

FLAGS = {"temperature": "--temperature", "seed": "--seed", "top_k": "--top-k", "top_p": "--top-p",
         "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
         "frequency_penalty": "--frequency-penalty", "presence_penalty": "--presence-penalty",
         "logit_bias": "--logit-bias"}


def run(moeline, model, params, logits_path):
    command = [moeline, "run", "--model", model, "--tokens", ",".join(map(str, PROMPT)),
               "--max-tokens", str(STEPS), "--ignore-eos", "--json", "--logprobs", str(TOP),
               "--step-logits-out", logits_path, "--threads", "2"]
    for key, value in params.items():
        if key == "logit_bias":
            value = ",".join(f"{token}={bias}" for token, bias in value.items())
        command += [FLAGS[key], str(value)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout), np.load(logits_path)


def check(name, params, result, step_logits):
    failures = []
    ids = result["ids"]
    if step_logits.shape[0] != len(ids):
        return [f"{name}: {step_logits.shape[0]} logits rows for {len(ids)} tokens"]
    expected = ref.replay(step_logits, PROMPT, params)
    for step, (got, want) in enumerate(zip(ids, expected)):
        if got != want:
            failures.append(f"{name}: step {step} drew {got}, the reference {want}")
            break
    if len(result.get("logprobs", [])) != len(ids):
        return failures + [f"{name}: {len(result.get('logprobs', []))} logprobs for {len(ids)} ids"]
    for step, (token, entry) in enumerate(zip(ids, result["logprobs"])):
        logprob, top = ref.logprobs(step_logits[step], token, TOP)
        if abs(entry["logprob"] - logprob) > LOGPROB_ATOL:
            failures.append(f"{name}: step {step} logprob {entry['logprob']} != {logprob}")
        if [t[0] for t in entry["top"]] != [t[0] for t in top]:
            failures.append(f"{name}: step {step} top ids {entry['top']} != {top}")
        elif any(abs(a[1] - b[1]) > LOGPROB_ATOL for a, b in zip(entry["top"], top)):
            failures.append(f"{name}: step {step} top logprobs {entry['top']} != {top}")
        if failures:
            break
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    failures, outputs = [], {}
    for name, params in SETTINGS:
        result, step_logits = run(args.moeline, args.model, params,
                                  os.path.join(args.workdir, f"{name}.npy"))
        outputs[name] = result["ids"]
        case_failures = check(name, params, result, step_logits)
        failures += case_failures
        print(f"{name}: {'FAIL' if case_failures else 'ok'} ids={result['ids']}")
    for penalized in ("greedy-repetition", "greedy-presence-frequency", "greedy-negative",
                      "greedy-bias"):
        if outputs[penalized] == outputs["greedy"]:
            failures.append(f"{penalized}: the same ids as plain greedy (the penalty did nothing)")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
