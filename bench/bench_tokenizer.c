/* bench_tokenizer.c — single-threaded encode and decode throughput of the tokenizer (MB/s of UTF-8 text).
 *
 *   build/bench_tokenizer [--tokenizer PATH] [--text PATH] [--mb N] [--runs N] [--dump PATH]
 *
 *   --tokenizer PATH  tokenizer.json (default tests/fixtures/tokenizer/deepseek.json, looked up from . and ..)
 *   --text PATH       benchmark this file instead of the generated text (documents separated by the byte 0x1E)
 *   --mb N            size of the generated text in MB (default 10)
 *   --runs N          timed passes over the text (default 3; the median is printed, with min and max)
 *   --dump PATH       also write the text to PATH, for bench/bench_tokenizer_hf.py (HF tokenizers on the same
 *                     text: it prints the same token count and id checksum when both agree id for id)
 *
 * The generated text is deterministic (a fixed LCG): documents of 1-12 paragraphs mixing English prose (most of
 * it), accented Latin, Cyrillic, Greek, Chinese, Japanese, Korean, emoji (with ZWJ sequences and flags), source
 * code, numbers and LaTeX, separated by the byte 0x1E. Each document is one encode call (as a training pipeline
 * would encode one sample); decode is timed per document on the ids encode produced. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "ds4.h"

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static void put(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 1 << 20;
        while (nc < b->n + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            fprintf(stderr, "bench_tokenizer: out of memory\n");
            exit(1);
        }
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void puts_(sbuf *b, const char *s) { put(b, s, strlen(s)); }

static uint64_t g_rng = 0x853C49E6748FEA9Bull;
static uint32_t rnd(uint32_t n) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((g_rng >> 33) % n);
}
#define PICK(arr) (arr)[rnd((uint32_t)(sizeof(arr) / sizeof((arr)[0])))]

static const char *const EN[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "was", "on", "be", "by", "at", "this",
    "which", "from", "or", "have", "an", "are", "not", "but", "model", "token", "training", "loss", "gradient",
    "expert", "router", "attention", "window", "compression", "reward", "policy", "sample", "learning", "rate",
    "however", "therefore", "experiment", "results", "between", "different", "important", "information", "system",
    "language", "understanding", "reasoning", "mathematics", "function", "probability", "distribution", "value",
    "Transformer", "DeepSeek", "GPU", "kernel", "memory", "throughput", "latency", "benchmark", "we", "they", "you",
    "I", "it's", "don't", "can't", "we'll", "they're", "user's", "e-mail", "state-of-the-art", "open-source",
};
static const char *const LATIN[] = {"función", "número", "über", "naïve", "café", "résumé", "façade", "señor", "Ærø",
                                    "größer", "déjà", "piñata", "crème", "brûlée", "Ångström", "São", "Paulo", "İstanbul"};
static const char *const CYR[] = {"Москва", "данные", "модель", "обучение", "вероятность", "функция", "и", "в", "не",
                                  "что", "это", "решение", "задача", "математика"};
static const char *const GREEK[] = {"πρόβλημα", "λύση", "συνάρτηση", "αλφα", "βήτα", "γάμμα", "και", "το", "της"};
static const char *const ZH[] = {"深度学习", "模型", "训练", "数据", "注意力机制", "专家", "我们", "的", "是", "在",
                                 "一个", "问题", "方法", "结果", "实验", "语言", "理解", "推理", "数学", "函数"};
static const char *const JA[] = {"東京", "ひらがな", "カタカナ", "です", "ます", "これは", "テスト", "日本語",
                                 "の", "を", "に", "学習", "モデル"};
static const char *const KO[] = {"한국어", "텍스트", "모델", "학습", "데이터", "입니다", "그리고", "서울"};
static const char *const EMOJI[] = {"😀", "🙂", "🚀", "🔥", "👍", "❤️", "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵", "✅", "🤖", "🧠"};
static const char *const PUNCT[] = {".", ",", "!", "?", ";", ":", " -", " (", ")", "\"", "'", "...", " —"};
static const char *const CODE[] = {
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; i++) {\n    y[i] += a * x[i];\n}\n",
    "local t = {1, 2, 3}\nprint(#t)\n",
    "if err != nil {\n\treturn err\n}\n",
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\n",
    "SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name;\n",
    "fn main() {\n    println!(\"hello {}\", 42);\n}\n",
    "const result = await fetch(`https://example.com/api?id=${id}`);\n",
};
static const char *const LATEX[] = {"\\frac{a}{b}", "\\boxed{42}", "$x^2 + y^2 = z^2$", "\\sum_{i=1}^{n} i = \\frac{n(n+1)}{2}",
                                    "$$\\int_0^1 x\\,dx = \\frac{1}{2}$$", "\\mathbb{E}[X]", "\\alpha \\cdot \\beta"};

static void sentence(sbuf *b) {
    uint32_t k = rnd(100);
    uint32_t n = 4 + rnd(18);
    for (uint32_t i = 0; i < n; i++) {
        const char *w;
        int space = 1;
        if (k < 62) w = PICK(EN);
        else if (k < 68) w = PICK(LATIN);
        else if (k < 73) w = PICK(CYR);
        else if (k < 75) w = PICK(GREEK);
        else if (k < 85) {
            w = PICK(ZH);
            space = 0;
        } else if (k < 90) {
            w = PICK(JA);
            space = 0;
        } else if (k < 94) w = PICK(KO);
        else w = i % 3 == 2 ? PICK(EMOJI) : PICK(EN);
        if (i && space) puts_(b, " ");
        puts_(b, w);
        if (rnd(12) == 0) puts_(b, PICK(PUNCT));
        if (rnd(25) == 0) {
            char num[32];
            snprintf(num, sizeof num, " %u", rnd(2) ? rnd(100) : rnd(4000000000u));
            puts_(b, num);
        }
    }
    puts_(b, k >= 75 && k < 90 ? "。" : PICK(PUNCT));
}

static void document(sbuf *b) {
    uint32_t paras = 1 + rnd(12);
    for (uint32_t p = 0; p < paras; p++) {
        uint32_t k = rnd(100);
        if (k < 75) {
            uint32_t s = 1 + rnd(6);
            for (uint32_t i = 0; i < s; i++) {
                if (i) puts_(b, " ");
                sentence(b);
            }
        } else if (k < 88) {
            puts_(b, PICK(CODE));
        } else if (k < 95) {
            puts_(b, "We have ");
            puts_(b, PICK(LATEX));
            puts_(b, " and so ");
            puts_(b, PICK(LATEX));
            puts_(b, ".");
        } else {
            char num[64];
            snprintf(num, sizeof num, "%u.%03u, %u, %u%%", rnd(100000), rnd(1000), rnd(1000000000u), rnd(100));
            puts_(b, num);
        }
        puts_(b, rnd(4) ? "\n\n" : "\n");
    }
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    sbuf b = {0};
    char tmp[1 << 16];
    size_t r;
    while ((r = fread(tmp, 1, sizeof tmp, f)) > 0) put(&b, tmp, r);
    fclose(f);
    *len = b.n;
    return b.p;
}

static void machine(char *buf, size_t cap) {
    snprintf(buf, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ') c++;
                c[strcspn(c, "\n")] = 0;
                snprintf(buf, cap, "%s", c);
            }
            break;
        }
    }
    fclose(f);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const char *tok_path = NULL, *text_path = NULL, *dump = NULL;
    double mb = 10;
    int runs = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--tokenizer") && i + 1 < argc) tok_path = argv[++i];
        else if (!strcmp(a, "--text") && i + 1 < argc) text_path = argv[++i];
        else if (!strcmp(a, "--mb") && i + 1 < argc) mb = atof(argv[++i]);
        else if (!strcmp(a, "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(a, "--dump") && i + 1 < argc) dump = argv[++i];
        else {
            fprintf(stderr, "usage: bench_tokenizer [--tokenizer PATH] [--text PATH] [--mb N] [--runs N] [--dump PATH]\n");
            return 2;
        }
    }
    if (runs < 1 || runs > 100 || !(mb > 0 && mb <= 4096)) {
        fprintf(stderr, "bench_tokenizer: --runs must be 1..100 and --mb in (0, 4096]\n");
        return 2;
    }
    ds4_tokenizer *tok = NULL;
    ds4_error err = {0};
    if (tok_path) {
        if (ds4_tokenizer_load(tok_path, &tok, &err) != DS4_OK) {
            fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
            return 1;
        }
    } else {
        static const char *const defaults[] = {"tests/fixtures/tokenizer/deepseek.json",
                                               "../tests/fixtures/tokenizer/deepseek.json"};
        for (size_t i = 0; i < 2 && !tok; i++)
            if (access(defaults[i], R_OK) == 0 && ds4_tokenizer_load(defaults[i], &tok, &err) == DS4_OK) tok_path = defaults[i];
        if (!tok) {
            fprintf(stderr, "bench_tokenizer: tests/fixtures/tokenizer/deepseek.json not found from . or .. (%s); use "
                            "--tokenizer PATH\n", err.msg[0] ? err.msg : "no such file");
            return 1;
        }
    }

    sbuf text = {0};
    if (text_path) {
        text.p = read_all(text_path, &text.n);
        if (!text.p) {
            fprintf(stderr, "bench_tokenizer: cannot read %s\n", text_path);
            return 1;
        }
    } else {
        size_t target = (size_t)(mb * 1e6);
        while (text.n < target) {
            if (text.n) put(&text, "\x1e", 1);
            document(&text);
        }
    }
    if (dump) {
        FILE *f = fopen(dump, "wb");
        if (!f || fwrite(text.p, 1, text.n, f) != text.n || fclose(f) != 0) {
            fprintf(stderr, "bench_tokenizer: cannot write %s\n", dump);
            return 1;
        }
    }
    /* documents: [start, end) offsets */
    size_t ndoc = 1;
    for (size_t i = 0; i < text.n; i++) ndoc += text.p[i] == 0x1e;
    size_t *doc = malloc((ndoc + 1) * sizeof *doc);
    if (!doc) return 1;
    size_t k = 0;
    doc[k++] = 0;
    for (size_t i = 0; i < text.n; i++)
        if (text.p[i] == 0x1e) doc[k++] = i + 1;
    doc[k] = text.n + 1;

    char cpu[256];
    machine(cpu, sizeof cpu);
    printf("bench_tokenizer: ds4 %s, machine: %s, %ld online cores, 1 thread\n", DS4_VERSION_STRING, cpu,
           sysconf(_SC_NPROCESSORS_ONLN));
    printf("tokenizer: %s (vocabulary size %d)\n", tok_path, (int)ds4_tokenizer_vocab_size(tok));
    printf("text: %s, %.2f MB, %zu documents\n", text_path ? text_path : "generated", (double)text.n / 1e6, ndoc);

    /* encode: all ids kept (one array), per-document counts for decode */
    ds4_tokens ids = {0};
    size_t *cnt = malloc(ndoc * sizeof *cnt);
    double *te = malloc((size_t)runs * sizeof *te), *td = malloc((size_t)runs * sizeof *td);
    if (!cnt || !te || !td) return 1;
    /* warm-up: the first documents, to fill the scratch pool and the caches */
    for (size_t d = 0; d < ndoc && d < 50; d++) {
        ids.n = 0;
        ds4_tokenizer_encode(tok, text.p + doc[d], doc[d + 1] - 1 - doc[d], 0, &ids, &err);
    }
    uint32_t checksum = 0;
    for (int r = 0; r < runs; r++) {
        ids.n = 0;
        double t0 = now_s();
        for (size_t d = 0; d < ndoc; d++) {
            size_t before = ids.n;
            if (ds4_tokenizer_encode(tok, text.p + doc[d], doc[d + 1] - 1 - doc[d], 0, &ids, &err) != DS4_OK) {
                fprintf(stderr, "bench_tokenizer: encode: %s\n", err.msg);
                return 1;
            }
            cnt[d] = ids.n - before;
        }
        te[r] = now_s() - t0;
    }
    /* FNV-1a over the ids as little-endian uint32: bench_tokenizer_hf.py prints the same for HF's ids */
    checksum = 2166136261u;
    for (size_t i = 0; i < ids.n; i++)
        for (int b = 0; b < 4; b++) {
            checksum ^= ((uint32_t)ids.ids[i] >> (8 * b)) & 0xFF;
            checksum *= 16777619u;
        }
    size_t out_bytes = 0;
    for (int r = 0; r < runs; r++) {
        size_t off = 0;
        out_bytes = 0;
        double t0 = now_s();
        for (size_t d = 0; d < ndoc; d++) {
            char *s = NULL;
            size_t sl = 0;
            if (ds4_tokenizer_decode(tok, ids.ids + off, cnt[d], 0, &s, &sl, &err) != DS4_OK) {
                fprintf(stderr, "bench_tokenizer: decode: %s\n", err.msg);
                return 1;
            }
            out_bytes += sl;
            off += cnt[d];
            free(s);
        }
        td[r] = now_s() - t0;
    }
    size_t in_bytes = text.n - (ndoc - 1);
    if (out_bytes != in_bytes) printf("note: decode gave %zu bytes for %zu bytes of text\n", out_bytes, in_bytes);
    qsort(te, (size_t)runs, sizeof *te, cmp_d);
    qsort(td, (size_t)runs, sizeof *td, cmp_d);
    double med_e = te[runs / 2], med_d = td[runs / 2];
    printf("tokens: %zu (%.2f bytes/token), id checksum (FNV-1a) %08x\n", ids.n, (double)in_bytes / (double)ids.n,
           checksum);
    printf("encode: %.2f MB/s (%.0f tokens/s), %.3f s median of %d (min %.3f, max %.3f)\n", (double)in_bytes / 1e6 / med_e,
           (double)ids.n / med_e, med_e, runs, te[0], te[runs - 1]);
    printf("decode: %.2f MB/s (%.0f tokens/s), %.3f s median of %d (min %.3f, max %.3f)\n", (double)out_bytes / 1e6 / med_d,
           (double)ids.n / med_d, med_d, runs, td[0], td[runs - 1]);
    ds4_tokens_free(&ids);
    free(cnt);
    free(te);
    free(td);
    free(doc);
    free(text.p);
    ds4_tokenizer_free(tok);
    return 0;
}
