// cuda_gemm_wgmma.cuh — the bf16 product y (+)= x Wᵀ on Hopper's warpgroup tensor-core instruction (wgmma), with the
// bits of cuda_gemm.cu's mma.sync kernels. Built for sm_90a only (cuda_gemm_wgmma.cu; CMakeLists.txt builds it apart
// from the other CUDA sources): cuda_gemm.cu calls it on a device of compute capability 9.0 and otherwise keeps the
// mma.sync kernels.
#ifndef DS4_CUDA_GEMM_WGMMA_CUH
#define DS4_CUDA_GEMM_WGMMA_CUH

#include <cstddef>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

struct ds4d_wg_args {
    float *y;                     // y [M, N] (row stride ldy), group z at y + z·gy
    int64_t ldy, gy;
    const __nv_bfloat16 *xk;      // x [M, K] rounded to bf16 in k32 order (ds4_cuda_rows_to_bf16_k32): rows of ldxk =
    int64_t ldxk, gxk;            // K rounded up to 32 values, zeros past K; group z at xk + z·gxk
    const __nv_bfloat16 *W;       // W [N, K] bf16 as the model holds it (row stride ldw, 16-byte aligned rows), group
    int64_t ldw, gw;              // z at W + z·gw
    int64_t M, N, K;
    const int64_t *off;           // row groups: rows [off[e], off[e+1]) use W + e·wstride; NULL: plain
    int64_t E, wstride;
    int acc;                      // y += the sum (formed first, added once), not y =
    int64_t groups;               // batched products: groups of x, W and y (1: one product)
    int rows_fast;                // the blocks walk x's row tiles fastest (W larger than x), else W's column tiles
    const int64_t *koff;          // reduction groups (with groups = E, off NULL): product z reduces over the
                                  // koff[z+1] - koff[z] columns of x and W from ds4d_wg_kstart(koff, z), x and W each
                                  // one [rows, K] operand (gxk, gw unused) whose columns past a group's count up to
                                  // the next group's start are zeros; y of group z at y + z·gy. NULL: K columns from 0
    uint32_t *yk;                 // non-NULL (plain products, acc 0): y is not written; its values rounded to bf16 go
    int64_t ldyk;                 // to yk instead, in k32 order, as the next product's x (rows of ldyk = groups·N
                                  // values, a multiple of 32; group z's column n at z·gy + n, gy = N), and, y16
    uint16_t *y16;                // non-NULL, to y16 in y's layout (the tape's copy): what rows_to_bf16_k32 would make
};

// Where reduction group z starts in koff's operands: 64-aligned (a stage of 64 k from there never reaches the next
// group, whose start is more than its count past this one's), so that a group's last stage reads its own zeros.
__host__ __device__ __forceinline__ int64_t ds4d_wg_kstart(const int64_t *koff, int64_t z) {
    return (koff[z] + 64 * z + 63) / 64 * 64;
}

// A block's tile: 128 rows of W (output columns) by 128 rows of x.
constexpr int DS4_WG_TILE_N = 128, DS4_WG_TILE_M = 128;

// The dynamic shared memory a block takes. prepare: the driver's tensor-map encoder into *encode (kept by the caller,
// once per backend) and the kernel's shared memory limit raised on the current device.
size_t ds4_cuda_wgmma_smem(void);
cudaError_t ds4_cuda_wgmma_prepare(void **encode);
// Enqueue the product on `stream` as `blocks` blocks (one per SM at most: each loops over output tiles).
// cudaErrorInvalidValue where the operands cannot be described to the copy engine (nothing launched); otherwise the
// launch's error, if any, left set for the caller's check (cudaPeekAtLastError).
cudaError_t ds4_cuda_wgmma_launch(const ds4d_wg_args &a, int blocks, cudaStream_t stream, void *encode);

#endif
