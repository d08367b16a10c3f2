#!/usr/bin/env bash
# test_dist_mpi.sh DS4 FIXTURES SOURCE — ds4.dist on CPU ranks under `mpirun -np 2` and `-np 4`: the collectives
# against closed forms (tests/lua/dist_collectives.lua), data, expert and context parallelism against one process on
# the whole batch (tests/lua/dist_data_parallel.lua, dist_expert_parallel.lua, dist_context_parallel.lua split by query
# and with attention whole on every rank; sharded
# experts against replicated expert parallelism, dist_expert_shard.lua; the RL trainer's indexer KL normalised over
# ranks and micro-batches, dist_rl_indexer_kl.lua; with LoRA
# adapters, dist_data_parallel_lora.lua, -np 2), and a rank that dies
# (tests/lua/dist_rank_dies.lua; also with its bucketed gradient sum in flight) or hangs: the others must be ended
# with an error naming that rank (or, for the hung one, the collective that timed out) within a bound, not hang.
# Skips (77) when mpirun is absent or ds4 was built without MPI (docs/distributed.md). Torchrun-style launches (no
# MPI): tests/test_dist_tcp.sh.
set -uo pipefail
DS4="$1"; FIX="$2"; SRC="$3"
T="$SRC/tests/lua"
# Open MPI refuses to start as root (CI runs as root) unless told twice.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One machine, no network: the loopback/shared-memory transports only, no probing of other interfaces.
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo

fail=0
bad() { echo "FAIL: $*"; fail=1; }

if ! command -v mpirun >/dev/null 2>&1; then
    echo "SKIP: mpirun not found (install openmpi-bin: scripts/install-deps.sh)"
    exit 77
fi
have="$(echo 'io.write(tostring(require("ds4").dist.have_mpi))' | "$DS4" run - 2>&1)" || true
if [ "$have" != "true" ]; then
    echo "SKIP: this ds4 was built without MPI (ds4.dist.have_mpi = $have)"
    exit 77
fi

# Under the sanitizer build (ASAN_OPTIONS set, as scripts/test.sh's asan stage does) the ranks run with
# AddressSanitizer and UBSan on but leak checking off: Open MPI leaks at MPI_Finalize from its plugins (MCA
# components it has dlclose'd: LeakSanitizer shows their frames as "<unknown module>", so no suppression can name
# them), and every rank would fail on leaks that are not ds4's. ds4's own code is leak-checked by test_dist and
# lua_test_dist (a world of one, no MPI_Init) in the same stage.
if [ -n "${ASAN_OPTIONS:-}" ]; then
    export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0"
    echo "note: sanitizer build: mpirun ranks run with detect_leaks=0 (Open MPI's plugin leaks)"
fi
LOG="$(mktemp "${TMPDIR:-/tmp}/ds4-dist.XXXXXX")"
trap 'rm -f "$LOG"' EXIT

# $1 = np, rest = script and args; a wall-clock bound so that a hang fails instead of stalling ctest
run_np() {
    local np="$1"; shift
    DS4_TEST_WORLD="$np" timeout -k 5 240 mpirun -np "$np" --oversubscribe -x DS4_TEST_WORLD "$DS4" run "$@" >"$LOG" 2>&1
}

# a world of one, without mpirun
DS4_TEST_WORLD=1 "$DS4" run "$T/dist_collectives.lua" "$FIX" >"$LOG" 2>&1 || { cat "$LOG"; bad "collectives, no mpirun"; }
"$DS4" run "$T/dist_expert_parallel.lua" "$FIX" >"$LOG" 2>&1 || { cat "$LOG"; bad "expert parallel, no mpirun"; }
"$DS4" run "$T/dist_expert_shard.lua" "$FIX" >"$LOG" 2>&1 || { cat "$LOG"; bad "sharded experts, no mpirun"; }
"$DS4" run "$T/dist_context_parallel.lua" "$FIX" >"$LOG" 2>&1 || { cat "$LOG"; bad "context parallel, no mpirun"; }
"$DS4" run "$T/dist_rl_indexer_kl.lua" "$FIX" >"$LOG" 2>&1 || { cat "$LOG"; bad "RL indexer KL, no mpirun"; }

for np in 2 4; do
    if run_np "$np" "$T/dist_collectives.lua" "$FIX"; then
        c="$(grep -c 'dist_collectives rank [0-9]* of '"$np"': [0-9]* checks, 0 failures' "$LOG")"
        [ "$c" = "$np" ] || { cat "$LOG"; bad "collectives -np $np: $c of $np ranks reported success"; }
    else
        cat "$LOG"; bad "collectives -np $np"
    fi
    for t in dist_data_parallel dist_buckets dist_expert_parallel dist_expert_shard dist_context_parallel \
        dist_rl_indexer_kl; do
        if run_np "$np" "$T/$t.lua" "$FIX"; then
            grep "$t:" "$LOG"
            c="$(grep -c "$t"' rank [0-9]* of '"$np"': [0-9]* checks, 0 failures' "$LOG")"
            [ "$c" = "$np" ] || { cat "$LOG"; bad "$t -np $np: $c of $np ranks reported success"; }
        else
            cat "$LOG"; bad "$t -np $np"
        fi
    done
    # context parallelism with attention over the whole sequences on every rank (its attention gradients bitwise)
    if run_np "$np" "$T/dist_context_parallel.lua" "$FIX" whole; then
        grep "dist_context_parallel:" "$LOG"
        c="$(grep -c 'dist_context_parallel rank [0-9]* of '"$np"': [0-9]* checks, 0 failures' "$LOG")"
        [ "$c" = "$np" ] || { cat "$LOG"; bad "dist_context_parallel whole -np $np: $c of $np ranks reported success"; }
    else
        cat "$LOG"; bad "dist_context_parallel whole -np $np"
    fi
done
# LoRA: 2 ranks all-reduce the adapters' gradients (the model's buffer does not exist then) == 1 rank on the batch
if run_np 2 "$T/dist_data_parallel_lora.lua" "$FIX" lora; then
    grep 'dist_data_parallel (LoRA):' "$LOG"
    c="$(grep -c 'dist_data_parallel rank [0-9]* of 2: [0-9]* checks, 0 failures' "$LOG")"
    [ "$c" = 2 ] || { cat "$LOG"; bad "LoRA data parallel -np 2: $c of 2 ranks reported success"; }
else
    cat "$LOG"; bad "LoRA data parallel -np 2"
fi

# A rank that dies: mpirun must end the job (non-zero), name the rank, and do it well within the bound. The
# survivors loop on collectives for 120 s if nobody ends them, and the timeout is 90 s: a hang fails here. A rank that
# hangs (asleep 30 s, DS4_DIST_TIMEOUT 4 s): the others' collective must fail at the deadline (dist/mpi_backend.c),
# naming it, and the job end long before the sleeper wakes (20 s).
for mode in kill error buckets hang; do
    for np in 2 4; do
        limit=60 tmo="${DS4_DIST_TIMEOUT:-300}"
        [ "$mode" = hang ] && limit=20 tmo=4
        t0=$SECONDS
        rc=0
        DS4_DIST_TIMEOUT=$tmo DS4_TEST_HANG_S=30 timeout -k 5 90 mpirun -np "$np" --oversubscribe \
            "$DS4" run "$T/dist_rank_dies.lua" "$mode" "$FIX" >"$LOG" 2>&1 || rc=$?
        dt=$((SECONDS - t0))
        last=$((np - 1))
        if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$dt" -ge "$limit" ]; then
            cat "$LOG"; bad "rank dies ($mode, -np $np): exit $rc after $dt s (want a non-zero exit within $limit s)"
        elif [ "$mode" = hang ] && ! grep -q "(MPI): MPI_I[a-z]* not complete after 4 s (the timeout" "$LOG"; then
            cat "$LOG"; bad "rank dies (hang, -np $np): no survivor's collective failed at the deadline"
        elif [ "$mode" = kill ] && ! grep -q "process rank $last .*exited on signal 9" "$LOG"; then
            cat "$LOG"; bad "rank dies (kill, -np $np): mpirun's message does not name rank $last and signal 9"
        elif [ "$mode" != kill ] && [ "$mode" != hang ] && ! grep -q "rank $last fails on purpose" "$LOG"; then
            cat "$LOG"; bad "rank dies ($mode, -np $np): the failing rank's error is not in the output"
        elif grep -q "still running after 120 s" "$LOG"; then
            cat "$LOG"; bad "rank dies ($mode, -np $np): a survivor was not ended"
        else
            echo "rank dies ($mode, -np $np): job ended in $dt s, exit $rc"
        fi
    done
done
exit "$fail"
