#!/usr/bin/python3
"""GGUF files and ggml's block-quantized types, written from the format's definition (llama.cpp's
docs/gguf.md and the block layouts of ggml-common.h), independently of moeline's C++:

  * write_gguf (re-exported from scripts/gguf_writer.py, the project's writer);
  * dequantize(type, raw, count): float64 weights from raw block bytes, vectorised over blocks;
  * random_blocks(type, count, rng): valid random data of a type (finite fp16 scales, any bits
    elsewhere: every bit pattern of a quant field is a weight).

  Q8_0  34-byte blocks of 32: fp16 d, int8 q[32];                 w = d*q
  Q4_0  18-byte blocks of 32: fp16 d, byte j = weight j (low nibble), j+16 (high); w = d*(n-8)
  Q4_K  144-byte blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for eight
        32-weight sub-blocks, 128 bytes of nibbles (byte l of group g: weight 64g+l low nibble,
        64g+32+l high);                                           w = d*scale*n - dmin*min
  Q5_K  176-byte blocks: as Q4_K with 32 bytes qh after the scales; bit 2g of qh[l] adds 16 to
        weight 64g+l, bit 2g+1 to weight 64g+32+l
  Q6_K  210-byte blocks of 256: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales
        (one per 16 weights), fp16 d;                             w = d*scale*(q - 32)
  Q4_1  20-byte blocks of 32: fp16 d, fp16 m, nibbles as Q4_0;   w = d*n + m
  Q5_0  22-byte blocks of 32: fp16 d, uint32 qh (bit j: the fifth bit of weight j), nibbles as
        Q4_0;                                                     w = d*(n + 16*bit - 16)
  Q5_1  24-byte blocks of 32: fp16 d, fp16 m, qh, nibbles;       w = d*(n + 16*bit) + m
"""

import os
import struct
import sys

import numpy as np

# The writer is the project's (scripts/gguf_writer.py): what is checked here is the reading side.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from gguf_writer import (  # noqa: E402,F401
    ARRAY, BF16, BLOCKS, BOOL, F16, F32, F32V, F64, I16, I32, I64, I8, NAMES, Q4_0, Q4_1, Q4_K,
    Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, STRING, U16, U32, U64, U8, write_gguf)


def _fp16(raw):
    return np.frombuffer(raw.tobytes(), dtype="<f2").astype(np.float64)


def _k_scales(s):
    """(scale, min) of the eight sub-blocks from each block's 12 bytes, s: [blocks, 12]."""
    s = s.astype(np.int64)
    scale = np.empty((len(s), 8), dtype=np.int64)
    low = np.empty((len(s), 8), dtype=np.int64)
    scale[:, :4] = s[:, 0:4] & 63
    low[:, :4] = s[:, 4:8] & 63
    scale[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    low[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return scale.astype(np.float64), low.astype(np.float64)


def dequantize(kind, raw, count):
    """float64 weights of `count` elements of type `kind` stored in `raw` (bytes)."""
    if kind == F32:
        return np.frombuffer(raw, dtype="<f4", count=count).astype(np.float64)
    if kind == F16:
        return np.frombuffer(raw, dtype="<f2", count=count).astype(np.float64)
    if kind == BF16:
        bits = np.frombuffer(raw, dtype="<u2", count=count).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    per, size = BLOCKS[kind]
    b = np.frombuffer(raw, dtype=np.uint8, count=count // per * size).reshape(-1, size)
    if kind == Q8_0:
        return (_fp16(b[:, 0:2])[:, None] * b[:, 2:].view(np.int8)).reshape(-1)
    if kind == Q4_0:
        q = b[:, 2:].astype(np.int64)
        nibbles = np.concatenate([q & 0xF, q >> 4], axis=1) - 8
        return (_fp16(b[:, 0:2])[:, None] * nibbles).reshape(-1)
    if kind in (Q4_1, Q5_0, Q5_1):
        # Q4_1: d, m, nibbles; Q5_0: d, qh (uint32: bit j is weight j's fifth bit), nibbles,
        # centred on 16; Q5_1: d, m, qh, nibbles. Byte j: weight j low nibble, j + 16 high.
        with_min, fifth = kind != Q5_0, kind != Q4_1
        d = _fp16(b[:, 0:2])[:, None]
        m = _fp16(b[:, 2:4])[:, None] if with_min else 0.0
        at = 4 if with_min else 2
        q = b[:, at + (4 if fifth else 0):].astype(np.int64)
        values = np.concatenate([q & 0xF, q >> 4], axis=1)
        if fifth:
            high = b[:, at:at + 4].copy().view("<u4").astype(np.int64)       # [block, 1]
            values = values + 16 * ((high >> np.arange(32)[None, :]) & 1)
            if not with_min:
                values = values - 16
        return (d * values + m).reshape(-1)
    if kind in (Q4_K, Q5_K):
        d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
        scale, low = _k_scales(b[:, 4:16])
        qs = b[:, 48:176] if kind == Q5_K else b[:, 16:144]
        q = qs.astype(np.int64).reshape(-1, 4, 32)                # [block, group, l]
        n = np.stack([q & 0xF, q >> 4], axis=2)                   # [block, group, half, l]
        if kind == Q5_K:
            qh = b[:, 16:48].astype(np.int64)[:, None, None, :]   # [block, 1, 1, l]
            bit = 2 * np.arange(4)[None, :, None, None] + np.arange(2)[None, None, :, None]
            n = n + 16 * ((qh >> bit) & 1)
        sub_scale = scale.reshape(-1, 4, 2, 1)
        sub_min = low.reshape(-1, 4, 2, 1)
        w = d[:, None, None, None] * sub_scale * n - dmin[:, None, None, None] * sub_min
        return w.reshape(-1)
    if kind == Q6_K:
        ql = b[:, 0:128].astype(np.int64).reshape(-1, 2, 64)      # [block, half, 64]
        qh = b[:, 128:192].astype(np.int64).reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float64).reshape(-1, 2, 8)
        d = _fp16(b[:, 208:210])
        quarters = [
            (ql[:, :, 0:32] & 0xF) | (((qh >> 0) & 3) << 4),
            (ql[:, :, 32:64] & 0xF) | (((qh >> 2) & 3) << 4),
            (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4),
        ]
        q = np.stack(quarters, axis=2) - 32                       # [block, half, quarter, 32]
        # The scale of weight 128h + 32k + l is sc[h][2k + l // 16].
        scale = sc.reshape(-1, 2, 4, 2)                           # [block, half, quarter, 16s]
        scale = np.repeat(scale, 16, axis=3)                      # [block, half, quarter, 32]
        return (d[:, None, None, None] * scale * q).reshape(-1)
    raise ValueError(f"no reference for ggml type {kind}")


def random_blocks(kind, count, rng):
    """Raw bytes of `count` random weights of type `kind`."""
    if kind == F32:
        return rng.standard_normal(count).astype("<f4").tobytes()
    if kind == F16:
        return rng.standard_normal(count).astype("<f2").tobytes()
    if kind == BF16:
        return (rng.standard_normal(count).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    per, size = BLOCKS[kind]
    b = rng.integers(0, 256, size=(count // per, size), dtype=np.uint8)
    scales = {Q8_0: [0], Q4_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208], Q4_1: [0, 2],
              Q5_0: [0], Q5_1: [0, 2]}[kind]
    for at in scales:  # finite fp16 scales of a plausible size
        b[:, at:at + 2] = (rng.uniform(0.001, 0.05, len(b)).astype("<f2")
                           .view(np.uint8).reshape(-1, 2))
    return b.tobytes()


_SCALAR_READ = {U8: ("<B", 1), I8: ("<b", 1), U16: ("<H", 2), I16: ("<h", 2), U32: ("<I", 4),
                I32: ("<i", 4), F32V: ("<f", 4), BOOL: ("<?", 1), U64: ("<Q", 8), I64: ("<q", 8),
                F64: ("<d", 8)}


def read_gguf(path):
    """(metadata {key: value}, tensors {name: (ggml type, dims, raw bytes)}) of a GGUF file, read
    from the format's definition: header, typed key/values, tensor infos, then the data section at
    the next multiple of general.alignment (32 when absent)."""
    return _parse_gguf(path)[:2]


def header_bytes(path):
    """Where a GGUF file's header (key/values and tensor infos) ends, before any padding."""
    return _parse_gguf(path)[2]


def _parse_gguf(path):
    """read_gguf's (metadata, tensors) and the header's end."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    raw = data.tobytes()
    at = 0

    def take(fmt, size):
        nonlocal at
        value = struct.unpack_from(fmt, raw, at)[0]
        at += size
        return value

    def string():
        nonlocal at
        n = take("<Q", 8)
        text = raw[at:at + n].decode("utf-8", errors="replace")
        at += n
        return text

    def value(kind):
        if kind == STRING:
            return string()
        if kind == ARRAY:
            element, count = take("<I", 4), take("<Q", 8)
            return [value(element) for _ in range(count)]
        return take(*_SCALAR_READ[kind])

    if raw[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    at = 4
    version, tensor_count, metadata_count = take("<I", 4), take("<Q", 8), take("<Q", 8)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}")
    metadata = {}
    for _ in range(metadata_count):
        key = string()
        metadata[key] = value(take("<I", 4))
    infos = []
    for _ in range(tensor_count):
        name = string()
        dims = [take("<Q", 8) for _ in range(take("<I", 4))]
        kind, offset = take("<I", 4), take("<Q", 8)
        infos.append((name, kind, dims, offset))
    alignment = metadata.get("general.alignment", 32)
    start = (at + alignment - 1) // alignment * alignment
    tensors = {}
    for name, kind, dims, offset in infos:
        per, size = BLOCKS[kind]
        count = int(np.prod(dims))
        tensors[name] = (kind, dims, raw[start + offset:start + offset + count // per * size])
    return metadata, tensors, at


def tensor_array(entry):
    """float64 weights of a read_gguf tensor, shaped outermost first (the dims reversed)."""
    kind, dims, raw = entry
    return dequantize(kind, raw, int(np.prod(dims))).reshape(list(reversed(dims)))
