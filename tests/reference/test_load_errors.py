#!/usr/bin/python3
"""Checks that moeline rejects broken checkpoints cleanly and says what is wrong.

  test_load_errors.py --moeline PATH --make-model PATH --workdir DIR

Makes a tiny model, then damaged copies of it (one fault each), and runs
`moeline run --model COPY --tokens 1,2 --max-tokens 1` on each. Every run must exit with a
non-zero status that is not a crash (no signal, no 134/139-style status) within the timeout, and
its stderr must name the offending file (basename) and, where one tensor is at fault, that
tensor. Exit status 1 if any case fails.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

TIMEOUT_S = 60


# --------------------------------------------------------------------------------------------
# Minimal safetensors surgery. Tensors are rebuilt from a list so that offsets stay consistent
# and each damaged file carries exactly one fault.
# --------------------------------------------------------------------------------------------

def read_st(path):
    """-> (metadata, [(name, dtype, shape, bytes)]) in data order."""
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", None)
    data = blob[8 + n:]
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return meta, [(k, v["dtype"], list(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
                  for k, v in entries]


def write_st(path, meta, tensors):
    header = {} if meta is None else {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for t in tensors:
            f.write(t[3])


def edit_tensors(path, fn):
    meta, tensors = read_st(path)
    write_st(path, meta, fn(tensors))


def edit_json(path, fn):
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


# --------------------------------------------------------------------------------------------
# Faults. Each takes the copy's directory and returns the strings stderr must contain; a tuple
# inside the list means "any one of these".
# --------------------------------------------------------------------------------------------

ST = "model.safetensors"
K_PROJ = "model.layers.1.self_attn.k_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
Q_PROJ_TYPO = "model.layers.0.self_attn.q_prj.weight"
SHAPE_T = "model.layers.0.self_attn.k_proj.weight"
F64_T = "model.layers.0.self_attn.v_proj.weight"
I8_T = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


def missing_tensor(d):
    edit_tensors(os.path.join(d, ST), lambda ts: [t for t in ts if t[0] != K_PROJ])
    return [ST, K_PROJ]


def misnamed_tensor(d):
    edit_tensors(os.path.join(d, ST),
                 lambda ts: [(Q_PROJ_TYPO if t[0] == Q_PROJ else t[0], *t[1:]) for t in ts])
    # The engine may report the expected name as missing or the stray name as unexpected.
    return [ST, (Q_PROJ, Q_PROJ_TYPO)]


def misshaped_tensor(d):
    # Same element count, transposed shape: the file stays valid, only the shape is wrong.
    edit_tensors(os.path.join(d, ST),
                 lambda ts: [(t[0], t[1], t[2][::-1], t[3]) if t[0] == SHAPE_T else t for t in ts])
    return [ST, SHAPE_T]


def truncated_file(d):
    path = os.path.join(d, ST)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    with open(path, "r+b") as f:
        f.truncate(data_start + (size - data_start) // 2)
    return [ST]


def header_past_end(d):
    path = os.path.join(d, ST)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write((size + 4096).to_bytes(8, "little"))
    return [ST]


def header_bad_json(d):
    path = os.path.join(d, ST)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{oops")
    return [ST]


def dtype_f64(d):
    def conv(ts):
        out = []
        for name, dtype, shape, data in ts:
            if name == F64_T:
                dtype, data = "F64", np.frombuffer(data, "<f4").astype("<f8").tobytes()
            out.append((name, dtype, shape, data))
        return out
    edit_tensors(os.path.join(d, ST), conv)
    return [ST, F64_T]


def dtype_i8(d):
    def conv(ts):
        out = []
        for name, dtype, shape, data in ts:
            if name == I8_T:
                q = np.clip(np.round(np.frombuffer(data, "<f4") * 64), -127, 127).astype(np.int8)
                dtype, data = "I8", q.tobytes()
            out.append((name, dtype, shape, data))
        return out
    edit_tensors(os.path.join(d, ST), conv)
    return [ST, I8_T]


def model_type_gpt2(d):
    def fn(c):
        c["model_type"] = "gpt2"
        c["architectures"] = ["GPT2LMHeadModel"]
    edit_json(os.path.join(d, "config.json"), fn)
    return ["config.json", "gpt2"]


def missing_config(d):
    os.remove(os.path.join(d, "config.json"))
    return ["config.json"]


def config_bad_json(d):
    with open(os.path.join(d, "config.json"), "a") as f:
        f.write("\n}{ not json")
    return ["config.json"]


def missing_weights(d):
    os.remove(os.path.join(d, ST))
    return [ST]


def missing_shard(d):
    # The index still lists the second shard, as after an interrupted download.
    shard = "model-00002-of-00002.safetensors"
    os.remove(os.path.join(d, shard))
    return [shard]


def index_bad_json(d):
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write('{"metadata": {"total_size": 1}, "weight_map": {')
    return ["model.safetensors.index.json"]


def layers_2_pow_31(d):
    # Accepted before: the loader sized per-layer structures from it and allocated without end.
    edit_json(os.path.join(d, "config.json"), lambda c: c.update(num_hidden_layers=2**31))
    return ["config.json", "num_hidden_layers"]


def experts_overflow(d):
    # A product of sizes that overflows 64 bits must be refused, not wrapped.
    edit_json(os.path.join(d, "config.json"),
              lambda c: c.update(num_local_experts=2**40, intermediate_size=2**40))
    return ["config.json", ("experts", "intermediate")]


def overlapping_tensors(d):
    # Two tensors' data_offsets share bytes (every size stays right): one tensor aliases another.
    path = os.path.join(d, ST)
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    a, b = (name for name in (Q_PROJ, K_PROJ))
    size_b = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start_a = header[a]["data_offsets"][0]
    header[b]["data_offsets"] = [start_a, start_a + size_b]
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        f.write(blob[8 + n:])
    return [ST, "overlap", b]


# (case, source model, fault)
CASES = [
    ("missing-tensor", "single", missing_tensor),
    ("misnamed-tensor", "single", misnamed_tensor),
    ("misshaped-tensor", "single", misshaped_tensor),
    ("truncated-file", "single", truncated_file),
    ("header-length-past-end", "single", header_past_end),
    ("header-not-json", "single", header_bad_json),
    ("dtype-F64", "single", dtype_f64),
    ("dtype-I8", "single", dtype_i8),
    ("model-type-gpt2", "single", model_type_gpt2),
    ("missing-config", "single", missing_config),
    ("config-not-json", "single", config_bad_json),
    ("missing-safetensors", "single", missing_weights),
    ("missing-shard", "sharded", missing_shard),
    ("index-not-json", "sharded", index_bad_json),
    ("layers-2^31", "single", layers_2_pow_31),
    ("experts-overflow", "single", experts_overflow),
    ("overlapping-tensors", "single", overlapping_tensors),
]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)

    sources = {"single": os.path.join(args.workdir, "good"),
               "sharded": os.path.join(args.workdir, "good-sharded")}
    for kind, extra in (("single", []), ("sharded", ["--shards", "2"])):
        r = subprocess.run([args.make_model, "--arch", "mixtral", "--preset", "tiny", "--seed", "1",
                            "--out", sources[kind], *extra], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL  make-model: {r.stderr}")
            return 1

    failures = []
    # The undamaged model must load, otherwise every case below would pass for the wrong reason.
    for kind, src in sources.items():
        r = subprocess.run([args.moeline, "run", "--model", src, "--tokens", "1,2", "--max-tokens", "1"],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
        if r.returncode != 0:
            failures.append(f"control ({kind}): undamaged model failed with {r.returncode}: {r.stderr.strip()}")
            print(f"FAIL  control ({kind}): exit {r.returncode}: {r.stderr.strip()}")
        else:
            print(f"ok    control ({kind}): undamaged model runs")

    for name, kind, fault in CASES:
        d = os.path.join(args.workdir, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(sources[kind], d)
        needles = fault(d)
        cmd = [args.moeline, "run", "--model", d, "--tokens", "1,2", "--max-tokens", "1"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            failures.append(f"{name}: no exit within {TIMEOUT_S} s")
            print(f"FAIL  {name}: hung (> {TIMEOUT_S} s)")
            continue
        stderr = r.stderr.strip()
        problems = []
        if r.returncode == 0:
            problems.append("exit status 0 (the damaged model was accepted)")
        elif r.returncode < 0 or r.returncode >= 128:
            # Negative: killed by a signal; >= 128: a shell-reported signal such as 134 (abort) or
            # 139 (segfault). Either way a crash, not an error report.
            problems.append(f"crashed (exit status {r.returncode})")
        for needle in needles:
            options = needle if isinstance(needle, tuple) else (needle,)
            if not any(o in stderr for o in options):
                problems.append("stderr does not mention " + " or ".join(repr(o) for o in options))
        line = stderr.splitlines()[-1] if stderr else "(empty stderr)"
        if problems:
            failures.append(f"{name}: {'; '.join(problems)}; stderr: {stderr[-1000:]!r}")
            print(f"FAIL  {name}: {'; '.join(problems)}\n      stderr: {line}")
        else:
            print(f"ok    {name}: exit {r.returncode}: {line}")

    total = len(CASES) + len(sources)
    if failures:
        print(f"\n{len(failures)} of {total} load-error checks FAILED:")
        for f in failures:
            print(f"  {f}")
        return 1
    print(f"\nall {total} load-error checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
