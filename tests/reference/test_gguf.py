#!/usr/bin/python3
"""moeline's GGUF reader and dequantization against gguf_reference.py.

  test_gguf.py --moeline PATH --workdir DIR

  * A file with metadata of every value type (and nested arrays) and a tensor of every type this
    build reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; 1-, 2- and
    3-dimensional) written by
    the reference: `moeline gguf FILE` must list the metadata and the tensors exactly, and
    `moeline gguf FILE --tensor T --out X.npy` must give the reference's weights. The reference
    works in float64 and moeline in float32 (d*scale rounded to float, then one multiply and one
    subtract): relative error at most DEQUANT_RTOL of the tensor's largest weight.
  * Damaged and hostile files (bad magic, version, truncations, tensors past the end or
    misaligned, absurd counts and lengths, unknown value and tensor types, duplicate names) must
    each fail with a clean exit 1 and a message naming the problem, never a crash.
"""

import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as ref  # noqa: E402

# float32 arithmetic on weights of magnitude <= |max|: a few ulps (2^-24 each) of the largest.
DEQUANT_RTOL = 1e-6

METADATA = [
    ("general.architecture", ref.STRING, "qwen3moe"),
    ("general.name", ref.STRING, "test — ünïcode"),
    ("test.u8", ref.U8, 200), ("test.i8", ref.I8, -100), ("test.u16", ref.U16, 60000),
    ("test.i16", ref.I16, -30000), ("test.u32", ref.U32, 4000000000), ("test.i32", ref.I32, -5),
    ("test.f32", ref.F32V, 0.5), ("test.bool", ref.BOOL, True), ("test.u64", ref.U64, 2 ** 63 + 7),
    ("test.i64", ref.I64, -(2 ** 62)), ("test.f64", ref.F64, 1e-300),
    ("tokenizer.ggml.tokens", ref.ARRAY, (ref.STRING, ["<s>", "a", "bc", "\u0120d"])),
    ("test.nested", ref.ARRAY, (ref.ARRAY, [(ref.I32, [1, 2]), (ref.I32, [])])),
]


def run(args, *extra):
    return subprocess.run([args.moeline, "gguf", *extra], capture_output=True, text=True,
                          timeout=120)


def check_good_file(args, failures):
    rng = np.random.default_rng(7)
    tensors = []
    for kind in ref.BLOCKS:
        per = ref.BLOCKS[kind][0]
        row = 2 * 256 if per == 256 else 96
        for dims in ([row], [row, 3], [row, 2, 2]):
            count = int(np.prod(dims))
            name = f"{ref.NAMES[kind].lower()}.{len(dims)}d"
            tensors.append((name, kind, dims, ref.random_blocks(kind, count, rng)))
    path = os.path.join(args.workdir, "good.gguf")
    ref.write_gguf(path, METADATA, tensors)
    out = run(args, path)
    if out.returncode != 0:
        return failures.append(f"good file: exit {out.returncode}: {out.stderr.strip()}")
    listing = json.loads(out.stdout)
    for key, kind, value in METADATA:
        got = listing["metadata"].get(key)
        want = value
        if kind == ref.ARRAY:
            want = value[1] if value[0] != ref.ARRAY else [v[1] for v in value[1]]
        if kind in (ref.F32V, ref.F64):
            ok = got is not None and abs(got - want) <= abs(want) * 1e-7
        else:
            ok = got == want
        if not ok:
            failures.append(f"metadata {key}: {got!r} != {want!r}")
    listed = {t["name"]: t for t in listing["tensors"]}
    for name, kind, dims, raw in tensors:
        entry = listed.get(name)
        if entry is None or entry["type"] != ref.NAMES[kind] or entry["dims"] != dims or \
                entry["bytes"] != len(raw):
            failures.append(f"tensor {name}: listed as {entry}")
            continue
        npy = os.path.join(args.workdir, f"{name}.npy")
        out = run(args, path, "--tensor", name, "--out", npy)
        if out.returncode != 0:
            failures.append(f"tensor {name}: exit {out.returncode}: {out.stderr.strip()}")
            continue
        got = np.load(npy)
        want = ref.dequantize(kind, raw, int(np.prod(dims))).reshape(list(reversed(dims)))
        scale = max(float(np.abs(want).max()), 1e-30)
        error = float(np.abs(got.astype(np.float64) - want).max()) / scale
        if got.shape != want.shape or error > DEQUANT_RTOL:
            failures.append(f"tensor {name} ({ref.NAMES[kind]}): shape {got.shape} vs "
                            f"{want.shape}, relative error {error:.2e} > {DEQUANT_RTOL}")
    print(f"good file: {len(METADATA)} metadata keys and {len(tensors)} tensors of "
          f"{len(ref.BLOCKS)} types read and dequantized as the reference")
    return path, tensors


def check_header_on_the_alignment(args, tensors, failures):
    """A header that ends exactly on the alignment: the data section starts right after it, with
    no padding (one file in 32 is like this, and none of the others here is)."""
    path = os.path.join(args.workdir, "aligned-header.gguf")
    for pad in range(32):
        ref.write_gguf(path, METADATA + [("test.pad", ref.STRING, "x" * pad)], tensors)
        if ref.header_bytes(path) % 32 == 0:
            break
    else:
        return failures.append("no padding string put the header's end on the alignment")
    for name, kind, dims, raw in (tensors[0], tensors[-1]):
        npy = os.path.join(args.workdir, f"aligned-{name}.npy")
        out = run(args, path, "--tensor", name, "--out", npy)
        want = ref.dequantize(kind, raw, int(np.prod(dims))).reshape(list(reversed(dims)))
        if out.returncode != 0:
            failures.append(f"aligned header, tensor {name}: exit {out.returncode}: "
                            f"{out.stderr.strip()}")
        elif np.abs(np.load(npy).astype(np.float64) - want).max() > \
                DEQUANT_RTOL * max(float(np.abs(want).max()), 1e-30):
            failures.append(f"aligned header, tensor {name}: not the reference's weights")
    print(f"a header ending on the alignment ({ref.header_bytes(path)} bytes): tensors read "
          "from right after it")


def damaged(args, good_path, tensors, failures):
    good = open(good_path, "rb").read()
    one = [("w", ref.Q4_K, [256], bytes(144))]

    def variant(name, data=None, metadata=None, tensor_list=None, **kw):
        path = os.path.join(args.workdir, f"bad-{name}.gguf")
        if data is not None:
            with open(path, "wb") as f:
                f.write(data)
        else:
            ref.write_gguf(path, METADATA[:1] if metadata is None else metadata,
                           one if tensor_list is None else tensor_list, **kw)
        return path

    def patched_count(offset, value):
        return good[:offset] + struct.pack("<Q", value) + good[offset + 8:]

    cases = [
        ("magic", variant("magic", data=b"GGUX" + good[4:]), "bad magic"),
        ("version", variant("version", version=1), "version 1"),
        ("empty", variant("empty", data=b""), "truncated"),
        ("cut-header", variant("cut-header", data=good[:200]), "truncated"),
        ("cut-data", variant("cut-data", data=good[:len(good) - 100]), "past the end"),
        ("tensor-count", variant("tensor-count", data=patched_count(8, 2 ** 40)), "implausible"),
        ("string-length", variant("string-length", data=patched_count(24, 2 ** 62)),
         "truncated"),
        ("array-count", variant("array-count", metadata=[("a", ref.ARRAY, (ref.U8, []))]),
         None),  # the case below patches the count in place
        ("unknown-value-type", variant("unknown-value-type", metadata=[("k", ref.U8, 1)]), None),
        ("unknown-tensor-type", variant("unknown-tensor-type",
                                        tensor_list=[("w", 11, [256], bytes(110))]), "Q3_K"),
        ("partial-block", variant("partial-block", tensor_list=[("w", ref.Q8_0, [40], bytes(34))]),
         "blocks"),
        ("zero-dim", variant("zero-dim", tensor_list=[("w", ref.F32, [0], b"")]), "dimension"),
        ("five-dims", variant("five-dims", tensor_list=[("w", ref.F32, [1, 1, 1, 1, 1],
                                                         bytes(4))]), "dimensions"),
        ("huge-tensor", variant("huge-tensor", tensor_list=[("w", ref.F32, [2 ** 40, 2 ** 30],
                                                             bytes(4))]), "larger than the file"),
        ("duplicate", variant("duplicate", tensor_list=one + one), "twice"),
    ]
    # An array whose count claims 2^50 elements, and a value of an unknown type (99).
    with open(cases[7][1], "rb") as f:
        data = f.read()
    at = data.index(struct.pack("<IQ", ref.U8, 0))
    with open(cases[7][1], "wb") as f:
        f.write(data[:at] + struct.pack("<IQ", ref.U8, 2 ** 50) + data[at + 12:])
    cases[7] = (cases[7][0], cases[7][1], "truncated")
    with open(cases[8][1], "rb") as f:
        data = f.read()
    at = data.index(b"k") + 1
    with open(cases[8][1], "wb") as f:
        f.write(data[:at] + struct.pack("<I", 99) + data[at + 4:])
    cases[8] = (cases[8][0], cases[8][1], "unknown value type")
    # A tensor at an offset that is not a multiple of the alignment.
    misaligned = os.path.join(args.workdir, "bad-misaligned.gguf")
    data = bytearray(open(variant("misaligned-src"), "rb").read())
    at = data.rindex(struct.pack("<IQ", ref.Q4_K, 0))  # the tensor's type, then its offset
    data[at + 4:at + 12] = struct.pack("<Q", 3)
    with open(misaligned, "wb") as f:
        f.write(data)
    cases.append(("misaligned", misaligned, "aligned"))

    for name, path, phrase in cases:
        out = run(args, path)
        if out.returncode != 1 or phrase not in out.stderr:
            failures.append(f"damaged file {name}: exit {out.returncode}, stderr "
                            f"{out.stderr.strip()[:300]!r} (want exit 1 naming {phrase!r})")
    print(f"damaged files: {len(cases)} cases, each refused with its reason")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moeline", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    failures = []
    good_path, tensors = check_good_file(args, failures)
    check_header_on_the_alignment(args, tensors, failures)
    damaged(args, good_path, tensors, failures)
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
