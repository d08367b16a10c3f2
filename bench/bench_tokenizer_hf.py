#!/usr/bin/env python3
"""Time HF `tokenizers` single-threaded on the text bench_tokenizer uses, for the comparison in bench/RESULTS.md.

    build/bench_tokenizer --dump /tmp/tok_bench.txt          # ds4 figures, and the text it timed
    python3 bench/bench_tokenizer_hf.py --text /tmp/tok_bench.txt [--tokenizer tests/fixtures/tokenizer/deepseek.json]

The text holds documents separated by the byte 0x1E; each document is one encode call, as in bench_tokenizer.
Single-threaded: RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false are set before tokenizers is imported, and
documents go through Tokenizer.encode one at a time (encode_batch is timed as well, on one Rayon thread, which
leaves out Python's per-call overhead). decode is timed per document on the ids encode produced.

It prints the token count and the FNV-1a checksum of the ids (as little-endian uint32, in order): when they equal
bench_tokenizer's, both produced the same ids for the whole text.
"""
import argparse
import os
import platform
import statistics
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tokenizers  # noqa: E402  (after the environment is set)
from tokenizers import Tokenizer  # noqa: E402


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def fnv1a(ids_per_doc):
    h = 2166136261
    for ids in ids_per_doc:
        for i in ids:
            for b in range(4):
                h ^= (i >> (8 * b)) & 0xFF
                h = (h * 16777619) & 0xFFFFFFFF
    return h


def timed(fn, runs):
    times = []
    out = None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True, help="file written by bench_tokenizer --dump")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the deepseek fixture)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    path = args.tokenizer
    if path is None:
        for p in ("tests/fixtures/tokenizer/deepseek.json", "../tests/fixtures/tokenizer/deepseek.json"):
            if os.path.exists(p):
                path = p
                break
    if path is None:
        sys.exit("bench_tokenizer_hf: tests/fixtures/tokenizer/deepseek.json not found; use --tokenizer PATH")
    with open(args.text, "rb") as f:
        raw = f.read()
    docs = raw.decode("utf-8").split("\x1e")
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    tok = Tokenizer.from_file(path)
    print(f"bench_tokenizer_hf: tokenizers {tokenizers.__version__}, Python {platform.python_version()}, "
          f"machine: {machine()}, {os.cpu_count()} online cores, 1 thread")
    print(f"tokenizer: {path} (vocabulary size {tok.get_vocab_size()})")
    print(f"text: {args.text}, {nbytes / 1e6:.2f} MB, {len(docs)} documents")

    for d in docs[:50]:  # warm-up, as bench_tokenizer does
        tok.encode(d, add_special_tokens=False)

    def enc_loop():
        return [tok.encode(d, add_special_tokens=False).ids for d in docs]

    def enc_batch():
        return [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]

    ids, te = timed(enc_loop, args.runs)
    ids_b, tb = timed(enc_batch, args.runs)
    if ids_b != ids:
        print("note: encode_batch ids differ from encode ids")
    ntok = sum(len(x) for x in ids)

    def dec_loop():
        return sum(len(tok.decode(x, skip_special_tokens=False).encode("utf-8")) for x in ids)

    out_bytes, td = timed(dec_loop, args.runs)
    if out_bytes != nbytes:
        print(f"note: decode gave {out_bytes} bytes for {nbytes} bytes of text")
    print(f"tokens: {ntok} ({nbytes / ntok:.2f} bytes/token), id checksum (FNV-1a) {fnv1a(ids):08x}")
    for name, ts in (("encode", te), ("encode_batch", tb), ("decode", td)):
        med = statistics.median(ts)
        mb = (out_bytes if name == "decode" else nbytes) / 1e6
        print(f"{name}: {mb / med:.2f} MB/s ({ntok / med:.0f} tokens/s), {med:.3f} s median of {len(ts)} "
              f"(min {min(ts):.3f}, max {max(ts):.3f})")


if __name__ == "__main__":
    main()
