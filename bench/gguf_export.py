#!/usr/bin/python3
"""Convert a Hugging Face Mixtral checkpoint into a GGUF file that llama.cpp can run.

Why this exists: moeline's CPU speed is compared side by side with llama.cpp on the same model
shape and the same weights. llama.cpp only reads GGUF, and its own converter is llama.cpp code
(and needs torch); this converter is written for moeline from the GGUF v3 format description
so that the repository never carries llama.cpp code. It is a benchmarking aid, not part of the
engine.

  bench/gguf_export.py --model HF_DIR --out FILE.gguf [--name NAME]

Input: config.json plus model.safetensors, or shards listed by model.safetensors.index.json
(or, without an index, every *.safetensors file in HF_DIR). Tensors may be BF16, F16 or F32.

Output: architecture "llama" with llama.expert_count / expert_used_count set, so llama.cpp runs
it as Mixtral does (softmax router, top-k, renormalised weights, SiLU-gated experts).
  * matrices keep their stored type (BF16 stays BF16); norms and the router (ffn_gate_inp)
    are F32, as llama.cpp's own converter writes them;
  * experts.{e}.w1/w3/w2 are stacked into ffn_gate_exps / ffn_up_exps / ffn_down_exps;
  * q_proj / k_proj rows are reordered per head from HF's rotate_half RoPE layout (pairs i and
    i + d/2) to GGUF's interleaved layout (pairs 2i and 2i + 1), so the logits match HF's;
  * the checkpoint has no tokenizer, so a synthetic SentencePiece-style vocabulary is written:
    <unk>, <s>, </s>, the 256 byte tokens <0xXX> when vocab_size leaves room, then <tok_i>.
    It lets llama.cpp load and tokenize; its text is meaningless.

Tensors are streamed one at a time (experts one matrix at a time, large matrices in row
chunks), so memory stays far below the model size. The file is written to FILE.gguf.tmp and
renamed when complete. Only Debian's python3 + numpy are required.
"""

import argparse
import json
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


def stacked(srcs):
    """Experts [out, in] each -> one [n_expert, out, in] tensor (ne = in, out, n_expert)."""
    first = srcs[0]
    for s in srcs:
        if s.shape != first.shape or s.dtype != first.dtype:
            raise ExportError(f"{s.name} is {s.dtype}{list(s.shape)} but {first.name} is "
                              f"{first.dtype}{list(first.shape)}; experts must match")
    return OutTensor(None, first.ggml_type, list(first.shape[::-1]) + [len(srcs)],
                     lambda: (s.read() for s in srcs))


def plan_tensors(tensors, cfg):
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
    if c.get("model_type") != "mixtral":
        raise ExportError(f"{path}: model_type is {c.get('model_type')!r}, expected 'mixtral'")

    def need(key):
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ExportError(f"{path}: {key}={v!r} is not a positive integer")
        return v

    hidden, n_head = need("hidden_size"), need("num_attention_heads")
    head_dim = c.get("head_dim") or hidden // n_head
    if c.get("rope_scaling"):
        raise ExportError(f"{path}: rope_scaling {c['rope_scaling']!r} is not supported")
    if c.get("sliding_window") is not None:
        # llama.cpp's llama architecture has no sliding window; the results differ from HF's
        # only once a sequence is longer than the window.
        print(f"gguf_export: note: sliding_window={c['sliding_window']} is not represented",
              file=sys.stderr)
    return {
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
    a = "llama"
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
        description="Export a Hugging Face Mixtral checkpoint to GGUF (arch llama + experts) for "
                    "side-by-side benchmarks with llama.cpp.")
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--name", help="general.name (default: the model directory's name)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress")
    args = ap.parse_args(argv)

    try:
        cfg = read_config(args.model)
        tensors = plan_tensors(open_checkpoint(args.model), cfg)
        file_type = FILE_TYPE[next(t.ggml_type for t in tensors if t.name.endswith("attn_q.weight"))]
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
