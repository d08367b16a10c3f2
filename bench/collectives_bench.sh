#!/usr/bin/env bash
# collectives_bench.sh BUILD_DIR [--cpu] [RANKS...] — the bandwidth of ds4's communicator against NCCL's own at the same
# message sizes: BUILD_DIR/bench_collectives (ds4_comm_device_all_reduce_sum / _all_to_all_v) and
# bench/nccl_torch_bw.py (torch.distributed's NCCL), each launched torchrun-style (plain processes with RANK /
# WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; rank r on GPU r), one after the other, for each rank count
# (default 2, and 4 with 4 GPUs). Prints both tables, then the bus bandwidths side by side, and ends with one line
# "coll bench: ..." (scripts/gpu.sh reads it): the busbw of both at 256 MiB.
#
# Without 2 GPUs, without NCCL in the build, or with --cpu: CPU ranks (default 2) through ds4's host collectives
# (the TCP star of a torchrun-style launch), at 64 KiB ... 16 MiB and a few iterations (about a second); torch/NCCL
# is not run there. bench_collectives checks every size's result against a closed form and fails (exit 1) on a wrong
# value, so a failure here is a wrong result, not a slow one.
#
#   bash bench/collectives_bench.sh build-gpu              # 2 (and 4) GPUs
#   bash bench/collectives_bench.sh build --cpu 2 4        # CPU ranks
# Environment: COLL_ARGS (more options for both programs, e.g. "--iters 50"), PYTHON (default python3).
set -uo pipefail
B="${1:?usage: collectives_bench.sh BUILD_DIR [--cpu] [RANKS...]}"
shift
here="$(cd "$(dirname "$0")/.." && pwd)"
cpu=0
[ "${1:-}" = "--cpu" ] && { cpu=1; shift; }
ranks=("$@")
[ -x "$B/bench_collectives" ] || { echo "collectives_bench: $B/bench_collectives not built"; echo "coll bench: FAILED (not built)"; exit 1; }
# shellcheck source=tests/dist_launch.sh
. "$here/tests/dist_launch.sh"
log="$(mktemp -d "${TMPDIR:-/tmp}/ds4-coll-bench.XXXXXX")"
trap 'rm -rf "$log"' EXIT
export DS4_DIST_TIMEOUT="${DS4_DIST_TIMEOUT:-120}"

ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" || ngpu=0
have_nccl=0 # one rank on one GPU, 4 KiB: exit 77 when the build has no NCCL
if [ "$cpu" = 0 ] && [ "$ngpu" -ge 2 ]; then
    env -u WORLD_SIZE -u RANK "$B/bench_collectives" --device cuda --sizes 4K --iters 1 --warmup 0 >"$log/probe" 2>&1
    [ $? -ne 77 ] && have_nccl=1
fi
if [ "$have_nccl" = 1 ]; then
    device=cuda
    [ ${#ranks[@]} -gt 0 ] || { ranks=(2); [ "$ngpu" -ge 4 ] && ranks+=(4); }
    opts=(--device cuda --sizes "1M,4M,16M,64M,256M,1G")
    ref=268435456 # the size of the summary line: 256 MiB
else
    device=cpu
    why="no 2 GPUs"
    [ "$cpu" = 1 ] && why="--cpu"
    [ "$cpu" = 0 ] && [ "$ngpu" -ge 2 ] && why="no NCCL in this build"
    echo "collectives_bench: CPU ranks through the host collectives ($why); torch/NCCL not run"
    [ ${#ranks[@]} -gt 0 ] || ranks=(2)
    opts=(--device cpu --sizes "64K,1M,16M" --iters 5 --warmup 1)
    ref=16777216
fi
# shellcheck disable=SC2206
extra=(${COLL_ARGS:-})

# busbw of OP at SIZE in a file of "coll OP SIZE BYTES TIME_US ALGBW BUSBW" lines
busbw() { awk -v op="$2" -v s="$3" '$1 == "coll" && $2 == op && $3 == s { print $7 }' "$1"; }

# " (95%)": ds4's busbw as a share of NCCL's, when both are there
pct() { awk -v d="$1" -v t="$2" 'BEGIN { if (d != "" && t > 0) printf " (%.0f%%)", 100 * d / t }'; }

line="" fail=0
for n in "${ranks[@]}"; do
    if [ "$device" = cuda ] && [ "$n" -gt "$ngpu" ]; then
        echo "collectives_bench: $n ranks need $n GPUs ($ngpu here): not run"
        continue
    fi
    ds4="$log/ds4.$n" torch="$log/torch.$n"
    if launch "$n" "$log/ds4run$n" 600 "$B/bench_collectives" "${opts[@]}" "${extra[@]}"; then
        cp "$log/ds4run$n.0" "$ds4"
        grep -v '^coll ' "$ds4"
    else
        echo "collectives_bench: ds4, $n ranks, failed (exit codes ${RCS[*]}):"
        tail -n 5 "$log/ds4run$n".*
        line="$line; $n ranks: ds4 FAILED"
        fail=1
        continue
    fi
    : >"$torch"
    if [ "$device" = cuda ]; then
        if launch "$n" "$log/torchrun$n" 600 "${PYTHON:-python3}" "$here/bench/nccl_torch_bw.py" "${opts[@]:2}" "${extra[@]}"; then
            cp "$log/torchrun$n.0" "$torch"
            grep -v '^coll ' "$torch"
        else
            echo "collectives_bench: torch/NCCL, $n ranks, failed (exit codes ${RCS[*]}):"
            tail -n 5 "$log/torchrun$n".*
        fi
        # side by side: busbw in GB/s, and ds4's share of NCCL's
        echo "# $n ranks, busbw GB/s: ds4 | torch/NCCL | ds4 / NCCL"
        printf '# %12s  %-32s  %-32s\n' "size(B)" "all_reduce" "all_to_all"
        # shellcheck disable=SC2013
        for s in $(awk '$1 == "coll" && $2 ~ /^all_/ { print $3 }' "$ds4" | sort -un); do
            row=""
            for op in all_reduce all_to_all; do
                d="$(busbw "$ds4" $op "$s")" t="$(busbw "$torch" $op "$s")"
                row="$row$(awk -v d="${d:--}" -v t="${t:--}" 'BEGIN {
                    r = (d != "-" && t != "-" && t > 0) ? sprintf("%.0f%%", 100 * d / t) : "-"
                    printf "  %-10s %-10s %-10s", d, t, r }')"
            done
            printf '  %12s%s\n' "$s" "$row"
        done
    fi
    ar="$(busbw "$ds4" all_reduce $ref)" aa="$(busbw "$ds4" all_to_all $ref)"
    if [ "$device" = cuda ]; then
        tar="$(busbw "$torch" all_reduce $ref)" taa="$(busbw "$torch" all_to_all $ref)"
        line="$line; $n ranks: all-reduce ds4 ${ar:-?} vs ${tar:-?} GB/s$(pct "$ar" "$tar"), all-to-all ds4 ${aa:-?} vs ${taa:-?} GB/s$(pct "$aa" "$taa")"
        ! grep -q SKIP "$torch" || line="$line (torch/NCCL $(grep -o 'SKIP.*' "$torch" | head -n1))"
    else
        line="$line; $n ranks: all-reduce ${ar:-?} GB/s, all-to-all ${aa:-?} GB/s"
    fi
done
if [ "$device" = cuda ]; then
    echo "coll bench: busbw at $((ref >> 20)) MiB, ds4 vs torch/NCCL${line}"
else
    echo "coll bench: CPU ranks, host collectives ($(awk '$1 == "coll" && $2 == "backend" { print $3; exit }' "$log"/ds4.* 2>/dev/null)), busbw at $((ref >> 20)) MiB${line}"
fi
exit "$fail"
