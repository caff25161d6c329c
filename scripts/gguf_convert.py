#!/usr/bin/python3
"""Convert a Hugging Face MoE checkpoint (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3,
GLM-4.5) to GGUF as llama.cpp's convert_hf_to_gguf.py lays it out, quantizing the matrices.

  scripts/gguf_convert.py --model DIR --out FILE.gguf --type TYPE [--legacy-mla]

TYPE: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k (every matrix of that type, as llama.cpp's
--pure), or q4_k_m, q5_k_m (llama.cpp's mixes: the output matrix and some attention-value and
ffn_down matrices one step up). Norms, routers and biases stay F32; a matrix whose rows are not
whole blocks of the type falls back as llama.cpp's does (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
Q8_0), then to F16. What follows the converter:

  * names: token_embd, blk.N.attn_q ..., experts stacked into ffn_{gate,up,down}_exps;
  * llama (Mixtral): attn_q and attn_k rows permuted per head from rotate-half to adjacent pairs;
  * deepseek2: kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, with
    key_length_mla / value_length_mla (--legacy-mla keeps attn_kv_b, as files before 2025-04);
  * glm4moe: post_attention_norm for the post-attention norm, and the multi-token-prediction
    layers kept after the decoder's (block_count counts them, nextn_predict_layers says how
    many; their extra tensors as blk.N.nextn.*);
  * the tokenizer as tokenizer.ggml.* (gpt2 byte-level BPE, or llama's SentencePiece-style vocab
    with byte tokens), its chat template as tokenizer.chat_template.

Only Debian's python3 + numpy are required.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_writer as gw  # noqa: E402
from terminal_progress import TerminalProgress  # noqa: E402

ARCH = {"mixtral": "llama", "olmoe": "olmoe", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe"}
# GLM-4.5's multi-token-prediction tensors, Hugging Face -> GGUF (under blk.N.).
NEXTN = (("eh_proj", "nextn.eh_proj"), ("enorm", "nextn.enorm"), ("hnorm", "nextn.hnorm"),
         ("embed_tokens", "nextn.embed_tokens"), ("shared_head.head", "nextn.shared_head_head"),
         ("shared_head.norm", "nextn.shared_head_norm"))
# llama_ftype of each --type, for general.file_type.
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k": 15, "q5_k": 17, "q6_k": 18,
             "bf16": 32, "q4_k_m": 15, "q5_k_m": 17}
# Token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Checkpoint:
    """The safetensors of a checkpoint folder, tensors read as float64 on demand."""

    DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}

    def __init__(self, folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        files = (sorted(set(json.load(open(index))["weight_map"].values()))
                 if os.path.exists(index) else ["model.safetensors"])
        self.tensors = {}
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            data = np.memmap(path, dtype=np.uint8, mode="r")
            for key, info in header.items():
                if key != "__metadata__":
                    begin, end = info["data_offsets"]
                    self.tensors[key] = (data[8 + size + begin:8 + size + end], info)

    def has(self, name):
        return name in self.tensors

    def get(self, name):
        raw, info = self.tensors[name]
        np_dtype, _ = self.DTYPES[info["dtype"]]
        values = raw.view(np_dtype)
        if info["dtype"] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float64).reshape(info["shape"])


def permute_rotate_half(w, heads):
    """Rows of each head from [first halves | second halves] to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def use_more_bits(layer, layers):
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


class TypePolicy:
    """Which ggml type each tensor is stored as."""

    def __init__(self, name, layers, experts):
        self.mix = name in ("q4_k_m", "q5_k_m")
        self.base = {"q4_k_m": gw.Q4_K, "q5_k_m": gw.Q5_K}.get(name) or gw.BY_NAME[name]
        self.layers, self.experts = layers, experts
        self.value_matrices = 0

    def of(self, name, shape):
        if len(shape) < 2 or not name.endswith(".weight") or "ffn_gate_inp" in name:
            return gw.F32
        kind = self.base
        if self.mix:
            layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
            if name == "output.weight":
                kind = gw.Q6_K
            elif "attn_v." in name or "attn_kv_b." in name:
                kind = gw.Q8_0 if self.experts == 8 else (
                    gw.Q6_K if use_more_bits(self.value_matrices, self.layers) else self.base)
                self.value_matrices += 1
            elif "attn_k." in name and self.experts == 8:
                kind = gw.Q8_0
            elif "attn_output." in name and self.experts == 8:
                kind = gw.Q5_K
            elif "ffn_down" in name and use_more_bits(layer, self.layers):
                kind = gw.Q6_K
        # llama.cpp's fallbacks for rows that are not whole super-blocks (tensor_type_fallback).
        fallback = {gw.Q4_K: gw.Q5_0, gw.Q5_K: gw.Q5_1, gw.Q6_K: gw.Q8_0}.get(kind, gw.Q8_0)
        row = shape[-1]
        for candidate in (kind, fallback, gw.F16):
            if row % gw.BLOCKS[candidate][0] == 0:
                return candidate
        return gw.F32


def nextn_layers(c):
    """GLM-4.5's multi-token-prediction layers, which the GGUF keeps after the decoder's."""
    return c.get("num_nextn_predict_layers", 0) if c["model_type"] == "glm4_moe" else 0


def tensor_plan(c, ckpt, legacy_mla):
    """[(gguf name, array)] in llama.cpp's order, with the HF tensors reshaped as GGUF wants."""
    mt = c["model_type"]
    out = [("token_embd.weight", ckpt.get("model.embed_tokens.weight"))]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    for layer in range(c["num_hidden_layers"] + nextn_layers(c)):
        p, b = f"model.layers.{layer}.", f"blk.{layer}."
        if layer >= c["num_hidden_layers"]:
            out += [(f"{b}{gguf}.weight", ckpt.get(f"{p}{hf}.weight")) for hf, gguf in NEXTN
                    if ckpt.has(f"{p}{hf}.weight")]
        out.append((b + "attn_norm.weight", ckpt.get(p + "input_layernorm.weight")))
        if mt.startswith("deepseek"):
            a = p + "self_attn."
            if c.get("q_lora_rank"):
                out += [(b + "attn_q_a.weight", ckpt.get(a + "q_a_proj.weight")),
                        (b + "attn_q_a_norm.weight", ckpt.get(a + "q_a_layernorm.weight")),
                        (b + "attn_q_b.weight", ckpt.get(a + "q_b_proj.weight"))]
            else:
                out.append((b + "attn_q.weight", ckpt.get(a + "q_proj.weight")))
            out += [(b + "attn_kv_a_mqa.weight", ckpt.get(a + "kv_a_proj_with_mqa.weight")),
                    (b + "attn_kv_a_norm.weight", ckpt.get(a + "kv_a_layernorm.weight"))]
            kv_b = ckpt.get(a + "kv_b_proj.weight")
            if legacy_mla:
                out.append((b + "attn_kv_b.weight", kv_b))
            else:
                nope, vd = c["qk_nope_head_dim"], c["v_head_dim"]
                per_head = kv_b.reshape(heads, nope + vd, kv_b.shape[-1])
                out += [(b + "attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1).copy()),
                        (b + "attn_v_b.weight", per_head[:, nope:].copy())]
            out.append((b + "attn_output.weight", ckpt.get(a + "o_proj.weight")))
        else:
            a = p + "self_attn."
            q, k = ckpt.get(a + "q_proj.weight"), ckpt.get(a + "k_proj.weight")
            if mt == "mixtral":
                q, k = permute_rotate_half(q, heads), permute_rotate_half(k, kv_heads)
            out += [(b + "attn_q.weight", q), (b + "attn_k.weight", k),
                    (b + "attn_v.weight", ckpt.get(a + "v_proj.weight")),
                    (b + "attn_output.weight", ckpt.get(a + "o_proj.weight"))]
            for bias in ("q", "k", "v", "o"):
                if ckpt.has(a + f"{bias}_proj.bias"):
                    gguf = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}[bias]
                    out.append((b + gguf + ".bias", ckpt.get(a + f"{bias}_proj.bias")))
            if mt in ("olmoe", "qwen3_moe") or ckpt.has(a + "q_norm.weight"):
                out += [(b + "attn_q_norm.weight", ckpt.get(a + "q_norm.weight")),
                        (b + "attn_k_norm.weight", ckpt.get(a + "k_norm.weight"))]
        post_norm = "post_attention_norm" if mt == "glm4_moe" else "ffn_norm"
        out.append((b + post_norm + ".weight", ckpt.get(p + "post_attention_layernorm.weight")))
        out += moe_tensors(c, ckpt, layer, p, b)
    out.append(("output_norm.weight", ckpt.get("model.norm.weight")))
    if not c.get("tie_word_embeddings", False):
        out.append(("output.weight", ckpt.get("lm_head.weight")))
    return out


def moe_tensors(c, ckpt, layer, p, b):
    mt = c["model_type"]
    if mt == "mixtral":
        moe, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        experts = c["num_local_experts"]
    else:
        moe, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        experts = c.get("num_experts") or c.get("n_routed_experts")
    if not ckpt.has(moe + "gate.weight"):  # a dense layer
        return [(b + f"ffn_{part}.weight", ckpt.get(moe + f"{hf}.weight"))
                for part, hf in zip(("gate", "up", "down"), names)]
    out = [(b + "ffn_gate_inp.weight", ckpt.get(moe + "gate.weight"))]
    if ckpt.has(moe + "gate.e_score_correction_bias"):
        out.append((b + "exp_probs_b.bias", ckpt.get(moe + "gate.e_score_correction_bias")))
    for part, hf in zip(("gate", "up", "down"), names):
        out.append((b + f"ffn_{part}_exps.weight",
                    np.stack([ckpt.get(moe + f"experts.{e}.{hf}.weight") for e in range(experts)])))
    for shared in ("shared_experts.", "shared_expert."):  # DeepSeek's, Qwen2-MoE's
        if ckpt.has(moe + shared + "gate_proj.weight"):
            out += [(b + f"ffn_{part}_shexp.weight", ckpt.get(moe + f"{shared}{hf}.weight"))
                    for part, hf in zip(("gate", "up", "down"), names)]
    if ckpt.has(moe + "shared_expert_gate.weight"):  # [1, hidden]: a vector in llama.cpp's files
        out.append((b + "ffn_gate_inp_shexp.weight",
                    ckpt.get(moe + "shared_expert_gate.weight").reshape(-1)))
    return out


def hparams(c, arch, legacy_mla):
    """[(key, type, value)] of the architecture's keys."""
    keys = []

    def put(key, kind, value):
        keys.append((f"{arch}.{key}", kind, value))

    mt = c["model_type"]
    heads = c["num_attention_heads"]
    put("context_length", gw.U32, c["max_position_embeddings"])
    put("embedding_length", gw.U32, c["hidden_size"])
    put("block_count", gw.U32, c["num_hidden_layers"] + nextn_layers(c))
    put("attention.head_count", gw.U32, heads)
    put("attention.layer_norm_rms_epsilon", gw.F32V, c.get("rms_norm_eps", 1e-6))
    put("rope.freq_base", gw.F32V, c.get("rope_theta", 10000.0))
    put("expert_used_count", gw.U32, c["num_experts_per_tok"])
    put("vocab_size", gw.U32, c["vocab_size"])
    if mt == "mixtral":
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        put("attention.head_count_kv", gw.U32, c.get("num_key_value_heads", heads))
        put("attention.key_length", gw.U32, head_dim)
        put("attention.value_length", gw.U32, head_dim)
        put("rope.dimension_count", gw.U32, head_dim)
        put("feed_forward_length", gw.U32, c["intermediate_size"])
        put("expert_count", gw.U32, c["num_local_experts"])
    elif mt == "olmoe":
        put("attention.head_count_kv", gw.U32, c.get("num_key_value_heads", heads))
        put("feed_forward_length", gw.U32, c["intermediate_size"])
        put("expert_count", gw.U32, c["num_experts"])
    elif mt in ("qwen2_moe", "qwen3_moe"):
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        put("attention.head_count_kv", gw.U32, c.get("num_key_value_heads", heads))
        put("attention.key_length", gw.U32, head_dim)
        put("attention.value_length", gw.U32, head_dim)
        put("feed_forward_length", gw.U32, c.get("intermediate_size", 0))
        put("expert_feed_forward_length", gw.U32, c["moe_intermediate_size"])
        put("expert_count", gw.U32, c["num_experts"])
        if mt == "qwen2_moe":
            put("expert_shared_feed_forward_length", gw.U32, c["shared_expert_intermediate_size"])
    elif mt == "glm4_moe":
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        put("attention.head_count_kv", gw.U32, c.get("num_key_value_heads", heads))
        put("attention.key_length", gw.U32, head_dim)
        put("attention.value_length", gw.U32, head_dim)
        put("rope.dimension_count", gw.U32, int(head_dim * c.get("partial_rotary_factor", 0.5)))
        put("feed_forward_length", gw.U32, c["intermediate_size"])
        put("expert_count", gw.U32, c["n_routed_experts"])
        put("expert_feed_forward_length", gw.U32, c["moe_intermediate_size"])
        put("expert_shared_count", gw.U32, c.get("n_shared_experts", 1))
        put("leading_dense_block_count", gw.U32, c.get("first_k_dense_replace", 1))
        put("expert_gating_func", gw.U32, 2)
        put("expert_weights_scale", gw.F32V, c.get("routed_scaling_factor", 1.0))
        put("expert_weights_norm", gw.BOOL, bool(c.get("norm_topk_prob", True)))
        put("nextn_predict_layers", gw.U32, nextn_layers(c))
        if c.get("n_group", 1) > 1:
            put("expert_group_count", gw.U32, c["n_group"])
            put("expert_group_used_count", gw.U32, c["topk_group"])
    else:
        v3 = mt == "deepseek_v3"
        nope, rope, vd, kv_lora = (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                                   c["kv_lora_rank"])
        if legacy_mla:
            put("attention.head_count_kv", gw.U32, heads)
            put("attention.key_length", gw.U32, nope + rope)
            put("attention.value_length", gw.U32, vd)
        else:
            put("attention.head_count_kv", gw.U32, 1)
            put("attention.key_length", gw.U32, kv_lora + rope)
            put("attention.value_length", gw.U32, kv_lora)
            put("attention.key_length_mla", gw.U32, nope + rope)
            put("attention.value_length_mla", gw.U32, vd)
        if c.get("q_lora_rank"):
            put("attention.q_lora_rank", gw.U32, c["q_lora_rank"])
        put("attention.kv_lora_rank", gw.U32, kv_lora)
        put("rope.dimension_count", gw.U32, rope)
        put("feed_forward_length", gw.U32, c.get("intermediate_size", 0))
        put("expert_feed_forward_length", gw.U32, c["moe_intermediate_size"])
        put("expert_count", gw.U32, c["n_routed_experts"])
        put("expert_shared_count", gw.U32, c.get("n_shared_experts") or 0)
        put("leading_dense_block_count", gw.U32, c.get("first_k_dense_replace", 0))
        put("expert_weights_scale", gw.F32V, c.get("routed_scaling_factor", 1.0))
        put("expert_weights_norm", gw.BOOL, bool(c.get("norm_topk_prob", v3)))
        put("expert_gating_func", gw.U32, 2 if c.get("scoring_func", "sigmoid" if v3 else
                                                     "softmax") == "sigmoid" else 1)
        if c.get("n_group", 1) > 1 and c.get("topk_method", "noaux_tc" if v3 else "greedy") != "greedy":
            put("expert_group_count", gw.U32, c["n_group"])
            put("expert_group_used_count", gw.U32, c["topk_group"])
        scaling = c.get("rope_scaling") or {}
        if scaling.get("type", scaling.get("rope_type")) == "yarn":
            put("rope.scaling.type", gw.STRING, "yarn")
            put("rope.scaling.factor", gw.F32V, scaling["factor"])
            put("rope.scaling.original_context_length", gw.U32,
                scaling["original_max_position_embeddings"])
            put("rope.scaling.yarn_log_multiplier", gw.F32V, 0.1 * scaling.get("mscale_all_dim", 0))
    return keys


def _leading_special(doc):
    """The special token a tokenizer.json's post-processor puts first (its BOS), or None."""
    post = doc.get("post_processor") or {}
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for step in steps:
        if step.get("type") == "TemplateProcessing" and step.get("single") and \
                "SpecialToken" in step["single"][0]:
            return step["single"][0]["SpecialToken"]["id"]
    return None


def tokenizer_keys(tokenizer_path, config_path=None, pre=None):
    """tokenizer.ggml.* and tokenizer.chat_template from a tokenizer.json (and, when there is one,
    the tokenizer_config.json beside it). `pre`: the tokenizer.ggml.pre name (default qwen2 for
    byte-level BPE: the pattern make-model's tokenizers use)."""
    with open(tokenizer_path, encoding="utf-8") as f:
        doc = json.load(f)
    model = doc["model"]
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in doc.get("added_tokens", [])}
    for content, token in added.items():
        vocab[content] = token["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    byte_level = not model.get("byte_fallback", False)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    produced = {}  # piece -> rank of the first merge that makes it
    for r, m in enumerate(merges):
        produced.setdefault(m.replace(" ", ""), r)
    types = []
    for text in tokens:
        if text in added:
            types.append(CONTROL if added[text]["special"] else USER_DEFINED)
        elif not byte_level and text == model.get("unk_token"):
            types.append(UNKNOWN)
        elif not byte_level and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    keys = [("tokenizer.ggml.model", gw.STRING, "gpt2" if byte_level else "llama"),
            ("tokenizer.ggml.pre", gw.STRING, pre or ("qwen2" if byte_level else "default")),
            ("tokenizer.ggml.tokens", gw.ARRAY, (gw.STRING, tokens)),
            ("tokenizer.ggml.token_type", gw.ARRAY, (gw.I32, types))]
    if byte_level:
        keys.append(("tokenizer.ggml.merges", gw.ARRAY, (gw.STRING, merges)))
    else:
        # SentencePiece scores: a piece made by an earlier merge scores higher; pieces no merge
        # makes (single characters, bytes, specials) score lowest.
        keys.append(("tokenizer.ggml.scores", gw.ARRAY,
                     (gw.F32V, [-float(produced[t]) if t in produced else -1e9 for t in tokens])))
    config = {}
    if config_path and os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)

    def token_id(key):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if value is not None else None

    if model.get("unk_token") in vocab:
        keys.append(("tokenizer.ggml.unknown_token_id", gw.U32, vocab[model["unk_token"]]))
    leading = _leading_special(doc)
    if token_id("bos_token") is None and leading in vocab:
        config = dict(config, bos_token=leading)
    for key, gguf in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id")):
        if token_id(key) is not None:
            keys.append((f"tokenizer.ggml.{gguf}", gw.U32, token_id(key)))
    add_bos = config.get("add_bos_token", leading is not None)
    keys.append(("tokenizer.ggml.add_bos_token", gw.BOOL, bool(add_bos)))
    # A chat_template.jinja beside tokenizer.json wins over tokenizer_config.json's, as in
    # transformers (GLM-4.5's release keeps its template only there).
    jinja = os.path.join(os.path.dirname(tokenizer_path), "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            keys.append(("tokenizer.chat_template", gw.STRING, f.read()))
    elif config.get("chat_template"):
        keys.append(("tokenizer.chat_template", gw.STRING, config["chat_template"]))
    return keys


def convert(folder, out, type_name, legacy_mla=False, extra_u32=()):
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    mt = c["model_type"]
    if mt not in ARCH:
        raise ValueError(f"model_type {mt!r} is not one of {', '.join(ARCH)}")
    if type_name not in FILE_TYPE:
        raise ValueError(f"--type {type_name!r} is not one of {', '.join(FILE_TYPE)}")
    arch = ARCH[mt]
    ckpt = Checkpoint(folder)
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    policy = TypePolicy(type_name, c["num_hidden_layers"], experts)
    metadata = [("general.architecture", gw.STRING, arch),
                ("general.name", gw.STRING, os.path.basename(os.path.abspath(folder))),
                ("general.file_type", gw.U32, FILE_TYPE[type_name]),
                ("general.quantization_version", gw.U32, 2)]
    metadata += hparams(c, arch, legacy_mla) + tokenizer_keys(
        os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer_config.json"))
    # Keys given on the command line replace the converter's own.
    extra = dict(extra_u32)
    metadata = [m for m in metadata if m[0] not in extra]
    metadata += [(key, gw.U32, value) for key, value in extra.items()]
    tensors = []
    with TerminalProgress(f"quantizing to {type_name}", "tensors") as progress:
        for name, array in tensor_plan(c, ckpt, legacy_mla):
            kind = policy.of(name, array.shape)
            tensors.append((name, kind, list(reversed(array.shape)), gw.quantize(kind, array)))
            progress.update(len(tensors))
    gw.write_gguf(out, metadata, tensors)
    return {gw.NAMES[kind] for _, kind, _, _ in tensors}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    ap.add_argument("--type", required=True, help=", ".join(FILE_TYPE))
    ap.add_argument("--legacy-mla", action="store_true",
                    help="deepseek2: keep attn_kv_b whole (files converted before 2025-04)")
    ap.add_argument("--u32", action="append", default=[], metavar="KEY=N",
                    help="add (or replace) a U32 metadata key, e.g. "
                         "tokenizer.ggml.eot_token_id=5; repeatable")
    args = ap.parse_args(argv)
    try:
        extra = []
        for item in args.u32:
            key, _, value = item.partition("=")
            if not key or not value.isdigit():
                raise ValueError(f"--u32 {item!r}: expected KEY=N")
            extra.append((key, int(value)))
        kinds = convert(args.model, args.out, args.type, args.legacy_mla, extra)
    except (OSError, KeyError, ValueError) as e:
        print(f"gguf_convert: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, "types": sorted(kinds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
