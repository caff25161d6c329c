#!/usr/bin/python3
"""GGUF models in the exact mode against a NumPy dequantize-then-compute of the same file.

  test_gguf_logits.py --moeline PATH --make-model PATH --convert PATH --workdir DIR

For each family (Mixtral as llama.cpp's `llama`, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 with the
legacy attn_kv_b, DeepSeek-V3 with the split attn_k_b / attn_v_b, GLM-4.5 with its
multi-token-prediction layer in the file) a small checkpoint, shaped so that rows are whole
256-weight super-blocks, is converted to GGUF once per tensor type (F16, BF16, Q8_0, Q4_0, Q4_K,
Q5_K, Q6_K and the Q4_K_M mix; rows that are not whole blocks fall back as llama.cpp's do) by
scripts/gguf_convert.py, once by `make-model --gguf`, and for five types by `moeline quantize`
(C++). For each file and prompt,
`moeline run --model FILE.gguf --quant-math exact --logits-out` (which reads its config from the
GGUF metadata alone) is compared with moe_reference.py's float64 forward over the file's weights,
dequantized by gguf_reference.py (written from the format's definition) and mapped back to the
Hugging Face names here (undoing the converter's rotate-half permutation, re-joining attn_k_b
and attn_v_b, unstacking the experts), with the checkpoint's own config.json.

Tolerance: both sides hold the same dequantized weights up to float32 rounding of d*scale*q (a few
ulps of each weight) and moeline accumulates in float32: relative L2 error ~1e-6, checked at
LOGITS_RTOL = 1e-4 (the issue's bound). A wrong permutation, split, scale, or metadata key moves
the logits by far more than 1e-2.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as gref  # noqa: E402
import moe_reference as ref  # noqa: E402

LOGITS_RTOL = 1e-4
PROMPTS = ([3], [5, 17, 99, 4, 250, 31, 8], [(7 * i + 3) % 500 for i in range(19)])
TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m")
# Also written by `moeline quantize` (C++; always MLA's split form), read back the same way.
QUANTIZE_TYPES = ("bf16", "q4_0", "q6_k", "q4_k_m", "q5_k_m")
TIMEOUT_S = 120
# Also written by `make-model --gguf` (through the same converter) for one case.
MAKE_MODEL_GGUF = ("qwen3", "q6_k")

# (case, arch, seed, make-model settings, converter flags). Widths are multiples of 256 so the
# K-quants apply; DeepSeek's 32-wide attn_k_b rows fall back to Q8_0 under them.
_WIDE = ["hidden_size=256", "intermediate_size=256", "vocab_size=512", "num_hidden_layers=2"]
CASES = [
    ("mixtral", "mixtral", 31, _WIDE + ["num_attention_heads=4", "num_key_value_heads=2",
                                        "head_dim=64"], []),
    ("qwen3", "qwen3_moe", 32, _WIDE + ["moe_intermediate_size=256", "num_attention_heads=4",
                                        "num_key_value_heads=2", "head_dim=64"], []),
    # Biases on q, k and v, and a gated shared expert (ffn_*_shexp, ffn_gate_inp_shexp).
    ("qwen2", "qwen2_moe", 36, _WIDE + ["moe_intermediate_size=256", "num_attention_heads=4",
                                        "num_key_value_heads=2",
                                        "shared_expert_intermediate_size=512"], []),
    # Q/K norms over the whole projections, experts intermediate_size wide (llama.cpp's olmoe:
    # multi-head attention only).
    ("olmoe", "olmoe", 37, _WIDE + ["num_attention_heads=4", "num_key_value_heads=4"], []),
    # RoPE over half of each head, q/k norms, biases on q/k/v, DeepSeek-V3's routing within 2 of
    # 4 groups (expert_group_count), a shared expert, layer 0 dense; the converter keeps the
    # multi-token-prediction layer (block_count 4, nextn_predict_layers 1), moeline quantize not.
    ("glm4", "glm4_moe", 38, _WIDE + ["num_hidden_layers=3", "moe_intermediate_size=256",
                                      "num_attention_heads=4", "num_key_value_heads=2",
                                      "head_dim=64", "use_qk_norm=true", "n_group=4",
                                      "topk_group=2"], []),
    ("deepseek_v2-legacy", "deepseek_v2", 33,
     _WIDE + ["num_hidden_layers=3", "moe_intermediate_size=256", "kv_lora_rank=256",
              "qk_nope_head_dim=32", "qk_rope_head_dim=32", "v_head_dim=64"], ["--legacy-mla"]),
    ("deepseek_v3", "deepseek_v3", 34,
     _WIDE + ["num_hidden_layers=3", "first_k_dense_replace=1", "moe_intermediate_size=256",
              "q_lora_rank=256", "kv_lora_rank=256", "qk_nope_head_dim=32",
              "qk_rope_head_dim=32", "v_head_dim=64"], []),
    # Rope dimensions in rotate-half order: `moeline quantize` reorders them into llama.cpp's
    # adjacent pairs, so the file is read (and referenced) as an interleaved model.
    ("deepseek_v3-rotate-half", "deepseek_v3", 35,
     _WIDE + ["num_hidden_layers=3", "first_k_dense_replace=1", "moe_intermediate_size=256",
              "q_lora_rank=256", "kv_lora_rank=256", "qk_nope_head_dim=32",
              "qk_rope_head_dim=32", "v_head_dim=64", "rope_interleave=false"], None),
]


def unpermute_rotate_half(w, heads):
    """The inverse of the converter's per-head reordering of rows into adjacent pairs."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(c, tensors):
    """Hugging Face name -> float64 weights of the GGUF's tensors."""
    get = lambda name: gref.tensor_array(tensors[name])  # noqa: E731
    mt = c["model_type"]
    w = {"model.embed_tokens.weight": get("token_embd.weight"),
         "model.norm.weight": get("output_norm.weight")}
    if "output.weight" in tensors:
        w["lm_head.weight"] = get("output.weight")
    heads = c["num_attention_heads"]
    for layer in range(c["num_hidden_layers"]):
        b, p = f"blk.{layer}.", f"model.layers.{layer}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = get(b + "attn_norm.weight")
        post_norm = "post_attention_norm" if mt == "glm4_moe" else "ffn_norm"
        w[p + "post_attention_layernorm.weight"] = get(b + post_norm + ".weight")
        if mt.startswith("deepseek"):
            for gguf, hf in (("attn_q", "q_proj"), ("attn_q_a", "q_a_proj"),
                             ("attn_q_a_norm", "q_a_layernorm"), ("attn_q_b", "q_b_proj"),
                             ("attn_kv_a_mqa", "kv_a_proj_with_mqa"),
                             ("attn_kv_a_norm", "kv_a_layernorm"), ("attn_kv_b", "kv_b_proj"),
                             ("attn_output", "o_proj")):
                if b + gguf + ".weight" in tensors:
                    w[a + hf + ".weight"] = get(b + gguf + ".weight")
            if b + "attn_k_b.weight" in tensors:
                k_b = get(b + "attn_k_b.weight")          # [heads, kv_lora, nope]
                v_b = get(b + "attn_v_b.weight")          # [heads, v, kv_lora]
                joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
                w[a + "kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1])
        else:
            q, k = get(b + "attn_q.weight"), get(b + "attn_k.weight")
            if mt == "mixtral":
                q = unpermute_rotate_half(q, heads)
                k = unpermute_rotate_half(k, c["num_key_value_heads"])
            w[a + "q_proj.weight"], w[a + "k_proj.weight"] = q, k
            w[a + "v_proj.weight"] = get(b + "attn_v.weight")
            w[a + "o_proj.weight"] = get(b + "attn_output.weight")
            if mt in ("olmoe", "qwen3_moe") or b + "attn_q_norm.weight" in tensors:
                w[a + "q_norm.weight"] = get(b + "attn_q_norm.weight")
                w[a + "k_norm.weight"] = get(b + "attn_k_norm.weight")
            for gguf, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
                if b + gguf + ".bias" in tensors:
                    w[a + hf + ".bias"] = get(b + gguf + ".bias")
        if mt == "mixtral":
            moe, parts = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            moe, parts = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        if b + "ffn_gate_inp.weight" not in tensors:
            for gguf, hf in zip(("gate", "up", "down"), parts):
                w[moe + hf + ".weight"] = get(b + f"ffn_{gguf}.weight")
            continue
        w[moe + "gate.weight"] = get(b + "ffn_gate_inp.weight")
        if b + "exp_probs_b.bias" in tensors:
            w[moe + "gate.e_score_correction_bias"] = get(b + "exp_probs_b.bias")
        for gguf, hf in zip(("gate", "up", "down"), parts):
            for e, matrix in enumerate(get(b + f"ffn_{gguf}_exps.weight")):
                w[moe + f"experts.{e}.{hf}.weight"] = matrix
            if b + f"ffn_{gguf}_shexp.weight" in tensors:
                shared = "shared_expert." if mt == "qwen2_moe" else "shared_experts."
                w[moe + f"{shared}{hf}.weight"] = get(b + f"ffn_{gguf}_shexp.weight")
        if b + "ffn_gate_inp_shexp.weight" in tensors:
            w[moe + "shared_expert_gate.weight"] = get(b + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    return w


class WeightsModel:
    """What moe_reference's forward reads: a config and weights by name with their shapes."""

    def __init__(self, config, weights):
        self.config, self._weights = config, weights

    def has(self, name):
        return name in self._weights

    def get(self, name, shape):
        if name not in self._weights:
            raise ref.ModelError(f"the GGUF has no tensor for {name}")
        value = self._weights[name]
        if tuple(value.shape) != tuple(shape):
            raise ref.ModelError(f"{name}: shape {value.shape} from the GGUF, expected {shape}")
        return value


def run_moeline(args, gguf, prompt, out):
    cmd = [args.moeline, "run", "--model", gguf, "--tokens", ",".join(map(str, prompt)),
           "--max-tokens", "1", "--logits-out", out, "--quant-math", "exact"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-600:]}")
    return np.load(out).astype(np.float64)


def check_end_of_turn(args, folder, failures):
    """A GGUF's end-of-turn token (tokenizer.ggml.eot_token_id, what chat models end an answer
    with) stops generation as its end-of-text token does: a token greedy decoding gives, named end
    of turn, ends the answer there."""
    def greedy(gguf, *extra):
        out = subprocess.run([args.moeline, "run", "--model", gguf, "--tokens", "1,2,3",
                              "--max-tokens", "8", "--json", *extra], capture_output=True,
                             text=True, timeout=TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip())
        return json.loads(out.stdout)["ids"]

    plain = os.path.join(args.workdir, "eot-plain.gguf")
    subprocess.run([sys.executable, args.convert, "--model", folder, "--out", plain, "--type",
                    "f16"], check=True, capture_output=True, timeout=TIMEOUT_S)
    ids = greedy(plain)
    # The first token after the first that has not come before (and is not the end of text the
    # answer may stop at): where the answer must end.
    limit = len(ids) if len(ids) == 8 else len(ids) - 1
    at = next((k for k in range(1, limit) if ids[k] not in ids[:k]), None)
    if at is None:
        return failures.append(f"end of turn: no new token in {ids}")
    marked = os.path.join(args.workdir, "eot-marked.gguf")
    subprocess.run([sys.executable, args.convert, "--model", folder, "--out", marked, "--type",
                    "f16", "--u32", f"tokenizer.ggml.eot_token_id={ids[at]}"], check=True,
                   capture_output=True, timeout=TIMEOUT_S)
    got = greedy(marked)
    if got != ids[:at + 1]:
        failures.append(f"end of turn {ids[at]}: generated {got}, want {ids[:at + 1]}")
    else:
        print(f"ok end of turn: eot_token_id {ids[at]} ends the answer at its step {at + 1}")


def check_rope_width_refused(args, folder, failures):
    """A glm4moe file whose rope.dimension_count no head can rotate (odd, or wider than the head)
    is refused naming the key, not run with a rounded width."""
    for width in (63, 66):
        gguf = os.path.join(args.workdir, f"glm4-rope-{width}.gguf")
        subprocess.run([sys.executable, args.convert, "--model", folder, "--out", gguf, "--type",
                        "f16", "--u32", f"glm4moe.rope.dimension_count={width}"], check=True,
                       capture_output=True, timeout=TIMEOUT_S)
        done = subprocess.run([args.moeline, "run", "--model", gguf, "--tokens", "1,2",
                               "--max-tokens", "1"], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        if done.returncode == 0 or "rope.dimension_count" not in done.stderr:
            failures.append(f"rope.dimension_count {width}: expected a refusal naming the key, got "
                            f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        else:
            print(f"ok rope.dimension_count {width} refused: {done.stderr.strip()[-120:]}")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--convert", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--only", metavar="CASE", help="run only this case (while developing)")
    args = ap.parse_args(argv)
    if args.only:
        CASES[:] = [case for case in CASES if case[0] == args.only]
    os.makedirs(args.workdir, exist_ok=True)
    failures, checked = [], 0
    for case, arch, seed, settings, flags in CASES:
        converter_types = TYPES if flags is not None else ()
        folder = os.path.join(args.workdir, case)
        cmd = [sys.executable, args.make_model, "--arch", arch, "--preset", "tiny", "--seed",
               str(seed), "--out", folder]
        for setting in settings:
            cmd += ["--set", setting]
        if case == MAKE_MODEL_GGUF[0]:
            cmd += ["--gguf", MAKE_MODEL_GGUF[1]]
        subprocess.run(cmd, check=True, capture_output=True, timeout=TIMEOUT_S)
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
        if raw.get("rope_interleave") is False:
            raw["rope_interleave"] = True  # what the file holds after the reordering
        config = ref.normalise_config(raw, folder)
        files = []
        for type_name in converter_types:
            gguf = os.path.join(args.workdir, f"{case}.{type_name}.gguf")
            subprocess.run([sys.executable, args.convert, "--model", folder, "--out", gguf,
                            "--type", type_name, *flags], check=True, capture_output=True,
                           timeout=TIMEOUT_S)
            files.append((type_name, gguf))
        if case == MAKE_MODEL_GGUF[0]:
            files.append((f"make-model-gguf-{MAKE_MODEL_GGUF[1]}",
                          os.path.join(folder, f"model.{MAKE_MODEL_GGUF[1]}.gguf")))
        for type_name in QUANTIZE_TYPES:
            gguf = os.path.join(args.workdir, f"{case}.quantize-{type_name}.gguf")
            subprocess.run([args.moeline, "quantize", "--model", folder, "--out", gguf, "--type",
                            type_name], check=True, capture_output=True, timeout=TIMEOUT_S)
            files.append((f"moeline-quantize-{type_name}", gguf))
        # The Q4_K_M mix (which tensors of which layers get more bits) is llama.cpp's rule, written
        # twice: moeline quantize's must give every tensor the converter's type. (DeepSeek's
        # attention splits differently in the two writers, so its files are left out here; GLM's
        # multi-token-prediction layer is the converter's alone, so GLM compares what both hold.)
        by_name = dict(files)
        if "q4_k_m" in by_name and "moeline-quantize-q4_k_m" in by_name and \
                arch in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "glm4_moe"):
            kinds = [{name: entry[0] for name, entry in gref.read_gguf(by_name[key])[1].items()}
                     for key in ("q4_k_m", "moeline-quantize-q4_k_m")]
            names = set(kinds[1]) if arch == "glm4_moe" else set(kinds[0]) | set(kinds[1])
            differ = sorted(n for n in names if kinds[0].get(n) != kinds[1].get(n))
            if differ:
                failures.append(f"{case}: moeline quantize's Q4_K_M types differ from the "
                                f"converter's for {differ}")
            checked += 1
        jinja = os.path.join(folder, "chat_template.jinja")
        for type_name, gguf in files:
            metadata, tensors = gref.read_gguf(gguf)
            if os.path.exists(jinja):
                # A release that keeps its template in chat_template.jinja (GLM-4.5's) has it
                # embedded as the file's tokenizer.chat_template by both writers.
                with open(jinja, encoding="utf-8") as f:
                    checked += 1
                    if metadata.get("tokenizer.chat_template") != f.read():
                        failures.append(f"{case} {type_name}: chat_template.jinja is not the "
                                        "file's tokenizer.chat_template")
            model = WeightsModel(config, hf_weights(config, tensors))
            for prompt in PROMPTS:
                name = f"{case} {type_name} prompt of {len(prompt)}"
                try:
                    got = run_moeline(args, gguf, prompt, os.path.join(args.workdir, "logits.npy"))
                    want = ref.forward_logits(model, prompt)[-1]
                    error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                except (RuntimeError, ref.ModelError, subprocess.TimeoutExpired) as e:
                    failures.append(f"{name}: {e}")
                    continue
                checked += 1
                status = "ok" if error <= LOGITS_RTOL else "FAIL"
                print(f"{status} {name}: rel L2 {error:.2e}", flush=True)
                if error > LOGITS_RTOL:
                    failures.append(f"{name}: logits rel L2 {error:.3e} > {LOGITS_RTOL}")
    check_end_of_turn(args, os.path.join(args.workdir, CASES[0][0]), failures)
    if any(case[0] == "glm4" for case in CASES):
        check_rope_width_refused(args, os.path.join(args.workdir, "glm4"), failures)
    for failure in failures:
        print("FAIL " + failure, file=sys.stderr)
    print(f"{checked} comparisons, {len(failures)} failures")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
