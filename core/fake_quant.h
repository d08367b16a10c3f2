/* fake_quant.h — the quantisation-aware-training option's arithmetic (docs/architecture.md, "FP8 KV quantisation-
 * aware training"): values rounded to FP8 e4m3 or FP4 e2m1 in blocks with power-of-two (ue8m0) scales and kept in
 * fp32, and the normalised Walsh-Hadamard rotation the indexer applies before FP4. Shared by the CPU backend's
 * operations; the definitions here are the reference. */
#ifndef DS4_FAKE_QUANT_H
#define DS4_FAKE_QUANT_H

#include <stdint.h>

enum {
    DS4_FQ_OFF = 0,  /* no rounding (a rotation alone, when hadamard is set) */
    DS4_FQ_E4M3 = 1, /* FP8 e4m3 (largest finite 448), blocks of 64 channels */
    DS4_FQ_E2M1 = 2, /* FP4 e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), blocks of 32 channels */
};

/* What to do to a vector: rotate the whole vector by the normalised Walsh-Hadamard transform first (hadamard; its
 * width must be a power of two), then fake-quantise its first nq channels in blocks of the format's size (the last
 * block may be shorter); the channels after nq (the RoPE part of a key) are left as they are. */
typedef struct ds4_fq {
    int32_t fmt;
    int32_t hadamard;
    int64_t nq;
} ds4_fq;

/* Channels per scale block of a format (0 for DS4_FQ_OFF). */
int64_t ds4_fq_block(int32_t fmt);
/* The block scale for a block whose largest magnitude is amax: 2^ceil(log2(max(amax, floor) / top)), with top the
 * format's largest value (448, 6) and floor 1e-4 (e4m3) or 6·2^-126 (e2m1), as the official inference code chooses
 * it. A NaN or infinite amax gives NaN (it spreads to the whole block instead of hiding). The CUDA backend repeats
 * these definitions operation for operation (cuda/cuda_kv_qat.cuh). */
float ds4_fq_scale(float amax, int32_t fmt);
/* v (in units of the scale) clamped to ±top and rounded to the nearest value of the format, ties to the even
 * mantissa. */
float ds4_fq_round(float v, int32_t fmt);
/* x[0 .. n) ← H x / sqrt(n), H the Sylvester-ordered Hadamard matrix (symmetric; applied twice it is the identity);
 * n a power of two. Butterflies in a fixed order, in fp32. */
void ds4_hadamard(float *x, int64_t n);
/* One vector of `width` floats, as q says. */
void ds4_fake_quant_row(float *x, int64_t width, const ds4_fq *q);

#endif /* DS4_FAKE_QUANT_H */
