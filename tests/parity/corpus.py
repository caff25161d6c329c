"""The text samples the tokenizer parity test and the tokenizer benchmark run on.

Covers what tends to break tokenizers: several scripts (English, Chinese, Japanese, Korean, Arabic,
Hindi, Russian, Greek), emoji with skin tones and ZWJ sequences, source code, long runs of spaces,
tabs and newlines, numbers of every length, accents in composed and decomposed form, control and
format characters, and special-token strings inside ordinary text. Deterministic: the random part is
seeded.
"""
import random
import unicodedata

FIXED = [
    "",
    " ",
    "Hello world",
    "Hello, world! How are you doing today?",
    " leading space and trailing space ",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!!!",
    "I'm sure they'll say it's what we've done; you'd think I'M WRONG'S ok.",
    "Don't, won't, can't — shan't. \"Quoted\" and 'single' quotes… ellipsis",
    "人工智能正在改变世界。我们今天去公园散步吧！",
    "日本語のテキストです。カタカナとひらがな、そして漢字。ｶﾀｶﾅ半角も。",
    "한국어 텍스트입니다. 안녕하세요, 세계!",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε· ΣΊΣΥΦΟΣ ςσΣ",
    "مرحبا بالعالم، هذا نص عربي.",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "emoji: 😀 👍🏽 🤷‍♂️ 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ ✨",
    "👩🏻‍💻👨🏿‍🚀🧑‍🤝‍🧑",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "const x = {a: [1, 2, 3], 'b': null}; // comment\n/* block */ x?.a ?? [];",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son';",
    "<html><body><div class=\"x\">Text &amp; more</div></body></html>",
    "    four spaces\n\n\n\nfour newlines\t\t\ttabs\r\nCRLF\r\n",
    "                                                                end",
    "\n\n\n\n\n\n\n\n\n\n",
    "\t \t \t \n \n \n",
    "a\u00a0b\u2003c\u3000d\u200be\ufeff f",
    "1 12 123 1234 12345 123456 1234567 3.14159 -42 +7 1e10 0x1F 1,000,000",
    "٣٤٥ ١٢ ๑๒๓ ⅫⅣ ½ ² ①",
    "café naïve résumé Ångström",
    unicodedata.normalize("NFD", "café naïve résumé Ångström"),
    "e\u0301 a\u0300 o\u0308 n\u0303 \u1e9b\u0323",
    "ﬁ ﬂ ﬀ ℌ ① Ⅻ ｶ ㍿ ™ ℃",
    "Mixed: Hello 世界 こんにちは 안녕 مرحبا 🌍 123",
    "tab\tseparated\tvalues\t1\t2\t3",
    "trailing newline\n",
    "__init__ self.__dict__ a_b_c __x__",
    "https://example.com/path?query=1&other=two#frag user@example.com",
    "$$$ %%% ^^^ &&& *** ((( ))) --- +++ === [[[ ]]] {{{ }}} ||| \\\\ ;;; ::: ''' \"\"\" <<< >>> ??? ///",
    "..................................................",
    "ааааааааааааааааааааааааааааааааааааааааааааааааааа",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f",
    "İstanbul ǅ ß ẞ ŉ",
]

SPECIAL_TEMPLATES = [
    "{s}",
    "{s}{s}",
    "Hello {s} world",
    "Hello{s}world",
    "  {s}  ",
    "text before {s}\nand after {e}",
    "{s}system\nYou are helpful.{e}\n{s}user\nHi!{e}\n",
    "not special: <{x}> and {s}{e}{s}",
]


def special_samples(specials):
    """Samples with this tokenizer's own special-token strings embedded in text."""
    if not specials:
        return []
    out = []
    for i, template in enumerate(SPECIAL_TEMPLATES):
        s = specials[i % len(specials)]
        e = specials[(i + 1) % len(specials)]
        out.append(template.format(s=s, e=e, x=s.strip("<>")))
    return out


RANGES = [
    (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
    (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2190, 0x23FF),
    (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF),
    (0x10000, 0x1007F), (0xE000, 0xE0FF),
]


def random_samples(count, seed=1234):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.15:
                chars.append(rng.choice(" \t\n  \r"))
            elif r < 0.45:
                chars.append(rng.choice("abcdefghijklmnopqrstuvwxyzABC0123456789'.,-_"))
            else:
                lo, hi = rng.choice(RANGES)
                cp = rng.randint(lo, hi)
                # Only characters assigned in the Unicode version of Debian 12's PCRE2 and of this
                # Python (14.0): the reference's regex engine has newer tables, and a character
                # assigned since then has no category in ours (tokenizer/README.md).
                if 0xD800 <= cp <= 0xDFFF or unicodedata.category(chr(cp)) == "Cn":
                    continue
                chars.append(chr(cp))
        out.append("".join(chars))
    return out


def samples(specials=()):
    return FIXED + special_samples(list(specials)) + random_samples(120)


def mixed_text(size_bytes, seed=7):
    """About size_bytes of UTF-8 built from the fixed samples (benchmark input)."""
    rng = random.Random(seed)
    parts, total = [], 0
    pool = [s for s in FIXED if s] + random_samples(40, seed)
    while total < size_bytes:
        s = rng.choice(pool)
        parts.append(s)
        total += len(s.encode()) + 1
    return " ".join(parts).encode()[:size_bytes].decode("utf-8", "ignore")
