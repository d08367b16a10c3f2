#!/usr/bin/env bash
# test_rollout_async.sh — asynchronous RL with real worker processes: one trainer (ds4.rl.trainer.run with a
# ds4.rollout.pool on ipc://, heartbeats every 0.25 s) and two `ds4 worker` processes started with --silence 3 (a
# trainer silent for 3 s has lost the session). The trainer runs, one after another on the same pool and workers, from the same starting model:
#   sync   the synchronous loop (pool max_staleness 0);
#   k0     async = {max_staleness = 0}: the same metrics (all but timings and version numbers) and bitwise the same
#          weights as sync;
#   k1/k2  async K = 1 and 2: every sample the loss sees is at most K versions behind the policy it trains (the
#          test's own count: pool.version - sample.policy_version), as staleness/max says;
#   slow   async K = 1, 4 micro-batches of 0.9 s each (train_delay_s): each training step lasts 3.6 s, longer than
#          the workers' 3 s of patience, and yet no worker loses its session (the trainer serves the pool between
#          micro-batches: no second hello, no worker declared dead, no "no message from the trainer" in their logs),
#          results arrive while the trainer trains, and samples one version old are trained on.
# Every task of every run completes exactly once (pool stats), and the workers exit 0 on SIGTERM.
#   bash tests/test_rollout_async.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
SRC="$3"
. "$(dirname "${BASH_SOURCE[0]}")/proc_lib.sh" async # $out, pids, fail
EP="ipc://$out/pool.sock"

cat >"$out/trainer.lua" <<'LUA'
-- arg: fixtures endpoint dir source
local ds4 = require("ds4")
local rl = require("ds4.rl")
local trainer = require("ds4.rl.trainer")
local fix, ep, dir = arg[1], arg[2], arg[3]
package.path = arg[4] .. "/tests/lua/?.lua;" .. package.path
local toy = require("toy_rl")
ds4.set_threads(1)
local training, arrived_in_training = false, 0
local pool = ds4.rollout.pool{ bind = ep, model = ds4.load(fix .. "/tiny_a"), workers = 2, wait_s = 120,
    max_staleness = 0, timeout_s = 300, quiet = true, heartbeat_s = 0.25,
    on_result = function() if training then arrived_in_training = arrived_in_training + 1 end end }
-- "training": from the moment a step's rollouts are collected to its publish (results handled inside publish do not
-- count); a batch submitted ahead cannot be taken in before (submit only sends tasks)
local collect, publish = pool.collect, pool.publish
function pool.collect(self, b)
    local res = collect(self, b)
    training = true
    return res
end
function pool.publish(self, m)
    training = false
    return publish(self, m)
end
local TIMING = { seconds = true, tokens_per_s = true, ["time/generate"] = true, ["time/reward"] = true,
    ["time/train"] = true, ["time/eval"] = true, policy_version = true }
local function run(name, o)
    local policy = ds4.load(fix .. "/tiny_a")
    -- every run starts from the fixture's weights (a new version for the workers); the first run's are published by
    -- the pool's first generate (its model's: the same weights)
    if pool.version > 0 then pool:publish(policy) end
    local st0 = pool:stats()
    local worst, lagged, n = 0, 0, 0
    arrived_in_training = 0
    trainer.run(toy.config(pool, {
        model = policy,
        steps = o.steps, micro_batches = o.micro_batches, train_delay_s = o.delay,
        async = o.K and { max_staleness = o.K } or nil,
        out = dir .. "/" .. name,
        loss = function(mb, spec, opts)
            for _, s in ipairs(mb) do
                local lag = pool.version - s.policy_version
                worst = math.max(worst, lag)
                if lag > 0 then lagged = lagged + 1 end
                n = n + 1
            end
            return rl.loss.compute(mb, spec, opts)
        end,
    }))
    training = false
    local st = pool:stats()
    local rows = require("ds4.plot").read_jsonl(dir .. "/" .. name .. "/metrics.jsonl")
    local smax, smin = -1, math.huge
    for _, r in ipairs(rows) do
        smax, smin = math.max(smax, r["staleness/max"] or -1), math.min(smin, r["staleness/mean"] or -1)
    end
    print(("%s: steps %d samples %d worst_lag %d lagged %d staleness_max %d staleness_min %d tasks %d completed %d "
        .. "failed %d in_training %d"):format(name, #rows, n, worst, lagged, smax, smin, st.tasks - st0.tasks,
        st.completed - st0.completed, st.failed - st0.failed, arrived_in_training))
    io.stdout:flush()
    local untimed = {}
    for i, r in ipairs(rows) do
        untimed[i] = {}
        for k, v in pairs(r) do if not TIMING[k] then untimed[i][k] = v end end
    end
    return policy, untimed
end
local ps, rs = run("sync", { steps = 3 })
local p0, r0 = run("k0", { steps = 3, K = 0 })
local function deep_eq(x, y)
    if type(x) ~= "table" or type(y) ~= "table" then return x == y end
    for k, v in pairs(x) do if not deep_eq(v, y[k]) then return false end end
    for k in pairs(y) do if x[k] == nil then return false end end
    return true
end
local same = deep_eq(rs, r0)
local a, b = ps:params(), p0:params()
local ffi = require("ffi")
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")
local bits = a:nbytes() == b:nbytes() and ffi.C.memcmp(a:data_ptr(), b:data_ptr(), a:nbytes()) == 0
print(("k0 vs sync: metrics %s, weights %s"):format(same and "equal" or "DIFFER", bits and "bitwise equal" or "DIFFER"))
run("k1", { steps = 4, K = 1 })
run("k2", { steps = 4, K = 2 })
run("slow", { steps = 3, K = 1, micro_batches = 4, delay = 0.9 })
local st = pool:stats()
print(("pool: hellos %d dead %d duplicates %d"):format(st.hellos, st.dead, st.duplicates))
pool:close()
LUA

"$DS4" run "$out/trainer.lua" "$FIX" "$EP" "$out" "$SRC" >"$out/trainer.log" 2>"$out/trainer.err" &
T=$!
pids+=("$T")
for id in a1 a2; do
    "$DS4" worker --connect "$EP" --threads 1 --id "$id" --silence 3 --give-up 600 --verbose >"$out/$id.log" 2>&1 &
    pids+=("$!")
done
# bounded: the whole run takes ~15 s here (the slow run alone ~8 s), ~30 s under the sanitizers; 10 minutes is a hang
for _ in $(seq 1 6000); do kill -0 "$T" 2>/dev/null || break; sleep 0.1; done
kill -0 "$T" 2>/dev/null && fail "the trainer did not finish in 10 minutes"
wait "$T" || fail "the trainer failed"
cat "$out/trainer.log"

field() { sed -n "s/^$1: .* $2 \([0-9-]*\).*/\1/p" "$out/trainer.log"; }
for run in sync k0 k1 k2 slow; do
    grep -q "^$run: " "$out/trainer.log" || fail "no summary for run $run"
    [ "$(field "$run" tasks)" = "$(field "$run" completed)" ] || fail "$run: not every task completed"
    [ "$(field "$run" failed)" = 0 ] || fail "$run: tasks failed"
done
grep -q "^k0 vs sync: metrics equal, weights bitwise equal" "$out/trainer.log" ||
    fail "async max_staleness = 0 is not the synchronous run"
for run in sync k0; do
    [ "$(field "$run" worst_lag)" = 0 ] || fail "$run: trained on a stale sample"
    [ "$(field "$run" staleness_max)" = 0 ] && [ "$(field "$run" staleness_min)" = 0 ] ||
        fail "$run: staleness/mean and /max are not 0 at every step"
done
for K in 1 2; do
    w="$(field "k$K" worst_lag)"
    [ "$w" -le "$K" ] || fail "k$K: a sample $w versions old was trained on (max_staleness $K)"
    [ "$(field "k$K" staleness_max)" = "$w" ] || fail "k$K: staleness/max differs from the test's count"
done
[ "$(field slow worst_lag)" -le 1 ] || fail "slow: a sample more than 1 version old was trained on"
[ "$(field slow lagged)" -gt 0 ] || fail "slow: no sample of an older version: the workers did not generate ahead"
[ "$(field slow in_training)" -gt 0 ] || fail "slow: no result arrived while the trainer trained"
[ "$(field sync in_training)" = 0 ] || fail "sync: results arrived while the trainer trained (nothing is in flight)"
grep -q "^pool: hellos 2 dead 0 " "$out/trainer.log" || fail "a worker lost its session or was declared dead"
if grep -l "no message from the trainer" "$out"/a1.log "$out"/a2.log; then
    fail "a worker heard nothing from the trainer for 3 s"
fi
echo "slow training steps (3.6 s, workers' --silence 3): no session lost"

for p in "${pids[@]}"; do [ "$p" = "$T" ] || kill -TERM "$p" 2>/dev/null || true; done
for p in "${pids[@]}"; do [ "$p" = "$T" ] || { wait "$p" || fail "a worker exited $? on SIGTERM"; }; done
pids=()
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log "$out"/*.err 2>/dev/null; then
    fail "sanitizer reports in the logs above"
fi
echo "1 passed, 0 failed"
