#!/usr/bin/env bash
# cp_memory.sh DS4 [DIR [B [S]]] — per-rank memory and step time of context parallelism on 1, 2 and 4 ranks,
# attention split by query and whole on every rank: bench/cp_memory.lua takes one training step of DIR (default
# tests/fixtures/tiny_a; a config .json: a random model of it) on B sequences of S tokens (default 1 x 2048); one rank
# is the one-process figure. Measures and prints; never passes or fails.
#   bash bench/cp_memory.sh build/ds4                         # CPU ranks under mpirun, THREADS threads each (1)
#   CP_DEVICE=cuda bash bench/cp_memory.sh build-gpu/ds4 bench/config_599m.json 1 16384
#                                                             # rank r on GPU r, launched torchrun-style (NCCL);
#                                                             # CP_DTYPE bf16 (default) or fp32; CP_RANKS "1 2 4"
set -uo pipefail
DS4="${1:?usage: cp_memory.sh DS4 [DIR [B [S]]]}"
here="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${2:-$here/tests/fixtures/tiny_a}" B="${3:-1}" S="${4:-2048}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ "${CP_DEVICE:-cpu}" = cuda ]; then
    # shellcheck source=tests/dist_launch.sh
    . "$here/tests/dist_launch.sh"
    log="$(mktemp -d "${TMPDIR:-/tmp}/ds4-cp-memory.XXXXXX")"
    trap 'rm -rf "$log"' EXIT
fi
run() { # np mode
    if [ "${CP_DEVICE:-cpu}" = cuda ]; then
        EXTRA_ENV="CP_DEVICE=cuda CP_DTYPE=${CP_DTYPE:-bf16}" launch "$1" "$log/run" 600 "$DS4" run \
            "$here/bench/cp_memory.lua" "$DIR" "$B" "$S" "$2" ||
            { echo "cp_memory: $1 ranks ($2) failed (exit codes ${RCS[*]}):"; tail -n 5 "$log"/run.*; }
        cat "$log"/run.* | grep '^cp_memory:' | sort -t' ' -k3n
        return
    fi
    DS4_THREADS="${THREADS:-1}" mpirun -np "$1" --oversubscribe -x DS4_THREADS "$DS4" run "$here/bench/cp_memory.lua" \
        "$DIR" "$B" "$S" "$2" 2>&1 | grep '^cp_memory:' | sort -t' ' -k3n
}
for np in ${CP_RANKS:-1 2 4}; do
    if [ "$np" = 1 ]; then
        run 1 query
    else
        for mode in query whole; do run "$np" "$mode"; done
    fi
done
