#!/usr/bin/python3
"""Independent NumPy reference forward pass for Mixtral and Qwen3-MoE checkpoints.

This is the oracle the moeline engine is tested against, so it is deliberately simple: no KV
cache, no batching, every step recomputes the whole sequence in float64 from the stored weights
(which are upcast exactly, so the engine and the oracle see identical parameters). Semantics
follow transformers' modeling_mixtral.py / modeling_qwen3_moe.py (eager attention path).

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

_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}


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


def to_float64(raw, st_dtype):
    """Exact upcast of stored values to float64."""
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
        if self._use_cache:
            self._cache[name] = w
        return w


# --------------------------------------------------------------------------------------------
# Config normalisation: resolve HF defaults and reject what the reference does not implement
# (silently computing something else would make the oracle wrong).
# --------------------------------------------------------------------------------------------

def normalise_config(raw, where):
    model_type = raw.get("model_type")
    if model_type not in ("mixtral", "qwen3_moe"):
        raise ModelError(f"{where}: unsupported model_type {model_type!r} (expected mixtral or qwen3_moe)")
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
    else:
        c.setdefault("attention_bias", False)
        c.setdefault("norm_topk_prob", False)
        c.setdefault("decoder_sparse_step", 1)
        if c.get("mlp_only_layers") is None:
            c["mlp_only_layers"] = []
        if "num_experts" not in c and "num_local_experts" in c:
            c["num_experts"] = c["num_local_experts"]
        c["qk_norm"] = True
        # Qwen3MoeConfig drops sliding_window unless use_sliding_window is set.
        c["window"] = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    return c


def is_sparse_layer(c, layer):
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
    bias = c["attention_bias"]

    def proj(name, out_f, in_f, inp):
        y = inp @ model.get(p + name + ".weight", (out_f, in_f)).T
        if bias:
            y = y + model.get(p + name + ".bias", (out_f,))
        return y

    q = proj("q_proj", nh * hd, h, x).reshape(n, nh, hd).transpose(1, 0, 2)
    k = proj("k_proj", nkv * hd, h, x).reshape(n, nkv, hd).transpose(1, 0, 2)
    v = proj("v_proj", nkv * hd, h, x).reshape(n, nkv, hd).transpose(1, 0, 2)
    if c["qk_norm"]:
        # Qwen3: RMSNorm over each head's vector, before RoPE.
        q = rms_norm(q, model.get(p + "q_norm.weight", (hd,)), c["rms_norm_eps"])
        k = rms_norm(k, model.get(p + "k_norm.weight", (hd,)), c["rms_norm_eps"])
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    group = nh // nkv  # query head i uses kv head i // group (repeat_kv)
    k = np.repeat(k, group, axis=0)
    v = np.repeat(v, group, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(attention_mask(n, c["window"])[None], scores, -np.inf)
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
    cos, sin = rope_tables(n, c["head_dim"], c["rope_theta"])
    if stats is not None:
        stats.setdefault("min_router_gap", np.inf)

    embed = model.get("model.embed_tokens.weight", (vocab, h))
    x = embed[tokens]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        hn = rms_norm(x, model.get(p + "input_layernorm.weight", (h,)), eps)
        x = x + attention(model, layer, hn, c, cos, sin)
        hn = rms_norm(x, model.get(p + "post_attention_layernorm.weight", (h,)), eps)
        if is_sparse_layer(c, layer):
            x = x + moe(model, layer, hn, c, stats)
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
