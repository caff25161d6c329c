#!/usr/bin/python3
"""Every `moeline` command parses its command line the same way: `--help` prints its usage and
exits 0; an unknown flag is an error (exit 2, one `moeline: error:` line naming it) and never
ignored, with the nearest real flag suggested for a misspelling; `--key=value` is read as
`--key value`; `moeline --version` prints the version. A stage's own section of a config file
may hold only that stage's settings (a misspelt key is an error with a suggestion).

The commands are read from `moeline --help`, so a new command is checked without editing this.

    test_uniform.py --moeline BIN --model DIR --workdir DIR
"""
import argparse
import json
import os
import re
import subprocess
import sys

failures = []

# Commands whose options follow a subcommand.
SUBCOMMAND = {"stack": ["status"], "client": ["status"], "keys": ["list"]}


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def run(moeline, *args):
    return subprocess.run([moeline, *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def commands(moeline):
    out = run(moeline, "--help").stdout
    return [m.group(1) for m in re.finditer(r"^  ([a-z][a-z-]+)\s{2,}", out, re.M)
            if m.group(1) != "version"]


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("moeline: error:")]


def misspelt(flag):
    """A flag with one letter dropped from its middle (--threads -> --threds)."""
    middle = len(flag) // 2 + 1
    return flag[:middle] + flag[middle + 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    m = args.moeline
    os.makedirs(args.workdir, exist_ok=True)

    version = run(m, "--version")
    check("moeline --version prints the version",
          version.returncode == 0 and re.match(r"moeline \d+\.\d+\.\d+", version.stdout),
          version.stdout + version.stderr)
    names = commands(m)
    check("moeline --help lists the commands", len(names) >= 15, f"{names}")

    for name in names:
        words = [name] + SUBCOMMAND.get(name, [])
        usage = run(m, name, "--help")
        check(f"{name} --help: its usage, exit 0",
              usage.returncode == 0 and "usage:" in usage.stdout, usage.stderr[-200:])
        if len(words) > 1:  # a subcommand's --help too, with nothing else it requires
            sub_usage = run(m, *words, "--help")
            check(f"{' '.join(words)} --help: its usage, exit 0",
                  sub_usage.returncode == 0 and "usage:" in sub_usage.stdout,
                  sub_usage.stderr[-200:])
        for bogus in ("--no-such-flag", "--no-such-flag=1"):
            out = run(m, *words, bogus)
            lines = error_lines(out)
            check(f"{' '.join(words)} {bogus}: exit 2, one error line naming --no-such-flag",
                  out.returncode == 2 and len(lines) == 1 and "'--no-such-flag'" in lines[0],
                  f"exit {out.returncode}: {out.stderr.strip()[-300:]}")
        flags = [f for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]{5,})", usage.stdout)
                 if f not in ("--help", "--config")]
        if flags:
            real = flags[0]
            out = run(m, *words, misspelt(real))
            lines = error_lines(out)
            check(f"{' '.join(words)} {misspelt(real)}: suggests {real}",
                  out.returncode == 2 and lines and f"did you mean {real}?" in lines[0],
                  f"exit {out.returncode}: {out.stderr.strip()[-300:]}")

    # --key=value and --key value give the same run.
    spaced = run(m, "run", "--model", args.model, "--tokens", "1,2,3", "--max-tokens", "4",
                 "--json")
    joined = run(m, "run", f"--model={args.model}", "--tokens=1,2,3", "--max-tokens=4", "--json")
    check("run: --key=value reads as --key value",
          spaced.returncode == 0 and joined.returncode == 0 and
          json.loads(spaced.stdout)["ids"] == json.loads(joined.stdout)["ids"],
          joined.stderr[-300:])

    # A stage's section of a config file names only its settings.
    config = os.path.join(args.workdir, "stages.json")
    with open(config, "w") as f:
        json.dump({"threads": 1, "gateway": {"max-in-flihgt": 8}}, f)
    out = run(m, "gateway", "--config", config, "--http", "127.0.0.1:0")
    lines = error_lines(out)
    check("a misspelt key in a stage's config section: exit 2, the nearest setting suggested",
          out.returncode == 2 and lines and "max-in-flihgt" in lines[0] and
          "did you mean --max-in-flight?" in lines[0], out.stderr.strip()[-300:])

    print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all CLI uniformity checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
