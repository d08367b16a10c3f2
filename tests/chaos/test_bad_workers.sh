#!/usr/bin/env bash
# test_bad_workers.sh — the rollout pool beside workers that misbehave, for real: one trainer (a ds4.rollout.pool on
# tcp://127.0.0.1, plain TCP: loopback only), one honest `ds4 worker`, and one process per mode of
# tests/chaos/bad_worker.lua at once (out-of-range ids, NaN log-probabilities, error replies, future policy
# versions, a new hello after taking tasks, a flood of credit and no answers, silence). Three rounds of 16 tasks
# with a publish after each. Every task must complete exactly once, every result must be the honest worker's and
# equal the trainer's own model:generate of that prompt (tokens and log-probabilities, bitwise), bad answers must
# be rejected and counted, and the repeat offenders quarantined, with the reason logged (issue 18, items 1, 2).
#   bash tests/chaos/test_bad_workers.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
SRC="$3"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-chaos-workers.XXXXXX")"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$out"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*"
    for f in "$out"/*.log "$out"/*.err; do [ -s "$f" ] && { echo "== $f"; tail -n 30 "$f"; }; done
    exit 1
}
MODES=(bad_ids nan_logprobs error future_version rehello credit_flood silence)

cat >"$out/trainer.lua" <<'LUA'
local ds4 = require("ds4")
local ffi = require("ffi")
local fix, dir, nworkers = arg[1], arg[2], tonumber(arg[3])
ds4.set_threads(1)
local policy = ds4.load(fix .. "/tiny_a")
local pool = ds4.rollout.pool{ bind = "tcp://127.0.0.1:*", insecure = true, model = policy, workers = nworkers,
    wait_s = 120, lease_s = 3, lease_rate = 1e9, dead_s = 3, timeout_s = 240 }
local f = assert(io.open(dir .. "/endpoint.tmp", "w"))
f:write(pool.endpoint)
f:close()
os.rename(dir .. "/endpoint.tmp", dir .. "/endpoint")
-- the reference: one more copy of the model, given each version's parameters in turn
local ref, weights = ds4.load(fix .. "/tiny_a"), { policy:params() }
local prompts = {}
for i = 1, 16 do prompts[i] = { 2 + i, (i * 37) % 250 + 2, 7 } end
local opts = { n = 2, max_new_tokens = 8, temperature = 1.0 }
local mismatches, foreign, results = 0, 0, 0
for round = 1, 3 do
    opts.seed = 100 + round
    local res = pool:generate(prompts, opts)
    for p = 1, #prompts do
        local o = {}
        for k, v in pairs(opts) do o[k] = v end
        o.seed = ds4.rollout.task_seed(opts.seed, p)
        ref:set_params(weights[res[(p - 1) * opts.n + 1].policy_version or 1])
        local want = ref:generate({ prompts[p] }, o)
        for s = 1, opts.n do
            local a, b = res[(p - 1) * opts.n + s], want[s]
            local same = a.finish_reason == b.finish_reason and #a.ids == #b.ids
            for j = 1, #b.ids do
                if a.ids[j] ~= b.ids[j] or a.logprobs[j] ~= b.logprobs[j] then same = false end
            end
            if not same then mismatches = mismatches + 1 end
            if a.worker ~= "honest" then foreign = foreign + 1 end
            results = results + 1
        end
    end
    local p = policy:params()
    local ptr = ffi.cast("float *", p:data_ptr())
    for i = 0, p:numel() - 1, 5 do ptr[i] = ptr[i] * 0.9 end
    policy:set_params(p)
    weights[pool:publish(policy)] = policy:params()
end
local st = pool:stats()
print(("summary: tasks %d completed %d failed %d results %d mismatches %d foreign %d invalid %d quarantined %d")
    :format(st.tasks, st.completed, st.failed, results, mismatches, foreign, st.invalid, st.quarantined))
pool:close()
LUA

"$DS4" run "$out/trainer.lua" "$FIX" "$out" $((1 + ${#MODES[@]})) >"$out/trainer.log" 2>"$out/trainer.err" &
T=$!
pids+=("$T")
for _ in $(seq 1 600); do [ -e "$out/endpoint" ] && break; sleep 0.1; done
[ -e "$out/endpoint" ] || fail "the trainer did not start"
EP="$(cat "$out/endpoint")"
"$DS4" worker --connect "$EP" --model "$FIX/tiny_a" --insecure --threads 1 --id honest --give-up 3600 \
    >"$out/honest.log" 2>&1 &
pids+=("$!")
for m in "${MODES[@]}"; do
    "$DS4" run "$SRC/tests/chaos/run_bad_worker.lua" "$EP" "$m" "bad-$m" "$FIX" 300 >"$out/bad-$m.log" 2>&1 &
    pids+=("$!")
done
wait "$T" || fail "the trainer failed"
line="$(grep '^summary: ' "$out/trainer.log")" || fail "no summary from the trainer"
echo "$line"
read -r _ _ tasks _ completed _ failed _ results _ mism _ foreign _ invalid _ quar <<<"$line"
[ "$tasks" = 48 ] && [ "$completed" = 48 ] || fail "$completed of $tasks tasks completed, want 48 of 48"
[ "$failed" = 0 ] || fail "$failed tasks failed"
[ "$results" = 96 ] || fail "$results results, want 96"
[ "$mism" = 0 ] || fail "$mism results differ from the trainer's own generation"
[ "$foreign" = 0 ] || fail "$foreign results came from a bad worker"
[ "$invalid" -ge 3 ] || fail "only $invalid bad answers rejected (bad ids, NaN log-probabilities, future versions)"
[ "$quar" -ge 5 ] || fail "only $quar workers quarantined"
for m in bad_ids nan_logprobs error future_version rehello; do
    grep -q "worker bad-$m quarantined" "$out/trainer.err" || fail "bad-$m was not quarantined"
done
grep -q "rejected samples for task .* from bad-bad_ids: sample 1 token 1 = 999999 is not a token id" \
    "$out/trainer.err" || fail "the out-of-range id is not named in the log"
grep -q "from bad-nan_logprobs: .*not finite" "$out/trainer.err" || fail "the NaN log-probabilities are not named"
grep -q "from bad-future_version: policy version" "$out/trainer.err" || fail "the future version is not named"
for p in "${pids[@]}"; do [ "$p" = "$T" ] || kill -TERM "$p" 2>/dev/null || true; done
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log "$out"/*.err 2>/dev/null; then
    fail "sanitizer reports"
fi
echo "1 passed, 0 failed"
