#!/usr/bin/python3
"""Fast, targeted numerical checks beside the long reference matrix (test_logits.py).

  test_targeted.py --moeline PATH --make-model PATH --workdir DIR

Each case is one tiny checkpoint chosen so that one piece of arithmetic matters, and one prompt
of 17 tokens (one full KV block and one more). For each it checks that moeline's last-position
logits match moe_reference.py within LOGITS_RTOL, and that the tolerance can see the bug the case
is about: the reference computed with that bug planted (the softmax scale from hidden / heads, an
epsilon ten times too large, the latent norms given rms_norm_eps) must move the logits by more
than PLANTED_MARGIN times the tolerance. A case whose planted bug stays inside the tolerance is a
failure of the test itself: it could not catch what it guards.

  attention scale   Mixtral with head_dim 24 and Qwen3 with head_dim 32, both != hidden / heads
  RMSNorm epsilon   rms_norm_eps 0.5 (Mixtral; Qwen3, whose q and k norms use it too), so that
                    the epsilon moves the logits far past the tolerance; at the default 1e-5 an
                    epsilon ten times too large moves them by less than the tolerance
  latent-norm eps   DeepSeek-V3 with rms_norm_eps 0.5, whose latent norms keep their own 1e-6
  sliding window    Mixtral with a window of 5 keys, 12 keys shorter than the prompt
"""

import argparse
import copy
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference as ref  # noqa: E402
from test_logits import LOGITS_RTOL, Runner, make_model, prompt_tokens, rel_l2  # noqa: E402

PROMPT_LENGTH = 17
# A planted bug must move the reference by this many tolerances: a check that can only just see
# a bug would miss it on other weights.
PLANTED_MARGIN = 10.0


def plant_scale_from_hidden(c):
    c["softmax_scale"] = (c["hidden_size"] // c["num_attention_heads"]) ** -0.5


def plant_eps_times_ten(c):
    c["rms_norm_eps"] *= 10.0


def plant_latent_eps_from_config(c):
    c["latent_norm_eps"] = c["rms_norm_eps"]


def plant_window_one_wider(c):
    c["window"] += 1


# (case, arch, seed, make-model arguments, [(planted bug, function of the config)])
CASES = [
    ("mixtral-headdim24", "mixtral", 4, ["--set", "head_dim=24"],
     [("softmax scale from hidden/heads", plant_scale_from_hidden)]),
    ("qwen3-headdim32", "qwen3_moe", 11, [],
     [("softmax scale from hidden/heads", plant_scale_from_hidden)]),
    ("mixtral-eps0.5", "mixtral", 41, ["--set", "rms_norm_eps=0.5"],
     [("rms_norm_eps x10", plant_eps_times_ten)]),
    ("qwen3-eps0.5", "qwen3_moe", 42, ["--set", "rms_norm_eps=0.5"],
     [("rms_norm_eps x10", plant_eps_times_ten)]),
    ("mixtral-window5", "mixtral", 44, ["--set", "sliding_window=5"],
     [("sliding window one key wider", plant_window_one_wider)]),
    ("deepseek3-eps0.5", "deepseek_v3", 43, ["--set", "rms_norm_eps=0.5"],
     [("latent norms given rms_norm_eps", plant_latent_eps_from_config),
      ("rms_norm_eps x10", plant_eps_times_ten)]),
]


def planted_logits(model, plant, tokens):
    bugged = copy.copy(model)
    bugged.config = copy.deepcopy(model.config)
    plant(bugged.config)
    return ref.forward_logits(bugged, tokens)[-1]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    runner = Runner(args.moeline)
    failures, checks = [], 0
    start = time.monotonic()
    for name, arch, seed, extra, plants in CASES:
        model_dir = os.path.join(args.workdir, name)
        make_model(args.make_model, model_dir, arch, seed, extra)
        model = ref.load_model(model_dir)
        tokens = prompt_tokens(seed, PROMPT_LENGTH, model.config["vocab_size"])
        want = ref.forward_logits(model, tokens)[-1]
        got = runner.logits(model_dir, tokens, os.path.join(args.workdir, f"{name}.npy"))
        err = rel_l2(got.reshape(-1).astype(np.float64), want)
        checks += 1
        matches = bool(np.isfinite(err) and err <= LOGITS_RTOL)
        if not matches:
            failures.append(f"{name}: logits relative L2 error {err:.3g} > tolerance {LOGITS_RTOL}")
        print(f"{'ok  ' if matches else 'FAIL'}  {name}: logits rel err {err:.2e}")
        for what, plant in plants:
            moved = rel_l2(planted_logits(model, plant, tokens), want)
            checks += 1
            visible = moved > PLANTED_MARGIN * LOGITS_RTOL
            if not visible:
                failures.append(f"{name}: the planted bug '{what}' moves the reference logits by only "
                                f"{moved:.3g}, within {PLANTED_MARGIN:g}x the tolerance {LOGITS_RTOL}")
            print(f"{'ok  ' if visible else 'FAIL'}  {name}: planted '{what}' moves the reference by "
                  f"{moved:.2e}")
    elapsed = time.monotonic() - start
    if failures:
        print(f"\n{len(failures)} of {checks} checks FAILED ({elapsed:.1f} s):")
        for failure in failures:
            print(f"  {failure}")
        return 1
    print(f"\nall {checks} checks passed ({len(CASES)} models, {elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
