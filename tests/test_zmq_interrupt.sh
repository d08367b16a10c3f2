#!/usr/bin/env bash
# test_zmq_interrupt.sh — a ds4.zmq wait without a timeout (sock:recv(), ds4.zmq.poll(socks)) ends soon after
# SIGINT: the wait wakes every 100 ms, sees the host's interrupt flag and raises; `ds4 run` then exits 1.
#
# usage: bash tests/test_zmq_interrupt.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -u

DS4=$(realpath "$1")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

fails=0
checks=0
fail() { fails=$((fails + 1)); echo "FAIL: $*" >&2; }

# interrupt NAME LUA_WAIT: run a script that prints "ready" and then waits with LUA_WAIT; SIGINT it.
interrupt() {
    local name=$1 wait=$2
    cat >"$WORK/$name.lua" <<EOF
local zmq = require("ds4").zmq
local s = zmq.socket("PULL")
s:bind("inproc://nobody-sends")
io.stdout:write("ready\n")
io.stdout:flush()
$wait
io.stdout:write("returned\n")
EOF
    "$DS4" run "$WORK/$name.lua" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    local pid=$! i
    for i in $(seq 1 100); do
        grep -q ready "$WORK/$name.out" 2>/dev/null && break
        sleep 0.05
    done
    sleep 0.2 # inside the wait by now
    local t0=$SECONDS
    kill -INT "$pid"
    for i in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.05
    done
    checks=$((checks + 3))
    if kill -0 "$pid" 2>/dev/null; then
        fail "$name: still waiting 5 s after SIGINT"
        kill -KILL "$pid"
        wait "$pid" 2>/dev/null
        return
    fi
    wait "$pid"
    local rc=$?
    [ "$rc" -eq 1 ] || fail "$name: exit status $rc, expected 1"
    grep -q "interrupted" "$WORK/$name.err" || { fail "$name: no 'interrupted' in stderr"; sed 's/^/    | /' "$WORK/$name.err" >&2; }
    ! grep -q returned "$WORK/$name.out" || fail "$name: the wait returned normally"
    [ $((SECONDS - t0)) -le 3 ] || fail "$name: took $((SECONDS - t0)) s"
}

interrupt recv 's:recv()'
interrupt poll 'zmq.poll({s})'
interrupt recv_timeout 's:recv(60000)'

echo "test_zmq_interrupt: $checks checks, $fails failures"
[ $fails -eq 0 ]
