# dist_launch.sh — sourced by tests/test_dist_tcp.sh and tests/test_dist_nccl.sh: start ranks as plain processes
# with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT), no MPI.
#
#   launch NP LOG BOUND CMD...   ranks 0..NP-1 run CMD under `timeout BOUND`; rank r's output goes to LOG.r; sets
#                                RCS (their exit codes, 124: the bound was hit) and ELAPSED (seconds); returns 0
#                                when every rank exited 0. A port is drawn at random and drawn again when rank 0
#                                finds it taken.
#   EXTRA_ENV                    "NAME=value ..." added to every rank's environment (word-split)

# A random port below the kernel's ephemeral range (ip_local_port_range, usually 32768-60999): ports there are taken
# by every outgoing connection and every wildcard bind (ZeroMQ's tcp://127.0.0.1:*, which the rollout tests running
# beside these ones use), so a port drawn there could be in use ("Address already in use" at rank 0).
free_port() {
    local lo=32768 hi
    read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || lo=32768
    [ "$lo" -gt 21000 ] 2>/dev/null || lo=60000
    echo $((20000 + (RANDOM * 32768 + RANDOM) % (lo - 20000)))
}

launch() {
    local np="$1" log="$2" bound="$3"
    shift 3
    local attempt r pids
    for attempt in 1 2 3 4 5; do
        PORT="$(free_port)"
        local t0=$SECONDS
        pids=()
        for ((r = 0; r < np; r++)); do
            # shellcheck disable=SC2086
            env RANK="$r" WORLD_SIZE="$np" LOCAL_RANK="$r" MASTER_ADDR=127.0.0.1 MASTER_PORT="$PORT" ${EXTRA_ENV:-} \
                timeout -k 5 "$bound" "$@" >"$log.$r" 2>&1 &
            pids+=($!)
        done
        RCS=()
        for ((r = 0; r < np; r++)); do
            wait "${pids[$r]}"
            RCS+=($?)
        done
        ELAPSED=$((SECONDS - t0))
        grep -q "Address already in use" "$log.0" || break
    done
    for r in "${RCS[@]}"; do [ "$r" -eq 0 ] || return 1; done
    return 0
}
