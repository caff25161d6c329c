"""Train a small BPE tokenizer and write it as a standard Hugging Face tokenizer.json.

Used by scripts/make-model so every generated checkpoint takes text. Two styles, matching the model
families moeline serves:

  byte_level    Qwen/DeepSeek/Llama-3 style: regex pre-split, GPT-2 byte alphabet, ByteLevel decoder,
                special tokens <|endoftext|>, <|im_start|>, <|im_end|> at the end of the vocabulary,
                merges written as [left, right] pairs (the newer format).
  metaspace     Llama-2/Mistral style: Prepend/Replace normalizer with U+2581, byte fallback
                <0x00>..<0xFF>, <unk> <s> </s> first, a post-processor adding <s>, merges written
                as "left right" strings (the older format).

The vocabulary has exactly `vocab_size` entries: the base alphabet, as many merges as the corpus
supports, then unused placeholder tokens. Training is deterministic (ties go to the smallest pair).
The default corpus is the licence texts every Debian system ships in /usr/share/common-licenses
(the base-files package: GPL, LGPL, GFDL, Apache, MPL, ...; about 300 KB of English), with a short
built-in text as a fallback elsewhere.
"""
import heapq
import json
import os
import re
from collections import Counter, defaultdict

FALLBACK_CORPUS = """\
Mixture-of-Experts language models route every token to a few experts out of many. The router
picks the experts, the experts transform the hidden state, and the results are mixed by the
router's weights. Serving such a model well means keeping the hot experts in fast memory, moving
cold ones in before they are needed, and reusing work that was already done for an earlier prompt.
This text exists so that a tokenizer can be trained anywhere, even without a system corpus.
"""

DEFAULT_CORPUS = "/usr/share/common-licenses"

# GPT-2's byte alphabet: printable bytes stand for themselves, the rest move to U+0100 onwards.
def byte_alphabet():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# An ASCII approximation of QWEN_PATTERN for splitting the training corpus (Python's re has no
# \p{..}); merges learned from it are valid for the real pattern.
TRAIN_SPLIT = re.compile(r"'(?:s|t|re|ve|m|ll|d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"
                         r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def read_corpus(path=None):
    """A file, or every distinct file of a folder in name order (symbolic links to the same file
    are read once)."""
    path = path or DEFAULT_CORPUS
    if os.path.isdir(path):
        seen, parts = set(), []
        for name in sorted(os.listdir(path)):
            real = os.path.realpath(os.path.join(path, name))
            if real in seen or not os.path.isfile(real):
                continue
            seen.add(real)
            with open(real, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
        if parts:
            return "\n".join(parts), path
    elif os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    return FALLBACK_CORPUS, "built-in text"


def learn_merges(words, max_merges):
    """words: {tuple of symbols: frequency}. Returns merges [(left, right)] in rank order."""
    seqs = [list(w) for w in words]
    freqs = list(words.values())
    pair_count = Counter()
    where = defaultdict(set)
    for i, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            pair_count[(a, b)] += freqs[i]
            where[(a, b)].add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    while heap and len(merges) < max_merges:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry
        if -neg < 2:
            break
        merges.append(pair)
        merged = pair[0] + pair[1]
        touched = set()
        for i in list(where[pair]):
            s, f = seqs[i], freqs[i]
            j, out = 0, []
            changed = False
            while j < len(s):
                if j + 1 < len(s) and s[j] == pair[0] and s[j + 1] == pair[1]:
                    out.append(merged)
                    j += 2
                    changed = True
                else:
                    out.append(s[j])
                    j += 1
            if not changed:
                continue
            for a, b in zip(s, s[1:]):
                pair_count[(a, b)] -= f
                touched.add((a, b))
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += f
                where[(a, b)].add(i)
                touched.add((a, b))
            seqs[i] = out
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    return merges


def _added(id_, content, special=True):
    return {"id": id_, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": not special, "special": special}


def _bpe_model(vocab, merges, **options):
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": False, "vocab": vocab, "merges": merges}
    model.update(options)
    return model


def build_byte_level(vocab_size, text):
    alphabet = byte_alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    base = 256 + len(specials)
    if vocab_size < base:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer "
                         f"(needs at least {base})")
    words = Counter()
    for piece in TRAIN_SPLIT.findall(text):
        words[tuple(alphabet[b] for b in piece.encode("utf-8"))] += 1
    merges = learn_merges(words, vocab_size - base)
    vocab = {alphabet[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    unused = 0
    while len(vocab) < vocab_size - len(specials):
        vocab[f"<|unused_{unused}|>"] = len(vocab)
        unused += 1
    added = [_added(len(vocab) + k, s) for k, s in enumerate(specials)]
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": _bpe_model(vocab, [[a, b] for a, b in merges]),
    }
    ids = {t["content"]: t["id"] for t in added}
    return doc, {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                 "bos_id": ids["<|endoftext|>"], "eos_id": ids["<|im_end|>"], "merges": len(merges)}


def build_metaspace(vocab_size, text):
    marker = "\u2581"
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    normalized = marker + text.replace(" ", marker)
    chars = sorted({c for c in normalized if c not in "\r\n"} | {marker})
    base = len(vocab) + len(chars)
    if vocab_size < base:
        raise ValueError(f"vocab_size {vocab_size} is too small for this tokenizer (needs at least "
                         f"{base} for the specials, the byte fallback and the corpus's characters)")
    for c in chars:
        vocab.setdefault(c, len(vocab))
    words = Counter(tuple(w) for w in re.findall(f"{marker}*[^{marker}\r\n]+|{marker}+", normalized))
    merges = learn_merges(words, vocab_size - len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    unused = 0
    while len(vocab) < vocab_size:
        vocab[f"<unused_{unused}>"] = len(vocab)
        unused += 1
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(i, s) for i, s in enumerate(specials)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": marker},
            {"type": "Replace", "pattern": {"String": " "}, "content": marker}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": marker}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": _bpe_model(vocab, [f"{a} {b}" for a, b in merges], unk_token="<unk>",
                            fuse_unk=True, byte_fallback=True),
    }
    return doc, {"bos": "<s>", "eos": "</s>", "pad": None, "bos_id": 1, "eos_id": 2,
                 "merges": len(merges)}


CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}")


def write(out_dir, style, vocab_size, corpus_path=None, max_length=4096, template_file=False):
    """Writes tokenizer.json and tokenizer_config.json; returns the special ids and statistics.
    template_file: the chat template goes to chat_template.jinja instead of tokenizer_config.json
    (as newer releases, GLM-4.5's among them, store it)."""
    text, source = read_corpus(corpus_path)
    doc, info = (build_byte_level if style == "byte_level" else build_metaspace)(vocab_size, text)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    config = {
        "tokenizer_class": "Qwen2Tokenizer" if style == "byte_level" else "LlamaTokenizer",
        "bos_token": info["bos"], "eos_token": info["eos"], "pad_token": info["pad"],
        "unk_token": None if style == "byte_level" else "<unk>",
        "add_bos_token": style != "byte_level", "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
        "chat_template": CHATML_TEMPLATE if style == "byte_level" else MISTRAL_TEMPLATE,
        "moeline_corpus": source,
    }
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if template_file:
        with open(jinja, "w", encoding="utf-8") as f:
            f.write(config.pop("chat_template"))
    elif os.path.exists(jinja):
        os.remove(jinja)  # from an earlier run: it would win over the config's
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    return info
