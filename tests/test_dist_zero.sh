#!/usr/bin/env bash
# test_dist_zero.sh DS4 FIXTURES SOURCE — ZeRO-1 (ds4.dist.shard_optimizer) on CPU ranks: tests/lua/dist_zero.lua on
# 2 ranks checks the sharded optimizer against the unsharded one after every step (weights, gradient norm, gathered
# moments: the same bits) and saves a checkpoint after 2 steps; the checkpoint is resumed on 1 rank (no launcher)
# and on 4 ranks, each checked against one process that ran all the steps uninterrupted (the same bits). Under
# mpirun, and torchrun-style over the TCP rendezvous. MPI parts skip without mpirun or an MPI build.
set -uo pipefail
DS4="$1"; FIX="$2"; SRC="$3"
T="$SRC/tests/lua"
# shellcheck source=tests/dist_launch.sh
. "$SRC/tests/dist_launch.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
export DS4_DIST_TIMEOUT=120
# Under the sanitizer build (ASAN_OPTIONS set) the mpirun runs are left to the release stage: the torchrun-style
# ones take the same C paths, with leak checking, and the mpirun ones would need detect_leaks=0 (Open MPI's plugins).

fail=0
bad() { echo "FAIL: $*"; fail=1; }
W="$(mktemp -d "${TMPDIR:-/tmp}/ds4-zero.XXXXXX")"
trap 'rm -rf "$W"' EXIT

passed() { # LOG NP: every rank's "0 failures" line
    local c
    c="$(grep -c "dist_zero rank [0-9]* of $2: [0-9]* checks, 0 failures" "$1")"
    [ "$c" = "$2" ]
}
report() { grep -h 'dist_zero \(save\|resume\):' "$@" | head -1; }

# torchrun-style: save on 2, resume on 4 and on 1
launch 2 "$W/tcp_save" 120 "$DS4" run "$T/dist_zero.lua" "$FIX" save "$W/ck_tcp" 2
cat "$W"/tcp_save.* >"$W/tcp_save.log"
passed "$W/tcp_save.log" 2 && report "$W/tcp_save.log" || { tail -20 "$W/tcp_save.log"; bad "tcp save on 2 ranks"; }
launch 4 "$W/tcp_res" 120 "$DS4" run "$T/dist_zero.lua" "$FIX" resume "$W/ck_tcp" 2
cat "$W"/tcp_res.* >"$W/tcp_res.log"
passed "$W/tcp_res.log" 4 && report "$W/tcp_res.log" || { tail -20 "$W/tcp_res.log"; bad "tcp resume on 4 ranks"; }
timeout -k 5 120 "$DS4" run "$T/dist_zero.lua" "$FIX" resume "$W/ck_tcp" 2 >"$W/one.log" 2>&1
passed "$W/one.log" 1 && report "$W/one.log" || { tail -20 "$W/one.log"; bad "resume on 1 rank"; }

if [ -n "${ASAN_OPTIONS:-}" ]; then
    echo "note: sanitizer build: the mpirun runs are left to the release stage"
elif command -v mpirun >/dev/null 2>&1 &&
    [ "$(echo 'io.write(tostring(require("ds4").dist.have_mpi))' | "$DS4" run - 2>&1)" = "true" ]; then
    mpi() { # NP LOG ARGS...
        local np="$1" log="$2"; shift 2
        timeout -k 5 200 mpirun -np "$np" --oversubscribe "$DS4" run "$T/dist_zero.lua" "$FIX" "$@" >"$log" 2>&1
    }
    mpi 2 "$W/mpi_save.log" save "$W/ck_mpi" 2
    passed "$W/mpi_save.log" 2 && report "$W/mpi_save.log" || { tail -20 "$W/mpi_save.log"; bad "mpirun save on 2 ranks"; }
    mpi 4 "$W/mpi_res.log" resume "$W/ck_mpi" 2
    passed "$W/mpi_res.log" 4 && report "$W/mpi_res.log" || { tail -20 "$W/mpi_res.log"; bad "mpirun resume on 4 ranks"; }
else
    echo "note: no mpirun or no MPI in this build: the mpirun runs are skipped"
fi
exit "$fail"
