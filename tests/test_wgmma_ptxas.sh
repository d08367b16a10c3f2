#!/usr/bin/env bash
# test_wgmma_ptxas.sh DS4 FIXTURES SRC_DIR — the wgmma GEMM as ptxas compiles it (sm_90a; no GPU needed; nvcc from
# $NVCC, else the PATH, else /usr/local/cuda/bin: the compiler the build found). Its speed rests on
# two things ptxas decides, which a change to the kernel can silently undo:
#   - no wait that ptxas injects for registers the products still read or write (its info C7517 "warpgroup.wait is
#     injected" or C7520 "wgmma ... serialized"): one such wait in the stage loop stops each warpgroup's tensor work
#     at every stage (it did until the stages' fragments alternated between two register sets: bench/RESULTS.md,
#     sessions 11 and 12);
#   - no spills in the forward's variants (neither reduction groups nor adding into y; y written in fp32, or rounded
#     to bf16 for the next product: ops.h's y16_only).
# Exit 77 (skipped) without nvcc.
set -uo pipefail
SRC="${3:?usage: test_wgmma_ptxas.sh DS4 FIXTURES SRC_DIR}"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { echo "test_wgmma_ptxas: no nvcc: skipped"; exit 77; }
tmp="$(mktemp -d "${TMPDIR:-/tmp}/ds4-ptxas.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
if ! "$NVCC" -O3 -DNDEBUG -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$SRC/cuda" -I"$SRC/core" \
    -I"$SRC/core/include" -Xptxas -v -cubin "$SRC/cuda/cuda_gemm_wgmma.cu" -o "$tmp/k.cubin" >"$tmp/log" 2>&1; then
    echo "test_wgmma_ptxas: FAIL: nvcc failed:"; tail -n 20 "$tmp/log"; exit 1
fi
fail=0
if grep -E "C7517|C7520" "$tmp/log"; then
    echo "test_wgmma_ptxas: FAIL: ptxas injected waits into the wgmma products (lines above)"; fail=1
fi
# ptxas prints "Compiling entry function 'NAME'", then its "Function properties" with the spill counts; the template
# arguments KOFF, ACC, OUT16 mangle as ILb0ELb0ELb0E (false, false, false)
for v in ILb0ELb0ELb0E ILb0ELb0ELb1E; do
    spill="$(awk -v v="$v" '/Compiling entry function/ { f = $0 } /spill stores/ && index(f, "gemm_wgmma_kernel" v) { print; exit }' \
        "$tmp/log")"
    case "$spill" in
        *" 0 bytes spill stores, 0 bytes spill loads"*) ;;
        *) echo "test_wgmma_ptxas: FAIL: the forward's variant $v spills: ${spill:-(no ptxas line found)}"; fail=1 ;;
    esac
done
[ "$fail" = 0 ] && echo "test_wgmma_ptxas: no injected waits, the forward's variants without spills"
exit "$fail"
