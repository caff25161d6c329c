#!/usr/bin/env python3
"""A bad handler table must not compile.

tests/unit/dispatch_test.cpp holds, behind MOELINE_BAD_TABLE, a table that lists a type twice, one
with a value the wire does not define, one that declares more rows than it lists, and one with a
row whose handler is nullptr. Each is
compiled with the flags the build uses for that file (compile_commands.json) and must be refused
with HandlerTable's own message; the file without a bad table must compile.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

CASES = {
    0: None,
    1: "a message type listed twice",
    2: "not a message type of the wire",
    3: "not a message type of the wire",  # the row not listed has no type (nor a handler)
    4: "use of deleted function",  # a row whose handler is nullptr (Route's deleted constructor)
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    with open(os.path.join(args.build_dir, "compile_commands.json")) as f:
        commands = json.load(f)
    entry = next((e for e in commands if e["file"].endswith("tests/unit/dispatch_test.cpp")), None)
    if entry is None:
        print("FAIL dispatch_test.cpp is not in compile_commands.json")
        return 1
    arguments = shlex.split(entry["command"]) if "command" in entry else entry["arguments"]
    # Drop the output and dependency-file options: only whether it compiles matters here.
    kept, skip = [], False
    for arg in arguments:
        if skip:
            skip = False
            continue
        if arg in ("-o", "-MF", "-MT"):
            skip = True
            continue
        if arg in ("-MD", "-MMD", "-c"):
            continue
        kept.append(arg)
    failures = 0
    for case, message in CASES.items():
        result = subprocess.run(kept[:-1] + [f"-DMOELINE_BAD_TABLE={case}", "-fsyntax-only",
                                             kept[-1]],
                                cwd=entry["directory"], capture_output=True, text=True)
        if message is None:
            ok = result.returncode == 0
            what = "the good tables compile" if ok else "the good tables do not compile:\n" + \
                result.stderr[-2000:]
        else:
            ok = result.returncode != 0 and message in result.stderr
            what = f"case {case} ({message}) " + ("refused" if ok else
                                                  "not refused with its message:\n" +
                                                  result.stderr[-2000:])
        print(("ok   " if ok else "FAIL ") + what)
        failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
