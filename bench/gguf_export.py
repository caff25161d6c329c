#!/usr/bin/python3
"""Convert a Hugging Face Mixtral or DeepSeek-V2/V3 checkpoint into a GGUF file llama.cpp can run.

Why this exists: moeline's CPU speed is compared side by side with llama.cpp on the same model
shape and the same weights. llama.cpp only reads GGUF, and its own converter is llama.cpp code
(and needs torch); this converter is written for moeline from the GGUF v3 format description
so that the repository never carries llama.cpp code. It is a benchmarking aid, not part of the
engine.

  bench/gguf_export.py --model HF_DIR --out FILE.gguf [--name NAME]

Input: config.json plus model.safetensors, or shards listed by model.safetensors.index.json
(or, without an index, every *.safetensors file in HF_DIR). Tensors may be BF16, F16 or F32.
model_type picks the output architecture:

mixtral -> architecture "llama" with llama.expert_count / expert_used_count set, so llama.cpp runs
it as Mixtral does (softmax router, top-k, renormalised weights, SiLU-gated experts).
  * experts.{e}.w1/w3/w2 are stacked into ffn_gate_exps / ffn_up_exps / ffn_down_exps;
  * q_proj / k_proj rows are reordered per head from HF's rotate_half RoPE layout (pairs i and
    i + d/2) to GGUF's interleaved layout (pairs 2i and 2i + 1), so the logits match HF's.

deepseek_v2 / deepseek_v3 (the hub's modeling_deepseek.py semantics) -> architecture "deepseek2",
llama.cpp's multi-head latent attention (MLA) form, as its own converter writes it:
  * head_count_kv = 1; key_length = kv_lora_rank + qk_rope_head_dim and value_length =
    kv_lora_rank (the cached latent); key_length_mla / value_length_mla = the per-head
    qk_nope + qk_rope / v_head_dim; q_lora_rank (0 when null: plain attn_q), kv_lora_rank;
    rope.dimension_count = qk_rope_head_dim;
  * q_a_proj / q_a_layernorm / q_b_proj (or q_proj) -> attn_q_a / attn_q_a_norm / attn_q_b (or
    attn_q); kv_a_proj_with_mqa -> attn_kv_a_mqa ([latent | k_pe] rows kept); kv_a_layernorm ->
    attn_kv_a_norm; kv_b_proj (per head: qk_nope K rows, then v_head_dim V rows) is split into
    attn_k_b, each head's K block transposed (ne = qk_nope, kv_lora_rank, n_head), and attn_v_b
    (ne = kv_lora_rank, v_head_dim, n_head);
  * RoPE: rope_interleave (the default) stores the rope dims as adjacent pairs, which is
    llama.cpp's NORM rope, so nothing moves; with rope_interleave false the rope rows of q and
    k_pe are reordered from rotate_half to interleaved order;
  * the first first_k_dense_replace layers (leading_dense_block_count) keep a dense SwiGLU
    (ffn_gate / ffn_up / ffn_down, feed_forward_length = intermediate_size); the others get the
    router ffn_gate_inp, stacked ffn_{gate,up,down}_exps (expert_feed_forward_length =
    moe_intermediate_size), shared experts ffn_{gate,up,down}_shexp (expert_shared_count) and,
    for topk_method noaux_tc, gate.e_score_correction_bias -> exp_probs_b.bias;
  * routing: expert_gating_func softmax (1) or sigmoid (2) from scoring_func;
    expert_group_count / expert_group_used_count from n_group / topk_group when groups are
    really limited; expert_weights_norm and expert_weights_scale reproduce the V2 rule (scale by
    routed_scaling_factor unless the top-k weights are normalised) and the V3 rule (normalise if
    norm_topk_prob, then scale);
  * YaRN rope_scaling: rope.scaling.type yarn, factor, original_context_length, beta_fast/slow,
    and rope.scaling.yarn_log_multiplier (+ rope.scaling.attn_factor when mscale !=
    mscale_all_dim) chosen so that llama.cpp's attention scale is HF's
    yarn_get_mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim) and its rope magnitude HF's
    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim);
  * settings llama.cpp's deepseek2 cannot express are refused with an error naming them:
    group_limited_greedy with topk_group < n_group (llama.cpp ranks groups by their top-2 sum,
    V2 by their max), YaRN beta_fast/beta_slow other than 32/1 (deepseek2 ignores the keys),
    moe_layer_freq != 1, no shared experts, no routed experts, attention_bias, and
    q_lora_rank set on 26/27-layer models (which llama.cpp treats as Lite: attn_q only);
  * not represented, reported as a note: HF applies a fixed eps 1e-6 in q_a/kv_a_layernorm,
    llama.cpp uses rms_norm_eps (identical for the official configs, which use 1e-6); MTP layers
    (model.layers.N >= num_hidden_layers) are skipped, as llama.cpp's converter does.

Both: matrices keep their stored type (BF16 stays BF16); norms, the router (ffn_gate_inp) and the
correction bias are F32, as llama.cpp's own converter writes them (llama.cpp's CPU backend rounds
the activations to BF16 for BF16 matrices, so its BF16 logits drift from ours by ~0.5% on tiny
models and a few % on mini ones, where routing ties flip; F32 exports agree to ~1e-6 with flash
attention off, ~5e-4 with it on). The checkpoint's tokenizer is not converted: a synthetic
SentencePiece-style vocabulary is written: <unk>, <s>, </s>, the 256 byte tokens <0xXX> when
vocab_size leaves room, then <tok_i>. It lets llama.cpp load and tokenize; its text is
meaningless (feed token ids, or use llama-bench).

Tensors are streamed one at a time (experts one matrix at a time, large matrices in row
chunks), so memory stays far below the model size. The file is written to FILE.gguf.tmp and
renamed when complete. Only Debian's python3 + numpy are required.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32  # GGUF default; written explicitly as general.alignment

# GGUF metadata value types
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9

# ggml tensor types
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16"}

# llama_ftype values for general.file_type
FILE_TYPE = {GGML_F32: 0, GGML_F16: 1, GGML_BF16: 32}

# safetensors dtype -> (numpy dtype of the raw little-endian elements, ggml type)
ST_DTYPES = {"F32": ("<f4", GGML_F32), "F16": ("<f2", GGML_F16), "BF16": ("<u2", GGML_BF16)}

# llama token types (tokenizer.ggml.token_type)
TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_BYTE = 1, 2, 3, 6

CHUNK_BYTES = 64 << 20  # rows of large matrices are copied in pieces of about this size


class ExportError(Exception):
    """A checkpoint this exporter cannot convert; reported as one line, exit status 1."""


def note(message):
    """Something the GGUF file does not represent exactly, but close enough to go on."""
    print(f"gguf_export: note: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# safetensors reading
# --------------------------------------------------------------------------------------------

class SourceTensor:
    """One tensor in a safetensors file, read lazily from disk."""

    def __init__(self, name, path, dtype, shape, offset, nbytes):
        self.name, self.path, self.dtype, self.shape = name, path, dtype, tuple(shape)
        self.offset, self.nbytes = offset, nbytes
        self.np_dtype, self.ggml_type = ST_DTYPES[dtype]

    def read_rows(self, start=0, stop=None):
        """Rows [start, stop) of the first axis as a numpy array of the raw element type."""
        rows = self.shape[0] if self.shape else 1
        stop = rows if stop is None else stop
        row_elems = int(np.prod(self.shape[1:], dtype=np.int64))
        row_bytes = row_elems * np.dtype(self.np_dtype).itemsize
        count = (stop - start) * row_elems
        a = np.fromfile(self.path, dtype=self.np_dtype, count=count,
                        offset=self.offset + start * row_bytes)
        if a.size != count:
            raise ExportError(f"{self.path}: tensor {self.name} is truncated")
        return a.reshape((stop - start,) + self.shape[1:]) if self.shape else a.reshape(())

    def read(self):
        return self.read_rows()


def read_safetensors_header(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ExportError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise ExportError(f"{path}: header length {n} runs past the end of the file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ExportError(f"{path}: header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        dtype = info.get("dtype")
        if dtype not in ST_DTYPES:
            raise ExportError(f"{path}: tensor {name} has dtype {dtype}; only "
                              f"{', '.join(ST_DTYPES)} are supported")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(ST_DTYPES[dtype][0]).itemsize
        if end - begin != need or begin < 0 or 8 + n + end > size:
            raise ExportError(f"{path}: tensor {name} data_offsets {info['data_offsets']} do not "
                              f"fit its shape {shape} or the file")
        tensors[name] = SourceTensor(name, path, dtype, shape, 8 + n + begin, need)
    return tensors


def open_checkpoint(model_dir):
    """Map every tensor name of the checkpoint to its SourceTensor."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
        files = ["model.safetensors"]
    else:
        files = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
        if not files:
            raise ExportError(f"{model_dir}: no model.safetensors, index or *.safetensors file")
    tensors = {}
    for fname in files:
        for name, t in read_safetensors_header(os.path.join(model_dir, fname)).items():
            if name in tensors:
                raise ExportError(f"tensor {name} appears in two files")
            tensors[name] = t
    return tensors


# --------------------------------------------------------------------------------------------
# Tensor transforms (all on raw element arrays; reordering rows never touches the values)
# --------------------------------------------------------------------------------------------

def to_f32(a, ggml_type):
    if ggml_type == GGML_BF16:  # bf16 is the top half of an IEEE float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def rope_rows_hf_to_gguf(w, n_head):
    """Reorder the rows of a q/k projection [n_head * d, in] from HF to GGUF RoPE layout.

    HF's rotate_half rotates element i of a head together with element i + d/2; llama.cpp's
    normal RoPE rotates elements 2i and 2i + 1. Within each head, new row 2i is old row i and
    new row 2i + 1 is old row i + d/2.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ExportError(f"q/k projection with {rows} rows cannot be split into {n_head} heads "
                          "of even size")
    d = rows // n_head
    return np.ascontiguousarray(
        w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def rope_tail_hf_to_gguf(w, n_group, tail):
    """Like rope_rows_hf_to_gguf, for the last `tail` rows of each of n_group row groups only.

    DeepSeek's q rows are [qk_nope | qk_rope] per head and kv_a_proj_with_mqa's rows are
    [latent | k_pe]; only the rope part rotates. Used when the checkpoint says
    rope_interleave=false (rotate_half layout); the default interleaved layout is already GGUF's.
    """
    g = w.shape[0] // n_group
    out = w.reshape(n_group, g, *w.shape[1:]).copy()
    rope = out[:, g - tail:]
    out[:, g - tail:] = rope.reshape(n_group, 2, tail // 2, *w.shape[1:]).swapaxes(1, 2).reshape(rope.shape)
    return out.reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Output tensor plan
# --------------------------------------------------------------------------------------------

class OutTensor:
    """A GGUF tensor: name, ggml type, dims in ggml order (ne[0] innermost) and a producer."""

    def __init__(self, name, ggml_type, ne, chunks):
        self.name, self.ggml_type, self.ne, self.chunks = name, ggml_type, list(ne), chunks
        itemsize = 4 if ggml_type == GGML_F32 else 2
        self.nbytes = int(np.prod(self.ne, dtype=np.int64)) * itemsize
        self.offset = 0


def plain(src):
    """Copy as stored, in row chunks."""
    def chunks():
        rows = src.shape[0]
        step = max(1, CHUNK_BYTES // max(1, src.nbytes // rows))
        for r in range(0, rows, step):
            yield src.read_rows(r, min(rows, r + step))
    return OutTensor(None, src.ggml_type, src.shape[::-1], chunks)


def as_f32(src):
    return OutTensor(None, GGML_F32, src.shape[::-1],
                     lambda: iter([to_f32(src.read(), src.ggml_type)]))


def permuted(src, n_head):
    return OutTensor(None, src.ggml_type, src.shape[::-1],
                     lambda: iter([rope_rows_hf_to_gguf(src.read(), n_head)]))


def rope_tail(src, n_group, tail):
    return OutTensor(None, src.ggml_type, src.shape[::-1],
                     lambda: iter([rope_tail_hf_to_gguf(src.read(), n_group, tail)]))


def kv_b_part(src, n_head, nope, v_dim, part):
    """One half of DeepSeek's kv_b_proj [n_head * (nope + v_dim), kv_lora_rank].

    part "k": each head's K rows transposed, [n_head, kv_lora_rank, nope] (ggml ne nope,
    kv_lora_rank, n_head): llama.cpp multiplies q_nope by it to absorb the key up-projection.
    part "v": each head's V rows, [n_head, v_dim, kv_lora_rank] (ne kv_lora_rank, v_dim, n_head).
    """
    lora = src.shape[1]

    def chunks():
        w = src.read().reshape(n_head, nope + v_dim, lora)
        if part == "k":
            yield np.ascontiguousarray(w[:, :nope, :].transpose(0, 2, 1))
        else:
            yield np.ascontiguousarray(w[:, nope:, :])
    ne = [nope, lora, n_head] if part == "k" else [lora, v_dim, n_head]
    return OutTensor(None, src.ggml_type, ne, chunks)


def stacked(srcs):
    """Experts [out, in] each -> one [n_expert, out, in] tensor (ne = in, out, n_expert)."""
    first = srcs[0]
    for s in srcs:
        if s.shape != first.shape or s.dtype != first.dtype:
            raise ExportError(f"{s.name} is {s.dtype}{list(s.shape)} but {first.name} is "
                              f"{first.dtype}{list(first.shape)}; experts must match")
    return OutTensor(None, first.ggml_type, list(first.shape[::-1]) + [len(srcs)],
                     lambda: (s.read() for s in srcs))


def plan_mixtral(tensors, cfg):
    used = set()

    def get(name):
        if name not in tensors:
            raise ExportError(f"checkpoint has no tensor {name}")
        used.add(name)
        return tensors[name]

    def shape_check(t, shape):
        if t.shape != tuple(shape):
            raise ExportError(f"{t.name} has shape {list(t.shape)}, config implies {list(shape)}")
        return t

    H, V, F = cfg["hidden"], cfg["vocab"], cfg["ff"]
    nh, nkv, hd, E = cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"], cfg["n_expert"]
    out = []

    def add(name, t):
        t.name = name
        out.append(t)

    add("token_embd.weight", plain(shape_check(get("model.embed_tokens.weight"), (V, H))))
    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", as_f32(shape_check(get(p + "input_layernorm.weight"), (H,))))
        add(f"blk.{i}.attn_q.weight",
            permuted(shape_check(get(p + "self_attn.q_proj.weight"), (nh * hd, H)), nh))
        add(f"blk.{i}.attn_k.weight",
            permuted(shape_check(get(p + "self_attn.k_proj.weight"), (nkv * hd, H)), nkv))
        add(f"blk.{i}.attn_v.weight", plain(shape_check(get(p + "self_attn.v_proj.weight"), (nkv * hd, H))))
        add(f"blk.{i}.attn_output.weight",
            plain(shape_check(get(p + "self_attn.o_proj.weight"), (H, nh * hd))))
        add(f"blk.{i}.ffn_norm.weight",
            as_f32(shape_check(get(p + "post_attention_layernorm.weight"), (H,))))
        m = p + "block_sparse_moe."
        add(f"blk.{i}.ffn_gate_inp.weight", as_f32(shape_check(get(m + "gate.weight"), (E, H))))
        ex = [m + f"experts.{e}." for e in range(E)]
        add(f"blk.{i}.ffn_gate_exps.weight",
            stacked([shape_check(get(x + "w1.weight"), (F, H)) for x in ex]))
        add(f"blk.{i}.ffn_down_exps.weight",
            stacked([shape_check(get(x + "w2.weight"), (H, F)) for x in ex]))
        add(f"blk.{i}.ffn_up_exps.weight",
            stacked([shape_check(get(x + "w3.weight"), (F, H)) for x in ex]))
    add("output_norm.weight", as_f32(shape_check(get("model.norm.weight"), (H,))))
    if "lm_head.weight" in tensors:
        add("output.weight", plain(shape_check(get("lm_head.weight"), (V, H))))
    elif not cfg["tied"]:
        raise ExportError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    # else: llama.cpp reuses token_embd as the output matrix when output.weight is absent

    # rotary_emb.inv_freq buffers are derived from rope_theta; anything else is a real mismatch
    unused = [n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ExportError(f"{len(unused)} checkpoint tensors would be dropped, e.g. {unused[0]}")
    return out


def plan_deepseek(tensors, cfg):
    used = set()

    def get(name, shape):
        if name not in tensors:
            raise ExportError(f"checkpoint has no tensor {name}")
        t = tensors[name]
        if t.shape != tuple(shape):
            raise ExportError(f"{name} has shape {list(t.shape)}, config implies {list(shape)}")
        used.add(name)
        return t

    H, V = cfg["hidden"], cfg["vocab"]
    nh, nope, rope, vd = cfg["n_head"], cfg["qk_nope"], cfg["qk_rope"], cfg["v_dim"]
    qk, kv_lora, q_lora = nope + rope, cfg["kv_lora"], cfg["q_lora"]
    E, Fe, F = cfg["n_expert"], cfg["ff_expert"], cfg["ff"]
    Fs = Fe * cfg["n_shared"]
    interleaved = cfg["rope_interleave"]
    out = []

    def add(name, t):
        t.name = name
        out.append(t)

    def q_rows(src):  # [n_head * (nope + rope), in]
        return plain(src) if interleaved else rope_tail(src, nh, rope)

    add("token_embd.weight", plain(get("model.embed_tokens.weight", (V, H))))
    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        b = f"blk.{i}."
        add(b + "attn_norm.weight", as_f32(get(p + "input_layernorm.weight", (H,))))
        if q_lora:
            add(b + "attn_q_a.weight", plain(get(a + "q_a_proj.weight", (q_lora, H))))
            add(b + "attn_q_a_norm.weight", as_f32(get(a + "q_a_layernorm.weight", (q_lora,))))
            add(b + "attn_q_b.weight", q_rows(get(a + "q_b_proj.weight", (nh * qk, q_lora))))
        else:
            add(b + "attn_q.weight", q_rows(get(a + "q_proj.weight", (nh * qk, H))))
        kv_a = get(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, H))
        add(b + "attn_kv_a_mqa.weight", plain(kv_a) if interleaved else rope_tail(kv_a, 1, rope))
        add(b + "attn_kv_a_norm.weight", as_f32(get(a + "kv_a_layernorm.weight", (kv_lora,))))
        kv_b = get(a + "kv_b_proj.weight", (nh * (nope + vd), kv_lora))
        add(b + "attn_k_b.weight", kv_b_part(kv_b, nh, nope, vd, "k"))
        add(b + "attn_v_b.weight", kv_b_part(kv_b, nh, nope, vd, "v"))
        add(b + "attn_output.weight", plain(get(a + "o_proj.weight", (H, nh * vd))))
        add(b + "ffn_norm.weight", as_f32(get(p + "post_attention_layernorm.weight", (H,))))
        m = p + "mlp."
        if i < cfg["n_dense"]:
            add(b + "ffn_gate.weight", plain(get(m + "gate_proj.weight", (F, H))))
            add(b + "ffn_down.weight", plain(get(m + "down_proj.weight", (H, F))))
            add(b + "ffn_up.weight", plain(get(m + "up_proj.weight", (F, H))))
            continue
        add(b + "ffn_gate_inp.weight", as_f32(get(m + "gate.weight", (E, H))))
        if cfg["score_bias"]:
            add(b + "exp_probs_b.bias", as_f32(get(m + "gate.e_score_correction_bias", (E,))))
        if m + "experts.gate_up_proj" in tensors:
            raise ExportError(f"{m}experts.gate_up_proj: the fused expert layout is not supported "
                              "(write per-expert gate_proj / up_proj / down_proj)")
        ex = [m + f"experts.{e}." for e in range(E)]
        add(b + "ffn_gate_exps.weight", stacked([get(x + "gate_proj.weight", (Fe, H)) for x in ex]))
        add(b + "ffn_down_exps.weight", stacked([get(x + "down_proj.weight", (H, Fe)) for x in ex]))
        add(b + "ffn_up_exps.weight", stacked([get(x + "up_proj.weight", (Fe, H)) for x in ex]))
        s = m + "shared_experts."
        add(b + "ffn_gate_shexp.weight", plain(get(s + "gate_proj.weight", (Fs, H))))
        add(b + "ffn_down_shexp.weight", plain(get(s + "down_proj.weight", (H, Fs))))
        add(b + "ffn_up_shexp.weight", plain(get(s + "up_proj.weight", (Fs, H))))
    add("output_norm.weight", as_f32(get("model.norm.weight", (H,))))
    if cfg["tied"]:
        # HF ignores any stored lm_head.weight when tied; llama.cpp reuses token_embd.
        used.add("lm_head.weight")
    elif "lm_head.weight" in tensors:
        add("output.weight", plain(get("lm_head.weight", (V, H))))
    else:
        raise ExportError("checkpoint has no lm_head.weight and tie_word_embeddings is false")

    def skipped(name):
        if name.endswith("rotary_emb.inv_freq"):  # derived from rope_theta
            return True
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= cfg["n_layer"]:
            return True  # multi-token-prediction layers, which llama.cpp's converter skips too
        # HF reads the correction bias only for topk_method noaux_tc
        return name.endswith(".mlp.gate.e_score_correction_bias") and not cfg["score_bias"]

    unused = [n for n in tensors if n not in used]
    dropped = [n for n in unused if not skipped(n)]
    if dropped:
        raise ExportError(f"{len(dropped)} checkpoint tensors would be dropped, e.g. {dropped[0]}")
    mtp = sorted({int(n.split(".")[2]) for n in unused if n.startswith("model.layers.")
                  and n.split(".")[2].isdigit() and int(n.split(".")[2]) >= cfg["n_layer"]})
    if mtp:
        note(f"the tensors of layers {mtp} (beyond num_hidden_layers: multi-token prediction) "
             "are not exported")
    if any(n.endswith("e_score_correction_bias") for n in unused):
        note("gate.e_score_correction_bias is not exported: topk_method "
             f"{cfg['topk_method']!r} does not use it")
    return out


def plan_tensors(tensors, cfg):
    return (plan_deepseek if cfg["arch"] == "deepseek2" else plan_mixtral)(tensors, cfg)


# --------------------------------------------------------------------------------------------
# Config and metadata
# --------------------------------------------------------------------------------------------

def read_config(model_dir):
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: {e}") from None
    if not isinstance(c, dict):
        raise ExportError(f"{path}: not a JSON object")
    if c.get("model_type") == "mixtral":
        return mixtral_config(c, path)
    if c.get("model_type") in ("deepseek_v2", "deepseek_v3"):
        return deepseek_config(c, path)
    raise ExportError(f"{path}: model_type is {c.get('model_type')!r}, expected 'mixtral', "
                      "'deepseek_v2' or 'deepseek_v3'")


def positive_int(c, path, key, minimum=1):
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ExportError(f"{path}: {key}={v!r} is not {what}")
    return v


def number(c, path, key, default):
    v = c.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ExportError(f"{path}: {key}={v!r} is not a number")
    return float(v)


def mixtral_config(c, path):
    def need(key):
        return positive_int(c, path, key)

    hidden, n_head = need("hidden_size"), need("num_attention_heads")
    head_dim = c.get("head_dim") or hidden // n_head
    if c.get("rope_scaling"):
        raise ExportError(f"{path}: rope_scaling {c['rope_scaling']!r} is not supported")
    if c.get("sliding_window") is not None:
        # llama.cpp's llama architecture has no sliding window; the results differ from HF's
        # only once a sequence is longer than the window.
        note(f"sliding_window={c['sliding_window']} is not represented")
    return {
        "arch": "llama",
        "vocab": need("vocab_size"), "hidden": hidden, "ff": need("intermediate_size"),
        "n_layer": need("num_hidden_layers"), "n_head": n_head,
        "n_head_kv": c.get("num_key_value_heads") or n_head, "head_dim": head_dim,
        "n_expert": need("num_local_experts"), "n_expert_used": need("num_experts_per_tok"),
        "ctx": c.get("max_position_embeddings") or 4096,
        "rope_theta": float(c.get("rope_theta") or 1e6),
        "rms_eps": float(c.get("rms_norm_eps") or 1e-5),
        "bos": c.get("bos_token_id") if isinstance(c.get("bos_token_id"), int) else 1,
        "eos": c.get("eos_token_id") if isinstance(c.get("eos_token_id"), int) else 2,
        "tied": bool(c.get("tie_word_embeddings", False)),
    }


def yarn_get_mscale(scale, mscale):
    """modeling_deepseek.py's yarn_get_mscale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_config(c, path):
    """DeepSeek-V2 / V3: resolve defaults as the hub's configuration_deepseek.py does, then map
    the semantics onto llama.cpp's deepseek2 hyperparameters (or refuse what it cannot run)."""
    v3 = c["model_type"] == "deepseek_v3"

    def need(key, minimum=1):
        return positive_int(c, path, key, minimum)

    def setting(key, default):  # like dict.setdefault: a key present with null stays null
        return c[key] if key in c else default

    if c.get("hidden_act", "silu") != "silu":
        raise ExportError(f"{path}: hidden_act {c['hidden_act']!r} is not supported (only silu)")
    if c.get("attention_bias"):
        raise ExportError(f"{path}: attention_bias is true; llama.cpp's deepseek2 has no "
                          "attention biases")
    if c.get("n_routed_experts") is None:
        raise ExportError(f"{path}: n_routed_experts is null (a dense model); only the MoE form "
                          "is supported")
    n_layer, n_expert, k = need("num_hidden_layers"), need("n_routed_experts"), need("num_experts_per_tok")
    if k > n_expert:
        raise ExportError(f"{path}: num_experts_per_tok={k} exceeds n_routed_experts={n_expert}")
    vocab, hidden = need("vocab_size"), need("hidden_size")
    q_lora = setting("q_lora_rank", None)
    if q_lora is not None:
        q_lora = need("q_lora_rank")
    rope_dim = need("qk_rope_head_dim")
    if rope_dim % 2:
        raise ExportError(f"{path}: qk_rope_head_dim={rope_dim} is odd; RoPE needs pairs")

    n_shared = setting("n_shared_experts", 1 if v3 else None)
    if not n_shared:
        raise ExportError(f"{path}: n_shared_experts={n_shared!r}; llama.cpp's deepseek2 needs at "
                          "least one shared expert")
    n_shared = need("n_shared_experts")
    first_k = setting("first_k_dense_replace", 3 if v3 else 0)
    first_k = 0 if first_k is None else need("first_k_dense_replace", 0)
    n_dense = min(first_k, n_layer)
    freq = setting("moe_layer_freq", 1)
    if any(i % freq for i in range(n_dense, n_layer)):
        raise ExportError(f"{path}: moe_layer_freq={freq} interleaves dense and MoE layers; "
                          "llama.cpp's deepseek2 only has leading dense layers "
                          "(leading_dense_block_count)")
    if n_layer in (26, 27) or (n_layer == 48 and vocab == 128256):
        if q_lora is not None:
            raise ExportError(f"{path}: llama.cpp's deepseek2 treats a model with {n_layer} layers "
                              f"(vocab {vocab}) as a Lite model without q_lora_rank, but "
                              f"q_lora_rank={q_lora}")

    # Routing.
    scoring = setting("scoring_func", "sigmoid" if v3 else "softmax")
    gating = {"softmax": 1, "sigmoid": 2}.get(scoring)  # llama_expert_gating_func_type
    if gating is None:
        raise ExportError(f"{path}: scoring_func {scoring!r} is not supported (softmax or sigmoid)")
    method = setting("topk_method", "noaux_tc" if v3 else "greedy")
    if method == "gready":  # the spelling of some early V2 configs
        method = "greedy"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ExportError(f"{path}: topk_method {method!r} is not supported")
    n_group = need("n_group") if c.get("n_group") is not None else (8 if v3 else 1)
    topk_group = need("topk_group") if c.get("topk_group") is not None else (4 if v3 else 1)
    groups = None  # (expert_group_count, expert_group_used_count) when groups really limit
    if method != "greedy" and topk_group < n_group:
        if n_expert % n_group:
            raise ExportError(f"{path}: n_routed_experts={n_expert} is not a multiple of "
                              f"n_group={n_group}")
        if method == "group_limited_greedy":
            raise ExportError(
                f"{path}: topk_method 'group_limited_greedy' with topk_group={topk_group} < "
                f"n_group={n_group} cannot be expressed: llama.cpp's deepseek2 ranks expert groups "
                "by the sum of their two best scores (V3's noaux_tc rule), V2 by their best score. "
                "Convert a variant with topk_method \"greedy\" (or topk_group = n_group) instead")
        if n_expert // n_group < 2:
            raise ExportError(f"{path}: {n_expert // n_group} expert per group; llama.cpp's group "
                              "ranking needs at least 2")
        groups = (n_group, topk_group)
    rsf = number(c, path, "routed_scaling_factor", 2.5 if v3 else 1.0)
    norm_topk = setting("norm_topk_prob", v3)
    if v3:  # normalise (if asked), then always scale
        weights_norm, weights_scale = bool(k > 1 and norm_topk), rsf
    elif k > 1 and norm_topk:  # V2: normalise instead of scaling
        weights_norm, weights_scale = True, 1.0
    else:
        weights_norm, weights_scale = False, rsf

    # RoPE / YaRN. llama.cpp (deepseek2, ext_factor 1) computes, with f = factor,
    # L = yarn_log_multiplier / 0.1 and R = rope.scaling.attn_factor:
    #   rope magnitude a = R (L != 0) or R * yarn_get_mscale(f, 1) (L == 0), applied to q_pe and k_pe
    #   softmax scale     = (a * (1 + 0.1 * L * ln f))^2 / sqrt(qk_head_dim)
    # HF: rope magnitude yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim) and
    # softmax scale yarn_get_mscale(f, mscale_all_dim)^2 / sqrt(qk_head_dim). Solve for L and R;
    # for the usual mscale == mscale_all_dim this gives L = mscale_all_dim and R = 1, which is
    # what llama.cpp's own converter writes.
    yarn = None
    rs = c.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict) or rs.get("type", rs.get("rope_type")) != "yarn":
            raise ExportError(f"{path}: rope_scaling {json.dumps(rs)} is not supported (null or yarn)")
        factor = number(rs, path, "factor", None) if rs.get("factor") is not None else None
        if factor is None or factor < 1:
            raise ExportError(f"{path}: rope_scaling factor {rs.get('factor')!r} is not >= 1")
        beta_fast, beta_slow = number(rs, path, "beta_fast", 32), number(rs, path, "beta_slow", 1)
        if factor > 1 and (beta_fast, beta_slow) != (32.0, 1.0):
            raise ExportError(f"{path}: YaRN beta_fast={beta_fast:g} beta_slow={beta_slow:g}: "
                              "llama.cpp's deepseek2 ignores these keys and always uses 32 and 1")
        mscale, mscale_all = number(rs, path, "mscale", 1), number(rs, path, "mscale_all_dim", 0)
        original = rs.get("original_max_position_embeddings", 4096)
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            raise ExportError(f"{path}: rope_scaling original_max_position_embeddings={original!r}")
        if factor > 1:  # factor 1 is plain RoPE
            rope_mag = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
            target = yarn_get_mscale(factor, mscale_all) / rope_mag  # = 1 + 0.1 * L * ln f
            log_mul = (target - 1) / (0.1 * math.log(factor))
            attn = rope_mag if log_mul != 0 else rope_mag / yarn_get_mscale(factor, 1)
            yarn = dict(factor=factor, original=original, beta_fast=beta_fast, beta_slow=beta_slow,
                        log_mul=log_mul, attn_factor=attn)

    rms_eps = number(c, path, "rms_norm_eps", 1e-6)
    if rms_eps != 1e-6:
        note(f"rms_norm_eps={rms_eps:g}: llama.cpp also uses it in the q_a/kv_a layernorms, "
             "where HF uses 1e-6 (a small numerical difference)")
    return {
        "arch": "deepseek2",
        "vocab": vocab, "hidden": hidden, "ff": need("intermediate_size"),
        "ff_expert": need("moe_intermediate_size"), "n_layer": n_layer, "n_dense": n_dense,
        "n_head": need("num_attention_heads"), "q_lora": q_lora, "kv_lora": need("kv_lora_rank"),
        "qk_nope": need("qk_nope_head_dim"), "qk_rope": rope_dim, "v_dim": need("v_head_dim"),
        "n_expert": n_expert, "n_expert_used": k, "n_shared": n_shared,
        "gating": gating, "score_bias": method == "noaux_tc", "topk_method": method,
        "groups": groups, "weights_norm": weights_norm, "weights_scale": weights_scale,
        "rope_interleave": bool(setting("rope_interleave", True)), "yarn": yarn,
        "ctx": c.get("max_position_embeddings") or 4096,
        "rope_theta": number(c, path, "rope_theta", 10000.0), "rms_eps": rms_eps,
        "bos": c.get("bos_token_id") if isinstance(c.get("bos_token_id"), int) else 1,
        "eos": c.get("eos_token_id") if isinstance(c.get("eos_token_id"), int) else 2,
        "tied": bool(c.get("tie_word_embeddings", False)),
    }


def synthetic_vocab(n, bos, eos):
    """Tokens, scores and types for a vocabulary of n meaningless but well-formed tokens."""
    tokens = [None] * n
    types = [TOK_NORMAL] * n
    for tid, text, kind in ((0, "<unk>", TOK_UNKNOWN), (bos, "<s>", TOK_CONTROL),
                            (eos, "</s>", TOK_CONTROL)):
        if 0 <= tid < n and tokens[tid] is None:
            tokens[tid], types[tid] = text, kind
    free = [i for i in range(n) if tokens[i] is None]
    if len(free) >= 256:  # byte fallback tokens make every text tokenizable
        for b, tid in enumerate(free[:256]):
            tokens[tid], types[tid] = f"<0x{b:02X}>", TOK_BYTE
    for i in range(n):
        if tokens[i] is None:
            tokens[i] = f"<tok_{i}>"
    scores = [0.0 if types[i] != TOK_NORMAL else -float(i) for i in range(n)]
    return tokens, scores, types


class Metadata:
    """Serialises GGUF key/value pairs."""

    def __init__(self):
        self.items = []

    @staticmethod
    def _str(s):
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def _add(self, key, vtype, payload):
        self.items.append(self._str(key) + struct.pack("<I", vtype) + payload)

    def u32(self, key, v):
        self._add(key, T_UINT32, struct.pack("<I", v))

    def f32(self, key, v):
        self._add(key, T_FLOAT32, struct.pack("<f", v))

    def boolean(self, key, v):
        self._add(key, T_BOOL, struct.pack("<B", 1 if v else 0))

    def string(self, key, v):
        self._add(key, T_STRING, self._str(v))

    def str_array(self, key, values):
        body = b"".join(self._str(v) for v in values)
        self._add(key, T_ARRAY, struct.pack("<IQ", T_STRING, len(values)) + body)

    def f32_array(self, key, values):
        self._add(key, T_ARRAY, struct.pack("<IQ", T_FLOAT32, len(values))
                  + np.asarray(values, dtype="<f4").tobytes())

    def i32_array(self, key, values):
        self._add(key, T_ARRAY, struct.pack("<IQ", T_INT32, len(values))
                  + np.asarray(values, dtype="<i4").tobytes())


def build_metadata(cfg, name, file_type):
    m = Metadata()
    a = cfg["arch"]
    m.string("general.architecture", a)
    m.string("general.name", name)
    m.u32("general.file_type", file_type)
    m.u32("general.alignment", ALIGNMENT)
    m.u32(f"{a}.vocab_size", cfg["vocab"])
    m.u32(f"{a}.context_length", cfg["ctx"])
    m.u32(f"{a}.embedding_length", cfg["hidden"])
    m.u32(f"{a}.block_count", cfg["n_layer"])
    m.u32(f"{a}.feed_forward_length", cfg["ff"])
    m.u32(f"{a}.attention.head_count", cfg["n_head"])
    if a == "deepseek2":
        deepseek_metadata(m, cfg)
    else:
        m.u32(f"{a}.attention.head_count_kv", cfg["n_head_kv"])
        m.u32(f"{a}.attention.key_length", cfg["head_dim"])
        m.u32(f"{a}.attention.value_length", cfg["head_dim"])
        m.f32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_eps"])
        m.f32(f"{a}.rope.freq_base", cfg["rope_theta"])
        m.u32(f"{a}.rope.dimension_count", cfg["head_dim"])
        m.u32(f"{a}.expert_count", cfg["n_expert"])
        m.u32(f"{a}.expert_used_count", cfg["n_expert_used"])
    tokens, scores, types = synthetic_vocab(cfg["vocab"], cfg["bos"], cfg["eos"])
    m.string("tokenizer.ggml.model", "llama")
    m.str_array("tokenizer.ggml.tokens", tokens)
    m.f32_array("tokenizer.ggml.scores", scores)
    m.i32_array("tokenizer.ggml.token_type", types)
    m.u32("tokenizer.ggml.unknown_token_id", 0)
    m.u32("tokenizer.ggml.bos_token_id", cfg["bos"])
    m.u32("tokenizer.ggml.eos_token_id", cfg["eos"])
    m.boolean("tokenizer.ggml.add_bos_token", True)
    m.boolean("tokenizer.ggml.add_eos_token", False)
    return m


def deepseek_metadata(m, cfg):
    a = "deepseek2"
    # MLA as llama.cpp runs it: one shared "KV head" holding [latent | k_pe] (keys) and the
    # latent (values); the per-head sizes after decompression are the *_mla lengths.
    m.u32(f"{a}.attention.head_count_kv", 1)
    m.u32(f"{a}.attention.key_length", cfg["kv_lora"] + cfg["qk_rope"])
    m.u32(f"{a}.attention.value_length", cfg["kv_lora"])
    m.u32(f"{a}.attention.key_length_mla", cfg["qk_nope"] + cfg["qk_rope"])
    m.u32(f"{a}.attention.value_length_mla", cfg["v_dim"])
    m.u32(f"{a}.attention.q_lora_rank", cfg["q_lora"] or 0)
    m.u32(f"{a}.attention.kv_lora_rank", cfg["kv_lora"])
    m.f32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_eps"])
    m.f32(f"{a}.rope.freq_base", cfg["rope_theta"])
    m.u32(f"{a}.rope.dimension_count", cfg["qk_rope"])
    y = cfg["yarn"]
    if y:
        m.string(f"{a}.rope.scaling.type", "yarn")
        m.f32(f"{a}.rope.scaling.factor", y["factor"])
        m.u32(f"{a}.rope.scaling.original_context_length", y["original"])
        m.f32(f"{a}.rope.scaling.yarn_beta_fast", y["beta_fast"])
        m.f32(f"{a}.rope.scaling.yarn_beta_slow", y["beta_slow"])
        if y["log_mul"] != 0:
            # llama.cpp divides this key by 0.1 when it loads a deepseek2 model
            m.f32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * y["log_mul"])
        if y["attn_factor"] != 1:
            m.f32(f"{a}.rope.scaling.attn_factor", y["attn_factor"])
    m.u32(f"{a}.leading_dense_block_count", cfg["n_dense"])
    m.u32(f"{a}.expert_feed_forward_length", cfg["ff_expert"])
    m.u32(f"{a}.expert_count", cfg["n_expert"])
    m.u32(f"{a}.expert_used_count", cfg["n_expert_used"])
    m.u32(f"{a}.expert_shared_count", cfg["n_shared"])
    m.u32(f"{a}.expert_gating_func", cfg["gating"])
    m.boolean(f"{a}.expert_weights_norm", cfg["weights_norm"])
    m.f32(f"{a}.expert_weights_scale", cfg["weights_scale"])
    if cfg["groups"]:
        m.u32(f"{a}.expert_group_count", cfg["groups"][0])
        m.u32(f"{a}.expert_group_used_count", cfg["groups"][1])


# --------------------------------------------------------------------------------------------
# GGUF writing
# --------------------------------------------------------------------------------------------

def pad_to(n, align=ALIGNMENT):
    return (n + align - 1) // align * align


def write_gguf(path, meta, tensors, log):
    offset = 0
    for t in tensors:
        t.offset = offset
        offset = pad_to(offset + t.nbytes)

    infos = []
    for t in tensors:
        infos.append(Metadata._str(t.name) + struct.pack("<I", len(t.ne))
                     + struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", t.ggml_type, t.offset))
    header = (GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(meta.items))
              + b"".join(meta.items) + b"".join(infos))
    header += b"\0" * (pad_to(len(header)) - len(header))

    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            data_start = f.tell()
            for k, t in enumerate(tensors):
                f.write(b"\0" * (data_start + t.offset - f.tell()))
                written = 0
                for chunk in t.chunks():
                    b = np.ascontiguousarray(chunk).astype(chunk.dtype.newbyteorder("<"), copy=False)
                    f.write(memoryview(b).cast("B"))
                    written += b.nbytes
                if written != t.nbytes:
                    raise ExportError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
                log(k + 1, len(tensors), t)
            f.write(b"\0" * (data_start + offset - f.tell()))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return data_start + offset


def main(argv):
    ap = argparse.ArgumentParser(
        description="Export a Hugging Face Mixtral (arch llama + experts) or DeepSeek-V2/V3 (arch "
                    "deepseek2) checkpoint to GGUF for side-by-side benchmarks with llama.cpp.")
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--name", help="general.name (default: the model directory's name)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress")
    args = ap.parse_args(argv)

    try:
        cfg = read_config(args.model)
        tensors = plan_tensors(open_checkpoint(args.model), cfg)
        file_type = FILE_TYPE[next(t.ggml_type for t in tensors
                                   if t.name.endswith(("attn_q.weight", "attn_kv_a_mqa.weight")))]
        name = args.name or os.path.basename(os.path.normpath(args.model))
        meta = build_metadata(cfg, name, file_type)

        def log(k, n, t):
            if not args.quiet:
                print(f"[{k:4d}/{n}] {t.name:32s} {GGML_TYPE_NAMES[t.ggml_type]:4s} {t.ne}",
                      file=sys.stderr)

        size = write_gguf(args.out, meta, tensors, log)
    except ExportError as e:
        print(f"gguf_export: error: {e}", file=sys.stderr)
        return 1
    print(f"gguf_export: wrote {args.out} ({size / 2**20:.1f} MiB, {len(tensors)} tensors, "
          f"{cfg['n_expert']} experts x {cfg['n_layer']} layers)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
