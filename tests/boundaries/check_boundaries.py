#!/usr/bin/env python3
"""The library boundaries, checked over the build's own compile commands.

Each library exposes only its own headers (moeline_public_headers in the top-level CMakeLists.txt:
an include tree per target under build/include/<target>), so a target sees exactly the trees of
what it links. This check fails when:

1. a source file is compiled with the source tree itself (or any folder in it) on its include path,
   which would let it include any header of any library;
2. a library sees the headers of a library that docs/ARCHITECTURE.md does not allow it to depend
   on (the table ALLOWED below is that document's table);
3. a quoted #include of a source file does not resolve through its own folder or the trees its
   target sees (a header of a library it does not link);
4. a library or tool reads an environment variable other than through base/environment.h (the
   one list of the variables moeline reads);
5. the mechanism does not hold: for every library, a translation unit that includes a header of a
   library outside what it sees must fail to compile with that library's own flags, and one that
   includes its own header must compile.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

# What each library may see (its own tree is implied): docs/ARCHITECTURE.md, "Libraries".
# Test, bench and tool targets may see anything; they are not libraries anything depends on.
ALLOWED = {
    "moeline_base": set(),
    "moeline_kernels": {"base"},
    "moeline_kernels_cuda": {"base", "kernels"},
    "moeline_offload": {"base", "kernels"},
    "moeline_jinja": {"base"},
    "moeline_tokenizer": {"base", "jinja"},
    "moeline_model_info": {"base", "kernels"},
    "moeline_model": {"base", "kernels", "offload", "tokenizer", "model_info"},
    "moeline_model_cuda": {"base", "kernels", "kernels_cuda", "offload", "tokenizer", "model_info",
                           "model"},
    "moeline_reuse": {"base", "kernels", "offload", "tokenizer", "model_info", "model"},
    "moeline_wire": {"base"},
    "moeline_sdk": {"base", "wire"},
    "moeline_runtime": {"base", "wire"},
    "moeline_stage_common": {"base", "kernels", "kernels_cuda", "offload", "tokenizer",
                             "model_info", "model", "model_cuda", "reuse", "wire", "runtime"},
    "moeline_cli_args": set(),
    "moeline_picture": set(),
    "moeline_stack": {"base", "wire", "runtime", "cli_args"},
}
STAGE_COMMON = ALLOWED["moeline_stage_common"] - {"kernels_cuda", "model_cuda"} | {"stage_common"}
for stage in ("gateway", "probe", "prefill", "decode", "offload"):
    ALLOWED[f"moeline_stage_{stage}"] = STAGE_COMMON
ALLOWED["moeline_stage_http"] = STAGE_COMMON | {"sdk"}
ALLOWED["moeline_load"] = STAGE_COMMON | {"sdk", "picture"}
# The tools may use every library but no stage's internals.
ALLOWED["moeline_cli"] = ALLOWED["moeline_stage_common"] | {"stage_common", "sdk", "stack",
                                                             "cli_args", "picture"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# An include under `#ifdef NAME` (model/cuda_engine.h under MOELINE_HAVE_CUDA) counts only where
# the file is compiled with NAME defined: a build without CUDA does not link that library.
IFDEF_BLOCK = re.compile(r'^\s*#\s*ifdef\s+(\w+)\s*$(.*?)^\s*#\s*endif', re.M | re.S)
GETENV = re.compile(r"\bgetenv\s*\(")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--compiler", default="c++")
    return parser.parse_args()


def target_of(command):
    match = re.search(r"CMakeFiles/([^/]+)\.dir/", command)
    return match.group(1) if match else None


def include_dirs(arguments):
    dirs = []
    for i, arg in enumerate(arguments):
        if arg.startswith("-I") and len(arg) > 2:
            dirs.append(arg[2:])
        elif arg in ("-I", "-isystem") and i + 1 < len(arguments):
            dirs.append(arguments[i + 1])
    return dirs


def main():
    args = parse_args()
    source_dir = os.path.realpath(args.source_dir)
    build_dir = os.path.realpath(args.build_dir)
    tree_root = os.path.join(build_dir, "include")
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        commands = json.load(f)

    failures = []
    seen_by_target = {}
    flags_by_target = {}
    checked_includes = 0
    for entry in commands:
        arguments = shlex.split(entry["command"]) if "command" in entry else entry["arguments"]
        target = target_of(" ".join(arguments))
        source = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
        if target is None or not source.startswith(source_dir + os.sep) or source.endswith(".cu"):
            continue
        dirs = [os.path.realpath(os.path.join(entry["directory"], d)) for d in include_dirs(arguments)]
        seen = set()
        for d in dirs:
            in_build = d == build_dir or d.startswith(build_dir + os.sep)
            if not in_build and (d == source_dir or d.startswith(source_dir + os.sep)):
                failures.append(f"{target}: {os.path.relpath(source, source_dir)} is compiled with "
                                f"the source folder {d} on its include path")
            elif os.path.dirname(d) == tree_root:
                seen.add(os.path.basename(d).removeprefix("moeline_"))
        own = target.removeprefix("moeline_")
        seen.discard(own)
        seen_by_target.setdefault(target, seen)
        if target not in flags_by_target:
            flags_by_target[target] = compile_flags(arguments)
        # 3: every quoted include resolves through the file's folder or the trees its target sees.
        with open(source, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if GETENV.search(text) and (target in ALLOWED or target in ("moeline", "moeline_cli")) \
                and not source.endswith(os.path.join("base", "environment.cpp")):
            failures.append(f"{target}: {os.path.relpath(source, source_dir)} calls getenv; "
                            f"read environment variables through base/environment.h")
        defined = {f[2:].split("=")[0] for f in flags_by_target[target] if f.startswith("-D")}
        compiled = IFDEF_BLOCK.sub(lambda m: m.group(0) if m.group(1) in defined else "", text)
        for header in INCLUDE.findall(compiled):
            checked_includes += 1
            candidates = [os.path.dirname(source)] + dirs
            if not any(os.path.exists(os.path.join(d, header)) for d in candidates):
                failures.append(f"{target}: {os.path.relpath(source, source_dir)} includes "
                                f'"{header}", a header of a library it does not link')

    # 2: what each library sees is what the architecture allows.
    libraries = [t for t in seen_by_target if t in ALLOWED]
    for target in libraries:
        extra = seen_by_target[target] - ALLOWED[target]
        if extra:
            failures.append(f"{target} sees the headers of {sorted(extra)}; docs/ARCHITECTURE.md "
                            f"allows {sorted(ALLOWED[target]) or 'nothing'}")
    unknown = [t for t in seen_by_target if t.startswith("moeline_") and t not in ALLOWED
               and os.path.isdir(os.path.join(tree_root, t)) and not is_leaf(t)]
    for target in unknown:
        failures.append(f"{target} is a library this check does not know: add it to ALLOWED and "
                        f"to docs/ARCHITECTURE.md")

    # 5: the mechanism, compiled.
    trees = {name: os.path.join(tree_root, name) for name in os.listdir(tree_root)}
    one_header = {}
    for name, tree in trees.items():
        for folder, _, files in sorted(os.walk(tree)):
            headers = sorted(f for f in files if f.endswith(".h"))
            if headers:
                one_header[name.removeprefix("moeline_")] = os.path.relpath(
                    os.path.join(folder, headers[0]), tree)
                break
    jobs = []  # (target, header, must compile, what it shows)
    for target in sorted(libraries):
        own = target.removeprefix("moeline_")
        for other in sorted(set(one_header) - seen_by_target[target] - {own}):
            jobs.append((target, one_header[other], False, other))
        if own in one_header:
            jobs.append((target, one_header[own], True, own))
    with tempfile.TemporaryDirectory() as scratch, \
            concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        results = pool.map(lambda job: compile_one(args.compiler, flags_by_target[job[0]],
                                                   job[1], scratch), jobs)
        for (target, header, must_compile, other), (ok, message) in zip(jobs, results):
            if must_compile and not ok:
                failures.append(f'{target} cannot include its own "{header}": '
                                f"{message.strip().splitlines()[-1:]}")
            elif not must_compile and ok:
                failures.append(f'{target} compiled an include of {other}\'s "{header}" without '
                                f"linking it")
    compiles = len(jobs)

    print(f"boundaries: {len(seen_by_target)} targets, {len(libraries)} libraries against the "
          f"architecture's table, {checked_includes} includes resolved, {compiles} compiles")
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


def compile_flags(arguments):
    """The flags that decide what an include resolves to: -I, -isystem, -D, -std."""
    flags = []
    for i, arg in enumerate(arguments[1:], start=1):
        if arg.startswith(("-I", "-D", "-std")):
            flags.append(arg)
        elif arg == "-isystem" and i + 1 < len(arguments):
            flags += [arg, arguments[i + 1]]
    return flags


def is_leaf(target):
    """Executables' own trees (the `moeline` executable) are not libraries."""
    return target == "moeline"


def compile_one(compiler, flags, header, scratch):
    descriptor, path = tempfile.mkstemp(suffix=".cpp", dir=scratch)
    os.close(descriptor)
    with open(path, "w") as f:
        f.write(f'#include "{header}"\n')
    result = subprocess.run([compiler, *flags, "-fsyntax-only", path], capture_output=True,
                            text=True)
    return result.returncode == 0, result.stderr


if __name__ == "__main__":
    sys.exit(main())
