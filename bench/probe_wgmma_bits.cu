// probe_wgmma_bits.cu — does Hopper's wgmma (m64n8k16, bf16 in, fp32 accumulate) give the same bits as mma.sync
// m16n8k16 when every product sits in the same k-slot? ds4's batch invariance rests on one summation order that the
// decoding kernels (mma.sync, few rows) and the training GEMM share (cuda/cuda_gemm.cu's header); a wgmma GEMM may
// replace the training GEMM only if it adds the same slots the same way. It measures, never fails: it prints, per slot
// order (natural k, and ds4's k32 order of ds4d_mma_k32), how many of the outputs differ between the two instructions
// on uniform, wide-exponent (2^-30..2^30, where the order of the sums decides the rounding) and near-cancelling data,
// the wgmma result's distance from a double reference (the layout check), and how many outputs move when mma.sync's
// products change slots. CMake builds it for sm_90a where the CUDA backend is built (bench/RESULTS.md has the result):
//   build/probe_wgmma_bits [TRIALS=4096 [K=256]]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cuda_bf16.h>

#define CU(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int M = 64, N = 8;

// k-slot s of k16-step j of a chunk of 32 holds k = 8t + 4j + 2hi + e (t = (s % 8) / 2, e = s % 2, hi = s / 8): the
// order of ds4d_mma_k32 (cuda_tile.cuh). perm=0: natural k order (slot s of step j holds k = 16j + s).
__host__ __device__ inline int slot_k(int perm, int j, int s) {
    if (!perm) return 16 * j + s;
    const int t = (s % 8) / 2, e = s % 2, hi = s / 8;
    return 8 * t + 4 * j + 2 * hi + e;
}

__device__ inline void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ inline uint32_t pack2(const __nv_bfloat16 *p) {
    return (uint32_t)__bfloat16_as_ushort(p[0]) | ((uint32_t)__bfloat16_as_ushort(p[1]) << 16);
}

// mma.sync: warp w rows 16w.., slot s of step j from k = slot_k(perm, j, s); A [trials][M][K], B [trials][N][K]
__global__ void k_mma(const __nv_bfloat16 *A, const __nv_bfloat16 *B, float *D, int K, int perm) {
    const int tr = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const __nv_bfloat16 *a = A + (size_t)tr * M * K, *b = B + (size_t)tr * N * K;
    float c[4] = {0, 0, 0, 0};
    for (int k0 = 0; k0 < K; k0 += 32)
        for (int j = 0; j < 2; j++) {
            __nv_bfloat16 ra[4][2], rb[2][2];
            // a0: row g slots 2t,2t+1; a1: row g+8 same; a2: row g slots 2t+8,+9; a3: row g+8 same; b0: col g slots
            // 2t,2t+1; b1: col g slots 2t+8,+9
            for (int e = 0; e < 2; e++) {
                const int klo = k0 + slot_k(perm, j, 2 * t + e), khi = k0 + slot_k(perm, j, 2 * t + 8 + e);
                ra[0][e] = a[(16 * w + g) * K + klo], ra[1][e] = a[(16 * w + g + 8) * K + klo];
                ra[2][e] = a[(16 * w + g) * K + khi], ra[3][e] = a[(16 * w + g + 8) * K + khi];
                rb[0][e] = b[g * K + klo], rb[1][e] = b[g * K + khi];
            }
            mma16816(c, pack2(ra[0]), pack2(ra[1]), pack2(ra[2]), pack2(ra[3]), pack2(rb[0]), pack2(rb[1]));
        }
    float *d = D + (size_t)tr * M * N;
    d[(16 * w + g) * N + 2 * t] = c[0], d[(16 * w + g) * N + 2 * t + 1] = c[1];
    d[(16 * w + g + 8) * N + 2 * t] = c[2], d[(16 * w + g + 8) * N + 2 * t + 1] = c[3];
}

__device__ inline uint64_t desc(const void *smem, int lbo, int sbo) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((addr >> 4) & 0x3fff) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32); // layout type 0: no swizzle
}

// wgmma m64n8k16 from shared memory, no swizzle, K-major: core matrices of 8 rows x 8 k (16 bytes a row, 128
// contiguous bytes), core (r8, k8) at (r8 · 2 + k8) · 128 bytes: neighbours in k 128 bytes apart, in rows 256.
__global__ void k_wgmma(const __nv_bfloat16 *A, const __nv_bfloat16 *B, float *D, int K, int perm) {
    __shared__ __align__(128) __nv_bfloat16 sa[M * 16], sb[N * 16];
    const int tr = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const __nv_bfloat16 *a = A + (size_t)tr * M * K, *b = B + (size_t)tr * N * K;
    float c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    const int lbo = 128, sbo = 256; // the leading (k) and stride (rows) byte offsets of the core matrices
    for (int k0 = 0; k0 < K; k0 += 32)
        for (int j = 0; j < 2; j++) {
            __syncthreads();
            for (int i = threadIdx.x; i < M * 16; i += blockDim.x) {
                const int r = i / 16, s = i % 16;
                sa[((r / 8) * 2 + s / 8) * 64 + (r % 8) * 8 + s % 8] = a[r * K + k0 + slot_k(perm, j, s)];
            }
            for (int i = threadIdx.x; i < N * 16; i += blockDim.x) {
                const int r = i / 16, s = i % 16;
                sb[((r / 8) * 2 + s / 8) * 64 + (r % 8) * 8 + s % 8] = b[r * K + k0 + slot_k(perm, j, s)];
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            const uint64_t da = desc(sa, lbo, sbo), db = desc(sb, lbo, sbo);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                         : "l"(da), "l"(db), "r"(1));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
    float *d = D + (size_t)tr * M * N;
    d[(16 * w + g) * N + 2 * t] = c0, d[(16 * w + g) * N + 2 * t + 1] = c1;
    d[(16 * w + g + 8) * N + 2 * t] = c2, d[(16 * w + g + 8) * N + 2 * t + 1] = c3;
}

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static double urand() {
    rs ^= rs >> 12, rs ^= rs << 25, rs ^= rs >> 27;
    return (double)((rs * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

int main(int argc, char **argv) {
    const int trials = argc > 1 ? atoi(argv[1]) : 4096, K = argc > 2 ? atoi(argv[2]) : 256;
    if (trials < 3 || trials > 100000 || K < 32 || K % 32 || K > 65536) {
        printf("usage: %s [TRIALS 3..100000 [K: a multiple of 32]]\n", argv[0]);
        return 2;
    }
    const size_t na = (size_t)trials * M * K, nb = (size_t)trials * N * K, nd = (size_t)trials * M * N;
    __nv_bfloat16 *hA = (__nv_bfloat16 *)malloc(na * 2), *hB = (__nv_bfloat16 *)malloc(nb * 2);
    // three kinds of data by trial: uniform(-1, 1); wide exponents (2^-30..2^30, random signs: the order of the sums
    // decides the rounding); near-cancelling pairs. per: the values of one trial.
    auto fill = [](__nv_bfloat16 *h, size_t n, size_t per) {
        for (size_t i = 0; i < n; i++) {
            const int kind = (int)((i / per) % 3);
            double v = 2 * urand() - 1;
            if (kind == 1) v = (urand() < 0.5 ? -1 : 1) * ldexp(1 + urand(), (int)(urand() * 60) - 30);
            if (kind == 2) v = (urand() < 0.5 ? -1 : 1) * (1 + ldexp(urand(), -7));
            h[i] = __float2bfloat16_rn((float)v);
        }
    };
    fill(hA, na, (size_t)M * K);
    fill(hB, nb, (size_t)N * K);
    __nv_bfloat16 *dA, *dB;
    float *d1, *d2, *d3;
    CU(cudaMalloc(&dA, na * 2));
    CU(cudaMalloc(&dB, nb * 2));
    CU(cudaMalloc(&d1, nd * 4));
    CU(cudaMalloc(&d2, nd * 4));
    CU(cudaMalloc(&d3, nd * 4));
    CU(cudaMemcpy(dA, hA, na * 2, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dB, hB, nb * 2, cudaMemcpyHostToDevice));
    float *h1 = (float *)malloc(nd * 4), *h2 = (float *)malloc(nd * 4), *h3 = (float *)malloc(nd * 4);
    for (int perm = 0; perm < 2; perm++) {
        k_mma<<<trials, 128>>>(dA, dB, d1, K, perm);
        CU(cudaGetLastError());
        CU(cudaMemcpy(h1, d1, nd * 4, cudaMemcpyDeviceToHost));
        {
            k_wgmma<<<trials, 128>>>(dA, dB, d2, K, perm);
            CU(cudaGetLastError());
            CU(cudaDeviceSynchronize());
            CU(cudaMemcpy(h2, d2, nd * 4, cudaMemcpyDeviceToHost));
            // reference in double on the first (uniform) trials: is the layout right at all?
            double err = 0, ref = 0;
            for (int tr = 0; tr < 3 * 8 && tr < trials; tr += 3)
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        double s = 0;
                        for (int k = 0; k < K; k++)
                            s += (double)__bfloat162float(hA[((size_t)tr * M + m) * K + k]) *
                                 (double)__bfloat162float(hB[((size_t)tr * N + n) * K + k]);
                        const double v = h2[((size_t)tr * M + m) * N + n];
                        err += (v - s) * (v - s), ref += s * s;
                    }
            size_t diff[3] = {0, 0, 0}, nan = 0;
            for (size_t i = 0; i < nd; i++) {
                if (h1[i] != h1[i] || h2[i] != h2[i]) nan++;
                if (memcmp(&h1[i], &h2[i], 4)) diff[(i / ((size_t)M * N)) % 3]++;
            }
            printf("slots %s: wgmma vs double rel %.2e; wgmma vs mma.sync: %zu / %zu / %zu of %zu "
                   "outputs differ (uniform / wide exponents / cancelling), NaN %zu\n",
                   perm ? "ds4 k32 order" : "natural",
                   sqrt(err / ref), diff[0], diff[1], diff[2], nd / 3, nan);
        }
    }
    // the same products in other slots: does mma.sync itself depend on which slot holds which product?
    k_mma<<<trials, 128>>>(dA, dB, d1, K, 0);
    k_mma<<<trials, 128>>>(dA, dB, d3, K, 1);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(h1, d1, nd * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(h3, d3, nd * 4, cudaMemcpyDeviceToHost));
    size_t dd[3] = {0, 0, 0};
    for (size_t i = 0; i < nd; i++)
        if (memcmp(&h1[i], &h3[i], 4)) dd[(i / ((size_t)M * N)) % 3]++;
    printf("mma.sync natural vs ds4 slot order: %zu / %zu / %zu outputs differ\n", dd[0], dd[1], dd[2]);
    return 0;
}
