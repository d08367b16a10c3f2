#!/usr/bin/env bash
# test_kill_resume.sh — a training run killed with -9, resumed, and run against a full disk (issue 18, items 3, 13):
#   1. examples/sft.lua (checkpoints every 5 updates) is killed with -9 after its checkpoint of update 10: the
#      metrics file holds at least the 10 records written before, each a whole JSON line (they used to wait in a
#      stdio buffer: 0 lines after most kills);
#   2. a line torn by the crash is appended, and crash leftovers of the killed process are planted in the
#      checkpoint root; the resumed run drops the torn line and the records it redoes, so the finished file has
#      every step exactly once, in order, and every line parses; its first checkpoint removes the leftovers (a dead
#      pid's, and an older step's whose pid is alive);
#   3. metrics.jsonl on a full device (/dev/full): the run stops with exit status 1 and says why (it used to
#      finish with status 0 and a cut file).
#   bash tests/chaos/test_kill_resume.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
SRC="$3"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-chaos-kill.XXXXXX")"
pid=
trap '[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; for f in "$out"/*.log; do [ -s "$f" ] && { echo "== $f"; tail -n 20 "$f"; }; done; exit 1; }
run=(--steps 30 --batch 8 --quiet --save-every 5 --keep-last 2 --out "$out/run")

# ------------------------------------------------------------------------------------------------ 1. kill -9
"$DS4" run "$SRC/examples/sft.lua" "${run[@]}" >"$out/first.log" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
    [ -e "$out/run/ckpt/step_000010/COMPLETE" ] && break
    kill -0 "$pid" 2>/dev/null || fail "sft.lua ended before its checkpoint of update 10"
    sleep 0.05
done
[ -e "$out/run/ckpt/step_000010/COMPLETE" ] || fail "no checkpoint of update 10 within 60 s"
kill -9 "$pid"
wait "$pid" 2>/dev/null || true
killed=$pid
pid=
n="$(wc -l <"$out/run/metrics.jsonl")"
[ "$n" -ge 11 ] || fail "after kill -9 past update 10, metrics.jsonl has $n lines"
"$DS4" run - "$out/run/metrics.jsonl" <<'LUA' || fail "the killed run's metrics do not parse"
local json = require("ds4.chat.json")
local text = assert(io.open(arg[1], "rb")):read("*a")
assert(text:sub(-1) == "\n", "the last line is torn")
local k = -1 -- the first line is the held-out loss at step 0
for line in text:gmatch("([^\n]*)\n") do
    k = k + 1
    local r = assert(json.decode(line), "line " .. k .. " does not parse")
    assert(r.step == k, ("line %d has step %s"):format(k, tostring(r.step)))
end
LUA
echo "kill -9 after update 10: $n whole metrics lines kept"

# ------------------------------------------------------------------------------------------------ 2. resume
printf '{"step": 99, "loss": 0.12' >>"$out/run/metrics.jsonl" # a line torn by a crash
host="$(hostname 2>/dev/null | tr -c 'A-Za-z0-9._\n-' '_' | cut -c1-64)"
mkdir -p "$out/run/ckpt/step_000015.tmp-$killed@$host" "$out/run/ckpt/step_000010.del-$killed@$host" \
    "$out/run/ckpt/step_000005.tmp-$$@$host"
"$DS4" run "$SRC/examples/sft.lua" "${run[@]}" --resume >"$out/resume.log" 2>&1 || fail "the resumed run failed"
grep -q "resuming from" "$out/resume.log" || fail "the second run did not resume"
"$DS4" run - "$out/run/metrics.jsonl" <<'LUA' || fail "metrics after the resume"
local json = require("ds4.chat.json")
local k, held = 0, 0
for line in io.lines(arg[1]) do
    local r = assert(json.decode(line), "line " .. k .. " does not parse: " .. line)
    if r["eval/loss"] then -- the held-out loss before and after training
        held = held + 1
        assert(r.step == (held == 1 and 0 or 30), "held-out loss records at steps 0 and 30")
    else
        k = k + 1
        assert(r.step == k, ("record %d has step %s: every step once, in order"):format(k, tostring(r.step)))
        assert(type(r.loss) == "number", "record " .. k .. " has no loss")
    end
end
assert(k == 30 and held == 2, k .. " records and " .. held .. " held-out ones, want 30 and 2")
print("resumed: 30 records, every step once, every line whole")
LUA
left="$(find "$out/run/ckpt" -maxdepth 1 -name 'step_*.*-*' | wc -l)"
[ "$left" = 0 ] || { ls "$out/run/ckpt"; fail "$left crash leftovers survived the resumed run's checkpoints"; }
echo "crash leftovers removed by the next checkpoint"

# ------------------------------------------------------------------------------------------------ 3. full disk
if [ -c /dev/full ]; then
    mkdir -p "$out/full"
    ln -s /dev/full "$out/full/metrics.jsonl"
    rc=0
    # --resume: the directory holds a metrics file already (a new run refuses to append to it)
    "$DS4" run "$SRC/examples/sft.lua" --steps 3 --batch 4 --quiet --out "$out/full" --resume --tensorboard=false \
        >"$out/full.log" 2>&1 || rc=$?
    [ "$rc" = 1 ] || fail "metrics on a full disk: exit status $rc, want 1"
    grep -q "ds4.metrics: write .*No space left on device" "$out/full.log" || fail "no 'No space left' message"
    echo "full disk: the run stops with status 1 and says why"
fi
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log 2>/dev/null; then fail "sanitizer reports"; fi
echo "1 passed, 0 failed"
