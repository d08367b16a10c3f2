#!/usr/bin/env bash
# test_async_faults.sh — asynchronous RL (trainer.run, async = {max_staleness = 1}, a checkpoint after every step,
# resume = true) against real worker processes and real faults, all on this machine (issue 16):
#   - worker w1 is killed with -9 at random moments and started again, again and again;
#   - the trainer is killed with -9 at random moments twice (after its checkpoints of steps >= 3 and >= 6) and started
#     again on the same endpoint: it resumes from its newest checkpoint, and the workers find it;
#   - a worker joins late (after the checkpoint of step 2) and answers tasks; one is 10x slower than the others
#     (tests/chaos/run_slow_worker.lua); one says a valid hello, takes tasks and answers each with malformed messages
#     (tests/chaos/bad_worker.lua, mode garbage).
# Checked: the run finishes all its steps, each recorded exactly once in metrics.jsonl; within each trainer process no
# task's results are taken twice and none fails (results collected = tasks completed, duplicates dropped); every
# sample trained is at most max_staleness = 1 versions behind the policy it trains (and TIS corrects them); the late
# and the slow worker answered tasks, the garbage worker had no result taken, its messages rejected and logged; no
# trainer crashed but by our kills, and the workers exit 0 on SIGTERM.
#   bash tests/chaos/test_async_faults.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
SRC="$3"
. "$SRC/tests/proc_lib.sh" async-faults # $out, pids, fail, wait_for
EP="ipc://$out/pool.sock"
STEPS=10

cat >"$out/trainer.lua" <<'LUA'
-- arg: fixtures endpoint dir steps source
local ds4 = require("ds4")
local rl = require("ds4.rl")
local trainer = require("ds4.rl.trainer")
local fix, ep, dir, steps = arg[1], arg[2], arg[3], tonumber(arg[4])
package.path = arg[5] .. "/tests/lua/?.lua;" .. package.path
local toy = require("toy_rl")
ds4.set_threads(1)
local pid = assert(io.open("/proc/self/stat")):read("*l"):match("^(%d+)")
local policy = ds4.load(fix .. "/tiny_a")
local pool = ds4.rollout.pool{ bind = ep, model = policy, workers = 1, wait_s = 120, timeout_s = 300, quiet = true,
    heartbeat_s = 0.25, dead_s = 2, lease_s = 4, lease_rate = 1e9 }
-- every result the trainer takes, one line each (flushed: a kill -9 loses nothing written before it)
local log = assert(io.open(dir .. "/collected.log", "a"))
log:setvbuf("line")
local collect = pool.collect
function pool.collect(self, b)
    local res = collect(self, b)
    for _, r in ipairs(res) do
        if r.sample_index == 1 then
            log:write(("C %s %d %d %s %s\n"):format(pid, r.task, r.attempt, tostring(r.worker), r.finish_reason))
        end
    end
    return res
end
trainer.run(toy.config(pool, {
    model = policy,
    -- 2 micro-batches of at least 0.25 s: a step lasts ~0.6 s, so that the kills land inside the run
    steps = steps, async = { max_staleness = 1 }, micro_batches = 2, train_delay_s = 0.25,
    checkpoint = { every = 1, keep_last = 2, resume = true, dir = dir .. "/run/ckpt" },
    out = dir .. "/run",
    loss = function(mb, spec, opts)
        for _, s in ipairs(mb) do log:write(("L %s %d\n"):format(pid, pool.version - s.policy_version)) end
        return rl.loss.compute(mb, spec, opts)
    end,
}))
local st = pool:stats()
log:write(("S %s tasks %d completed %d failed %d duplicates %d invalid %d\n"):format(pid, st.tasks, st.completed,
    st.failed, st.duplicates, st.invalid))
print(("done: pid %s tasks %d completed %d failed %d duplicates %d invalid %d"):format(pid, st.tasks, st.completed,
    st.failed, st.duplicates, st.invalid))
pool:close()
LUA

T=
start_trainer() { # n
    "$DS4" run "$out/trainer.lua" "$FIX" "$EP" "$out" "$STEPS" "$SRC" >>"$out/trainer$1.log" 2>>"$out/trainer$1.err" &
    T=$!
    pids+=("$T")
}
W1=
start_w1() {
    # --credits 2 here and 1 for the slow worker: they hold 3 of the ~6 tasks in flight, so the late one gets work
    "$DS4" worker --connect "$EP" --model "$FIX/tiny_a" --threads 1 --id w1 --silence 2 --give-up 600 --verbose \
        --credits 2 >>"$out/w1.log" 2>&1 &
    W1=$!
    pids+=("$W1")
}
newest_ckpt() { # the step of the newest complete checkpoint, 0 when none
    local d n=0
    for d in "$out"/run/ckpt/step_[0-9][0-9][0-9][0-9][0-9][0-9]; do
        [ -e "$d/COMPLETE" ] || continue
        [ "$((10#${d##*step_}))" -gt "$n" ] && n="$((10#${d##*step_}))"
    done
    echo "$n"
}
ckpt_at_least() { [ "$(newest_ckpt)" -ge "$1" ]; }
wait_ckpt() { # step seconds
    local i
    for i in $(seq 1 $(($2 * 10))); do
        ckpt_at_least "$1" && return 0
        kill -0 "$T" 2>/dev/null || fail "the trainer ended before its checkpoint of step $1"
        sleep 0.1
    done
    return 1
}
kill_w1() { # at a random moment within the next second, then restart it
    sleep "0.$((RANDOM % 10))"
    kill -9 "$W1" 2>/dev/null || true
    wait "$W1" 2>/dev/null || true
    echo "killed w1 (-9)"
    start_w1
}
kill_trainer() {
    sleep "0.$((RANDOM % 10))"
    kill -9 "$T" 2>/dev/null || fail "the trainer ended before it was killed"
    wait "$T" 2>/dev/null || true
    KILLED_AT="$(newest_ckpt)"
    echo "killed the trainer (-9) after its checkpoint of step $KILLED_AT"
}

start_trainer 1
start_w1
"$DS4" run "$SRC/tests/chaos/run_slow_worker.lua" "$EP" slow "$FIX" 10 >"$out/slow.log" 2>&1 &
pids+=("$!")
SLOW=$!
"$DS4" run "$SRC/tests/chaos/run_bad_worker.lua" "$EP" garbage garbage "$FIX" 600 >"$out/garbage.log" 2>&1 &
pids+=("$!")
# bounded: the whole test takes ~30 s here; each wait below is a hang at its bound
wait_ckpt 2 120 || fail "no checkpoint of step 2 within 120 s"
"$DS4" worker --connect "$EP" --model "$FIX/tiny_a" --threads 1 --id late --silence 2 --give-up 600 --verbose \
    >"$out/late.log" 2>&1 &
pids+=("$!")
LATE=$!
kill_w1
wait_ckpt 3 120 || fail "no checkpoint of step 3 within 120 s"
kill_trainer
start_trainer 2
kill_w1
# trainer 2 trains at least two steps (so each trainer process takes results) before it is killed in turn
wait_ckpt $((KILLED_AT + 2)) 120 || fail "no checkpoint of step $((KILLED_AT + 2)) within 120 s"
kill_w1
kill_trainer
[ "$KILLED_AT" -lt "$STEPS" ] || fail "trainer 2 finished before it was killed"
start_trainer 3
kill_w1
for _ in $(seq 1 1200); do kill -0 "$T" 2>/dev/null || break; sleep 0.1; done
kill -0 "$T" 2>/dev/null && fail "the last trainer did not finish within 120 s"
wait "$T" || fail "the last trainer failed"

cat "$out/trainer3.log"
"$DS4" run - "$out/run/metrics.jsonl" "$STEPS" <<'LUA' || fail "metrics.jsonl"
local rows = require("ds4.plot").read_jsonl(arg[1])
local seen = {}
for _, r in ipairs(rows) do
    if r.step and not r["eval/loss"] then
        assert(not seen[r.step], "step " .. r.step .. " recorded twice")
        seen[r.step] = true
        assert((r["staleness/max"] or 0) <= 1, "step " .. r.step .. ": staleness/max " .. tostring(r["staleness/max"]))
    end
end
for s = 1, tonumber(arg[2]) do assert(seen[s], "step " .. s .. " is not recorded") end
print(("metrics: steps 1..%d each recorded once, staleness/max <= 1"):format(arg[2]))
LUA
"$DS4" run - "$out/collected.log" <<'LUA' || fail "collected.log"
local per, workers, worst, trained, stats = {}, {}, 0, 0, 0
for line in io.lines(arg[1]) do
    local kind, pid, rest = line:match("^(%a) (%d+) (.*)$")
    if kind == "C" then
        local task, _, worker, finish = rest:match("^(%d+) (%d+) (%S+) (%S+)$")
        per[pid] = per[pid] or {}
        assert(not per[pid][task], ("trainer %s took task %s twice"):format(pid, task))
        assert(finish ~= "failed", ("trainer %s: task %s failed"):format(pid, task))
        per[pid][task] = true
        workers[worker] = (workers[worker] or 0) + 1
    elseif kind == "L" then
        local lag = tonumber(rest)
        worst = math.max(worst, lag)
        trained = trained + 1
    elseif kind == "S" then
        local t, c, f = rest:match("^tasks (%d+) completed (%d+) failed (%d+)")
        assert(tonumber(f) == 0, "the last trainer: " .. f .. " tasks failed")
        local taken = 0
        for _ in pairs(per[pid]) do taken = taken + 1 end
        -- tasks of batches still in flight at the end are completed or cancelled, never taken twice
        assert(taken <= tonumber(c), ("the last trainer took %d tasks, completed %s"):format(taken, c))
        stats = stats + 1
    end
end
local np = 0
for _ in pairs(per) do np = np + 1 end
assert(np == 3, np .. " trainer processes took results, want 3")
assert(stats == 1, "the last trainer did not report its stats")
assert(worst <= 1, "a sample " .. worst .. " versions behind was trained (max_staleness 1)")
assert(trained > 0, "nothing trained")
assert(not workers.garbage, "the garbage worker's results were taken")
print(("collected: 3 trainer processes, no task taken twice, none failed; %d samples trained, worst lag %d; "
    .. "results per worker: w1 %d, late %d, slow %d"):format(trained, worst, workers.w1 or 0, workers.late or 0,
    workers.slow or 0))
LUA
grep -q "rejected a message from garbage" "$out"/trainer*.err || fail "the garbage worker's messages were not logged"
# the late and the slow worker answered tasks (whether a given answer was the one taken depends on the kills' timing)
for id in late slow; do
    n="$(grep -c "attempt [0-9]*: [0-9]* samples, " "$out/$id.log" || true)"
    [ "$n" -gt 0 ] || fail "the $id worker answered no task"
    echo "$id worker: $n tasks answered"
done
# (the garbage worker leaves at the trainer's bye)
for p in "$W1" "$LATE" "$SLOW"; do kill -0 "$p" 2>/dev/null || fail "a worker died (pid $p)"; done
for p in "$W1" "$LATE"; do
    kill -TERM "$p"
    wait "$p" || fail "a worker exited $? on SIGTERM"
done
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log "$out"/*.err 2>/dev/null; then
    fail "sanitizer reports"
fi
echo "1 passed, 0 failed"
