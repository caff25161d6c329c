#!/usr/bin/python3
"""FP8 checkpoints (DeepSeek-V3's release layout) against a NumPy reference of the same files.

  test_fp8_logits.py --moeline PATH --make-model PATH --workdir DIR

For each family a small checkpoint is written by `make-model --dtype fp8`: the layers' linear
weights as float8_e4m3fn with one float32 `weight_scale_inv` per block (block shapes that do and
do not divide the matrices, one file or several), the rest BF16, and config.json's
quantization_config. For each prompt, `moeline run --logits-out` is compared with
moe_reference.py's float64 forward, whose loader decodes e4m3 from the format's definition and
multiplies each block by its scale (written apart from moeline's code). The same checkpoint is
also converted by `moeline quantize --type f32` and the GGUF's logits compared with the same
reference: the conversion must apply the block scales too. Greedy output must not change when the
experts are read on demand into a pool of 50% or 25% of them (the pool holds the FP8 bytes; the
scales stay with the mapped checkpoint). Then the checkpoint is broken in three ways and each
must be refused with a message naming what is wrong.

Tolerance: moeline rounds each weight fp8 * scale once to float32 (the reference keeps it in
float64) and accumulates in float32: relative L2 error ~3e-7, checked at 1e-4 as for the other
weight types. A scale applied to the wrong block, row or column, or not at all, moves the logits
by several percent (FP8 itself is ~8% from the unquantized model at these sizes).
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

LOGITS_RTOL = 1e-4
PROMPTS = ([3], [5, 17, 99, 4, 250, 31, 8], [(7 * i + 3) % 500 for i in range(19)])
TIMEOUT_S = 120

BUDGETS = ("50%", "25%")

# (case, arch, seed, --fp8-block, extra make-model flags, also through `moeline quantize`)
CASES = [
    ("mixtral", "mixtral", 41, "16,24", [], True),
    ("qwen3", "qwen3_moe", 42, "32,32", ["--shards", "3"], False),
    ("deepseek_v2", "deepseek_v2", 43, "16,24", [], False),
    ("deepseek_v3", "deepseek_v3", 44, "8,40", [], True),
    # The release's own block: every matrix of the tiny preset is one partial block.
    ("deepseek_v3-128", "deepseek_v3", 45, "128,128", [], False),
    # Odd latent ranks: FP8 weights and BF16 norms of odd byte counts, so later F32 scale tables
    # sit at offsets that are not multiples of 4 (safetensors does not align tensors).
    ("deepseek_v3-odd", "deepseek_v3", 46, "16,16",
     ["--set", "kv_lora_rank=33", "--set", "q_lora_rank=47"], False),
]


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)


def moeline_logits(args, model, prompt, out):
    cmd = [args.moeline, "run", "--model", model, "--tokens", ",".join(map(str, prompt)),
           "--max-tokens", "1", "--logits-out", out]
    done = run(cmd)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-600:]}")
    return np.load(out).astype(np.float64)


def check_logits(args, name, model_path, reference, failures):
    checked = 0
    for prompt in PROMPTS:
        label = f"{name} prompt of {len(prompt)}"
        try:
            got = moeline_logits(args, model_path, prompt, os.path.join(args.workdir, "logits.npy"))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failures.append(f"{label}: {e}")
            continue
        want = ref.forward_logits(reference, prompt)[-1]
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        print(f"{label}: rel L2 {error:.2e}")
        checked += 1
        if not error <= LOGITS_RTOL:
            failures.append(f"{label}: relative L2 error {error:.3e} > {LOGITS_RTOL}")
    return checked


def check_budgets(args, name, model_path, failures):
    prompt = ",".join(map(str, PROMPTS[2]))
    outputs = {}
    for budget in ("all",) + BUDGETS:
        cmd = [args.moeline, "run", "--model", model_path, "--tokens", prompt, "--max-tokens", "16"]
        if budget != "all":
            cmd += ["--expert-budget", budget]
        done = run(cmd)
        if done.returncode != 0:
            failures.append(f"{name} budget {budget}: exited {done.returncode}: {done.stderr[-300:]}")
            return
        outputs[budget] = done.stdout.strip().splitlines()[-1]
    for budget in BUDGETS:
        if outputs[budget] != outputs["all"]:
            failures.append(f"{name}: greedy output with --expert-budget {budget} "
                            f"{outputs[budget]} differs from {outputs['all']}")
    print(f"{name}: same 16 tokens with every expert resident and at {', '.join(BUDGETS)}")


def expect_refusal(args, name, folder, edit, needles, failures):
    """Copy the checkpoint, break it with `edit(copy)`, and require moeline to refuse it with a
    message holding every needle."""
    broken = os.path.join(args.workdir, name)
    shutil.rmtree(broken, ignore_errors=True)
    shutil.copytree(folder, broken)
    edit(broken)
    done = run([args.moeline, "run", "--model", broken, "--tokens", "3", "--max-tokens", "1"])
    message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode == 0 or not all(n in done.stderr for n in needles):
        failures.append(f"{name}: expected a refusal naming {needles}, got exit "
                        f"{done.returncode}: {message!r}")
    else:
        print(f"{name}: refused: {message}")


def edit_config(change):
    def edit(folder):
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        change(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return edit


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    failures, checked = [], 0
    for case, arch, seed, block, flags, through_quantize in CASES:
        folder = os.path.join(args.workdir, case)
        done = run([sys.executable, args.make_model, "--arch", arch, "--preset", "tiny", "--seed",
                    str(seed), "--dtype", "fp8", "--fp8-block", block, "--out", folder, *flags])
        if done.returncode != 0:
            failures.append(f"{case}: make-model failed: {done.stderr[-400:]}")
            continue
        reference = ref.load_model(folder)
        stored = {t[1] for t in reference._tensors.values()}
        if stored != {"F8_E4M3", "F32", "BF16"}:
            failures.append(f"{case}: expected F8_E4M3 weights with F32 scales, stored {stored}")
        checked += check_logits(args, f"{case} fp8 {block}", folder, reference, failures)
        check_budgets(args, case, folder, failures)
        if through_quantize:
            gguf = os.path.join(args.workdir, f"{case}.f32.gguf")
            done = run([args.moeline, "quantize", "--model", folder, "--type", "f32", "--out", gguf])
            if done.returncode != 0:
                failures.append(f"{case}: moeline quantize failed: {done.stderr[-400:]}")
            else:
                checked += check_logits(args, f"{case} fp8 -> f32 GGUF", gguf, reference, failures)

    folder = os.path.join(args.workdir, "deepseek_v3")
    expect_refusal(args, "no-quantization-config", folder,
                   edit_config(lambda c: c.pop("quantization_config")),
                   ["F8_E4M3", "quantization_config"], failures)
    expect_refusal(args, "other-quant-method", folder,
                   edit_config(lambda c: c["quantization_config"].update(quant_method="gptq")),
                   ["quant_method", "gptq"], failures)
    expect_refusal(args, "wrong-block-size", folder,
                   edit_config(lambda c: c["quantization_config"].update(weight_block_size=[8, 8])),
                   ["_scale_inv", "shape"], failures)

    print(f"{checked} logit comparisons")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures))
        return 1
    if checked == 0:
        print("FAIL: nothing was compared")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
