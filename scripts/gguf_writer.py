"""GGUF files (llama.cpp's format, version 3) and ggml's block-quantized types, in NumPy.

  write_gguf(path, metadata, tensors)   typed metadata and raw tensors, each aligned to 32 bytes
  quantize(kind, x)                     raw block bytes of float weights (rows of whole blocks)

The quantizers produce valid blocks of each type by plain rounding (absmax scales for the symmetric
types, min/max for Q4_K and Q5_K); they do not search for the error-minimising scales llama.cpp's
quantizer tries, so a file from here is somewhat less accurate than llama.cpp's of the same type,
never differently laid out. Block layouts (ggml-common.h):

  Q8_0  34-byte blocks of 32: fp16 d, int8 q[32];                 w = d*q
  Q4_0  18-byte blocks of 32: fp16 d, byte j = weight j (low nibble), j+16 (high); w = d*(n-8)
  Q4_K  144-byte blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for eight
        32-weight sub-blocks, 128 bytes of nibbles (byte l of group g: weight 64g+l low nibble,
        64g+32+l high);                                           w = d*scale*n - dmin*min
  Q5_K  176-byte blocks: as Q4_K with 32 bytes qh after the scales; bit 2g of qh[l] adds 16 to
        weight 64g+l, bit 2g+1 to weight 64g+32+l
  Q6_K  210-byte blocks of 256: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales
        (one per 16 weights), fp16 d;                             w = d*scale*(q - 32)
"""

import struct

import numpy as np

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
# ggml type -> (weights per block, bytes per block)
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), Q4_1: (32, 20), Q5_0: (32, 22),
          Q5_1: (32, 24)}
NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_K: "Q4_K",
         Q5_K: "Q5_K", Q6_K: "Q6_K", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1"}
BY_NAME = {name.lower(): kind for kind, name in NAMES.items()}

# Metadata value types.
U8, I8, U16, I16, U32, I32, F32V, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32V: "<f",
           BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}


def _string(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _value(kind, value):
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        element, items = value
        if element in _SCALAR and element != BOOL:
            return struct.pack("<IQ", element, len(items)) + np.asarray(
                items, dtype=_SCALAR[element]).tobytes()
        return struct.pack("<IQ", element, len(items)) + b"".join(_value(element, v) for v in items)
    return struct.pack(_SCALAR[kind], value)


def write_gguf(path, metadata, tensors, alignment=32, version=3):
    """metadata: [(key, type, value)] (an ARRAY's value: (element type, [values]));
    tensors: [(name, ggml type, dims, raw bytes)], dims a row's length first."""
    out = [b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))]
    for key, kind, value in metadata:
        out.append(_string(key) + struct.pack("<I", kind) + _value(kind, value))
    offset = 0
    for name, kind, dims, raw in tensors:
        out.append(_string(name) + struct.pack("<I", len(dims)) +
                   b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset))
        offset += len(raw) + (-len(raw) % alignment)
    header = b"".join(out)
    with open(path, "wb") as f:
        f.write(header + b"\0" * (-len(header) % alignment))
        for _, _, _, raw in tensors:
            f.write(raw)
            f.write(b"\0" * (-len(raw) % alignment))


def _fp16(values):
    """fp16 bytes and the values they hold (what a reader will use)."""
    half = np.asarray(values, dtype=np.float32).astype("<f2")
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float64)


def _safe_inverse(d):
    return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)


def _q8_0(x):
    d_bytes, d = _fp16(np.abs(x).max(axis=1) / 127.0)
    q = np.clip(np.rint(x * _safe_inverse(d)[:, None]), -127, 127).astype(np.int8)
    return np.concatenate([d_bytes, q.view(np.uint8)], axis=1)


def _q4_0(x):
    # ggml's choice: the scale carries the sign of the largest-magnitude weight, which maps to -8.
    at = np.abs(x).argmax(axis=1)
    d_bytes, d = _fp16(x[np.arange(len(x)), at] / -8.0)
    q = np.clip(np.floor(x * _safe_inverse(d)[:, None] + 8.5), 0, 15).astype(np.uint8)
    return np.concatenate([d_bytes, q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _q4_5_legacy(x, fifth, with_min):
    """Q4_1 (min/max, 16 levels), Q5_0 (absmax, 32 levels centred on 16), Q5_1 (min/max, 32)."""
    levels = 31 if fifth else 15
    if with_min:
        low, high = x.min(axis=1), x.max(axis=1)
        d_bytes, d = _fp16((high - low) / levels)
        m_bytes, m = _fp16(low)
        q = np.clip(np.rint((x - m[:, None]) * _safe_inverse(d)[:, None]), 0, levels)
    else:
        at = np.abs(x).argmax(axis=1)
        d_bytes, d = _fp16(x[np.arange(len(x)), at] / -16.0)
        q = np.clip(np.rint(x * _safe_inverse(d)[:, None]) + 16, 0, 31)
    q = q.astype(np.uint32)
    parts = [d_bytes] + ([m_bytes] if with_min else [])
    if fifth:
        high_bits = ((q >> 4) << np.arange(32, dtype=np.uint32)[None, :]).sum(axis=1)
        parts.append(high_bits.astype("<u4").view(np.uint8).reshape(-1, 4))
    q = (q & 0xF).astype(np.uint8)
    parts.append(q[:, :16] | (q[:, 16:] << 4))
    return np.concatenate(parts, axis=1)


def _pack_k_scales(scale, low):
    """Eight 6-bit scales and mins per block [blocks, 8] into the 12 bytes K-quants store."""
    scale, low = scale.astype(np.uint8), low.astype(np.uint8)
    out = np.empty((len(scale), 12), dtype=np.uint8)
    out[:, 0:4] = (scale[:, 0:4] & 63) | ((scale[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (low[:, 0:4] & 63) | ((low[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (scale[:, 4:8] & 0xF) | ((low[:, 4:8] & 0xF) << 4)
    return out


def _q45_k(x, levels):
    sub = x.reshape(-1, 8, 32)
    lowest = np.minimum(sub.min(axis=2), 0.0)
    step = (sub.max(axis=2) - lowest) / levels               # [blocks, 8]
    d_bytes, d = _fp16(step.max(axis=1) / 63.0)
    m_bytes, dmin = _fp16((-lowest).max(axis=1) / 63.0)
    scale = np.clip(np.rint(step * _safe_inverse(d)[:, None]), 0, 63)
    low = np.clip(np.rint(-lowest * _safe_inverse(dmin)[:, None]), 0, 63)
    eff_step = d[:, None] * scale                            # what a reader multiplies by
    eff_min = dmin[:, None] * low
    q = np.rint((sub + eff_min[:, :, None]) * _safe_inverse(eff_step)[:, :, None])
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(-1, 4, 2, 32)  # [block, group, half, l]
    parts = [d_bytes, m_bytes, _pack_k_scales(scale, low)]
    if levels == 31:
        bits = (q >> 4) & 1                                   # bit 2g+half of qh[l]
        shift = (2 * np.arange(4)[None, :, None, None] + np.arange(2)[None, None, :, None])
        parts.append((bits.astype(np.uint32) << shift).sum(axis=(1, 2)).astype(np.uint8))
        q = q & 0xF
    nibbles = q[:, :, 0, :] | (q[:, :, 1, :] << 4)           # [block, group, l]
    parts.append(nibbles.reshape(-1, 128))
    return np.concatenate(parts, axis=1)


def _q6_k(x):
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 31.0                   # [blocks, 16]
    d_bytes, d = _fp16(step.max(axis=1) / 127.0)
    scale = np.clip(np.rint(step * _safe_inverse(d)[:, None]), 0, 127)
    eff = d[:, None] * scale
    q = np.clip(np.rint(sub * _safe_inverse(eff)[:, :, None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)             # [block, half, quarter, l]
    low = np.concatenate([q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4),
                          q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2)  # [b, half, 64]
    high = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) |
            ((q[:, :, 3] >> 4) << 6))                        # [b, half, 32]
    return np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64),
                           scale.astype(np.int8).view(np.uint8), d_bytes], axis=1)


def quantize(kind, x):
    """Raw bytes of the float weights `x` (any shape whose size is whole blocks) as `kind`."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if kind == F32:
        return x.astype("<f4").tobytes()
    if kind == F16:
        return x.astype("<f2").tobytes()
    if kind == BF16:
        bits = x.astype("<f4").view("<u4").astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    per = BLOCKS[kind][0]
    blocks = x.reshape(-1, per)
    if kind == Q8_0:
        return _q8_0(blocks).tobytes()
    if kind == Q4_0:
        return _q4_0(blocks).tobytes()
    if kind in (Q4_1, Q5_0, Q5_1):
        return _q4_5_legacy(blocks, kind != Q4_1, kind != Q5_0).tobytes()
    if kind == Q4_K:
        return _q45_k(blocks, 15).tobytes()
    if kind == Q5_K:
        return _q45_k(blocks, 31).tobytes()
    if kind == Q6_K:
        return _q6_k(blocks).tobytes()
    raise ValueError(f"no quantizer for ggml type {kind}")
