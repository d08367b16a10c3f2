#!/usr/bin/env bash
# cp_memory.sh DS4 [DIR [B [S]]] — per-rank memory and step time of context parallelism on 1, 2 and 4 CPU ranks
# (mpirun), attention split by query and whole on every rank: bench/cp_memory.lua takes one training step of DIR
# (default tests/fixtures/tiny_a) on B sequences of S tokens (default 1 x 2048), each rank on THREADS threads
# (default 1); one rank is the one-process figure. Measures and prints; never passes or fails.
#   bash bench/cp_memory.sh build/ds4
set -uo pipefail
DS4="${1:?usage: cp_memory.sh DS4 [DIR [B [S]]]}"
here="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${2:-$here/tests/fixtures/tiny_a}" B="${3:-1}" S="${4:-2048}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() { # np mode
    DS4_THREADS="${THREADS:-1}" mpirun -np "$1" --oversubscribe -x DS4_THREADS "$DS4" run "$here/bench/cp_memory.lua" \
        "$DIR" "$B" "$S" "$2" 2>&1 | grep '^cp_memory:' | sort -t' ' -k3n
}
run 1 query
for np in 2 4; do
    for mode in query whole; do run "$np" "$mode"; done
done
