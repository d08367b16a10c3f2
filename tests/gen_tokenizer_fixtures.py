#!/usr/bin/env python3
"""Regenerate tests/fixtures/tokenizer/ with HF `tokenizers` (run on a host that has it, e.g. the GPU host).

    python3 tests/gen_tokenizer_fixtures.py OUTDIR

Trains small byte-level BPE tokenizers on a synthetic multilingual corpus and records, for a few hundred
test strings, the ids HF `tokenizers` produces and its decode of them:

  deepseek.json      DeepSeek-V3/V4-style pipeline: Split \\p{N}{1,3} (isolated), Split CJK runs (isolated),
                     Split punctuation/word regex (isolated), ByteLevel without prefix space and without its
                     own regex; ByteLevel decoder; the DeepSeek chat special tokens as added tokens.
  variant.json       other components: NFC normaliser, Digits(individual_digits), Split with the behaviours
                     removed / merged_with_previous / merged_with_next / contiguous and invert, ByteLevel with
                     its GPT-2 regex, ignore_merges = true, merges written as [a, b] pairs.
  cases.jsonl        one JSON object per line: {"text": ..., "deepseek": [ids], "variant": [ids],
                     "deepseek_decoded": ..., "variant_decoded": ...}
"""
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
           "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜▁pad▁｜>"]

DS_WORD = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
           " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
CJK = "[一-龥぀-ゟ゠-ヿ]+"


def corpus(rng):
    words = ("the of and to in is that for it with as was on be by at this which from or have an are not but "
             "model token train loss gradient expert router attention window compress reward policy sample "
             "función número über naïve café résumé Москва данные πρόβλημα").split()
    cjk = ["深度学习", "模型", "训练", "数据", "注意力机制", "专家", "東京", "ひらがな", "カタカナ", "한국어"]
    code = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; i++) { y[i] += a * x[i]; }\n",
            "local t = {1, 2, 3}\nprint(#t)\n", "if err != nil {\n\treturn err\n}\n"]
    latex = ["\\frac{a}{b}", "\\boxed{42}", "$x^2 + y^2 = z^2$", "\\sum_{i=1}^{n} i = \\frac{n(n+1)}{2}"]
    out = []
    for _ in range(6000):
        k = rng.random()
        if k < 0.5:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) + rng.choice([".", "!", "?", ",", "\n"]))
        elif k < 0.65:
            out.append("".join(rng.choice(cjk) for _ in range(rng.randint(1, 6))) + "。")
        elif k < 0.8:
            out.append(rng.choice(code))
        elif k < 0.9:
            out.append(rng.choice(latex))
        else:
            out.append(str(rng.randint(0, 10 ** rng.randint(1, 12))) + " " + f"{rng.random() * 1000:.3f}")
    return out


def cases(rng):
    fixed = [
        "", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \t \n ", "a", "ab", "hello world", "Hello, World!",
        "   leading spaces", "trailing spaces   ", "multiple   inner    spaces", "line1\nline2\n\nline3",
        "0", "12", "123", "1234", "1234567890123", "3.14159", "-42", "1,000,000", "x1y22z333w4444",
        "深度学习模型", "東京タワーとひらがな", "中文English混合123", "한국어 텍스트", "Ελληνικά", "Русский текст",
        "emoji 😀", "👨‍👩‍👧‍👦 family", "flags 🇫🇷🇯🇵", "e\u0301 combining", "n\u0303o\u0308", "Å vs A\u030a",
        "ﬁ ligature", "def f(x):\n    return x ** 2\n", "int main(void) { return 0; }",
        "\\frac{1}{2} + \\sqrt{x}", "\\boxed{\\dfrac{3}{4}}", "$$\\int_0^1 x\\,dx$$",
        "<｜User｜>hi<｜Assistant｜>", "text <think>reasoning</think> answer", "<｜end▁of▁sentence｜>",
        "a<｜begin▁of▁sentence｜>b", "<think></think>", "<｜User｜><｜User｜>", "<｜Use", "｜User｜>",
        "don't won't it's", "'s 're 've 'll", "AI's", "e-mail", "snake_case_name", "CamelCaseWord",
        "http://example.com/a?b=c&d=e", "user@example.com", "!!!???...", "(((nested)))", "[a, b, c]",
        "\u00a0nbsp", "zero\u200bwidth", "\u3000ideographic space", "tab\tseparated\tvalues",
        "mixed\r\nline\rendings\n", "ends with newline\n", "🙂🙃", "ÀÉÎÕÜ àéîõü", "ß ẞ", "İstanbul ıi",
    ]
    rng_pieces = fixed + ["0123456789" * 3, "a" * 100, " " * 33, "\n" * 7, "9" * 40, "深" * 30]
    out = list(rng_pieces)
    alphabet = list("abcxyz ABC 0123456789 .,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|\n\t") + ["深", "学", "ひ", "カ", "é",
                                                                                       "😀", "\u0301", "ß", "я"]
    while len(out) < 400:
        n = rng.randint(1, 60)
        s = "".join(rng.choice(alphabet) for _ in range(n))
        if rng.random() < 0.2:
            s = s[: n // 2] + rng.choice(SPECIAL[:6]) + s[n // 2:]
        out.append(s)
    return out


def deepseek_tokenizer(texts):
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\\p{N}{1,3}"), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(CJK), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(DS_WORD), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def variant_tokenizer(texts):
    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("[0-9]+"), behavior="merged_with_previous", invert=False),
        pre_tokenizers.Split("--", behavior="removed", invert=False),
        pre_tokenizers.Split(Regex("[!?]"), behavior="merged_with_next", invert=False),
        pre_tokenizers.Split(Regex("\\s+"), behavior="contiguous", invert=True),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIAL[:6], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tokenizer"
    os.makedirs(out, exist_ok=True)
    rng = random.Random(4)
    texts = corpus(rng)
    toks = {"deepseek": deepseek_tokenizer(texts), "variant": variant_tokenizer(texts)}
    for name, tok in toks.items():
        tok.save(os.path.join(out, f"{name}.json"), pretty=False)
    # merges as [a, b] pairs in one file, "a b" strings in the other: both spellings get tested
    vpath = os.path.join(out, "variant.json")
    with open(vpath) as f:
        v = json.load(f)
    v["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in v["model"]["merges"]]
    with open(vpath, "w") as f:
        json.dump(v, f, ensure_ascii=False)
    toks["variant"] = Tokenizer.from_file(vpath)
    dpath = os.path.join(out, "deepseek.json")
    with open(dpath) as f:
        d = json.load(f)
    d["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]]
    with open(dpath, "w") as f:
        json.dump(d, f, ensure_ascii=False)
    toks["deepseek"] = Tokenizer.from_file(dpath)
    with open(os.path.join(out, "cases.jsonl"), "w") as f:
        for s in cases(rng):
            row = {"text": s}
            for name, tok in toks.items():
                ids = tok.encode(s, add_special_tokens=False).ids
                row[name] = ids
                row[name + "_decoded"] = tok.decode(ids, skip_special_tokens=False)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    # a larger text for the speed benchmark (not committed; the bench regenerates it the same way)
    print("vocab sizes:", {k: t.get_vocab_size() for k, t in toks.items()})
    for k in toks:
        print(k, os.path.getsize(os.path.join(out, f"{k}.json")), "bytes")


if __name__ == "__main__":
    main()
