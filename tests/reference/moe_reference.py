#!/usr/bin/python3
"""Independent NumPy reference forward pass for Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2/V3 and GLM-4.5 checkpoints.

This is the oracle the moeline engine is tested against, so it is deliberately simple: no KV
cache, no batching, every step recomputes the whole sequence in float64 from the stored weights
(which are upcast exactly, so the engine and the oracle see identical parameters). Semantics
follow transformers' modeling_mixtral.py / modeling_olmoe.py / modeling_qwen2_moe.py /
modeling_qwen3_moe.py / modeling_glm4_moe.py (eager attention path) and, for
DeepSeek, the modeling_deepseek.py shipped with the official checkpoints: multi-head latent
attention in its plain form (every head's key and value expanded from the latent, nothing
absorbed, no cache), YaRN RoPE, and the V2 / V3 gates.

  moe_reference.py --model DIR --tokens 1,2,3 [--out FILE.npy] [--greedy N]

Library use: load_model(dir) -> ReferenceModel; forward_logits(model, tokens) -> [len, vocab].
Only Debian's python3 + numpy are required.
"""

import argparse
import json
import os
import sys

import numpy as np


class ModelError(Exception):
    """A checkpoint this reference cannot (or must not) evaluate; the message names the cause."""


# --------------------------------------------------------------------------------------------
# safetensors reading (written independently of scripts/make-model's writer so that a bug in
# one does not hide in the other)
# --------------------------------------------------------------------------------------------

_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F8_E4M3": ("u1", 1)}


def read_safetensors_header(path):
    """Return (header dict without __metadata__, absolute offset of the data section)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelError(f"{path}: shorter than the 8-byte header length")
        n = int.from_bytes(raw, "little")
        if n > size - 8:
            raise ModelError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path}: header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        if info.get("dtype") not in _DTYPES:
            raise ModelError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        begin, end = info["data_offsets"]
        need = int(np.prod(info["shape"], dtype=np.int64)) * _DTYPES[info["dtype"]][1]
        if end - begin != need or begin < 0 or data_start + end > size:
            raise ModelError(f"{path}: tensor {name} data_offsets {info['data_offsets']} do not fit "
                             f"its shape {info['shape']} or the file")
    return header, data_start


def e4m3_to_float64(raw):
    """float8_e4m3fn from its definition (OCP FP8, the "fn" variant): sign, a 4-bit exponent with
    bias 7, a 3-bit mantissa; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN and there
    are no infinities."""
    b = raw.astype(np.int64)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6,
                         (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    magnitude = np.where((b & 0x7F) == 0x7F, np.nan, magnitude)
    return np.where(b & 0x80, -magnitude, magnitude)


def to_float64(raw, st_dtype):
    """Exact upcast of stored values to float64."""
    if st_dtype == "F8_E4M3":
        return e4m3_to_float64(raw)
    if st_dtype == "BF16":
        # bf16 is the top half of a float32: shifting the bits back up is exact.
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


class ReferenceModel:
    """Config plus lazily-upcast weights (memory-mapped, so a large model does not load fully)."""

    # Models at or below this many parameters keep their float64 weights cached after first use.
    CACHE_LIMIT_PARAMS = 64 << 20

    def __init__(self, model_dir, config, tensors, weights_file):
        self.dir = model_dir
        self.weights_file = weights_file  # model.safetensors or the index: named in errors
        self.config = config
        self._tensors = tensors  # name -> (path, dtype, shape, absolute offset)
        self._maps = {}
        self._cache = {}
        total = sum(int(np.prod(t[2], dtype=np.int64)) for t in tensors.values())
        self._use_cache = total <= self.CACHE_LIMIT_PARAMS

    def has(self, name):
        return name in self._tensors

    def get(self, name, shape):
        if name in self._cache:
            return self._cache[name]
        if name not in self._tensors:
            raise ModelError(f"{self.weights_file}: missing tensor {name}")
        path, st_dtype, stored_shape, offset = self._tensors[name]
        if tuple(stored_shape) != tuple(shape):
            raise ModelError(f"{path}: tensor {name} has shape {list(stored_shape)}, expected {list(shape)}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        np_dtype, elem = _DTYPES[st_dtype]
        count = int(np.prod(shape, dtype=np.int64))
        raw = self._maps[path][offset:offset + count * elem].view(np_dtype).reshape(shape)
        w = to_float64(raw, st_dtype)
        if st_dtype == "F8_E4M3":
            w = self._apply_block_scales(name, w)
        if self._use_cache:
            self._cache[name] = w
        return w


    def _apply_block_scales(self, name, w):
        """DeepSeek-V3's FP8 layout (its weight_dequant): weight = fp8 * weight_scale_inv[i // br,
        j // bc], one float32 scale per [br, bc] block of quantization_config.weight_block_size."""
        quantization = self.config.get("quantization_config") or {}
        if quantization.get("quant_method") != "fp8":
            raise ModelError(f"{self.weights_file}: {name} is F8_E4M3 but config.json declares no "
                             "fp8 quantization_config")
        br, bc = quantization["weight_block_size"]
        rows, cols = w.shape
        scale_shape = (-(-rows // br), -(-cols // bc))
        scale = self.get(name + "_scale_inv", scale_shape)
        return w * np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:rows, :cols]


# --------------------------------------------------------------------------------------------
# Config normalisation: resolve HF defaults and reject what the reference does not implement
# (silently computing something else would make the oracle wrong).
# --------------------------------------------------------------------------------------------

def yarn_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * np.log(scale) + 1.0


def normalise_deepseek(c, where):
    """DeepSeek-V2 / V3: resolve defaults the way the hub's configuration_deepseek.py does."""
    v3 = c["model_type"] == "deepseek_v3"
    c.setdefault("rope_theta", 10000.0)
    c.setdefault("tie_word_embeddings", False)
    c.setdefault("attention_bias", False)
    c.setdefault("q_lora_rank", None)
    c.setdefault("n_shared_experts", 1 if v3 else None)
    c.setdefault("first_k_dense_replace", 3 if v3 else 0)
    c.setdefault("moe_layer_freq", 1)
    for key, v3_default in (("n_group", 8), ("topk_group", 4)):
        if c.get(key) is None:
            c[key] = v3_default if v3 else 1
    c.setdefault("routed_scaling_factor", 2.5 if v3 else 1.0)
    c.setdefault("norm_topk_prob", v3)
    c.setdefault("scoring_func", "sigmoid" if v3 else "softmax")
    c.setdefault("topk_method", "noaux_tc" if v3 else "greedy")
    c.setdefault("rope_interleave", True)
    # DeepseekV3RMSNorm's default epsilon, which the latent norms (q_a_layernorm, kv_a_layernorm)
    # are built with: modeling_deepseek.py does not pass rms_norm_eps to them.
    c["latent_norm_eps"] = 1e-6
    if c["attention_bias"]:
        raise ModelError(f"{where}: attention_bias is not implemented by this reference")
    if c["scoring_func"] not in ("softmax", "sigmoid"):
        raise ModelError(f"{where}: unsupported scoring_func {c['scoring_func']!r}")
    if c["topk_method"] == "gready":  # the spelling of some early V2 configs
        c["topk_method"] = "greedy"
    if c["topk_method"] not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ModelError(f"{where}: unsupported topk_method {c['topk_method']!r}")
    c["qk_head_dim"] = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    scale = c["qk_head_dim"] ** -0.5
    c["rope_mscale"] = 1.0
    c["rope_yarn"] = None
    rs = c.get("rope_scaling")
    if rs is not None:
        kind = rs.get("type", rs.get("rope_type"))
        if kind != "yarn":
            raise ModelError(f"{where}: unsupported rope_scaling {json.dumps(rs)} (only null or yarn)")
        factor = float(rs["factor"])
        mscale, mscale_all = rs.get("mscale", 1), rs.get("mscale_all_dim", 0)
        if mscale_all:
            m = yarn_mscale(factor, mscale_all)
            scale *= m * m
        c["rope_mscale"] = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        c["rope_yarn"] = dict(factor=factor, original=rs.get("original_max_position_embeddings", 4096),
                              beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1))
    c["softmax_scale"] = scale
    return c


def normalise_glm4(c, where):
    """GLM-4.5: resolve defaults as Glm4MoeConfig does."""
    c.setdefault("partial_rotary_factor", 0.5)
    c.setdefault("attention_bias", False)
    c.setdefault("use_qk_norm", False)
    c.setdefault("rms_norm_eps", 1e-5)
    c.setdefault("rope_theta", 10000.0)
    c.setdefault("tie_word_embeddings", False)
    for key, default in (("n_shared_experts", 1), ("first_k_dense_replace", 1), ("n_group", 1),
                         ("topk_group", 1), ("routed_scaling_factor", 1.0), ("norm_topk_prob", True)):
        c.setdefault(key, default)
    if c.get("rope_scaling") is not None:
        raise ModelError(f"{where}: unsupported rope_scaling {json.dumps(c['rope_scaling'])}")
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    # Glm4MoeRotaryEmbedding: a table for int(head_dim * factor) dimensions; apply_rotary_pos_emb
    # rotates that many leading dimensions of each head (rotate_half within them).
    c["rotary_dim"] = int(c["head_dim"] * c["partial_rotary_factor"])
    c["softmax_scale"] = c["head_dim"] ** -0.5
    # Glm4MoeAttention: q, k, v biased with attention_bias, o_proj never.
    c["biased_projections"] = ("q_proj", "k_proj", "v_proj") if c["attention_bias"] else ()
    c["qk_norm"] = c["use_qk_norm"]
    c["window"] = None
    return c


def normalise_config(raw, where):
    model_type = raw.get("model_type")
    if model_type == "glm4_moe":
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"{where}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        return normalise_glm4(dict(raw), where)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"{where}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        return normalise_deepseek(dict(raw), where)
    if model_type not in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe"):
        raise ModelError(f"{where}: unsupported model_type {model_type!r} (expected mixtral, "
                         "olmoe, qwen2_moe, qwen3_moe, deepseek_v2 or deepseek_v3)")
    c = dict(raw)
    if c.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{where}: unsupported hidden_act {c['hidden_act']!r} (only silu)")

    # RoPE: accept the legacy rope_scaling key and the newer rope_parameters key, default only.
    theta = c.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rs = c.get(key)
        if rs is None:
            continue
        kind = rs.get("rope_type", rs.get("type", "default")) if isinstance(rs, dict) else rs
        if kind != "default":
            raise ModelError(f"{where}: unsupported {key} {json.dumps(rs)} (only null or default)")
        if isinstance(rs, dict) and "rope_theta" in rs:
            theta = rs["rope_theta"]
    if theta is None:
        theta = 1000000.0 if model_type == "mixtral" else 10000.0
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelError(f"{where}: unsupported partial_rotary_factor {c['partial_rotary_factor']}")
    c["rope_theta"] = float(theta)

    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    # Scores are scaled by head_dim^-1/2 (HF's self.scaling), whatever hidden_size / heads is.
    c["softmax_scale"] = c["head_dim"] ** -0.5
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    c.setdefault("tie_word_embeddings", False)

    if model_type == "mixtral":
        c["num_experts"] = c["num_local_experts"]
        c["norm_topk_prob"] = True  # Mixtral always renormalises the top-k weights
        c["attention_bias"] = False
        c["qk_norm"] = False
        c["window"] = c.get("sliding_window")
        c["mlp_only_layers"] = []
        c["decoder_sparse_step"] = 1
        c["moe_intermediate_size"] = c["intermediate_size"]
    elif model_type == "olmoe":
        # OlmoeAttention: bias on all four projections with attention_bias; RMSNorm over the whole
        # q and k projections; q, k, v clamped with clip_qkv. Every layer is MoE.
        c.setdefault("attention_bias", False)
        c["biased_projections"] = (("q_proj", "k_proj", "v_proj", "o_proj")
                                   if c["attention_bias"] else ())
        c.setdefault("norm_topk_prob", False)
        c.setdefault("rms_norm_eps", 1e-5)
        c["qk_norm"] = False
        c["qk_norm_whole"] = True
        c["window"] = None
        c["mlp_only_layers"] = []
        c["decoder_sparse_step"] = 1
        c["moe_intermediate_size"] = c["intermediate_size"]
    elif model_type == "qwen2_moe":
        # Qwen2MoeAttention: q, k and v with bias (qkv_bias, default true), o_proj without.
        c["biased_projections"] = ("q_proj", "k_proj", "v_proj") if c.get("qkv_bias", True) else ()
        c.setdefault("norm_topk_prob", False)
        c.setdefault("decoder_sparse_step", 1)
        if c.get("mlp_only_layers") is None:
            c["mlp_only_layers"] = []
        c["qk_norm"] = False
        # The window slides in the layers layer_types names, else in those from max_window_layers
        # on, and only with use_sliding_window (Qwen2MoeConfig).
        layers = c["num_hidden_layers"]
        window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
        kinds = c.get("layer_types") or [
            "sliding_attention" if window is not None and i >= c.get("max_window_layers", 28)
            else "full_attention" for i in range(layers)]
        c["layer_windows"] = [window if kind == "sliding_attention" else None for kind in kinds]
        c["window"] = None
    else:
        c.setdefault("attention_bias", False)
        c.setdefault("norm_topk_prob", False)
        c.setdefault("decoder_sparse_step", 1)
        if c.get("mlp_only_layers") is None:
            c["mlp_only_layers"] = []
        if "num_experts" not in c and "num_local_experts" in c:
            c["num_experts"] = c["num_local_experts"]
        c["qk_norm"] = True
        c["biased_projections"] = (("q_proj", "k_proj", "v_proj", "o_proj")
                                   if c["attention_bias"] else ())
        # Qwen3MoeConfig drops sliding_window unless use_sliding_window is set.
        c["window"] = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    return c


def is_sparse_layer(c, layer):
    if c["model_type"] == "glm4_moe":
        return layer >= c["first_k_dense_replace"]  # Glm4MoeDecoderLayer
    if c["model_type"].startswith("deepseek"):
        return (c.get("n_routed_experts") is not None and layer >= c["first_k_dense_replace"]
                and layer % c["moe_layer_freq"] == 0)
    if c["model_type"] == "mixtral":
        return True
    return (layer not in c["mlp_only_layers"] and c["num_experts"] > 0
            and (layer + 1) % c["decoder_sparse_step"] == 0)


def load_model(model_dir):
    cfg_path = os.path.join(model_dir, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelError(f"{cfg_path}: not found") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_path}: not valid JSON ({e})") from None
    config = normalise_config(raw, cfg_path)

    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelError(f"{index_path}: not a valid index ({e!r})") from None
        files = sorted(set(weight_map.values()))
        weights_file = index_path
    else:
        weight_map = None
        files = ["model.safetensors"]
        weights_file = os.path.join(model_dir, files[0])

    tensors = {}
    for fn in files:
        path = os.path.join(model_dir, fn)
        if not os.path.exists(path):
            raise ModelError(f"{path}: not found")
        header, data_start = read_safetensors_header(path)
        for name, info in header.items():
            if weight_map is not None and weight_map.get(name) != fn:
                continue  # the index is authoritative about which file holds a tensor
            tensors[name] = (path, info["dtype"], tuple(info["shape"]), data_start + info["data_offsets"][0])
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ModelError(f"{index_path}: tensor {missing[0]} is not in {weight_map[missing[0]]}")
    return ReferenceModel(model_dir, config, tensors, weights_file)


# --------------------------------------------------------------------------------------------
# Forward pass
# --------------------------------------------------------------------------------------------

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    # x * sigmoid(x), with sigmoid written via tanh so large |x| cannot overflow exp().
    return x * 0.5 * (1.0 + np.tanh(0.5 * x))


def rope_tables(n, head_dim, theta):
    # HF layout: inv_freq over even indices, then the angles are duplicated ([f, f]) so that
    # dimension d pairs with d + head_dim/2 (rotate_half), not with d + 1 (interleaved).
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    return np.cos(emb), np.sin(emb)


def apply_rope(x, cos, sin):
    """x: [heads, n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None] + rotated * sin[None]


def attention_mask(n, window):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window  # HF sliding_window_overlay: the last `window` keys incl. self
    return visible


def attention(model, layer, x, c, cos, sin):
    p = f"model.layers.{layer}.self_attn."
    n, h = x.shape
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    biased = c.get("biased_projections", ())

    def proj(name, out_f, in_f, inp):
        y = inp @ model.get(p + name + ".weight", (out_f, in_f)).T
        if name in biased:
            y = y + model.get(p + name + ".bias", (out_f,))
        return y

    q, k, v = proj("q_proj", nh * hd, h, x), proj("k_proj", nkv * hd, h, x), proj("v_proj", nkv * hd, h, x)
    if c.get("qk_norm_whole"):
        # OLMoE: one RMSNorm over all heads of the projection.
        q = rms_norm(q, model.get(p + "q_norm.weight", (nh * hd,)), c["rms_norm_eps"])
        k = rms_norm(k, model.get(p + "k_norm.weight", (nkv * hd,)), c["rms_norm_eps"])
    if c.get("clip_qkv") is not None:
        q, k, v = (np.clip(t, -c["clip_qkv"], c["clip_qkv"]) for t in (q, k, v))
    q = q.reshape(n, nh, hd).transpose(1, 0, 2)
    k = k.reshape(n, nkv, hd).transpose(1, 0, 2)
    v = v.reshape(n, nkv, hd).transpose(1, 0, 2)
    if c["qk_norm"]:
        # Qwen3: RMSNorm over each head's vector, before RoPE.
        q = rms_norm(q, model.get(p + "q_norm.weight", (hd,)), c["rms_norm_eps"])
        k = rms_norm(k, model.get(p + "k_norm.weight", (hd,)), c["rms_norm_eps"])
    # The leading rotary_dim dimensions of each head turn (all of them but in GLM-4.5).
    r = c.get("rotary_dim", hd)
    q = np.concatenate([apply_rope(q[..., :r], cos, sin), q[..., r:]], axis=-1)
    k = np.concatenate([apply_rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)

    group = nh // nkv  # query head i uses kv head i // group (repeat_kv)
    k = np.repeat(k, group, axis=0)
    v = np.repeat(v, group, axis=0)
    scores = q @ k.transpose(0, 2, 1) * c["softmax_scale"]
    window = c["layer_windows"][layer] if "layer_windows" in c else c["window"]
    scores = np.where(attention_mask(n, window)[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(n, nh * hd)
    return proj("o_proj", h, nh * hd, out)


def swiglu(model, prefix, names, x, h, inter):
    gate, up, down = names
    g = x @ model.get(prefix + gate + ".weight", (inter, h)).T
    u = x @ model.get(prefix + up + ".weight", (inter, h)).T
    return (silu(g) * u) @ model.get(prefix + down + ".weight", (h, inter)).T


def moe(model, layer, x, c, stats):
    n, h = x.shape
    if c["model_type"] == "mixtral":
        prefix = f"model.layers.{layer}.block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        prefix = f"model.layers.{layer}.mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    ne, k, inter = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]

    logits = x @ model.get(prefix + "gate.weight", (ne, h)).T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # Stable descending sort: ties go to the lower expert index, like torch.topk in practice.
    order = np.argsort(-probs, axis=-1, kind="stable")
    top = order[:, :k]
    weights = np.take_along_axis(probs, top, axis=-1)
    if c["norm_topk_prob"]:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if stats is not None and k < ne:
        # How close routing came to a different expert choice; an engine computing in float32
        # may legitimately pick the other expert when this is ~1e-6 or less.
        kth = np.take_along_axis(probs, order[:, k - 1:k], axis=-1)
        nxt = np.take_along_axis(probs, order[:, k:k + 1], axis=-1)
        gap = float(np.min(kth - nxt))
        stats["min_router_gap"] = min(stats.get("min_router_gap", np.inf), gap)

    out = routed_experts(model, layer, prefix, names, x, top, weights, ne, inter, stats)
    if c["model_type"] == "qwen2_moe":
        # Qwen2MoeSparseMoeBlock: + sigmoid(shared_expert_gate(x)) * shared_expert(x).
        shared = swiglu(model, prefix + "shared_expert.", names, x, h,
                        c["shared_expert_intermediate_size"])
        gate = x @ model.get(prefix + "shared_expert_gate.weight", (1, h)).T
        out += 1.0 / (1.0 + np.exp(-gate)) * shared
    return out


def routed_experts(model, layer, prefix, names, x, top, weights, ne, inter, stats):
    """Σ over each token's chosen experts of weight × expert(x); counts the choices in `stats`."""
    h = x.shape[1]
    if stats is not None:
        counts = stats.setdefault("expert_counts", {})
        counts[layer] = counts.get(layer, 0) + np.bincount(top.reshape(-1), minlength=ne)
    out = np.zeros_like(x)
    for e in range(ne):
        rows, slot = np.nonzero(top == e)
        if rows.size == 0:
            continue
        y = swiglu(model, f"{prefix}experts.{e}.", names, x[rows], h, inter)
        out[rows] += y * weights[rows, slot][:, None]
    return out


# --------------------------------------------------------------------------------------------
# DeepSeek-V2 / V3
# --------------------------------------------------------------------------------------------

def deepseek_inv_freq(c):
    """Per pair frequencies of the rope dims: plain, or YaRN-blended (DeepseekV3YarnRotaryEmbedding)."""
    dim, base = c["qk_rope_head_dim"], c["rope_theta"]
    extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    yarn = c["rope_yarn"]
    if yarn is None:
        return extra
    inter = extra / yarn["factor"]

    def correction_dim(rotations):
        return dim * np.log(yarn["original"] / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low = max(int(np.floor(correction_dim(yarn["beta_fast"]))), 0)
    high = min(int(np.ceil(correction_dim(yarn["beta_slow"]))), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp  # 1: the original frequency (high-frequency dims), 0: interpolated
    return inter * (1 - keep) + extra * keep


def deepseek_rope(x, positions, c):
    """x: [..., n, rope_dim]. The checkpoint's rope dims are interleaved pairs (2i, 2i+1) when
    rope_interleave (the hub code de-interleaves them before rotate_half); otherwise the
    rotate_half layout (i, i + d/2)."""
    inv = deepseek_inv_freq(c)
    angles = positions[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(angles) * c["rope_mscale"], np.sin(angles) * c["rope_mscale"]
    if c["rope_interleave"]:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    # Return in rotate_half order; the dot products of q and k do not depend on the order as long
    # as both use the same one.
    return np.concatenate([ra, rb], axis=-1)


def deepseek_attention(model, layer, x, c):
    p = f"model.layers.{layer}.self_attn."
    n, h = x.shape
    heads, nope, rope, vd = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                             c["v_head_dim"])
    qk, kv_lora = c["qk_head_dim"], c["kv_lora_rank"]
    # The latent norms use a fixed epsilon (c["latent_norm_eps"]), not rms_norm_eps.
    if c["q_lora_rank"] is None:
        q = x @ model.get(p + "q_proj.weight", (heads * qk, h)).T
    else:
        r = c["q_lora_rank"]
        qa = rms_norm(x @ model.get(p + "q_a_proj.weight", (r, h)).T,
                      model.get(p + "q_a_layernorm.weight", (r,)), c["latent_norm_eps"])
        q = qa @ model.get(p + "q_b_proj.weight", (heads * qk, r)).T
    q = q.reshape(n, heads, qk).transpose(1, 0, 2)
    q_nope, q_pe = q[..., :nope], q[..., nope:]

    compressed = x @ model.get(p + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h)).T
    latent, k_pe = compressed[:, :kv_lora], compressed[:, kv_lora:]
    latent = rms_norm(latent, model.get(p + "kv_a_layernorm.weight", (kv_lora,)), c["latent_norm_eps"])
    kv = (latent @ model.get(p + "kv_b_proj.weight", (heads * (nope + vd), kv_lora)).T)
    kv = kv.reshape(n, heads, nope + vd).transpose(1, 0, 2)
    k_nope, v = kv[..., :nope], kv[..., nope:]

    positions = np.arange(n)
    q_pe = deepseek_rope(q_pe, positions, c)
    k_pe = deepseek_rope(k_pe[None], positions, c)  # one rope key shared by every head
    k = np.concatenate([k_nope, np.broadcast_to(k_pe, (heads, n, rope))], axis=-1)
    q = np.concatenate([q_nope, q_pe], axis=-1)
    scores = q @ k.transpose(0, 2, 1) * c["softmax_scale"]
    scores = np.where(attention_mask(n, None)[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(n, heads * vd)
    return out @ model.get(p + "o_proj.weight", (h, heads * vd)).T


def deepseek_route(c, logits, bias):
    """(chosen experts [n, k], their weights [n, k], the scores the choice was made on)."""
    n, ne = logits.shape
    k, groups, keep = c["num_experts_per_tok"], c["n_group"], c["topk_group"]
    if c["scoring_func"] == "softmax":
        scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias if bias is not None else scores.copy()
    if c["topk_method"] in ("group_limited_greedy", "noaux_tc"):
        grouped = choice.reshape(n, groups, ne // groups)
        if c["topk_method"] == "noaux_tc":
            group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        else:
            group_scores = grouped.max(axis=-1)
        kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :keep]
        mask = np.zeros((n, groups), dtype=bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        # Experts of dropped groups can never be chosen.
        choice = np.where(np.repeat(mask, ne // groups, axis=-1), choice, -np.inf)
    order = np.argsort(-choice, axis=-1, kind="stable")
    top = order[:, :k]
    weights = np.take_along_axis(scores, top, axis=-1)  # the unbiased scores
    if c["model_type"] == "deepseek_v3":
        if k > 1 and c["norm_topk_prob"]:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * c["routed_scaling_factor"]
    elif k > 1 and c["norm_topk_prob"]:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    else:
        weights = weights * c["routed_scaling_factor"]
    return top, weights, choice, order


def glm4_route(c, logits, bias):
    """Glm4MoeMoE.route_tokens_to_experts: sigmoid scores, chosen on score + bias within the
    topk_group groups whose best two (biased) scores sum highest, other groups' experts masked
    to 0; weighted by the unbiased scores, renormalised with norm_topk_prob (whatever top_k is),
    then scaled by routed_scaling_factor."""
    n, ne = logits.shape
    k, groups, keep = c["num_experts_per_tok"], c["n_group"], c["topk_group"]
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias
    group_scores = np.sort(choice.reshape(n, groups, ne // groups), axis=-1)[..., -2:].sum(axis=-1)
    kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :keep]
    mask = np.zeros((n, groups), dtype=bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    choice = np.where(np.repeat(mask, ne // groups, axis=-1), choice, 0.0)
    order = np.argsort(-choice, axis=-1, kind="stable")
    top = order[:, :k]
    weights = np.take_along_axis(scores, top, axis=-1)
    if c["norm_topk_prob"]:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return top, weights * c["routed_scaling_factor"], choice, order


def deepseek_moe(model, layer, x, c, stats):
    n, h = x.shape
    prefix = f"model.layers.{layer}.mlp."
    ne, k, inter = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    logits = x @ model.get(prefix + "gate.weight", (ne, h)).T
    if c["model_type"] == "glm4_moe":
        bias = model.get(prefix + "gate.e_score_correction_bias", (ne,))
        top, weights, choice, order = glm4_route(c, logits, bias)
    else:
        bias = None
        if c["topk_method"] == "noaux_tc":
            bias = model.get(prefix + "gate.e_score_correction_bias", (ne,))
        top, weights, choice, order = deepseek_route(c, logits, bias)
    if stats is not None and k < ne:
        kth = np.take_along_axis(choice, order[:, k - 1:k], axis=-1)
        nxt = np.take_along_axis(choice, order[:, k:k + 1], axis=-1)
        stats["min_router_gap"] = min(stats.get("min_router_gap", np.inf), float(np.min(kth - nxt)))
    names = ("gate_proj", "up_proj", "down_proj")
    out = routed_experts(model, layer, prefix, names, x, top, weights, ne, inter, stats)
    if c["n_shared_experts"]:
        out += swiglu(model, prefix + "shared_experts.", names, x, h, inter * c["n_shared_experts"])
    return out


def forward_logits(model, tokens, stats=None):
    """Logits for every position, float64 [len(tokens), vocab]. Positions start at 0.

    If `stats` is a dict it receives "min_router_gap": the smallest margin between the k-th and
    (k+1)-th router probability over all tokens and MoE layers (inf when no MoE layer), and
    "expert_counts": {layer: per-expert count of top-k selections}, accumulated across calls.
    """
    c = model.config
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    vocab, h = c["vocab_size"], c["hidden_size"]
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab})")
    eps = c["rms_norm_eps"]
    n = tokens.size
    if not c["model_type"].startswith("deepseek"):
        cos, sin = rope_tables(n, c.get("rotary_dim", c["head_dim"]), c["rope_theta"])
    if stats is not None:
        stats.setdefault("min_router_gap", np.inf)

    embed = model.get("model.embed_tokens.weight", (vocab, h))
    x = embed[tokens]
    deepseek = c["model_type"].startswith("deepseek")
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        hn = rms_norm(x, model.get(p + "input_layernorm.weight", (h,)), eps)
        if deepseek:
            x = x + deepseek_attention(model, layer, hn, c)
        else:
            x = x + attention(model, layer, hn, c, cos, sin)
        hn = rms_norm(x, model.get(p + "post_attention_layernorm.weight", (h,)), eps)
        if is_sparse_layer(c, layer):
            deepseek_experts = deepseek or c["model_type"] == "glm4_moe"
            x = x + (deepseek_moe if deepseek_experts else moe)(model, layer, hn, c, stats)
        else:
            x = x + swiglu(model, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), hn, h,
                           c["intermediate_size"])
    x = rms_norm(x, model.get("model.norm.weight", (h,)), eps)
    # HF ties lm_head to the embedding when tie_word_embeddings is set and does not read any
    # stored lm_head.weight in that case.
    head = embed if c["tie_word_embeddings"] else model.get("lm_head.weight", (vocab, h))
    return x @ head.T


def greedy(model, tokens, steps, stats=None):
    """Greedy ids (generated only) and the top-1/top-2 logit margin at each step.

    Does not stop at EOS: the caller decides how to treat an early stop.
    """
    seq = list(tokens)
    ids, margins = [], []
    for _ in range(steps):
        last = forward_logits(model, seq, stats)[-1]
        top2 = np.argsort(-last, kind="stable")[:2]
        ids.append(int(top2[0]))
        margins.append(float(last[top2[0]] - last[top2[1]]))
        seq.append(int(top2[0]))
    return ids, margins


def parse_tokens(text):
    try:
        return [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: expected comma-separated integers") from None


def main(argv):
    ap = argparse.ArgumentParser(description="NumPy float64 reference forward for Mixtral / Qwen3-MoE")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, type=parse_tokens)
    ap.add_argument("--out", help="write last-position logits as float32 .npy of shape [vocab]")
    ap.add_argument("--greedy", type=int, default=0, metavar="N", help="print N greedy ids as JSON")
    args = ap.parse_args(argv)
    try:
        model = load_model(args.model)
        if args.out:
            np.save(args.out, forward_logits(model, args.tokens)[-1].astype(np.float32))
        if args.greedy:
            ids, _ = greedy(model, args.tokens, args.greedy)
            print(json.dumps(ids))
    except (ModelError, ValueError) as e:
        print(f"moe_reference: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
