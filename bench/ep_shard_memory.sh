#!/usr/bin/env bash
# ep_shard_memory.sh DS4 [CONFIG] — per-rank memory of expert parallelism with replicated and with sharded experts
# on 1, 2 and 4 CPU ranks (mpirun): a random model of CONFIG (default bench/config_moe_32e.json: tiny_a with 32
# experts of width 256 on a hidden size of 128) is saved once, then bench/ep_shard_memory.lua loads it in each mode and
# takes one training step; it prints each rank's line. Measures and prints; never passes or fails.
#   bash bench/ep_shard_memory.sh build/ds4
set -uo pipefail
DS4="${1:?usage: ep_shard_memory.sh DS4 [CONFIG]}"
here="$(cd "$(dirname "$0")/.." && pwd)"
CONFIG="${2:-$here/bench/config_moe_32e.json}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp="$(mktemp -d "${TMPDIR:-/tmp}/ds4-ep-shard-memory.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
printf 'require("ds4").random_model(arg[1], 1):save(arg[2])\n' >"$tmp/make.lua"
"$DS4" run "$tmp/make.lua" "$CONFIG" "$tmp/model" || exit 1
for mode in replicated sharded; do
    for np in 1 2 4; do
        mpirun -np "$np" --oversubscribe "$DS4" run "$here/bench/ep_shard_memory.lua" "$tmp/model" "$mode" 2>&1 |
            grep '^ep_shard_memory:' | sort -t' ' -k5n
    done
done
