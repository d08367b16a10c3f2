#!/usr/bin/env bash
# test_resume_cuda.sh — exact resume on the GPU: tests/test_resume.sh (12 updates in one process == 5 updates, a
# checkpoint, a NEW process and 7 more; losses, weights and AdamW moments bit-identical) with the model on CUDA
# device 0, in bf16 (fp32 master weights, gradients and moments on the device; the checkpoint holds the master)
# and in fp32, and a LoRA run in bf16. Skipped (exit 77) where ds4 sees no CUDA device: CI; scripts/gpu.sh runs it
# on a GPU machine.
#   bash tests/test_resume_cuda.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
probe="$(mktemp "${TMPDIR:-/tmp}/ds4-cudaprobe.XXXXXX.lua")"
trap 'rm -f "$probe"' EXIT
echo 'print(require("ds4").cuda_devices())' >"$probe"
n="$("$DS4" run "$probe" 2>/dev/null || echo 0)"
if [ "${n:-0}" -lt 1 ]; then
    echo "no CUDA device: skipped"
    exit 77
fi
for dtype in bf16 fp32; do
    bash "$here/test_resume.sh" "$@" --device cuda --dtype "$dtype" | grep -v 'passed, 0 failed'
done
# LoRA on the device: the adapters, their gradients and moments live there; the checkpoint brings them home
bash "$here/test_resume.sh" "$@" --device cuda --dtype bf16 --lora 4 | grep -v 'passed, 0 failed'
echo "3 passed, 0 failed"
