#!/usr/bin/python3
"""Prompt log-probabilities (OpenAI's echo with logprobs) against the NumPy reference.

  test_prompt_logprobs.py --moeline PATH --make-model PATH --workdir DIR

For tiny random checkpoints of every family, `moeline run --tokens ... --max-tokens 1 --json
--prompt-logprobs K` must report, for each prompt token after the first, its log-probability
under the tokens before it and the K most likely tokens', as the float64 reference computes them
(log-softmax of moe_reference.forward_logits at the position before it). Prompts of 1, 2, 17 and
300 tokens: none, one entry, a block boundary, and more than one of the engine's 256-token
scoring chunks (model/prompt_logprobs.h), so an entry shifted by one position or lost at a chunk
boundary fails. The first generated token must be the reference's greedy choice at the last
position, as it is without prompt log-probabilities.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference as ref  # noqa: E402
from test_logits import case_models, prompt_tokens  # noqa: E402

# The engine's logits match the reference to a relative L2 of ~1e-6 (test_logits.py bounds it
# by 1e-4); a log-probability is a logit minus the log-sum-exp, so its absolute error is about
# twice the logits' absolute error: 1.5e-6 at most over these cases when written. 1e-3 leaves
# orders of margin, while an entry read one position off moves by O(1) on these random models.
LOGPROB_ATOL = 1e-3
# Two candidates closer than this in the reference may legitimately swap places in float32.
RANK_TIE = 1e-3
TOP = 3
PROMPT_LENGTHS = (1, 2, 17, 300)
SUBPROCESS_TIMEOUT_S = 120

CASES = [
    ("mixtral", "mixtral", 41, []),
    ("mixtral-bf16-window5", "mixtral", 42, ["--dtype", "bf16", "--set", "sliding_window=5"]),
    ("qwen3", "qwen3_moe", 43, []),
    ("deepseek2", "deepseek_v2", 44, []),
    ("deepseek3", "deepseek_v3", 45, []),
]


def log_softmax(logits):
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def run_engine(moeline, model_dir, tokens):
    cmd = [moeline, "run", "--model", model_dir, "--tokens", ",".join(map(str, tokens)),
           "--max-tokens", "1", "--json", "--prompt-logprobs", str(TOP)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])


def check_entry(entry, reference_row, token):
    """None if the engine's entry for `token` matches the reference's log-softmax row."""
    want = reference_row[token]
    if abs(entry["logprob"] - want) > LOGPROB_ATOL:
        return f"logprob {entry['logprob']:.6f}, reference {want:.6f}"
    top = entry["top"]
    if len(top) != TOP:
        return f"{len(top)} alternatives, asked for {TOP}"
    order = np.argsort(-reference_row, kind="stable")
    for rank, (token_id, logprob) in enumerate(top):
        if abs(logprob - reference_row[token_id]) > LOGPROB_ATOL:
            return f"alternative {token_id}: {logprob:.6f}, reference {reference_row[token_id]:.6f}"
        expected = int(order[rank])
        if token_id != expected and abs(reference_row[expected] - reference_row[token_id]) > RANK_TIE:
            return f"alternative {rank} is {token_id}, reference {expected}"
    return None


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)

    failures, checked, worst = [], 0, 0.0
    for name, seed, model_dir, model, vocab in case_models(args.make_model, args.workdir, CASES):
        for length in PROMPT_LENGTHS:
            tokens = prompt_tokens(seed, length, vocab)
            got = run_engine(args.moeline, model_dir, tokens)
            reference = log_softmax(ref.forward_logits(model, tokens))
            case = f"{name} prompt {length}"
            entries = got.get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) != length - 1:
                failures.append(f"{case}: {len(entries) if isinstance(entries, list) else entries} "
                                f"prompt entries, expected {length - 1}")
                continue
            for position, entry in enumerate(entries):
                worst = max(worst, abs(entry["logprob"] - reference[position][tokens[position + 1]]))
                problem = check_entry(entry, reference[position], tokens[position + 1])
                if problem:
                    failures.append(f"{case}: token {position + 1}: {problem}")
                    break
            last = reference[-1]
            order = np.argsort(-last, kind="stable")
            if got["ids"][0] != int(order[0]) and last[order[0]] - last[order[1]] > RANK_TIE:
                failures.append(f"{case}: first token {got['ids'][0]}, reference greedy {int(order[0])}")
            checked += 1

    for failure in failures:
        print("FAIL", failure)
    print(f"prompt log-probabilities: {checked} prompts checked, {len(failures)} failures, "
          f"largest error {worst:.2e} (atol {LOGPROB_ATOL}, top {TOP})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
