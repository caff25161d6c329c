#!/usr/bin/python3
"""`moeline tokenize`, `detokenize` and `run --prompt` as a user drives them: the output contract
(one JSON array of ids; the text), --no-special / --skip-special, and bad input (invalid UTF-8,
malformed or unsupported tokenizer files, malformed id lists) answered with a non-zero exit and one
clear `moeline: error:` line, never a crash.

    test_tokenizer_cli.py --moeline BIN --models DIR_WITH_mixtral-f32_AND_qwen3-f32 --workdir DIR
"""
import argparse
import json
import os
import subprocess
import sys

failures = []


def run(moeline, args, stdin=b""):
    return subprocess.run([moeline, *args], input=stdin, capture_output=True, timeout=120)


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def clean_error(r, code, words):
    err = r.stderr.decode("utf-8", "replace")
    lines = [line for line in err.splitlines() if line.startswith("moeline: error:")]
    ok = r.returncode == code and len(lines) == 1 and all(w in lines[0] for w in words)
    return ok, f"exit {r.returncode}, stderr {err!r}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    m = args.moeline
    os.makedirs(args.workdir, exist_ok=True)
    mixtral = os.path.join(args.models, "mixtral-f32")
    qwen = os.path.join(args.models, "qwen3-f32")

    # Output contract.
    r = run(m, ["tokenize", "--tokenizer", mixtral], "Hello world".encode())
    ids = json.loads(r.stdout) if r.returncode == 0 else None
    check("tokenize prints one JSON array of ids", isinstance(ids, list) and all(isinstance(i, int) for i in ids),
          r.stderr)
    check("the post-processor adds <s> (id 1) by default", bool(ids) and ids[0] == 1)
    r2 = run(m, ["tokenize", "--tokenizer", os.path.join(mixtral, "tokenizer.json"), "--no-special"],
             "Hello world".encode())
    check("--no-special leaves the post-processor out; a tokenizer.json path works too",
          r2.returncode == 0 and ids and json.loads(r2.stdout) == ids[1:], r2.stdout)
    r = run(m, ["detokenize", "--tokenizer", mixtral], json.dumps(ids).encode())
    check("detokenize gives the text back (special tokens kept)", r.stdout == b"<s> Hello world", r.stdout)
    r = run(m, ["detokenize", "--tokenizer", mixtral, "--skip-special"], json.dumps(ids).encode())
    check("--skip-special drops them", r.stdout == b"Hello world", r.stdout)
    text = "naïve 日本 🤷‍♂️\n\ttabs"
    r = run(m, ["tokenize", "--tokenizer", qwen, "--no-special"], text.encode())
    r = run(m, ["detokenize", "--tokenizer", qwen], r.stdout)
    check("byte-level round trip through both commands", r.stdout.decode() == text, r.stdout)

    r = run(m, ["run", "--model", qwen, "--prompt", "Hello world", "--max-tokens", "4", "--ignore-eos",
                "--json"])
    out = json.loads(r.stdout) if r.returncode == 0 else {}
    prompt_ids = json.loads(run(m, ["tokenize", "--tokenizer", qwen], b"Hello world").stdout)
    check("run --prompt tokenizes with the model's tokenizer and reports the text",
          out.get("usage", {}).get("prompt_tokens") == len(prompt_ids) and isinstance(out.get("text"), str)
          and len(out.get("ids", [])) == 4, r.stderr)
    r = run(m, ["run", "--model", qwen, "--prompt", "Hello", "--chat", "--system", "Be brief.",
                "--max-tokens", "2", "--json"])
    chat_prompt = run(m, ["chat-template", "--tokenizer", qwen],
                      json.dumps([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello"}]).encode()).stdout
    chat_ids = json.loads(run(m, ["tokenize", "--tokenizer", qwen, "--no-special"], chat_prompt).stdout)
    out = json.loads(r.stdout) if r.returncode == 0 else {}
    check("run --chat prompts with the rendered chat template",
          out.get("usage", {}).get("prompt_tokens") == len(chat_ids), r.stderr)

    # Bad input.
    r = run(m, ["tokenize", "--tokenizer", qwen], b"abc\xff\xfe")
    check("invalid UTF-8 on stdin: clear error", *clean_error(r, 1, ["not valid UTF-8", "offset 3"]))
    r = run(m, ["run", "--model", qwen, "--prompt", "ok", "--tokens", "1"])
    check("--prompt with --tokens is a usage error", *clean_error(r, 2, ["--prompt", "--tokens"]))
    r = subprocess.run([m, "run", "--model", qwen, "--prompt", b"bad \xc3\x28 text"], capture_output=True)
    check("run --prompt with invalid UTF-8: clear error", *clean_error(r, 2, ["--prompt", "UTF-8"]))
    r = run(m, ["detokenize", "--tokenizer", qwen], b"[1, 2, 99999999]")
    check("detokenize of an id outside the vocabulary: clear error",
          *clean_error(r, 1, ["99999999", "vocabulary"]))
    for payload, words in ((b"{\"a\": 1}", ["JSON array"]), (b"[1, -2]", ["non-negative"]),
                           (b"[1, 2.5]", ["integer"]), (b"not json", ["stdin"])):
        r = run(m, ["detokenize", "--tokenizer", qwen], payload)
        check(f"detokenize {payload!r}: clear error", *clean_error(r, 1, words))
    r = run(m, ["tokenize"], b"x")
    check("tokenize without --tokenizer: usage error", *clean_error(r, 2, ["--tokenizer"]))

    good = json.load(open(os.path.join(qwen, "tokenizer.json"), encoding="utf-8"))
    broken = {
        "truncated": (json.dumps(good)[:5000], ["not valid JSON"]),
        "empty": ("", ["not valid JSON"]),
        "unigram": (json.dumps(dict(good, model={"type": "Unigram", "vocab": []})),
                    ["unsupported model type", "Unigram"]),
        "bad-normalizer": (json.dumps(dict(good, normalizer={"type": "Precompiled"})),
                           ["normalizer", "Precompiled"]),
        "bad-regex": (json.dumps(dict(good, pre_tokenizer={
            "type": "Split", "pattern": {"Regex": "[unclosed"}, "behavior": "Isolated"})),
            ["pre_tokenizer.pattern.Regex", "does not compile"]),
        "merge-not-in-vocab": (json.dumps(dict(good, model=dict(good["model"], merges=[["zz\u0100", "q"]]))),
                               ["merges[0]", "not in the vocab"]),
    }
    for name, (content, words) in broken.items():
        path = os.path.join(args.workdir, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        r = run(m, ["tokenize", "--tokenizer", path], b"hello")
        check(f"tokenizer file {name}: clear error naming the file", *clean_error(r, 1, [path] + words))
    r = run(m, ["tokenize", "--tokenizer", os.path.join(args.workdir, "missing.json")], b"x")
    check("missing tokenizer file: clear error", *clean_error(r, 1, ["cannot open"]))

    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
