#!/usr/bin/env bash
# test_trainer_gone.sh — a rollout worker does not wait forever for a trainer (issue 17):
#   1. a worker started against an endpoint where no trainer ever binds exits with status 1 after --give-up
#      seconds, saying so;
#   2. a worker whose trainer is killed (-9) after serving it loses the session (10 s of silence), then gives up
#      --give-up seconds later, exit status 1 and the same message.
#   bash tests/chaos/test_trainer_gone.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-chaos-gone.XXXXXX")"
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; for f in "$out"/*.log; do [ -s "$f" ] && { echo "== $f"; tail -n 15 "$f"; }; done; exit 1; }

# ------------------------------------------------------------------------------------------------ 1. never there
t0=$SECONDS
rc=0
"$DS4" worker --connect "ipc://$out/nobody.sock" --model "$FIX/tiny_a" --threads 1 --id w0 --give-up 2 \
    >"$out/w0.log" 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "a worker without a trainer: exit $rc, want 1"
grep -q "no trainer at ipc://$out/nobody.sock for 2 s" "$out/w0.log" || fail "no 'no trainer' message"
[ $((SECONDS - t0)) -lt 30 ] || fail "the worker took $((SECONDS - t0)) s to give up after 2 s"
echo "no trainer: the worker gave up after --give-up 2 s, exit 1"

# ------------------------------------------------------------------------------------------------ 2. trainer killed
cat >"$out/trainer.lua" <<'LUA'
local ds4 = require("ds4")
ds4.set_threads(1)
local pool = ds4.rollout.pool{ bind = arg[2], model = ds4.load(arg[1] .. "/tiny_a"), workers = 1, wait_s = 60,
    quiet = true }
local res = pool:generate({ { 5, 6, 7 } }, { n = 2, max_new_tokens = 3, seed = 1 })
assert(#res == 2 and res[1].finish_reason ~= "failed", "the worker served the task")
assert(io.open(arg[3], "w")):close() -- served: the shell kills this process now
while true do pool:service(1000) end
LUA
"$DS4" run "$out/trainer.lua" "$FIX" "ipc://$out/trainer.sock" "$out/served" >"$out/trainer.log" 2>&1 &
T=$!
pids+=("$T")
"$DS4" worker --connect "ipc://$out/trainer.sock" --model "$FIX/tiny_a" --threads 1 --id w1 --give-up 3 \
    >"$out/w1.log" 2>&1 &
W=$!
pids+=("$W")
for _ in $(seq 1 600); do [ -e "$out/served" ] && break; sleep 0.1; done
[ -e "$out/served" ] || fail "the trainer was not served within 60 s"
kill -9 "$T"
wait "$T" 2>/dev/null || true
t0=$SECONDS
rc=0
wait "$W" || rc=$?
[ "$rc" = 1 ] || fail "a worker whose trainer was killed: exit $rc, want 1"
grep -q "no trainer at ipc://$out/trainer.sock for 3 s" "$out/w1.log" || fail "no 'no trainer' message"
[ $((SECONDS - t0)) -lt 60 ] || fail "the worker took $((SECONDS - t0)) s after the trainer's death"
echo "trainer killed: the worker lost the session and gave up $((SECONDS - t0)) s later, exit 1"
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log 2>/dev/null; then fail "sanitizer reports"; fi
echo "1 passed, 0 failed"
