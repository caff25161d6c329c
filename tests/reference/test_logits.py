#!/usr/bin/python3
"""End-to-end numerical check of moeline against the NumPy reference (moe_reference.py).

  test_logits.py --moeline PATH --make-model PATH --workdir DIR
  test_logits.py --reference-only --make-model PATH --workdir DIR   (validates the oracle itself)

For a matrix of tiny random checkpoints (both families, several seeds and config variants) and
prompts of lengths 1, 5, 16, 17, 40 (either side of 16-token block boundaries) it checks:
  * last-position logits: `moeline run --model M --tokens ... --max-tokens 1 --logits-out X.npy`
    against the float64 reference, relative L2 error <= LOGITS_RTOL;
  * greedy ids: `moeline run --model M --tokens ... --max-tokens 6 --json` (stdout: one JSON
    object whose "ids" are the generated ids only) against the reference's greedy ids.
Exit status 1 on any failure; each failure names the case, the error and the tolerance.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference as ref  # noqa: E402

# Weights are bit-identical on both sides (the reference upcasts the very values the engine
# reads), so the only difference is arithmetic precision: float32 accumulation over dot products
# of K <= a few hundred terms, a handful of layers and a softmax gives relative errors ~1e-6.
# 1e-4 leaves two orders of margin yet catches any semantic slip (wrong RoPE pairing, a missed
# norm weight, off-by-one window), which all move the logits by >1e-2.
LOGITS_RTOL = 1e-4
# A greedy mismatch is only excusable where the reference itself is nearly undecided.
GREEDY_MARGIN = 1e-3
# Router near-ties: below this probability gap, float32 rounding may legitimately select a
# different expert, which changes the logits by far more than LOGITS_RTOL.
ROUTER_TIE_GAP = 1e-6
GREEDY_STEPS = 6
PROMPT_LENGTHS = (1, 5, 16, 17, 40)
SUBPROCESS_TIMEOUT_S = 120

# (case name, arch, seed, extra make-model arguments). Seeds differ per case so that every
# case also exercises fresh weights.
CASES = [
    ("mixtral-s1", "mixtral", 1, []),
    ("mixtral-s2", "mixtral", 2, []),
    ("mixtral-s3", "mixtral", 3, []),
    ("mixtral-headdim24", "mixtral", 4, ["--set", "head_dim=24"]),
    ("mixtral-tied", "mixtral", 5, ["--set", "tie_word_embeddings=true"]),
    ("mixtral-window5", "mixtral", 6, ["--set", "sliding_window=5"]),
    ("mixtral-shards3", "mixtral", 7, ["--shards", "3"]),
    ("mixtral-bf16", "mixtral", 8, ["--dtype", "bf16"]),
    ("mixtral-f16", "mixtral", 9, ["--dtype", "f16"]),
    ("mixtral-mqa-top1", "mixtral", 10, ["--set", "num_key_value_heads=1", "--set", "num_experts_per_tok=1"]),
    # Qwen2-MoE: biases on q, k, v (not o), no q/k norm, unnormalised top-k, a shared expert
    # scaled per token by sigmoid(x · shared_expert_gate).
    ("qwen2-s1", "qwen2_moe", 33, []),
    ("qwen2-norm-topk-bf16", "qwen2_moe", 34, ["--set", "norm_topk_prob=true", "--dtype", "bf16"]),
    ("qwen2-sparse-step2-mha", "qwen2_moe", 35,
     ["--set", "num_hidden_layers=4", "--set", "decoder_sparse_step=2", "--set", "num_key_value_heads=4"]),
    # Every layer slides (max_window_layers 0), as Qwen2MoeConfig's layer_types then say.
    ("qwen2-window5-tied", "qwen2_moe", 36,
     ["--set", "use_sliding_window=true", "--set", "sliding_window=5", "--set", "max_window_layers=0",
      "--set", "tie_word_embeddings=true"]),
    # OLMoE: q/k RMSNorm over the whole projection, unnormalised top-k, every layer MoE.
    ("olmoe-s1", "olmoe", 37, []),
    ("olmoe-gqa-clip-bias-bf16", "olmoe", 38,
     ["--set", "num_key_value_heads=2", "--set", "clip_qkv=0.8", "--set", "attention_bias=true",
      "--set", "norm_topk_prob=true", "--dtype", "bf16"]),
    # GLM-4.5: RoPE over the first half of each head, biases on q/k/v (not o), DeepSeek-V3's
    # routing (one group here, scaled by 2.5), one shared expert, layer 0 dense, and a
    # multi-token-prediction layer in the checkpoint that inference must leave unread.
    ("glm4-s1", "glm4_moe", 39, []),
    ("glm4-qk-norm-groups-bf16", "glm4_moe", 40,
     ["--set", "use_qk_norm=true", "--set", "n_group=4", "--set", "topk_group=2",
      "--set", "routed_scaling_factor=1.0", "--dtype", "bf16"]),
    # Top-1 renormalised to weight 1 (GLM renormalises one expert too), whole-head RoPE.
    ("glm4-top1-full-rotary-tied", "glm4_moe", 41,
     ["--set", "num_experts_per_tok=1", "--set", "partial_rotary_factor=1.0",
      "--set", "routed_scaling_factor=1.0",
      "--set", "tie_word_embeddings=true", "--set", "attention_bias=false",
      "--set", "num_nextn_predict_layers=0"]),
    ("glm4-quarter-rotary-no-shared", "glm4_moe", 42,
     ["--set", "partial_rotary_factor=0.25", "--set", "n_shared_experts=0",
      "--set", "first_k_dense_replace=0", "--set", "norm_topk_prob=false"]),
    ("qwen3-s1", "qwen3_moe", 11, []),  # head_dim 32 != hidden/heads 16
    ("qwen3-s2", "qwen3_moe", 12, []),
    ("qwen3-headdim8", "qwen3_moe", 13, ["--set", "head_dim=8"]),
    ("qwen3-no-norm-topk", "qwen3_moe", 14, ["--set", "norm_topk_prob=false"]),
    ("qwen3-mlp-only-0", "qwen3_moe", 15, ["--set", "mlp_only_layers=[0]"]),
    ("qwen3-sparse-step2", "qwen3_moe", 16,
     ["--set", "num_hidden_layers=4", "--set", "decoder_sparse_step=2", "--set", "mlp_only_layers=[3]"]),
    ("qwen3-attn-bias", "qwen3_moe", 17, ["--set", "attention_bias=true"]),
    ("qwen3-window5", "qwen3_moe", 18, ["--set", "use_sliding_window=true", "--set", "sliding_window=5"]),
    # sliding_window is set but use_sliding_window is false: HF ignores the window.
    ("qwen3-window-off", "qwen3_moe", 19, ["--set", "use_sliding_window=false", "--set", "sliding_window=5"]),
    ("qwen3-tied", "qwen3_moe", 20, ["--set", "tie_word_embeddings=true"]),
    ("qwen3-shards3-bf16", "qwen3_moe", 21, ["--shards", "3", "--dtype", "bf16"]),
    ("qwen3-f16", "qwen3_moe", 22, ["--dtype", "f16"]),
    ("qwen3-top3-mha", "qwen3_moe", 23, ["--set", "num_experts_per_tok=3", "--set", "num_key_value_heads=4"]),
    # DeepSeek-V2: no q_lora_rank (q_proj), softmax gate limited to 2 of 4 groups by their best
    # expert, unnormalised weights times routed_scaling_factor, 2 shared experts, YaRN with
    # mscale == mscale_all_dim (V2-Lite's), one dense layer.
    ("deepseek2-s1", "deepseek_v2", 24, []),
    ("deepseek2-greedy-norm", "deepseek_v2", 25,
     ["--set", 'topk_method="greedy"', "--set", "norm_topk_prob=true"]),
    ("deepseek2-plain-rope-bf16", "deepseek_v2", 26, ["--set", "rope_scaling=null", "--dtype", "bf16"]),
    # DeepSeek-V3: q through q_lora_rank, sigmoid gate choosing on score + correction bias within
    # the 2 of 4 groups with the best top-two sums, normalised weights times 2.5, two dense layers.
    ("deepseek3-s1", "deepseek_v3", 27, []),
    ("deepseek3-mscale-ratio", "deepseek_v3", 28,
     ["--set", 'rope_scaling={"type":"yarn","factor":8.0,"original_max_position_embeddings":64,'
               '"beta_fast":16,"beta_slow":2,"mscale":1.0,"mscale_all_dim":0.8}']),
    ("deepseek3-rotate-half", "deepseek_v3", 29, ["--set", "rope_interleave=false"]),
    ("deepseek3-top1-no-shared", "deepseek_v3", 30,
     ["--set", "num_experts_per_tok=1", "--set", "n_shared_experts=0"]),
    ("deepseek3-freq2-3groups", "deepseek_v3", 31,
     ["--set", "moe_layer_freq=2", "--set", "first_k_dense_replace=1", "--set", "n_routed_experts=24",
      "--set", "n_group=3", "--set", "topk_group=1", "--set", "num_experts_per_tok=3"]),
    ("deepseek3-shards3-bf16", "deepseek_v3", 32, ["--shards", "3", "--dtype", "bf16"]),
]


def prompt_tokens(seed, length, vocab):
    rng = np.random.default_rng([seed, length, 7])
    return [int(t) for t in rng.integers(0, vocab, size=length)]


def make_model(make_model_path, out_dir, arch, seed, extra):
    cmd = [make_model_path, "--arch", arch, "--preset", "tiny", "--seed", str(seed), "--out", out_dir, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"make-model failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")


def case_models(make_model_path, workdir, cases):
    """For each (name, arch, seed, extra) case: (name, seed, its generated checkpoint folder, the
    reference's model of it, its vocabulary size)."""
    for name, arch, seed, extra in cases:
        model_dir = os.path.join(workdir, name)
        make_model(make_model_path, model_dir, arch, seed, extra)
        model = ref.load_model(model_dir)
        yield name, seed, model_dir, model, model.config["vocab_size"]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Runner:
    def __init__(self, moeline):
        self.moeline = moeline

    def run(self, model_dir, tokens, extra):
        cmd = [self.moeline, "run", "--model", model_dir, "--tokens", ",".join(map(str, tokens)), *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        return r.stdout

    def logits(self, model_dir, tokens, npy_path):
        if os.path.exists(npy_path):
            os.remove(npy_path)
        self.run(model_dir, tokens, ["--max-tokens", "1", "--logits-out", npy_path])
        return np.load(npy_path)

    def greedy_ids(self, model_dir, tokens, steps):
        out = self.run(model_dir, tokens, ["--max-tokens", str(steps), "--json"])
        try:
            obj = json.loads(out)
        except json.JSONDecodeError:
            # Tolerate log lines before the JSON object; the object itself must be one line.
            lines = [ln for ln in out.splitlines() if ln.strip().startswith("{")]
            if not lines:
                raise RuntimeError(f"--json printed no JSON object on stdout: {out[-500:]!r}") from None
            obj = json.loads(lines[-1])
        if not isinstance(obj, dict) or not isinstance(obj.get("ids"), list):
            raise RuntimeError(f"--json output has no \"ids\" list: {json.dumps(obj)[:500]}")
        return [int(t) for t in obj["ids"]]


def check_greedy(engine_ids, ref_ids, margins, eos_ids):
    """Return None if acceptable, else a failure description."""
    if len(engine_ids) > len(ref_ids):
        return f"engine returned {len(engine_ids)} ids, asked for {len(ref_ids)}: {engine_ids}"
    for step, (got, want) in enumerate(zip(engine_ids, ref_ids)):
        if got != want:
            if margins[step] < GREEDY_MARGIN:
                return None  # reference near-tie: both choices are right; later steps diverge
            return (f"greedy id {step} is {got}, reference {want} (reference top-1/top-2 margin "
                    f"{margins[step]:.3g} >= tolerance {GREEDY_MARGIN}); engine {engine_ids}, reference {ref_ids}")
    if len(engine_ids) < len(ref_ids) and not (engine_ids and engine_ids[-1] in eos_ids):
        return (f"engine returned {len(engine_ids)} ids without ending at EOS {sorted(eos_ids)}: "
                f"{engine_ids}, reference {ref_ids}")
    return None


def eos_set(config):
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def run_engine_matrix(args):
    runner = Runner(args.moeline)
    failures, n_checks = [], 0
    for name, seed, model_dir, model, vocab in case_models(args.make_model, args.workdir, CASES):
        for length in PROMPT_LENGTHS:
            case = f"{name} len={length}"
            tokens = prompt_tokens(seed, length, vocab)
            stats = {}
            want = ref.forward_logits(model, tokens, stats)[-1]
            n_checks += 2
            try:
                got = runner.logits(model_dir, tokens, os.path.join(args.workdir, f"{name}-{length}.npy"))
                if got.size != vocab:
                    raise RuntimeError(f"--logits-out has shape {got.shape}, expected [{vocab}]")
                err = rel_l2(got.reshape(-1).astype(np.float64), want)
                gap = stats["min_router_gap"]
                if not np.isfinite(err) or err > LOGITS_RTOL:
                    if gap < ROUTER_TIE_GAP:
                        print(f"WARN  {case}: logits rel err {err:.3g} tolerated: router near-tie (gap {gap:.2g})")
                    else:
                        failures.append(f"{case}: logits relative L2 error {err:.3g} > tolerance {LOGITS_RTOL}")
                        print(f"FAIL  {case}: logits rel err {err:.3g} > {LOGITS_RTOL}")
                        continue
                print(f"ok    {case}: logits rel err {err:.2e}")

                ref_ids, margins = ref.greedy(model, tokens, GREEDY_STEPS)
                engine_ids = runner.greedy_ids(model_dir, tokens, GREEDY_STEPS)
                problem = check_greedy(engine_ids, ref_ids, margins, eos_set(model.config))
                if problem:
                    failures.append(f"{case}: {problem}")
                    print(f"FAIL  {case}: {problem}")
                else:
                    print(f"ok    {case}: greedy {engine_ids}")
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
                failures.append(f"{case}: {e}")
                print(f"FAIL  {case}: {e}")
    return failures, n_checks


# --------------------------------------------------------------------------------------------
# --reference-only: checks that the oracle is self-consistent and reads what make-model wrote.
# --------------------------------------------------------------------------------------------

def naive_decode_logits(model, tokens):
    """Token-by-token decode with an explicit KV cache and per-head loops.

    Written in a different style from moe_reference.forward_logits on purpose: agreement checks
    masking, RoPE positions and GQA head mapping of the vectorised oracle.
    """
    c = model.config
    h, hd = c["hidden_size"], c["head_dim"]
    nh, nkv, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    # GLM-4.5 turns only the first rotary_dim dimensions of each head.
    rotated = c.get("rotary_dim", hd)
    half = rotated // 2
    inv_freq = [c["rope_theta"] ** (-(2.0 * i) / rotated) for i in range(half)]
    cache = [([], []) for _ in range(c["num_hidden_layers"])]
    embed = model.get("model.embed_tokens.weight", (c["vocab_size"], h))
    qwen2 = c["model_type"] == "qwen2_moe"
    glm4 = c["model_type"] == "glm4_moe"
    rows = []

    def norm(v, w):
        return v * w / np.sqrt(np.dot(v, v) / v.size + eps)

    def rope(v, pos):
        out = v.copy()
        for i in range(half):
            a = pos * inv_freq[i]
            x1, x2 = v[i], v[i + half]
            out[i] = x1 * np.cos(a) - x2 * np.sin(a)
            out[i + half] = x2 * np.cos(a) + x1 * np.sin(a)
        return out

    for pos, tok in enumerate(tokens):
        x = embed[tok].copy()
        for layer in range(c["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            a = norm(x, model.get(p + "input_layernorm.weight", (h,)))

            def lin(name, out_f, in_f, v):
                y = model.get(p + f"self_attn.{name}.weight", (out_f, in_f)) @ v
                # Qwen2-MoE: q, k and v carry biases (qkv_bias), o_proj none.
                # GLM-4.5: q, k and v with attention_bias, o_proj never.
                qwen2_bias = qwen2 and c.get("qkv_bias", True) and name != "o_proj"
                glm4_bias = glm4 and c["attention_bias"] and name != "o_proj"
                if qwen2_bias or glm4_bias or (not qwen2 and not glm4 and c["attention_bias"]):
                    y = y + model.get(p + f"self_attn.{name}.bias", (out_f,))
                return y

            q, k, v = lin("q_proj", nh * hd, h, a), lin("k_proj", nkv * hd, h, a), lin("v_proj", nkv * hd, h, a)
            if c["model_type"] == "olmoe":
                q = norm(q, model.get(p + "self_attn.q_norm.weight", (nh * hd,)))
                k = norm(k, model.get(p + "self_attn.k_norm.weight", (nkv * hd,)))
                clip = c.get("clip_qkv")
                if clip is not None:
                    q, k, v = (np.minimum(np.maximum(t, -clip), clip) for t in (q, k, v))
            q, k, v = q.reshape(nh, hd), k.reshape(nkv, hd), v.reshape(nkv, hd)
            if c["qk_norm"]:
                qn, kn = model.get(p + "self_attn.q_norm.weight", (hd,)), model.get(p + "self_attn.k_norm.weight", (hd,))
                q = np.stack([norm(q[i], qn) for i in range(nh)])
                k = np.stack([norm(k[i], kn) for i in range(nkv)])
            q = np.stack([rope(q[i], pos) for i in range(nh)])
            k = np.stack([rope(k[i], pos) for i in range(nkv)])
            keys, vals = cache[layer]
            keys.append(k)
            vals.append(v)
            window = c["layer_windows"][layer] if qwen2 else c["window"]
            first = 0 if window is None else max(0, pos - window + 1)
            heads = []
            for i in range(nh):
                g = i // (nh // nkv)
                s = np.array([np.dot(q[i], keys[j][g]) / np.sqrt(hd) for j in range(first, pos + 1)])
                w = np.exp(s - s.max())
                w /= w.sum()
                heads.append(sum(w[t] * vals[first + t][g] for t in range(len(w))))
            x = x + lin("o_proj", h, nh * hd, np.concatenate(heads))

            m = norm(x, model.get(p + "post_attention_layernorm.weight", (h,)))
            if glm4 and ref.is_sparse_layer(c, layer):
                x = x + glm4_moe_one_token(model, p + "mlp.", m, c)
            elif ref.is_sparse_layer(c, layer):
                mixtral = c["model_type"] == "mixtral"
                pre = p + ("block_sparse_moe." if mixtral else "mlp.")
                gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                ne, topk, inter = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
                logit = model.get(pre + "gate.weight", (ne, h)) @ m
                prob = np.exp(logit - logit.max())
                prob /= prob.sum()
                chosen = sorted(range(ne), key=lambda e: (-prob[e], e))[:topk]
                total = sum(prob[e] for e in chosen) if c["norm_topk_prob"] else 1.0
                for e in chosen:
                    q_ = f"{pre}experts.{e}."
                    gv = model.get(q_ + gate + ".weight", (inter, h)) @ m
                    uv = model.get(q_ + up + ".weight", (inter, h)) @ m
                    act = gv / (1.0 + np.exp(-gv)) * uv
                    x = x + (prob[e] / total) * (model.get(q_ + down + ".weight", (h, inter)) @ act)
                if qwen2:
                    si = c["shared_expert_intermediate_size"]
                    s_ = pre + "shared_expert."
                    gv = model.get(s_ + "gate_proj.weight", (si, h)) @ m
                    uv = model.get(s_ + "up_proj.weight", (si, h)) @ m
                    shared = model.get(s_ + "down_proj.weight", (h, si)) @ (gv / (1.0 + np.exp(-gv)) * uv)
                    scale = model.get(pre + "shared_expert_gate.weight", (1, h))[0] @ m
                    x = x + shared / (1.0 + np.exp(-scale))
            else:
                inter = c["intermediate_size"]
                gv = model.get(p + "mlp.gate_proj.weight", (inter, h)) @ m
                uv = model.get(p + "mlp.up_proj.weight", (inter, h)) @ m
                x = x + model.get(p + "mlp.down_proj.weight", (h, inter)) @ (gv / (1.0 + np.exp(-gv)) * uv)
        f = norm(x, model.get("model.norm.weight", (h,)))
        head = embed if c["tie_word_embeddings"] else model.get("lm_head.weight", (c["vocab_size"], h))
        rows.append(head @ f)
    return np.stack(rows)


def glm4_moe_one_token(model, pre, m, c):
    """GLM-4.5's MoE block for one token, as loops: sigmoid scores, each group scored by its two
    best biased scores, the topk_group best groups kept, top-k experts of those by biased score,
    weighted by unbiased scores (renormalised with norm_topk_prob), times routed_scaling_factor,
    plus the shared experts."""
    h = c["hidden_size"]
    ne, topk, inter = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    logit = model.get(pre + "gate.weight", (ne, h)) @ m
    score = [1.0 / (1.0 + np.exp(-v)) for v in logit]
    bias = model.get(pre + "gate.e_score_correction_bias", (ne,))
    biased = [score[e] + bias[e] for e in range(ne)]
    size = ne // c["n_group"]
    group_score = [sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(c["n_group"])]
    kept = sorted(range(c["n_group"]), key=lambda g: (-group_score[g], g))[:c["topk_group"]]
    eligible = [e for e in range(ne) if e // size in kept]
    chosen = sorted(eligible, key=lambda e: (-biased[e], e))[:topk]
    total = sum(score[e] for e in chosen) + 1e-20 if c["norm_topk_prob"] else 1.0
    out = np.zeros(h)

    def swiglu(prefix, width):
        g = model.get(prefix + "gate_proj.weight", (width, h)) @ m
        u = model.get(prefix + "up_proj.weight", (width, h)) @ m
        return model.get(prefix + "down_proj.weight", (h, width)) @ (g / (1.0 + np.exp(-g)) * u)

    for e in chosen:
        out += score[e] / total * c["routed_scaling_factor"] * swiglu(f"{pre}experts.{e}.", inter)
    if c["n_shared_experts"]:
        out += swiglu(pre + "shared_experts.", inter * c["n_shared_experts"])
    return out


def latent_decode_logits(model, tokens):
    """DeepSeek, one token at a time over a cache of what MLA keeps per token (the normalised
    latent and the rotated rope key), with both up-projections absorbed: each head's query is
    mapped into latent space by its K rows of kv_b_proj and its attended latent mapped out by its
    V rows. Must equal the plain (expanded, no cache) forward: the algebra the engine relies on."""
    c = model.config
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, vd, kv_lora = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    qk = nope + rope
    eps = c["rms_norm_eps"]
    embed = model.get("model.embed_tokens.weight", (c["vocab_size"], h))
    caches = [([], []) for _ in range(c["num_hidden_layers"])]
    rows = []
    for pos, tok in enumerate(tokens):
        x = embed[tok][None]
        where = np.array([pos])
        for layer in range(c["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            a = p + "self_attn."
            hn = ref.rms_norm(x, model.get(p + "input_layernorm.weight", (h,)), eps)
            if c["q_lora_rank"] is None:
                q = hn @ model.get(a + "q_proj.weight", (heads * qk, h)).T
            else:
                r = c["q_lora_rank"]
                q = ref.rms_norm(hn @ model.get(a + "q_a_proj.weight", (r, h)).T,
                                 model.get(a + "q_a_layernorm.weight", (r,)), 1e-6)
                q = q @ model.get(a + "q_b_proj.weight", (heads * qk, r)).T
            q = q.reshape(heads, qk)
            ckv = (hn @ model.get(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h)).T)[0]
            latent = ref.rms_norm(ckv[:kv_lora], model.get(a + "kv_a_layernorm.weight", (kv_lora,)), 1e-6)
            k_pe = ref.deepseek_rope(ckv[kv_lora:][None], where, c)[0]
            q_pe = ref.deepseek_rope(q[:, None, nope:], where, c)[:, 0]
            latents, rope_keys = caches[layer]
            latents.append(latent)
            rope_keys.append(k_pe)
            kv_b = model.get(a + "kv_b_proj.weight", (heads * (nope + vd), kv_lora)).reshape(heads, nope + vd, kv_lora)
            out = np.zeros((heads, vd))
            C, R = np.array(latents), np.array(rope_keys)
            for head in range(heads):
                q_latent = q[head, :nope] @ kv_b[head, :nope]  # [kv_lora]
                scores = (C @ q_latent + R @ q_pe[head]) * c["softmax_scale"]
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[head] = kv_b[head, nope:] @ (w @ C)
            x = x + out.reshape(1, heads * vd) @ model.get(a + "o_proj.weight", (h, heads * vd)).T
            hn = ref.rms_norm(x, model.get(p + "post_attention_layernorm.weight", (h,)), eps)
            if ref.is_sparse_layer(c, layer):
                x = x + ref.deepseek_moe(model, layer, hn, c, None)
            else:
                x = x + ref.swiglu(model, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), hn, h,
                                   c["intermediate_size"])
        x = ref.rms_norm(x, model.get("model.norm.weight", (h,)), eps)
        head_w = embed if c["tie_word_embeddings"] else model.get("lm_head.weight", (c["vocab_size"], h))
        rows.append((x @ head_w.T)[0])
    return np.array(rows)


def bf16_round_independent(x32):
    """float32 -> nearest bf16 value as float64, by comparing the two neighbouring candidates."""
    u = x32.view(np.uint32).astype(np.uint64)
    lo = (u & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = ((u & 0xFFFF0000) + 0x10000).astype(np.uint32).view(np.float32).astype(np.float64)
    x = x32.astype(np.float64)
    lo_even = ((u >> 16) & 1) == 0
    pick_hi = (np.abs(hi - x) < np.abs(x - lo)) | ((np.abs(hi - x) == np.abs(x - lo)) & ~lo_even)
    return np.where(pick_hi, hi, lo)


def run_reference_checks(args):
    failures, n_checks = [], 0

    def check(cond, what):
        nonlocal n_checks
        n_checks += 1
        print(f"{'ok  ' if cond else 'FAIL'}  {what}")
        if not cond:
            failures.append(what)

    def build(name, arch, seed, extra):
        d = os.path.join(args.workdir, name)
        make_model(args.make_model, d, arch, seed, extra)
        return ref.load_model(d)

    # 1. Every matrix case: prefix consistency, incremental decode, logits conditioning.
    for name, arch, seed, extra in CASES:
        model = build(name, arch, seed, extra)
        vocab = model.config["vocab_size"]
        tokens = prompt_tokens(seed, max(PROMPT_LENGTHS), vocab)
        stats = {}
        full = ref.forward_logits(model, tokens, stats)
        worst = max(rel_l2(ref.forward_logits(model, tokens[:n])[-1], full[n - 1]) for n in PROMPT_LENGTHS)
        check(worst < 1e-12, f"{name}: prefix forward == rows of longer forward (worst rel err {worst:.2e})")
        decode = latent_decode_logits if arch.startswith("deepseek") else naive_decode_logits
        inc = decode(model, tokens[:20])
        err = max(rel_l2(inc[i], full[i]) for i in range(20))
        route = "latent-cache (absorbed MLA)" if arch.startswith("deepseek") else "naive KV-cache"
        check(err < 1e-10, f"{name}: {route} decode == vectorised forward (worst rel err {err:.2e})")
        check(full.std() > 0.3 and np.isfinite(full).all(),
              f"{name}: logits finite and O(1) (std {full.std():.3f}, min router gap {stats['min_router_gap']:.2g})")
        ids, margins = ref.greedy(model, tokens[:5], GREEDY_STEPS)
        check(min(margins) > 0, f"{name}: greedy {ids} margins min {min(margins):.3g}")

    # 2. Stored dtypes read back exactly: bf16/f16 weights equal the f32 weights rounded.
    base = build("rt-f32", "mixtral", 31, [])
    names = ["model.embed_tokens.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
             "model.layers.0.input_layernorm.weight", "lm_head.weight"]
    for dtype in ("bf16", "f16"):
        other = build(f"rt-{dtype}", "mixtral", 31, ["--dtype", dtype])
        for n in names:
            shape = base._tensors[n][2]
            w32 = base.get(n, shape).astype(np.float32)
            want = bf16_round_independent(w32) if dtype == "bf16" else w32.astype(np.float16).astype(np.float64)
            got = other.get(n, shape)
            check(np.array_equal(got, want) and not np.array_equal(got, w32.astype(np.float64)),
                  f"{dtype} round trip of {n}")

    # 3. Sharding changes the files, not the weights.
    sharded = build("rt-shards3", "mixtral", 31, ["--shards", "3"])
    toks = prompt_tokens(31, 17, 256)
    check(np.array_equal(ref.forward_logits(sharded, toks), ref.forward_logits(base, toks)),
          "sharded (3) and single-file checkpoints give identical logits")

    # 4. Windows: a window >= the sequence is a no-op, a short one changes only later positions;
    # Qwen3 ignores sliding_window unless use_sliding_window.
    wide = build("rt-window40", "mixtral", 31, ["--set", "sliding_window=40"])
    short = build("rt-window5", "mixtral", 31, ["--set", "sliding_window=5"])
    a, b, s = (ref.forward_logits(m, toks) for m in (base, wide, short))
    check(np.array_equal(a, b), "mixtral sliding_window >= length is a no-op")
    check(np.array_equal(a[:5], s[:5]) and rel_l2(s[5:], a[5:]) > 1e-3,
          f"mixtral sliding_window=5 leaves positions < 5 alone and changes later ones ({rel_l2(s[5:], a[5:]):.3g})")
    qbase = build("rt-q", "qwen3_moe", 32, [])
    qoff = build("rt-q-off", "qwen3_moe", 32, ["--set", "sliding_window=5"])
    qon = build("rt-q-on", "qwen3_moe", 32, ["--set", "sliding_window=5", "--set", "use_sliding_window=true"])
    qa, qb, qc = (ref.forward_logits(m, toks) for m in (qbase, qoff, qon))
    check(np.array_equal(qa, qb) and rel_l2(qc[5:], qa[5:]) > 1e-3,
          "qwen3 honours sliding_window only when use_sliding_window is true")

    # 5. norm_topk_prob changes Qwen3 logits; tied embeddings use the embedding matrix.
    qn = build("rt-q-nonorm", "qwen3_moe", 32, ["--set", "norm_topk_prob=false"])
    check(rel_l2(ref.forward_logits(qn, toks), qa) > 1e-3, "qwen3 norm_topk_prob=false changes logits")
    tied = build("rt-tied", "mixtral", 31, ["--set", "tie_word_embeddings=true"])
    check(not tied.has("lm_head.weight"), "tied checkpoint has no lm_head.weight")

    # 6. DeepSeek: every routing and RoPE setting the engine must honour moves the logits (so an
    # engine that ignored one would fail the matrix), and the hub's defaults are resolved.
    d3 = build("rt-ds3", "deepseek_v3", 33, [])
    dtoks = prompt_tokens(33, 24, 512)
    d3_logits = ref.forward_logits(d3, dtoks)

    def moved(model, what, expect=True):
        err = rel_l2(ref.forward_logits(model, dtoks), d3_logits)
        check((err > 1e-3) == expect, f"deepseek_v3: {what} ({'changes' if expect else 'keeps'} logits, rel {err:.3g})")

    unbiased = build("rt-ds3-nobias", "deepseek_v3", 33, [])
    for layer in range(unbiased.config["num_hidden_layers"]):
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if unbiased.has(name):
            unbiased._cache[name] = np.zeros(unbiased.config["n_routed_experts"])
    moved(unbiased, "the correction bias")
    ungrouped = build("rt-ds3-nogroup", "deepseek_v3", 33, [])
    ungrouped.config["topk_group"] = ungrouped.config["n_group"]
    moved(ungrouped, "the group limit")
    for key, value, what in (("rope_interleave", False, "the rope pair layout"),
                             ("softmax_scale", d3.config["softmax_scale"] * 1.3, "the softmax scale"),
                             ("routed_scaling_factor", 1.0, "routed_scaling_factor"),
                             ("norm_topk_prob", False, "norm_topk_prob")):
        other = build(f"rt-ds3-{key}", "deepseek_v3", 33, [])
        other.config[key] = value
        moved(other, what)
    no_yarn = build("rt-ds3-noyarn", "deepseek_v3", 33, ["--set", "rope_scaling=null"])
    moved(no_yarn, "YaRN")
    d2 = build("rt-ds2", "deepseek_v2", 34, [])
    scale = d2.config["softmax_scale"] * np.sqrt(24)
    check(abs(scale - (0.1 * 0.707 * np.log(4.0) + 1) ** 2) < 1e-12,
          f"deepseek_v2: softmax scale carries mscale_all_dim^2 ({scale:.6f})")
    bare = dict(json.load(open(os.path.join(d3.dir, "config.json"))))
    for key in ("n_group", "topk_group", "routed_scaling_factor", "scoring_func", "topk_method"):
        bare.pop(key)
    resolved = ref.normalise_config(bare, "bare")
    check((resolved["n_group"], resolved["topk_group"], resolved["routed_scaling_factor"],
           resolved["scoring_func"], resolved["topk_method"]) == (8, 4, 2.5, "sigmoid", "noaux_tc"),
          "deepseek_v3: the hub config's defaults")

    # 7. CLI --out matches the library call.
    out = os.path.join(args.workdir, "cli.npy")
    r = subprocess.run([sys.executable, ref.__file__, "--model", base.dir, "--tokens", ",".join(map(str, toks)),
                        "--out", out, "--greedy", "3"], capture_output=True, text=True)
    lib = ref.forward_logits(base, toks)[-1]
    check(r.returncode == 0 and np.array_equal(np.load(out), lib.astype(np.float32))
          and json.loads(r.stdout) == ref.greedy(base, toks, 3)[0], "CLI --out/--greedy match the library")

    # 8. The oracle refuses what it does not implement instead of computing something else.
    for arch, setting, needle in (
            ("qwen3_moe", "rope_scaling={\"type\":\"linear\",\"factor\":2.0}", "rope_scaling"),
            ("qwen3_moe", "hidden_act=\"gelu\"", "hidden_act"),
            ("deepseek_v3", "rope_scaling={\"type\":\"dynamic\",\"factor\":2.0}", "rope_scaling"),
            ("deepseek_v2", "topk_method=\"random\"", "topk_method")):
        d = os.path.join(args.workdir, "rt-reject")
        make_model(args.make_model, d, arch, 1, ["--set", setting])
        try:
            ref.load_model(d)
            check(False, f"reference rejects {setting}")
        except ref.ModelError as e:
            check(needle in str(e), f"reference rejects {setting}: {e}")
    return failures, n_checks


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", help="path to the moeline binary")
    ap.add_argument("--make-model", required=True, help="path to scripts/make-model")
    ap.add_argument("--workdir", required=True, help="scratch folder for generated models")
    ap.add_argument("--reference-only", action="store_true",
                    help="validate the reference and make-model without an engine")
    ap.add_argument("--only", metavar="TEXT",
                    help="run only the cases whose name contains TEXT (while developing)")
    args = ap.parse_args(argv)
    if args.only:
        CASES[:] = [case for case in CASES if args.only in case[0]]
    if not args.reference_only and not args.moeline:
        ap.error("--moeline is required unless --reference-only")
    os.makedirs(args.workdir, exist_ok=True)

    t0 = time.monotonic()
    if args.reference_only:
        failures, n = run_reference_checks(args)
    else:
        failures, n = run_engine_matrix(args)
    elapsed = time.monotonic() - t0
    if failures:
        print(f"\n{len(failures)} of {n} checks FAILED ({elapsed:.1f} s):")
        for f in failures:
            print(f"  {f}")
        return 1
    scope = "reference self-checks" if args.reference_only else \
        f"{len(CASES)} models x {len(PROMPT_LENGTHS)} prompts"
    print(f"\nall {n} checks passed ({scope}, {elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
