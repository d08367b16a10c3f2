#!/usr/bin/env bash
# test_dist_nccl.sh DS4 FIXTURES SOURCE — the NCCL communicator on GPUs (docs/distributed.md). Skips (77) without
# NCCL in the build or without a GPU (CI); scripts/gpu.sh runs it on a GPU machine.
#
#   1 GPU: test_dist_nccl (device all_reduce / all_gather / broadcast against closed forms, all_reduce_grads of a
#          CUDA model) as a world of one; data parallelism by hand (tests/lua/dist_data_parallel.lua), expert
#          parallelism (tests/lua/dist_expert_parallel.lua: rows through NCCL send / recv; dist_expert_shard.lua:
#          sharded experts on the GPU against replicated ones) and context parallelism
#          (tests/lua/dist_context_parallel.lua, fp32 and bf16, split by query and whole: attention rows and the key
#          gradients' parts through NCCL all-gathers) on the GPU;
#          context parallelism of a GPU model refused without NCCL.
#   2 GPUs or more, for 2 ranks (and 4 with 4 GPUs): the same, launched torchrun-style (plain processes, the TCP
#          rendezvous hands out the NCCL id) and, when mpirun and MPI are there, under mpirun; the data-parallel run
#          compares 2 ranks' NCCL all-reduced gradients and weights with one copy on the whole batch, the bucketed
#          all-reduce (tests/lua/dist_buckets.lua: NCCL on its stream after events on the model's, while the backward
#          runs) and ZeRO-1's reduce-scatter (ncclReduce per region) against the unbucketed all-reduce, the
#          expert-parallel run its logits, expert gradients and loads (bitwise) and the rest, the sharded experts
#          (each GPU holding only its experts' working copy, gradients, master and moments) against replicated expert
#          parallelism on the GPUs, every step (fp32 and bf16), with each rank's device memory printed
#          ("dist_expert_shard memory:" lines), the context-parallel run (fp32 and bf16, split by query and whole;
#          fp32 split under mpirun) each rank's slice of two sequences against the whole on one GPU; then a rank
#          killed (SIGKILL) or hung after the first all-reduce: the survivor's NCCL all-reduce must fail, naming NCCL,
#          within DS4_DIST_TIMEOUT (20 s here) plus a margin — not hang; examples/sft.lua on 2 GPUs against one GPU of
#          2 micro-batches (bitwise, fp32 and bf16), with and without --zero; on 1 GPU, test_grad_accum.lua on the
#          CUDA backend.
#   ZeRO-1 on 2 GPUs (tests/lua/dist_zero.lua, DS4_TEST_DEVICE=cuda): the sharded device optimizer (its shard's moments
#          and fp32 master weights on the GPU, the updated working copy's regions gathered through NCCL, the master's
#          gathered from their owners when read back) against the unsharded one after every step (weights, gradient
#          norm, gathered moments: bitwise), each rank's training-state bytes on its GPU printed ("dist_zero memory:"
#          lines: the moments and the master half of the unsharded ones), and its checkpoint resumed on 1 GPU and on
#          2, each equal to one uninterrupted process, bitwise; the same 2-rank run with bf16 working copies. Then
#          a read-back of the sharded master on rank 0 alone (tests/lua/dist_zero_alone.lua: model:params(),
#          opt:state(), a save; torchrun-style, and model:params() under mpirun) while rank 1 sleeps past the timeout:
#          rank 0 must exit non-zero within DS4_DIST_TIMEOUT (15 s there) plus 15 s, its error naming the read-back.
set -uo pipefail
DS4="$1"; FIX="$2"; SRC="$3"
T="$SRC/tests/lua"
BIN="$(dirname "$DS4")"
# shellcheck source=tests/dist_launch.sh
. "$SRC/tests/dist_launch.sh"

have="$(echo 'io.write(tostring(require("ds4").dist.have_nccl))' | "$DS4" run - 2>&1)" || true
if [ "$have" != "true" ]; then
    echo "SKIP: this ds4 was built without NCCL (ds4.dist.have_nccl = $have)"
    exit 77
fi
ngpu="$(echo 'io.write(require("ds4").cuda_devices())' | "$DS4" run - 2>/dev/null)" || ngpu=0
if [ "${ngpu:-0}" -lt 1 ]; then
    echo "SKIP: no CUDA device"
    exit 77
fi
[ -x "$BIN/test_dist_nccl" ] || { echo "FAIL: $BIN/test_dist_nccl not built"; exit 1; }

fail=0
bad() { echo "FAIL: $*"; fail=1; }
LOG="$(mktemp -d "${TMPDIR:-/tmp}/ds4-dist-nccl.XXXXXX")"
ZCK="$LOG.zero" # ZeRO-1's checkpoint (beside the logs, which show() prints)
trap 'rm -rf "$LOG" "$ZCK"' EXIT
show() { for f in "$LOG"/*; do echo "--- $f"; tail -n 20 "$f"; done; }
export DS4_DIST_TIMEOUT=120
# (NCCL_DEBUG=WARN, the default, prints NCCL's own warnings, which go into the logs shown on failure)

# rank r's log says "<what> rank r of np: N ... 0 failures/failed"
all_passed() {
    local np="$1" what="$2" prefix="$3" r
    for ((r = 0; r < np; r++)); do
        grep -q "$what rank $r of $np: [0-9]* \(checks, 0 failures\|passed, 0 failed\)" "$prefix.$r" || return 1
    done
}

# ---- one GPU: a world of one
"$BIN/test_dist_nccl" "$FIX" >"$LOG/one.0" 2>&1
grep 'all_reduce_grads' "$LOG/one.0"
all_passed 1 test_dist_nccl "$LOG/one" || { show; bad "test_dist_nccl, 1 rank"; }
for t in dist_data_parallel dist_buckets dist_expert_parallel dist_expert_shard; do
    DS4_TEST_DEVICE=cuda "$DS4" run "$T/$t.lua" "$FIX" >"$LOG/one.0" 2>&1
    grep "$t:" "$LOG/one.0"
    all_passed 1 "$t" "$LOG/one" || { show; bad "$t on cuda, 1 rank"; }
done
# context parallelism on the GPU (a world of one: the attention rows and the key gradients' parts through NCCL all
# the same), fp32 and bf16, split by query and with whole-sequence attention
for dt in fp32 bf16; do
    for mode in "" whole; do
        DS4_TEST_DEVICE=cuda DS4_TEST_DTYPE=$dt "$DS4" run "$T/dist_context_parallel.lua" "$FIX" $mode >"$LOG/one.0" 2>&1
        grep "dist_context_parallel:" "$LOG/one.0"
        all_passed 1 dist_context_parallel "$LOG/one" ||
            { show; bad "dist_context_parallel on cuda ($dt${mode:+, $mode}), 1 rank"; }
    done
done
# a GPU model's context parallelism without NCCL in the communicator is refused, saying how to get it
cat >"$LOG/cp_refused.lua" <<'LUA'
local ds4 = require("ds4")
ds4.dist.init()
local m = ds4.load(arg[1] .. "/tiny_a", { device = "cuda", dtype = "fp32" })
local ok, e = pcall(ds4.dist.context_parallel, m)
assert(not ok and tostring(e):find("gathers its attention rows through NCCL", 1, true), tostring(e))
ds4.dist.finalize()
print("context parallelism of a GPU model without NCCL: refused, 0 failures")
LUA
"$DS4" run "$LOG/cp_refused.lua" "$FIX" >"$LOG/one.0" 2>&1
grep -q "without NCCL: refused, 0 failures" "$LOG/one.0" || { show; bad "context parallelism refused without NCCL"; }
# a backward adds its gradient once on the GPU too: accumulated = apart and summed, bit for bit
DS4_TEST_DEVICE=cuda "$DS4" run "$T/test_grad_accum.lua" "$FIX" >"$LOG/one.0" 2>&1
grep -q "test_grad_accum.lua: [0-9]* checks, 0 failures" "$LOG/one.0" || { show; bad "gradient accumulation on cuda"; }
rm -f "$LOG"/one.*

if [ "$ngpu" -lt 2 ]; then
    echo "note: $ngpu GPU: the multi-rank part needs 2 (it ran nothing more)"
    exit "$fail"
fi
sizes="2"
[ "$ngpu" -ge 4 ] && sizes="2 4"
have_mpi=0
if command -v mpirun >/dev/null 2>&1 &&
    [ "$(echo 'io.write(tostring(require("ds4").dist.have_mpi))' | "$DS4" run - 2>&1)" = true ]; then
    have_mpi=1
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
else
    echo "note: no mpirun or no MPI in this build: the mpirun launches are not run (torchrun-style ones are)"
fi
mpi_ranks() { # NP CMD...: under mpirun, rank r's output in $LOG/run.r
    local np="$1"
    shift
    timeout -k 5 300 mpirun -np "$np" -x DS4_DIST_TIMEOUT -x DS4_TEST_DEVICE \
        bash -c 'exec "$@" >"'"$LOG"'/run.$OMPI_COMM_WORLD_RANK" 2>&1' rank "$@" >"$LOG/mpi" 2>&1
}

for np in $sizes; do
    launch "$np" "$LOG/run" 300 "$BIN/test_dist_nccl" "$FIX"
    grep 'all_reduce_grads' "$LOG/run.0"
    all_passed "$np" test_dist_nccl "$LOG/run" || { show; bad "test_dist_nccl, $np ranks, torchrun-style (exit ${RCS[*]})"; }
    for t in dist_data_parallel dist_buckets dist_expert_parallel dist_expert_shard; do
        EXTRA_ENV="DS4_TEST_DEVICE=cuda" launch "$np" "$LOG/run" 300 "$DS4" run "$T/$t.lua" "$FIX"
        grep -h "$t\( memory\)\?:" "$LOG"/run.*
        all_passed "$np" "$t" "$LOG/run" || { show; bad "$t on cuda, $np ranks, torchrun-style (exit ${RCS[*]})"; }
    done
    # context parallelism: each rank's slice of the sequences on its GPU, the attention rows gathered through NCCL,
    # against the same GPU's kernels on the whole sequences; split by query (each rank's queries, the key gradients'
    # parts summed through NCCL: losses and log-probabilities bitwise, gradients within 1e-5, bf16 2^-8) and whole
    # (fp32: bitwise but the per-token weights' gradients; bf16: the losses and log-probabilities bitwise, the
    # gradients within bf16's unit roundoff)
    for dt in fp32 bf16; do
        for mode in "" whole; do
            EXTRA_ENV="DS4_TEST_DEVICE=cuda DS4_TEST_DTYPE=$dt" launch "$np" "$LOG/run" 300 "$DS4" run \
                "$T/dist_context_parallel.lua" "$FIX" $mode
            grep "dist_context_parallel:" "$LOG/run.0"
            all_passed "$np" dist_context_parallel "$LOG/run" ||
                { show; bad "dist_context_parallel on cuda ($dt${mode:+, $mode}), $np ranks, torchrun-style (exit ${RCS[*]})"; }
        done
    done
    # LoRA: the adapters' gradient buffer, on the device, all-reduced through NCCL
    EXTRA_ENV="DS4_TEST_DEVICE=cuda" launch "$np" "$LOG/run" 300 "$DS4" run "$T/dist_data_parallel_lora.lua" "$FIX" lora
    grep 'dist_data_parallel (LoRA):' "$LOG/run.0"
    all_passed "$np" dist_data_parallel "$LOG/run" ||
        { show; bad "LoRA data parallel on cuda, $np ranks, torchrun-style (exit ${RCS[*]})"; }
    if [ "$have_mpi" -eq 1 ]; then
        mpi_ranks "$np" "$BIN/test_dist_nccl" "$FIX"
        all_passed "$np" test_dist_nccl "$LOG/run" || { show; bad "test_dist_nccl, $np ranks, mpirun"; }
        for t in dist_data_parallel dist_buckets dist_expert_parallel dist_expert_shard dist_context_parallel; do
            DS4_TEST_DEVICE=cuda mpi_ranks "$np" "$DS4" run "$T/$t.lua" "$FIX"
            grep "$t:" "$LOG/run.0"
            all_passed "$np" "$t" "$LOG/run" || { show; bad "$t on cuda, $np ranks, mpirun"; }
        done
    fi
done
rm -f "$LOG"/run.* "$LOG/mpi"

# ZeRO-1 on 2 GPU ranks (torchrun-style): sharded = unsharded after every step; a checkpoint after 2 steps resumed on
# 1 GPU (a world of one) and on 2, each ending with the weights of one uninterrupted process (bitwise: 2 ranks' NCCL
# sums are one addition per element)
Z=(env DS4_TEST_DEVICE=cuda "$DS4" run "$T/dist_zero.lua" "$FIX")
launch 2 "$LOG/run" 300 "${Z[@]}" save "$ZCK" 2
grep -h "dist_zero \(save\|memory\):\|dist_zero rank [01] of 2:" "$LOG"/run.0 "$LOG"/run.1
all_passed 2 dist_zero "$LOG/run" || { show; bad "ZeRO-1 on cuda, 2 ranks, torchrun-style (exit ${RCS[*]})"; }
"${Z[@]}" resume "$ZCK" 2 >"$LOG/one.0" 2>&1
grep -h "dist_zero resume:" "$LOG/one.0"
all_passed 1 dist_zero "$LOG/one" || { show; bad "ZeRO-1 on cuda: the 2-rank checkpoint resumed on 1 GPU"; }
launch 2 "$LOG/run" 300 "${Z[@]}" resume "$ZCK" 2
grep -h "dist_zero resume:" "$LOG/run.0"
all_passed 2 dist_zero "$LOG/run" || { show; bad "ZeRO-1 on cuda: the 2-rank checkpoint resumed on 2 GPUs (exit ${RCS[*]})"; }
rm -f "$LOG"/run.* "$LOG"/one.*
# bf16 working copies: each rank casts its region of the fp32 master to bf16 and the gather moves those 2-byte values
rm -rf "$ZCK"
launch 2 "$LOG/run" 300 env DS4_TEST_DTYPE=bf16 "${Z[@]}" save "$ZCK" 2
grep -h "dist_zero \(save\|memory\):\|dist_zero rank [01] of 2:" "$LOG"/run.0 "$LOG"/run.1
all_passed 2 dist_zero "$LOG/run" || { show; bad "ZeRO-1 on cuda in bf16, 2 ranks, torchrun-style (exit ${RCS[*]})"; }
rm -f "$LOG"/run.*
# A read-back of the sharded master is a collective: rank 0 reading it back alone (rank 1 asleep for 45 s, never
# joining) must fail within the timeout (15 s) plus a margin of 15 s, saying which read-back failed, not hang. Rank
# 0's line "dist_zero_alone: rank 0's WHAT alone (...) failed after N s: <the error>" gives the time and the message.
alone_ok() { # WHAT HOW RC: rank 0's exit RC (non-zero, not the bound's 124), its time and its message
    local line s
    line="$(grep -h "dist_zero_alone: rank 0's" "$LOG/run.0" | head -n1)"
    s="$(echo "$line" | sed -n 's/.* failed after \([0-9]*\) s: .*/\1/p')"
    if [ "$3" -ne 0 ] && [ "$3" -ne 124 ] && [ -n "$s" ] && [ "$s" -le 30 ] &&
        echo "$line" | grep -q "reading the sharded master weights back (ZeRO-1"; then
        echo "ZeRO-1 read-back alone ($1, 2 GPUs, $2): rank 0 exit $3 after $s s:" \
            "$(echo "$line" | sed 's/^.* failed after [0-9]* s: //' | cut -c1-240)"
    else
        show; bad "ZeRO-1 read-back alone ($1, 2 GPUs, $2): rank 0 exit $3 (want non-zero, not 124): ${line:-no line}"
    fi
}
for what in params state save; do
    rm -rf "$ZCK"
    EXTRA_ENV="DS4_DIST_TIMEOUT=15 DS4_TEST_HANG_S=45" launch 2 "$LOG/run" 120 "$DS4" run "$T/dist_zero_alone.lua" \
        "$FIX" "$what" "$ZCK"
    alone_ok "$what" torchrun-style "${RCS[0]}"
done
if [ "$have_mpi" -eq 1 ]; then # MPI's collectives have the same deadline (dist/mpi_backend.c)
    rc=0
    DS4_DIST_TIMEOUT=15 DS4_TEST_HANG_S=45 mpi_ranks 2 "$DS4" run "$T/dist_zero_alone.lua" "$FIX" params || rc=$?
    alone_ok params mpirun "$rc"
fi
rm -rf "$LOG"/run.* "$ZCK"

# examples/sft.lua data parallel on 2 GPUs (torchrun-style; each rank on its GPU, gradients through NCCL) against one
# GPU with 2 micro-batches: the same weights and metrics, bit for bit (with 2 ranks NCCL's sum is one addition per
# element), in fp32 and bf16 (tests/lua/dist_compare_runs.lua)
for dt in fp32 bf16; do
    SFT=("$SRC/examples/sft.lua" --steps 6 --batch 8 --device cuda --dtype "$dt" --quiet)
    "$DS4" run "${SFT[@]}" --micro-batches 2 --out "$LOG/sft1_$dt" >"$LOG/sft1.log" 2>&1 || { tail -20 "$LOG/sft1.log"; bad "sft on 1 GPU ($dt)"; }
    launch 2 "$LOG/sft2" 300 "$DS4" run "${SFT[@]}" --out "$LOG/sft2_$dt" || { show; bad "sft on 2 GPUs ($dt) (exit ${RCS[*]})"; }
    if "$DS4" run "$T/dist_compare_runs.lua" "$LOG/sft1_$dt" "$LOG/sft2_$dt" >"$LOG/cmp" 2>&1; then
        echo "sft, 2 GPUs = 1 GPU of 2 micro-batches ($dt): $(grep 'dist_compare_runs:' "$LOG/cmp" | head -1)"
    else
        cat "$LOG/cmp"; bad "sft, 2 GPUs vs 1 GPU of 2 micro-batches ($dt)"
    fi
    # --zero: each GPU keeps its shard of the moments; the working copy is cast from the gathered master
    launch 2 "$LOG/sftz" 300 "$DS4" run "${SFT[@]}" --zero --out "$LOG/sftz_$dt" || { show; bad "sft --zero on 2 GPUs ($dt) (exit ${RCS[*]})"; }
    if "$DS4" run "$T/dist_compare_runs.lua" "$LOG/sft1_$dt" "$LOG/sftz_$dt" >"$LOG/cmp" 2>&1; then
        echo "sft --zero, 2 GPUs = 1 GPU of 2 micro-batches ($dt): $(grep 'dist_compare_runs:' "$LOG/cmp" | head -1)"
    else
        cat "$LOG/cmp"; bad "sft --zero, 2 GPUs vs 1 GPU of 2 micro-batches ($dt)"
    fi
done
rm -rf "$LOG"/sft* "$LOG/cmp"

# A rank killed or hung after the first NCCL all-reduce: the survivor's next all-reduce must fail within the
# timeout (NCCL's own error, or the watchdog's abort), naming NCCL; the bound is the timeout plus 40 s of margin.
export DS4_DIST_TIMEOUT=20 DS4_TEST_HANG_S=25
for mode in kill hang; do
    EXTRA_ENV="DS4_TEST_DEVICE=cuda" launch 2 "$LOG/run" 120 "$DS4" run "$T/dist_rank_dies.lua" "$mode" "$FIX"
    if [ "${RCS[0]}" -ne 0 ] && [ "${RCS[0]}" -ne 124 ] && grep -q "(NCCL)" "$LOG/run.0"; then
        echo "rank dies ($mode, 2 GPUs): rank 0 failed with exit ${RCS[0]}: $(grep -o 'dist [a-z_]* (NCCL): .*' "$LOG/run.0" | head -n1 | cut -c1-200)"
    else
        show; bad "rank dies ($mode, 2 GPUs): rank 0 exit ${RCS[0]} (want non-zero, not the bound's 124) and an NCCL error"
    fi
    t="$(grep -o 'not complete after [0-9]* s' "$LOG/run.0" || true)"
    [ -z "$t" ] || echo "  (the watchdog: $t)"
    echo "  all ranks done in $ELAPSED s"
done
exit "$fail"
