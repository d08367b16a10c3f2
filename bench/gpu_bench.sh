#!/usr/bin/env bash
# gpu_bench.sh BUILD_DIR [LOG_DIR] [--quick] — ds4 (bench_gpu) and transformers (hf_generate.py) on the same config
# and GPU, in one run: decode / prefill / generate tokens/s at each batch, transformers' generate tokens/s, the ratios,
# and batch 1's fraction of the memory-bandwidth roofline. Ends with one line "bench: ..." (scripts/gpu.sh reads it).
set -uo pipefail
build=${1:?usage: gpu_bench.sh BUILD_DIR [LOG_DIR] [--quick]}
log=${2:-$build}
batches_ds4=1,8,64,256 batches_hf=1,8,64
if [ "${3:-}" = "--quick" ]; then batches_ds4=1,8 batches_hf=1; fi
mkdir -p "$log"
"$build/bench_gpu" --batches "$batches_ds4" --profile "$log/profile_b1.txt" >"$log/bench_ds4.txt" 2>&1 ||
    { echo "bench: ds4 FAILED: $(tail -n1 "$log/bench_ds4.txt")"; exit 1; }
cat "$log/bench_ds4.txt"
hf_ok=1
PYTHONUNBUFFERED=1 python3 bench/hf_generate.py --batches "$batches_hf" >"$log/bench_hf.txt" 2>&1 || hf_ok=0
cat "$log/bench_hf.txt" | grep -v "^hf " | tail -n 20
val() { grep "^$1 $2 " "$3" | tail -n1 | awk '{print $3}'; }
printf '\n%-6s %16s %16s %18s %10s\n' batch "ds4 decode" "ds4 generate" "transformers gen." ratio
summary=""
for b in ${batches_ds4//,/ }; do
    d=$(val ds4 "decode_b$b" "$log/bench_ds4.txt"); g=$(val ds4 "generate_b$b" "$log/bench_ds4.txt")
    h=$(val hf "generate_b$b" "$log/bench_hf.txt")
    r=""
    [ -n "$h" ] && [ -n "$g" ] && r=$(awk -v g="$g" -v h="$h" 'BEGIN{printf "%.1fx", g/h}')
    printf '%-6s %16s %16s %18s %10s\n' "$b" "${d:--}" "${g:--}" "${h:--}" "${r:--}"
    summary="$summary b$b ${g:-?} tok/s${r:+ ($r)}"
done
roof=$(val ds4 roofline_b1 "$log/bench_ds4.txt"); bw=$(val ds4 copy_GBps "$log/bench_ds4.txt")
pre=$(val ds4 prefill_8x512 "$log/bench_ds4.txt")
[ "$hf_ok" = 1 ] || summary="$summary (transformers FAILED: $(tail -n1 "$log/bench_hf.txt"))"
# one training step (bf16, batch 8 x 1024): ds4 against transformers + torch AdamW, eager (TRAIN_COMPILE=1: also
# torch.compile, whose compilation takes minutes)
train=""
if [ -x "$build/bench_train_gpu" ]; then
    "$build/bench_train_gpu" --profile "$log/profile_train.txt" >"$log/bench_train_ds4.txt" 2>&1 || echo "ds4 training bench FAILED: $(tail -n1 "$log/bench_train_ds4.txt")"
    PYTHONUNBUFFERED=1 python3 bench/hf_train.py >"$log/bench_train_hf.txt" 2>&1 || true
    [ "${TRAIN_COMPILE:-0}" = 1 ] && PYTHONUNBUFFERED=1 timeout 900 python3 bench/hf_train.py --compile \
        >"$log/bench_train_hf_compile.txt" 2>&1
    grep -h "^#" "$log/bench_train_ds4.txt" "$log/bench_train_hf.txt" "$log/bench_train_hf_compile.txt" 2>/dev/null
    dt=$(val ds4 train_tokens_per_s "$log/bench_train_ds4.txt"); ht=$(val hf train_tokens_per_s "$log/bench_train_hf.txt")
    ct=$(val hf_compile train_tokens_per_s "$log/bench_train_hf_compile.txt" 2>/dev/null)
    dm=$(val ds4 train_peak_gib "$log/bench_train_ds4.txt"); hm=$(val hf train_peak_gib "$log/bench_train_hf.txt")
    mfu=$(val ds4 train_mfu "$log/bench_train_ds4.txt")
    r=""; [ -n "$dt" ] && [ -n "$ht" ] && r=$(awk -v a="$dt" -v b="$ht" 'BEGIN{printf " (%.2fx)", a/b}')
    train="; train 8x1024 ds4 ${dt:-?} tok/s${r} ${dm:-?} GiB, MFU $(awk -v m="${mfu:-0}" 'BEGIN{printf "%.1f%%", 100*m}'), transformers eager ${ht:-?} tok/s ${hm:-?} GiB${ct:+, torch.compile $ct tok/s}"
fi
echo "bench: generate (64 new tokens, bf16) vs transformers eager:$summary; prefill 8x512 ${pre:-?} tok/s; b1 roofline $(awk -v r="${roof:-0}" 'BEGIN{printf "%.0f%%", 100*r}') of ${bw:-?} GB/s$train"
