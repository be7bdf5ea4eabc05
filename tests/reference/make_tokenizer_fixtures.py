#!/usr/bin/env python3
"""Golden fixtures for tests/test_tokenizer.c: encodes a fixed list of texts with the Hugging
Face `tokenizers` library for each tokenizer in tests/fixtures/tokenizers/<name>/ and writes
cases.json there (a list of {text_b64, ids, ids_special, decoded}). Inputs are raw bytes; bytes
that are not valid UTF-8 are decoded the way a caller would (errors="replace") before encoding,
which is the behaviour the C tokenizer must reproduce.

The tokenizer.json files are committed gzip-compressed (tokenizer.json.gz, 47 MB -> 9 MB); the
build unpacks them into the build folder for the C test. This script reads the .gz too.

Run from the repository root:  python3 tests/reference/make_tokenizer_fixtures.py
"""
import base64
import gzip
import json
import os
import random
import sys

from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures", "tokenizers")
NAMES = ["qwen3", "deepseek_v3", "llama2", "gptoss"]

COMMON = [
    "",
    "Hello world",
    "Hello, world! How are you doing today?",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "The quick brown fox jumps over the lazy dog. It's what they'd've said, isn't it? WE'LL SEE.",
    "def foo(x):\n    if x > 0:\n\treturn x * 2\n    return -x\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "a  b   c    d\n\n\ne\r\nf \n \n g\t\t h",
    "\n\n\n",
    "    ",
    "1234567890 3.14159 1,000,000 and 2024-01-15 then 007",
    "12345678901234567890123456789",
    "中文分词测试：你好，世界！",
    "日本語のテキスト、ひらがなとカタカナ。東京タワー",
    "한국어 텍스트입니다",
    "emoji 😀👍🏽 and family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️",
    "cafe\u0301 vs café and n\u0303 and A\u030a\u0301",
    "\u1100\u1161\u11a8 hangul jamo",
    "مرحبا بالعالم",
    "שלום עולם",
    "Ünïcödé Straße ΑΒΓ αβγ Привет мир",
    "mixed\u00a0nbsp\u2003em-space\u200bzero-width",
    "URLs: https://example.com/path?q=1&r=two#frag and user@mail.org",
    "<html><body class=\"x\">Tom &amp; Jerry</body></html>",
    "CamelCaseIdentifier snake_case_name SCREAMING_CASE mIxEd",
    "Ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ ①②③ ½ ²",
    "tab\tseparated\tvalues\n",
    "a \u180e b\u180e\u180ec \u0085 d\u2028e",
    "x" * 300 + " " * 40 + "\n" * 5 + "9" * 50,
]

# Short random mixtures of the kinds of characters above (fixed seed): the pre-tokenizer
# regexes, whitespace rules and normalization meet in ways hand-written cases miss.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " ", "  \t\n\r\x0b\x0c",
    "'\"!?.,;:-_()[]{}<>/\\|@#$%^&*+=~`", "中文字日本語の漢字ひらがなカタカナ한국어", "éèêëàâäôöûüçñÉÀßøåæœ",
    "\u0301\u0300\u0308\u0303\u0327\u0323\u0345\u05bc\u0651", "😀👍🏽👨‍👩‍👧❤️🇫🇷",
    "\u00a0\u2003\u200b\u3000\u0085\u180e\u2028\u202f\ufeff", "αβγδΑΒΓΔабвгдАБВГД", "مرحباשלום",
    "ǅǈǋᾈᾉ", "①½²ⅣⅫ٣٤۵", "'s'S'll'LL'RE'd", "\ud7a3\u1100\u1161\u11a8\uac00",
]


def random_texts(count: int) -> list:
    rng = random.Random(1234)
    out = []
    for _ in range(count):
        n = rng.randint(1, 40)
        out.append("".join(rng.choice(rng.choice(POOLS)) for _ in range(n)))
    return out


# Raw byte inputs that are not valid UTF-8.
INVALID = [
    b"abc\xffdef",
    b"\xe4\xbd",
    b"\xf0\x9f\x98 x",
    b"\xc0\xaf and \xed\xa0\x80",
    b"ok \x80\x80\x80 end",
    b"\xf5\xf8\xfe",
    b"trunc \xe2\x82",
]

SPECIAL = {
    "qwen3": ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
              "text<|endoftext|>more", "<|im_start|><|im_end|>", " <|im_end|> x"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>hello<｜end▁of▁sentence｜>",
                    "<｜User｜>hi<｜Assistant｜>yes", "a<|EOT|>b <｜fim▁hole｜> c"],
    "llama2": ["<s>hello</s>", "hi <s> there", "<s>", "a<unk>b"],
    "gptoss": ["<|start|>user<|message|>hi<|end|>", "<|channel|>final<|message|>ok<|return|>",
               "x <|endoftext|> y"],
}


def main() -> int:
    with open(os.path.join(FIX, "shakespeare_4k.txt"), "rb") as f:
        shakespeare = f.read()
    for name in NAMES:
        with gzip.open(os.path.join(FIX, name, "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
            tok = Tokenizer.from_str(f.read())
        inputs = [t.encode("utf-8") for t in COMMON + SPECIAL[name] + random_texts(30)] + INVALID + [shakespeare]
        cases = []
        for raw in inputs:
            text = raw.decode("utf-8", errors="replace")
            ids = tok.encode(text, add_special_tokens=False).ids
            ids_special = tok.encode(text, add_special_tokens=True).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            cases.append({"text_b64": base64.b64encode(raw).decode("ascii"), "ids": ids,
                          "ids_special": ids_special, "decoded": decoded})
        out = os.path.join(FIX, name, "cases.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        print(f"{name}: {len(cases)} cases -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
