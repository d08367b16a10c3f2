#!/usr/bin/env bash
# test_worker_bootstrap.sh — protocol v2's worker bootstrap (issue 16), real processes on the loopback:
#   1. a worker started with only the trainer's address and keys (no --model, no local files) builds its model from
#      the trainer's weight_announce (config, hash-routing tables, weights) and trains with it: two policy versions,
#      every result's tokens and log-probabilities equal to the trainer's own model:generate at the version the
#      result reports (bitwise);
#   2. a worker whose --model has all-zero tid2eid tables (HF's placeholder) is refused with a message naming the
#      tables, by the trainer and by the worker itself, and exits 1: it never generates for that trainer;
#   3. a trainer of protocol version 4 (a raw ROUTER answering hello with a version-4 announce): the worker stops
#      with status 1 and a message naming the versions.
#   bash tests/test_worker_bootstrap.sh <path-to-ds4> <fixtures_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
. "$(dirname "${BASH_SOURCE[0]}")/proc_lib.sh" bootstrap # $out, pids, fail, wait_for
for k in trainer w1 w0; do "$DS4" keygen --out "$out/$k" >/dev/null; done

# A checkpoint of tiny_a whose hash-routing tables are all zero (every token to expert 0, K times)
"$DS4" run - "$FIX" "$out/zero" <<'LUA' || fail "cannot write the all-zero-tables checkpoint"
local ds4 = require("ds4")
local m = ds4.load(arg[1] .. "/tiny_a")
local t = m:tables()
assert(#t > 0, "tiny_a has no hash-routing tables: this test needs them")
m:set_tables(("\0"):rep(#t))
m:save(arg[2])
LUA

# ------------------------------------------------------------------------------------------------ 1. the trainer
cat >"$out/trainer.lua" <<'LUA'
local ds4 = require("ds4")
local ffi = require("ffi")
local fix, dir = arg[1], arg[2]
ds4.set_threads(1)
local policy = ds4.load(fix .. "/tiny_a")
-- max_staleness = 0: round 2's tasks need version 2, so the worker must fetch and load it (with a bound of 1 a
-- continuously batching worker may take all of round 2 before the download of version 2 ends, legitimately)
local pool = ds4.rollout.pool{ bind = "tcp://127.0.0.1:*", model = policy, workers = 1, wait_s = 60, max_staleness = 0,
    timeout_s = 300, curve = { secret = dir .. "/trainer.key", public = dir .. "/trainer.pub",
    allow = { dir .. "/w1.pub", dir .. "/w0.pub" } } }
local f = assert(io.open(dir .. "/endpoint.tmp", "w"))
f:write(pool.endpoint)
f:close()
os.rename(dir .. "/endpoint.tmp", dir .. "/endpoint")
local function snapshot()
    local m = ds4.load(fix .. "/tiny_a")
    m:set_params(policy:params())
    return m
end
local versions = {}
versions[pool:publish(policy)] = snapshot()
local prompts = {}
for i = 1, 6 do
    local p = {}
    for j = 1, 2 + i % 4 do p[j] = (i * 11 + j * 7) % 250 + 2 end
    prompts[i] = p
end
local opts = { n = 2, max_new_tokens = 24, temperature = 1.0 }
local results, mismatches, used = 0, 0, {}
for r = 1, 2 do
    opts.seed = 300 + r
    local res = pool:generate(prompts, opts)
    for p = 1, #prompts do
        local first = res[(p - 1) * opts.n + 1]
        used[first.policy_version] = true
        local o = { n = opts.n, max_new_tokens = opts.max_new_tokens, temperature = opts.temperature,
            seed = ds4.rollout.task_seed(opts.seed, p) }
        local ref = versions[first.policy_version]:generate({ prompts[p] }, o)
        for s = 1, opts.n do
            local a, b = res[(p - 1) * opts.n + s], ref[s]
            local same = #a.ids == #b.ids and a.finish_reason == b.finish_reason and #b.ids > 0
            for j = 1, #b.ids do
                if a.ids[j] ~= b.ids[j] or a.logprobs[j] ~= b.logprobs[j] then same = false end
            end
            if not same then mismatches = mismatches + 1 end
            results = results + 1
        end
    end
    -- a "training step": new weights, published as the next version
    local p = policy:params()
    local ptr = ffi.cast("float *", p:data_ptr())
    for i = 0, p:numel() - 1, 3 do ptr[i] = ptr[i] * 0.8 end
    policy:set_params(p)
    versions[pool:publish(policy)] = snapshot()
end
local st = pool:stats()
local nused = 0
for _ in pairs(used) do nused = nused + 1 end
print(("bootstrap: completed %d failed %d results %d mismatches %d versions_used %d refused %d"):format(st.completed,
    st.failed, results, mismatches, nused, st.refused))
io.stdout:flush()
-- stay up for the all-zero-tables worker, then leave
local t0 = os.time()
while not io.open(dir .. "/w0_done") and os.time() - t0 < 60 do pool:service(100) end
print(("after: refused %d"):format(pool:stats().refused))
pool:close()
LUA
"$DS4" run "$out/trainer.lua" "$FIX" "$out" >"$out/trainer.log" 2>"$out/trainer.err" &
T=$!
pids+=("$T")
wait_for "$out/endpoint" 30 || fail "the trainer did not bind"
EP="$(cat "$out/endpoint")"
# no --model: nothing but the address and the keys
"$DS4" worker --connect "$EP" --key "$out/w1.key" --server-key "$out/trainer.pub" --id w1 --threads 1 \
    --give-up 120 >"$out/w1.log" 2>&1 &
pids+=("$!")
W1=$!
for _ in $(seq 1 1800); do grep -q "^bootstrap: " "$out/trainer.log" && break; sleep 0.1; done
line="$(grep "^bootstrap: " "$out/trainer.log")" || fail "no summary from the trainer"
echo "$line"
read -r _ _ completed _ failed _ results _ mism _ vused _ _ <<<"$line"
[ "$completed" = 12 ] && [ "$failed" = 0 ] || fail "want 12 tasks completed, none failed"
[ "$results" = 24 ] && [ "$mism" = 0 ] || fail "$mism of $results results differ from the trainer's model:generate"
[ "$vused" = 2 ] || fail "the results came from $vused policy versions, want 2"
grep -q "built the trainer's model from its announce" "$out/w1.log" || fail "the worker did not build its model"
echo "worker without local files: ok (its results equal the trainer's, two versions)"

# ------------------------------------------------------------------------------------------------ 2. zero tables
rc=0
timeout 60 "$DS4" worker --connect "$EP" --model "$out/zero" --key "$out/w0.key" --server-key "$out/trainer.pub" \
    --id w0 --threads 1 --give-up 30 >"$out/w0.log" 2>&1 || rc=$?
touch "$out/w0_done"
[ "$rc" = 1 ] || fail "the all-zero-tables worker must exit 1, got $rc"
grep -q "tid2eid" "$out/w0.log" || fail "the worker's refusal does not name the tables"
grep -q "refused worker w0: hash-routing tables (tid2eid) differ" "$out/trainer.err" || fail "the trainer did not refuse w0"
grep -q "worker w0 joined" "$out/trainer.err" && fail "the all-zero-tables worker joined"
wait "$T" || fail "the trainer failed"
echo "all-zero tid2eid worker refused: ok"
kill "$W1" 2>/dev/null || true

# ------------------------------------------------------------------------------------------------ 3. a v4 trainer
sock="ipc://$out/v1.sock"
"$DS4" run - "$sock" "$out" >"$out/v1.log" 2>&1 <<'LUA' &
local ds4 = require("ds4")
local s = ds4.zmq.socket("ROUTER")
s:set{ linger = 0 }
s:bind(arg[1])
assert(io.open(arg[2] .. "/v1_bound", "w")):close()
local t0 = os.time()
while os.time() - t0 < 30 do
    local fr = s:recv(200)
    if fr then
        local peer = fr[1]
        -- what a version-4 trainer sends (as far as this worker reads it): this build's announce with "v" = 4 (the
        -- first key, so byte 4)
        local msg = ds4.wire.encode({ t = "weight_announce", version = 1, n_params = 1, chunk = 4, crc = 0,
            config = "{}" })
        msg[1] = msg[1]:sub(1, 3) .. "\4" .. msg[1]:sub(5)
        assert(msg[1]:byte(2) == 0xa1 and msg[1]:sub(3, 3) == "v", "the header does not start with v")
        table.insert(msg, 1, peer)
        s:send(msg)
    end
    if io.open(arg[2] .. "/v1_done") then break end
end
s:close()
LUA
pids+=("$!")
wait_for "$out/v1_bound" 30 || fail "the fake v1 trainer did not bind"
rc=0
timeout 60 "$DS4" worker --connect "$sock" --id wv --threads 1 --give-up 30 >"$out/wv.log" 2>&1 || rc=$?
touch "$out/v1_done"
[ "$rc" = 1 ] || fail "a worker facing a version-4 trainer must exit 1, got $rc"
grep -q "protocol version 4, this build speaks version 6" "$out/wv.log" || fail "no version message from the worker"
echo "version-4 trainer refused: ok"
