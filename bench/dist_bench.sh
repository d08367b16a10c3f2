#!/usr/bin/env bash
# dist_bench.sh DS4 [RANKS...] [-- dist_train.lua options] — data-parallel training throughput on 1, 2 (, 4) ranks
# launched torchrun-style (plain processes with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; rank r
# on GPU r), one run after the other: bench/dist_train.lua's global tokens/s at each size and the scaling efficiency
# (tokens/s over N times one rank's). Ends with one line "dist bench: ..." (scripts/gpu.sh reads it). With
# `-- --ep 1` the runs of more than one rank add expert parallelism (DP×EP; the 1-rank run is the same either way),
# `-- --ep 2` with sharded experts (each GPU holds only its experts' state; every rank's state in MiB is printed).
#
#   bash bench/dist_bench.sh build-gpu/ds4 1 2                     # the 599M config, 8 x 1024 rows per rank, bf16
#   bash bench/dist_bench.sh build-gpu/ds4 1 2 4 -- --ep 1         # DP×EP: 32 experts, 8 on each of 4 GPUs
#   bash bench/dist_bench.sh build-gpu/ds4 1 2 4 -- --ep 2         # the same, each GPU holding only its 8 experts
#   bash bench/dist_bench.sh build-gpu/ds4 1 2 4 -- --zero 2       # ZeRO-1 with the reduce-scatter (--zero 1: all-reduce)
#   bash bench/dist_bench.sh build/ds4 1 2 -- --device cpu --dtype fp32 --config tests/fixtures/tiny_a/config.json
set -uo pipefail
DS4="${1:?usage: dist_bench.sh DS4 [RANKS...] [-- dist_train.lua options]}"
shift
here="$(cd "$(dirname "$0")/.." && pwd)"
ranks=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do ranks+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#ranks[@]} -gt 0 ] || ranks=(1 2)
# shellcheck source=tests/dist_launch.sh
. "$here/tests/dist_launch.sh"
log="$(mktemp -d "${TMPDIR:-/tmp}/ds4-dist-bench.XXXXXX")"
trap 'rm -rf "$log"' EXIT
export DS4_DIST_TIMEOUT="${DS4_DIST_TIMEOUT:-300}"
one="" line="" mode="data-parallel"
for n in "${ranks[@]}"; do
    if ! launch "$n" "$log/run$n" 900 "$DS4" run "$here/bench/dist_train.lua" "$@"; then
        echo "dist_bench: $n ranks failed (exit codes ${RCS[*]}):"
        tail -n 5 "$log/run$n".*
        line="$line; $n ranks FAILED"
        continue
    fi
    grep '^#' "$log/run$n.0"
    tps="$(sed -n 's/^dist tokens_per_s //p' "$log/run$n.0")"
    [ "$n" = 1 ] && one="$tps"
    if [ "$n" -gt 1 ]; then # the mode of the runs of several ranks (one rank runs neither EP nor ZeRO-1)
        mode="data-parallel"
        grep -q '^dist expert_parallel 1' "$log/run$n.0" && mode="data × expert parallel"
        grep -q '^dist expert_parallel 2' "$log/run$n.0" && mode="data × expert parallel, sharded experts"
        grep -q '^dist zero 1' "$log/run$n.0" && mode="$mode, ZeRO-1"
        grep -q '^dist zero 2' "$log/run$n.0" && mode="$mode, ZeRO-1 reduce-scatter"
    fi
    mib="$(sed -n 's/^dist state_mib //p' "$log/run$n.0")"
    [ "$n" -gt 1 ] && sed -n 's/^dist state_mib_rank \([0-9]*\) \(.*\)/  rank \1: \2 MiB of training state on its device/p' "$log/run$n.0"
    eff=""
    [ -n "$one" ] && [ -n "$tps" ] && eff="$(awk -v t="$tps" -v o="$one" -v n="$n" 'BEGIN{printf " (%.0f%% of %d x 1 rank)", 100*t/(n*o), n}')"
    per="$(awk -v t="$tps" -v n="$n" 'BEGIN { if (t != "" && n > 1) printf ", %.0f per rank", t / n }')"
    line="$line; $n rank$([ "$n" = 1 ] || echo s) ${tps:-?} tok/s$per$eff${mib:+, ${mib} MiB of state per rank}"
done
echo "dist bench: $mode training, global tokens/s${line}"
