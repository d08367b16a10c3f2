#!/usr/bin/env bash
# test_rollout_partial.sh — streaming and partial rollouts (protocol 5) with real processes on ipc://: one trainer (a
# ds4.rollout.pool) and two `ds4 worker --partial-rollouts` processes.
#   1. a batch submitted with stream = 32 and long generations (512 tokens, eos ignored): partial results arrive while
#      it runs (cfg.on_partial), each continuing the last; once some have, the trainer publishes version 2. The
#      workers put version 2 in under their running sequences: answers carry each token's version, the tokens
#      before the switch are the trainer's own model:generate at version 1 (bitwise), versions never go back, the
#      result's policy_version is the oldest, and what was streamed begins every final result, with the same
#      per-token versions (protocol 6: partial messages carry them once a sequence went on under version 2);
#   2. trainer.run with async = {max_staleness = 1} and those workers: the staleness metrics count each sample by
#      its oldest token, and no sample trained is more than 1 version behind by that count.
# Bounded: ~10 s here; the trainer gives up after 120 s.
#   bash tests/test_rollout_partial.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
FIX="$2"
SRC="$3"
. "$(dirname "${BASH_SOURCE[0]}")/proc_lib.sh" partial # $out, pids, fail
EP="ipc://$out/pool.sock"

cat >"$out/trainer.lua" <<'LUA'
local ds4 = require("ds4")
local ffi = require("ffi")
local rl = require("ds4.rl")
local trainer = require("ds4.rl.trainer")
local fix, ep, dir = arg[1], arg[2], arg[3]
package.path = arg[4] .. "/tests/lua/?.lua;" .. package.path
local toy = require("toy_rl")
ds4.set_threads(1)
local streamed, partials, order_bad, sver, vparts = {}, 0, 0, {}, 0
local pool = ds4.rollout.pool{ bind = ep, model = ds4.load(fix .. "/tiny_a"), workers = 2, wait_s = 60,
    timeout_s = 120, quiet = true, heartbeat_s = 0.25, max_staleness = 1,
    on_partial = function(p, parts, worker, attempt)
        partials = partials + 1
        streamed[p], sver[p] = streamed[p] or {}, sver[p] or {}
        for s, part in ipairs(parts) do
            local seen, sv = streamed[p][s] or {}, sver[p][s] or {}
            streamed[p][s], sver[p][s] = seen, sv
            if part.offset ~= #seen then order_bad = order_bad + 1 end
            if part.versions then vparts = vparts + 1 end
            for j = 1, #part.ids do
                seen[#seen + 1] = part.ids[j]
                sv[#sv + 1] = part.versions and part.versions[j] or part.policy -- protocol 6
            end
        end
    end }
-- 1. streaming, and a publish while the batch runs
local v1 = ds4.load(fix .. "/tiny_a")
pool:publish(v1)
local prompts = {}
for i = 1, 8 do prompts[i] = { 3 + i, (i * 29) % 200 + 2, 7 } end
local opts = { n = 2, max_new_tokens = 512, temperature = 1.0, seed = 9, ignore_eos = true, stream = 32 }
local b = pool:submit(prompts, opts)
local t0 = os.time()
while partials < 1 and os.time() - t0 < 60 do pool:poll() end
local v2 = ds4.load(fix .. "/tiny_a")
local q = v2:params()
local ptr = ffi.cast("float *", q:data_ptr())
for i = 0, q:numel() - 1, 3 do ptr[i] = ptr[i] * 0.7 end
v2:set_params(q)
local published = pool:publish(v2)
local res = pool:collect(b)
local versions = { v1, v2 }
local mixed, prefix_bad, back, oldest_bad, stream_bad, whole_bad, sv_bad = 0, 0, 0, 0, 0, 0, 0
for p = 1, #prompts do
    local o = { n = 2, max_new_tokens = 512, temperature = 1.0, ignore_eos = true,
        seed = ds4.rollout.task_seed(opts.seed, p) }
    local ref = { v1:generate({ prompts[p] }, o), v2:generate({ prompts[p] }, o) }
    for s = 1, 2 do
        local r = res[(p - 1) * 2 + s]
        local tv = r.token_versions
        if tv then
            local cut = 0
            for j = 1, #tv do
                if j > 1 and tv[j] < tv[j - 1] then back = back + 1 end
                if tv[j] == 1 then cut = j end
            end
            if cut > 0 and cut < #tv then mixed = mixed + 1 end
            for j = 1, cut do
                if r.ids[j] ~= ref[1][s].ids[j] or r.logprobs[j] ~= ref[1][s].logprobs[j] then prefix_bad = prefix_bad + 1 end
            end
            if r.policy_version ~= tv[1] then oldest_bad = oldest_bad + 1 end
        else -- of one version: model:generate's at that version, whole
            local e = ref[r.policy_version][s]
            for j = 1, #e.ids do if r.ids[j] ~= e.ids[j] then whole_bad = whole_bad + 1 end end
        end
        local seen = streamed[p] and streamed[p][s] or {}
        for j = 1, #seen do if seen[j] ~= r.ids[j] then stream_bad = stream_bad + 1 end end
        -- the versions streamed with the tokens (protocol 6) are the answer's
        local sv = sver[p] and sver[p][s] or {}
        for j = 1, #sv do
            if sv[j] ~= (tv and tv[j] or r.policy_version) then sv_bad = sv_bad + 1 end
        end
    end
end
local st = pool:stats()
print(("partial: published %d partials %d order_bad %d mixed %d prefix_bad %d back %d oldest_bad %d stream_bad %d "
    .. "whole_bad %d mixed_answers %d versions_bad %d versioned_parts %d"):format(published, partials, order_bad, mixed,
    prefix_bad, back, oldest_bad, stream_bad, whole_bad, st.mixed_versions, sv_bad, vparts))
io.stdout:flush()
-- 2. asynchronous RL over partial-rollout workers
local policy = ds4.load(fix .. "/tiny_a")
pool:publish(policy)
local worst = 0
trainer.run(toy.config(pool, {
    model = policy, steps = 4, async = { max_staleness = 1 }, out = dir .. "/run",
    loss = function(mb, spec, o)
        for _, s in ipairs(mb) do worst = math.max(worst, pool.version - s.policy_version) end
        return rl.loss.compute(mb, spec, o)
    end,
}, 24))
local rows = require("ds4.plot").read_jsonl(dir .. "/run/metrics.jsonl")
local smax, has_mixed = 0, true
for _, r in ipairs(rows) do
    smax = math.max(smax, r["staleness/max"] or 0)
    has_mixed = has_mixed and r["staleness/mixed"] ~= nil
end
print(("async: steps %d worst_lag %d staleness_max %d mixed_metric %s"):format(#rows, worst, smax, tostring(has_mixed)))
pool:close()
LUA

"$DS4" run "$out/trainer.lua" "$FIX" "$EP" "$out" "$SRC" >"$out/trainer.log" 2>"$out/trainer.err" &
T=$!
pids+=("$T")
for id in p1 p2; do
    "$DS4" worker --connect "$EP" --threads 1 --id "$id" --max-batch 32 --partial-rollouts --give-up 120 --verbose \
        >"$out/$id.log" 2>&1 &
    pids+=("$!")
done
for _ in $(seq 1 1200); do kill -0 "$T" 2>/dev/null || break; sleep 0.1; done
kill -0 "$T" 2>/dev/null && fail "the trainer did not finish in 120 s"
wait "$T" || fail "the trainer failed"
cat "$out/trainer.log"
line="$(grep '^partial: ' "$out/trainer.log")" || fail "no summary of part 1"
read -r _ _ published _ partials _ order_bad _ mixed _ prefix_bad _ back _ oldest_bad _ stream_bad _ whole_bad \
    _ mixed_answers _ versions_bad _ versioned_parts <<<"$line"
[ "$published" = 2 ] || fail "version 2 was not published"
[ "$partials" -ge 8 ] || fail "only $partials partial results arrived"
[ "$order_bad" = 0 ] || fail "$order_bad partial results did not continue the last one"
[ "$mixed" -gt 0 ] || fail "no sequence went on under version 2"
[ "$mixed_answers" -gt 0 ] || fail "the pool counted no answer of mixed versions"
[ "$prefix_bad" = 0 ] || fail "$prefix_bad tokens before the switch differ from model:generate at version 1"
[ "$back" = 0 ] || fail "a sequence went back to older weights"
[ "$oldest_bad" = 0 ] || fail "policy_version is not the oldest token's version"
[ "$stream_bad" = 0 ] || fail "streamed tokens differ from the final results"
[ "$versions_bad" = 0 ] || fail "$versions_bad streamed tokens' versions differ from the final results' (protocol 6)"
[ "$versioned_parts" -gt 0 ] || fail "no partial message carried per-token versions"
[ "$whole_bad" = 0 ] || fail "a one-version result differs from model:generate"
grep -q "policy version 2 goes in under .* running tasks (partial rollouts)" "$out"/p1.log "$out"/p2.log ||
    fail "no worker logged a switch under running tasks"
line="$(grep '^async: ' "$out/trainer.log")" || fail "no summary of part 2"
read -r _ _ steps _ worst _ smax _ has_mixed <<<"$line"
[ "$steps" = 4 ] || fail "the async run did $steps steps, want 4"
[ "$worst" -le 1 ] || fail "a sample $worst versions behind (its oldest token) was trained"
[ "$smax" = "$worst" ] || fail "staleness/max ($smax) is not the oldest-token lag ($worst)"
[ "$has_mixed" = true ] || fail "no staleness/mixed metric"
for p in "${pids[@]}"; do [ "$p" = "$T" ] || kill -TERM "$p" 2>/dev/null || true; done
for p in "${pids[@]}"; do [ "$p" = "$T" ] || { wait "$p" || fail "a worker exited $? on SIGTERM"; }; done
pids=()
if grep -l "AddressSanitizer\|runtime error:\|LeakSanitizer" "$out"/*.log "$out"/*.err 2>/dev/null; then
    fail "sanitizer reports in the logs above"
fi
echo "1 passed, 0 failed"
