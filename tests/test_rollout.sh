#!/usr/bin/env bash
# test_rollout.sh — remote rollouts for real: a trainer process (a ds4.rollout.pool on tcp://127.0.0.1 with CURVE
# keys from `ds4 keygen`) and three `ds4 worker` processes, all on this machine.
#   1. plain TCP without --insecure is refused, by the worker and by the pool, with a message saying why;
#   2. trainer 1 runs 3 rounds of 24 tasks (n = 4) with a publish after each; worker w2 is killed with -9 while it
#      holds leases and started again under the same id; a worker whose key is not in the allow-list is refused
#      at the CURVE handshake and the refusal is logged. The trainer checks and prints: every task completed
#      exactly once (completed = tasks, failed = 0, n results per prompt in order; w2's unanswered leases re-issued),
#      and every result equal to its own model:generate of that prompt with ds4.rollout.task_seed at the policy
#      version the result reports (tokens and log-probabilities, bitwise);
#   3. trainer 1 is killed with -9 and trainer 2 binds the same port: the workers notice ("unknown worker" /
#      silence), say hello again, and trainer 2's rounds complete with the same checks; before them, a raw DEALER
#      sends malformed frames and gets an error reply for each, and nobody crashes;
#      the workers batch their tasks continuously (up to 32 sequences, several tasks at once: checked in their
#      logs), round 2 with frequent stop ids so that sequences of one batch end at mixed lengths;
#   4. SIGTERM: each worker says bye and exits 0;
#   5. examples/dapo.lua --workers ipc://... --lora 4 with two local workers, tiny settings, --max-staleness 0: the
#      rollouts come from the workers and the trainer's recomputed log-probabilities equal theirs; the workers start
#      from the warmed-up base the trainer saved and fetch only the adapters (protocol 4), version after version.
#   bash tests/test_rollout.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
SRC="$3"
# $out, pids, fail, wait_for (KEEP=1: leave the logs and keys in $out, for debugging)
. "$(dirname "${BASH_SOURCE[0]}")/proc_lib.sh" rollout
LAST=
# Workers here wait for a trainer as long as the test runs (--give-up: without it a worker leaves after 120 s without
# a session, which the refused one and, under the sanitizers, the others between trainers can reach)
GIVE_UP=(--give-up 3600)
start_worker() { # id [extra args]: a CURVE worker of tiny_a on $EP
    local id="$1"
    shift
    "$DS4" worker --connect "$EP" --model "$FIX/tiny_a" --threads 1 --key "$out/$id.key" \
        --server-key "$out/trainer.pub" --id "$id" --verbose "${GIVE_UP[@]}" "$@" >>"$out/$id.log" 2>&1 &
    LAST=$!
    pids+=("$LAST")
}

# ------------------------------------------------------------------------------------------------ 1. plain TCP
set +e
"$DS4" worker --connect tcp://127.0.0.1:9 --model "$FIX/tiny_a" 2>"$out/plain_worker.err"
rc=$?
set -e
[ "$rc" = 2 ] || fail "a plain-TCP worker without --insecure must exit 2, got $rc"
grep -q "is plain TCP" "$out/plain_worker.err" || fail "no plain-TCP message from the worker"
if "$DS4" run - 2>"$out/plain_pool.err" <<<'require("ds4").rollout.pool{bind = "tcp://127.0.0.1:*"}'; then
    fail "a plain-TCP pool without insecure = true must fail"
fi
grep -q "is plain TCP" "$out/plain_pool.err" || fail "no plain-TCP message from the pool"
echo "plain TCP refused: ok"

for k in trainer w1 w2 w3 raw rogue; do "$DS4" keygen --out "$out/$k" >/dev/null; done

# ------------------------------------------------------------------------------------------------ the trainer
cat >"$out/trainer.lua" <<'LUA'
-- arg: fixtures mode(first|second) bind dir
local ds4 = require("ds4")
local ffi = require("ffi")
local fix, mode, bind, dir = arg[1], arg[2], arg[3], arg[4]
ds4.set_threads(1)
local function exists(p) local f = io.open(p) if f then f:close() return true end return false end
local function touch(p) assert(io.open(p, "w")):close() end
local policy = ds4.load(fix .. "/tiny_a")
policy:set_tokenizer(ds4.tokenizer()) -- byte-level (ids < 256 are bytes): the announce carries it, for stop strings
local done, paused = 0, false
local pool
pool = ds4.rollout.pool{ bind = bind, model = policy, workers = 3, wait_s = 60, dead_s = 4, timeout_s = 300,
    curve = { secret = dir .. "/trainer.key", public = dir .. "/trainer.pub",
              allow = { dir .. "/w1.pub", dir .. "/w2.pub", dir .. "/w3.pub", dir .. "/raw.pub" } },
    on_result = function()
        done = done + 1
        -- from the 6th result on, at the first result when w2 holds leases: hold still while the shell kills w2
        -- (its leases stay out). Waiting for w2's leases, not a fixed count: under load w2 can join after w1 and
        -- w3 have taken every task, and a w2 killed with nothing leased leaves nothing to re-issue.
        local w2 = mode == "first" and not paused and done >= 6 and pool:stats().workers.w2
        if w2 and w2.leases > 0 then
            paused = true
            touch(dir .. "/mid")
            for _ = 1, 300 do if exists(dir .. "/killed") then break end os.execute("sleep 0.1") end
        end
    end }
local f = assert(io.open(dir .. "/endpoint_" .. mode .. ".tmp", "w"))
f:write(pool.endpoint)
f:close()
os.rename(dir .. "/endpoint_" .. mode .. ".tmp", dir .. "/endpoint_" .. mode)
if mode == "second" then -- the malformed-message client goes first
    local t0 = os.time()
    while not exists(dir .. "/raw_done") and os.time() - t0 < 60 do pool:service(100) end
end
local function snapshot()
    local m = ds4.load(fix .. "/tiny_a")
    m:set_params(policy:params())
    return m
end
local versions = { snapshot() }
local prompts = {}
for i = 1, 24 do
    local p = {}
    for j = 1, 2 + i % 5 do p[j] = (i * 7 + j * 13) % 250 + 2 end
    prompts[i] = p
end
local opts = { n = 4, max_new_tokens = 40, temperature = 1.0, top_p = 0.95 }
local results, mismatches, order_bad, finishes = 0, 0, 0, {}
for r = 1, 3 do
    opts.seed = (mode == "first" and 100 or 200) + r
    -- round 2: frequent stop ids and stop strings (protocol v3), so that the sequences of a worker's batch end at
    -- mixed lengths
    opts.stop = r == 2 and { 3, 17, 42, 99, 150, 201, "!", "@A", "\x80" } or nil
    local res = pool:generate(prompts, opts)
    if #res ~= #prompts * opts.n then order_bad = order_bad + 1 end
    for p = 1, #prompts do
        local first = res[(p - 1) * opts.n + 1]
        local o = {}
        for k, v in pairs(opts) do o[k] = v end
        o.seed = ds4.rollout.task_seed(opts.seed, p)
        o.tokenizer = policy:tokenizer()
        local ref = versions[first.policy_version]:generate({ prompts[p] }, o)
        for s = 1, opts.n do
            local a, b = res[(p - 1) * opts.n + s], ref[s]
            if a.prompt_index ~= p or a.sample_index ~= s then order_bad = order_bad + 1 end
            local same = #a.ids == #b.ids and a.finish_reason == b.finish_reason and a.stop == b.stop
            finishes[a.finish_reason] = (finishes[a.finish_reason] or 0) + 1
            for j = 1, #b.ids do
                if a.ids[j] ~= b.ids[j] or a.logprobs[j] ~= b.logprobs[j] then same = false end
            end
            if not same then mismatches = mismatches + 1 end
            results = results + 1
        end
    end
    -- a "training step": new weights, published as the next policy version
    local p = policy:params()
    local ptr = ffi.cast("float *", p:data_ptr())
    for i = 0, p:numel() - 1, 5 do ptr[i] = ptr[i] * 0.9 end
    policy:set_params(p)
    versions[pool:publish(policy)] = snapshot()
end
local st = pool:stats()
print(("%s: tasks %d completed %d reissued %d duplicates %d failed %d results %d mismatches %d order %d versions %d "
    .. "curve_refused %d"):format(mode, st.tasks, st.completed, st.reissued, st.duplicates, st.failed, results,
    mismatches, order_bad, st.version, st.curve_refused or 0))
print(("%s finishes: stop_string %d stop_token %d length %d eos %d"):format(mode, finishes.stop_string or 0,
    finishes.stop_token or 0, finishes.length or 0, finishes.eos or 0))
io.stdout:flush()
if mode == "first" then
    touch(dir .. "/first_done")
    while true do pool:service(100) end -- until killed
end
pool:close()
LUA

check_run() { # log mode: every task exactly once, results equal the local generation
    local line
    line="$(grep "^$2: " "$1")" || fail "no summary line from trainer $2"
    echo "$line"
    read -r _ _ tasks _ completed _ reissued _ dups _ failed _ results _ mism _ order _ versions _ refused <<<"$line"
    [ "$tasks" = 72 ] && [ "$completed" = 72 ] || fail "trainer $2: $completed of $tasks tasks completed, want 72 of 72"
    [ "$failed" = 0 ] || fail "trainer $2: $failed tasks failed"
    [ "$results" = 288 ] || fail "trainer $2: $results results, want 288"
    [ "$mism" = 0 ] || fail "trainer $2: $mism results differ from the local model:generate"
    [ "$order" = 0 ] || fail "trainer $2: results out of order"
    [ "$versions" = 4 ] || fail "trainer $2: $versions policy versions, want 4"
    line="$(grep "^$2 finishes: " "$1")" || fail "no finishes line from trainer $2"
    echo "$line"
    read -r _ _ _ nstr _ ntok _ <<<"$line"
    [ "$nstr" -gt 0 ] && [ "$ntok" -gt 0 ] || fail "trainer $2: no sample ended by a stop string or a stop id"
    REISSUED=$reissued
    REFUSED=$refused
}

# ------------------------------------------------------------------------------------------------ 2. trainer 1
"$DS4" run "$out/trainer.lua" "$FIX" first "tcp://127.0.0.1:*" "$out" >"$out/t1.log" 2>"$out/t1.err" &
T1=$!
pids+=("$T1")
wait_for "$out/endpoint_first" 60 || fail "trainer 1 did not start"
EP="$(cat "$out/endpoint_first")"
echo "trainer 1 on $EP"
# --credits 8: at most 8 tasks in flight each (the batcher still holds several at once), so that the first worker to
# connect cannot take every task and w2 holds leases when it is killed
start_worker w1 --credits 8
start_worker w2 --credits 8
W2=$LAST
start_worker w3 --credits 8
# a worker with a key the trainer does not know: refused at the CURVE handshake
"$DS4" worker --connect "$EP" --model "$FIX/tiny_a" --threads 1 --key "$out/rogue.key" \
    --server-key "$out/trainer.pub" --id rogue "${GIVE_UP[@]}" >"$out/rogue.log" 2>&1 &
ROGUE=$!
pids+=("$ROGUE")
wait_for "$out/mid" 120 || fail "trainer 1 made no progress"
kill -9 "$W2"
wait "$W2" 2>/dev/null || true
touch "$out/killed"
echo "killed w2 (-9) mid-run; starting it again"
start_worker w2 --credits 8
wait_for "$out/first_done" 240 || fail "trainer 1 did not finish"
check_run "$out/t1.log" first
# w2 held leases when it was killed (the trainer pauses at a result while it does), but it may have answered them all
# in the moment before: such answers wait in the trainer's socket and complete their leases when it goes on, so a
# re-issue cannot be required here (CI saw 0 on a quiet machine; test_rollout_pool.lua's part (b) tests re-issue
# deterministically). What must hold either way was checked above: every task completed exactly once, no duplicate.
echo "trainer 1: $REISSUED lease(s) re-issued after w2 was killed"
grep -q "worker w2 joined" "$out/t1.err" || fail "w2 never joined"
[ "$(grep -c "worker w2 joined" "$out/t1.err")" -ge 2 ] || fail "the restarted w2 did not join again"
grep -qF "refused CURVE key $(cat "$out/rogue.pub")" "$out/t1.err" || fail "the unknown key's refusal is not logged"
grep -q "CURVE: refused" "$out/t1.err" || fail "the pool did not report the refusal"
[ "$REFUSED" -ge 1 ] || fail "the pool counted no CURVE refusal"
if grep -q "worker rogue joined" "$out/t1.err"; then fail "the rogue worker joined"; fi
echo "trainer 1: ok (w2 killed and back, every task once, rogue key refused)"

# ------------------------------------------------------------------------------------------------ 3. trainer 2
kill -9 "$T1"
wait "$T1" 2>/dev/null || true
echo "trainer 1 killed (-9); trainer 2 on the same port"
"$DS4" run "$out/trainer.lua" "$FIX" second "$EP" "$out" >"$out/t2.log" 2>"$out/t2.err" &
T2=$!
pids+=("$T2")
wait_for "$out/endpoint_second" 60 || fail "trainer 2 did not start"
"$DS4" run - "$EP" "$out" >"$out/raw.log" 2>&1 <<'LUA' || fail "the raw client failed"
-- a raw DEALER (an allowed key) sends malformed messages: each must get an error reply
local ds4 = require("ds4")
local ep, dir = arg[1], arg[2]
local zmq = ds4.zmq
local s = zmq.socket("DEALER")
local sec = zmq.read_key(dir .. "/raw.key")
s:set{ routing_id = "raw-client", curve_serverkey = zmq.read_key(dir .. "/trainer.pub"), curve_secretkey = sec,
    curve_publickey = zmq.public_from_secret(sec) }
s:connect(ep)
local credit = ds4.wire.encode({ t = "credit", n = 1 })
local cases = {
    -- peers of protocol versions 1 to 5 (a hello as they wrote it; 4: no streaming, no per-token versions; 5: no
    -- per-token versions in partial messages),
    -- first: the trainer logs at most 10 rejections of a peer per second: refused by version, whatever else they say
    { "a version 1 hello", { "\131\161v\1\161t\165hello\166worker\170raw-client" }, "version" },
    { "a version 2 hello", { "\131\161v\2\161t\165hello\166worker\170raw-client" }, "version" },
    { "a version 3 hello", { "\131\161v\3\161t\165hello\166worker\170raw-client" }, "version" },
    { "a version 4 hello", { "\131\161v\4\161t\165hello\166worker\170raw-client" }, "version" },
    { "a version 5 hello", { "\131\161v\5\161t\165hello\166worker\170raw-client" }, "version" },
    { "not a map", { "\193 garbage" }, "not_map" },
    { "truncated msgpack", { "\130\161v\1\161t" }, "parse" },
    { "another protocol version", { "\129\161v\7" }, "version" },
    { "an empty header", { "" }, "parse" },
    { "an undeclared raw frame", { credit[1], "extra" }, "frame" },
    { "an oversized header", { ("\144"):rep(70000) }, "limit" },
    { "an unknown message type", { "\130\161v" .. string.char(ds4.wire.VERSION) .. "\161t\164nope" }, "type" },
    { "a credit from an unknown worker", credit, "state" },
    { "a hello with another vocabulary", ds4.wire.encode({ t = "hello", worker = "raw-client", policy = 0,
        max_batch = 1, threads = 1, vocab_size = 7, n_params = 1, build = "raw" }), "refused" },
}
for _, c in ipairs(cases) do
    assert(s:send(c[2], { timeout = 5000 }), "send failed")
    local r = s:recv(10000)
    assert(r, "no reply to " .. c[1])
    local m = ds4.wire.decode(r)
    assert(m and m.t == "error", "the reply to " .. c[1] .. " is not an error message")
    assert(not c[3] or m.code_name == c[3], ("%s: got %s, want %s"):format(c[1], m.code_name, tostring(c[3])))
    print(("%s -> error %s: %s"):format(c[1], m.code_name, m.reason))
end
s:close()
assert(io.open(dir .. "/raw_done", "w")):close()
LUA
cat "$out/raw.log"
wait "$T2" || fail "trainer 2 failed"
check_run "$out/t2.log" second
grep -q "rejected a message from raw-client" "$out/t2.err" || fail "trainer 2 did not log the rejections"
grep -q "refused worker raw-client" "$out/t2.err" || fail "trainer 2 did not log the refused hello"
grep -q "protocol version 1, this build speaks version 6" "$out/t2.err" || fail "trainer 2 did not log the v1 refusal"
grep -q "protocol version 2, this build speaks version 6" "$out/t2.err" || fail "trainer 2 did not log the v2 refusal"
grep -q "protocol version 3, this build speaks version 6" "$out/t2.err" || fail "trainer 2 did not log the v3 refusal"
grep -q "protocol version 4, this build speaks version 6" "$out/t2.err" || fail "trainer 2 did not log the v4 refusal"
grep -q "protocol version 5, this build speaks version 6" "$out/t2.err" || fail "trainer 2 did not log the v5 refusal"
grep -q "a version 1 hello -> error version: .*protocol version 1" "$out/raw.log" || fail "no version error for v1"
grep -q "a version 2 hello -> error version: .*protocol version 2" "$out/raw.log" || fail "no version error for v2"
grep -q "a version 3 hello -> error version: .*protocol version 3" "$out/raw.log" || fail "no version error for v3"
grep -q "a version 4 hello -> error version: .*protocol version 4" "$out/raw.log" || fail "no version error for v4"
for id in w1 w2 w3; do
    grep -q "worker $id joined" "$out/t2.err" || fail "$id did not reconnect to trainer 2"
done
echo "trainer 2: ok (workers reconnected; malformed messages answered with errors)"
# continuous batching: a worker ran several tasks at once (and still matched model:generate of each, above)
most="$(grep -ho "admitted: [0-9]* tasks in the batcher" "$out"/w*.log | awk '{ if ($2 > m) m = $2 } END { print m + 0 }')"
[ "$most" -ge 3 ] || fail "no worker held 3 or more tasks in its batcher at once (at most $most)"
echo "continuous batching: up to $most tasks at once in a worker's batcher, results equal to local generation"

# ------------------------------------------------------------------------------------------------ 4. SIGTERM
for p in "${pids[@]}"; do
    [ "$p" = "$T1" ] || [ "$p" = "$T2" ] || [ "$p" = "$W2" ] || kill -TERM "$p" 2>/dev/null || true
done
for p in "${pids[@]}"; do
    [ "$p" = "$T1" ] || [ "$p" = "$T2" ] || [ "$p" = "$W2" ] || { wait "$p" || fail "a worker exited $? on SIGTERM"; }
done
grep -q "stopped:" "$out/w1.log" || fail "w1 did not stop cleanly"
echo "SIGTERM: every worker said bye and exited 0"
pids=()

# ------------------------------------------------------------------------------------------------ 5. dapo.lua
mkdir -p "$out/dapo"
sock="ipc://$out/dapo.sock"
# a small dataset in the user format and a short warm-up: the built-in task's 20,000-problem files and 64-row SFT
# batches take minutes under the sanitizers, and this part checks the rollout path, not learning
for i in $(seq 1 32); do echo "{\"prompt\": \"$i+1=\", \"answer\": \"$((i + 1))\"}"; done >"$out/dapo.jsonl"
"$DS4" run "$SRC/examples/dapo.lua" --data "$out/dapo.jsonl" --steps 3 --sft-steps 20 --sft-batch 16 --eval 8 \
    --prompts 6 --n 4 --max-new-tokens 14 \
    --out "$out/dapo" --quiet --workers "$sock" --n-workers 2 --max-staleness 0 --lora 4 >"$out/dapo.log" \
    2>"$out/dapo.err" &
D=$!
pids+=("$D")
wait_for "$out/dapo.log" 300 "start a worker: " || fail "dapo.lua printed no worker command line"
# the printed command line is what a user pastes: run it as it is (plus a thread count, an id, and --credits 2: a
# continuously batching worker would otherwise take every task of these small steps while the other one connects)
cmd="$(sed -n 's/^start a worker: //p' "$out/dapo.log")"
case "$cmd" in *" worker --connect $sock --model $out/dapo/worker_model"*) ;; *) fail "worker command: $cmd" ;; esac
for id in d1 d2; do
    eval "exec $cmd --threads 1 --id $id --credits 2 ${GIVE_UP[*]}" >"$out/$id.log" 2>&1 &
    pids+=("$!")
done
wait "$D" || fail "dapo.lua with workers failed"
grep -q "workers: .* tasks completed, 0 re-issued" "$out/dapo.log" || fail "dapo.lua: no worker summary"
grep -q "greedy accuracy on 8 held-out problems" "$out/dapo.log" || fail "dapo.lua did not finish"
grep -q "MB per version (the LoRA adapters)" "$out/dapo.log" || fail "dapo.lua --lora: no per-version size"
for id in d1 d2; do # started from the saved base: only adapters fetched, never the base
    grep -q "the starting weights are base version" "$out/$id.log" || fail "worker $id did not recognise the base"
    grep -q "loaded policy version [0-9]* (LoRA adapters)" "$out/$id.log" || fail "worker $id loaded no adapters"
    ! grep -q "fetched base" "$out/$id.log" || fail "worker $id fetched the base it had"
done
"$DS4" run - "$out/dapo/metrics.jsonl" <<'LUA' || fail "dapo.lua metrics"
local json = require("ds4.chat.json")
local n, trained = 0, 0
for line in io.lines(arg[1]) do
    local m = json.decode(line)
    if m.step > 0 then
        n = n + 1
        if m["logprob_mismatch/max"] then
            trained = trained + 1
            assert(m["logprob_mismatch/max"] < 1e-4, "worker vs trainer log-probs differ by " .. m["logprob_mismatch/max"])
        end
    end
end
assert(n == 3, n .. " RL steps")
print(("dapo metrics: %d steps, %d with training, worker log-probs equal the trainer's"):format(n, trained))
LUA
for p in "${pids[@]}"; do [ "$p" = "$D" ] || kill -TERM "$p" 2>/dev/null || true; done
for p in "${pids[@]}"; do [ "$p" = "$D" ] || { wait "$p" || fail "a dapo worker exited $? on SIGTERM"; }; done
pids=()
grep -Eq "stopped: [1-9][0-9]* tasks" "$out/d1.log" && grep -Eq "stopped: [1-9][0-9]* tasks" "$out/d2.log" ||
    fail "a dapo worker did no work"
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log "$out"/*.err 2>/dev/null; then
    fail "sanitizer reports in the logs above"
fi
echo "1 passed, 0 failed"
