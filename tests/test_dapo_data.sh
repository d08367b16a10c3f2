#!/usr/bin/env bash
# test_dapo_data.sh — examples/dapo.lua (ds4.rl.trainer) on a user's data, configured from a file, checkpointed and
# resumed (issue 17):
#   1. conversational prompts (TRL: "prompt" a list of messages) rendered with the chat template, the generation
#      prompt appended and the thinking mode chosen (--thinking): the logged completions show the rendered prompt;
#      verl's layout (reward_model.ground_truth) through --columns verl;
#   2. --config FILE with an algorithm table, a dotted override on the command line, the effective configuration
#      in RUN/config.lua; a misspelt algorithm field or an unknown algorithm is a usage error naming it;
#   3. --save-every 2 and --resume: a run stopped right after its checkpoint of step 2 and resumed in a new process
#      gives the uninterrupted run's metrics (every number but the timings) and final weights, bit for bit, and
#      does not redo the SFT warm-up;
#   4. the run directory: metrics.svg with reward, loss, KL and entropy panels; TensorBoard events (when built with
#      protobuf-c); completions.jsonl.
#   bash tests/test_dapo_data.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$(realpath "$1")"
SRC="$(realpath "$3")"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-dapodata.XXXXXX")"
trap 'rm -rf "$out"' EXIT
cd "$out"
fail() { echo "FAIL: $*"; exit 1; }
small=(--steps 2 --sft-steps 4 --sft-batch 8 --prompts 4 --n 2 --max-new-tokens 6 --minibatches 1 --quiet
       --log-completions 1)
dapo() { "$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" "$@"; }

# ------------------------------------------------------------------------------------------------ 1. chat prompts
for i in $(seq 1 12); do
    echo "{\"prompt\": [{\"role\": \"system\", \"content\": \"answer briefly\"}, {\"role\": \"user\", \"content\": \"$i+2=\"}], \"answer\": $((i + 2))}"
done >chat.jsonl
dapo --data chat.jsonl --eval 4 --thinking --out chat >chat.log 2>&1 || { cat chat.log; fail "conversational prompts"; }
"$DS4" run - chat/completions.jsonl <<'LUA' || fail "the logged prompts are not the rendered conversations"
local json = require("ds4.chat.json")
local n = 0
for line in io.lines(arg[1]) do
    local r = json.decode(line)
    assert(r.prompt:find("<｜User｜>", 1, true) and r.prompt:find("<｜Assistant｜><think>$"), r.prompt)
    assert(r.prompt:find("answer briefly", 1, true), "the system turn is rendered: " .. r.prompt)
    n = n + 1
end
assert(n > 0, "no completions logged")
LUA
for i in $(seq 1 12); do
    echo "{\"data_source\": \"toy\", \"prompt\": [{\"role\": \"user\", \"content\": \"$i+3=\"}], \"ability\": \"math\", \"reward_model\": {\"style\": \"rule\", \"ground_truth\": \"$((i + 3))\"}}"
done >verl.jsonl
dapo --data verl.jsonl --eval 4 --columns verl --out verl >verl.log 2>&1 || { cat verl.log; fail "verl layout"; }
grep -q '<｜Assistant｜></think>' verl/completions.jsonl || fail "chat mode without --thinking"
rc=0
dapo --data verl.jsonl --eval 4 --out verl2 >/dev/null 2>err.txt || rc=$?
[ "$rc" = 1 ] && grep -q 'verl.jsonl:1: "answer" must be a string or a finite number, got missing' err.txt ||
    { cat err.txt; fail "verl rows without --columns verl: exit $rc"; }

# ------------------------------------------------------------------------------------------------ 2. config files
cat >run.lua <<EOF
return {
    data = "$out/chat.jsonl", eval = 4,
    algorithm = { name = "grpo", loss = { eps_high = 0.3 } },
    lr = 1e-4,
}
EOF
dapo --config run.lua --algorithm.loss.eps_low 0.1 --lr 2e-4 --out cfg >cfg.log 2>&1 || { cat cfg.log; fail "--config"; }
"$DS4" run - cfg/config.lua <<'LUA' || fail "the effective configuration"
local c = dofile(arg[1])
assert(c.algorithm.name == "grpo" and c.algorithm.loss.eps_high == 0.3, "the file's algorithm table")
assert(c.algorithm.loss.eps_low == 0.1, "the command line's dotted field")
assert(c.lr == 2e-4 and c.eval == 4 and c.steps == 2, "the command line over the file")
LUA
grep -q "^grpo: " cfg.log || fail "the algorithm's name comes from the config file"
bad() { # message args...
    local msg="$1" rc=0
    shift
    dapo --data chat.jsonl --eval 4 "$@" >/dev/null 2>err.txt || rc=$?
    [ "$rc" = 2 ] && grep -qF -- "$msg" err.txt || { cat err.txt; fail "dapo.lua $*: exit $rc, want 2 and '$msg'"; }
}
bad "--algorithm.loss.eps_hgh: no such field" --algorithm.loss.eps_hgh 0.3 --out bad1
bad "unknown algorithm 'ppo'" --algorithm ppo --out bad2
bad "unknown option '--step' (did you mean --steps?)" --step 3

# ------------------------------------------------------------------------------------------------ 3. resume
for i in $(seq 1 30); do echo "{\"prompt\": \"$i+1=\", \"answer\": \"$((i + 1))\"}"; done >plain.jsonl
res=(--data "$out/plain.jsonl" --eval 4 --algorithm grpo --steps 4 --save-every 2)
dapo "${res[@]}" --out full >full.log 2>&1 || { cat full.log; fail "the uninterrupted run"; }
cat >stop2.lua <<EOF
-- dapo.lua, ended right after its checkpoint of RL step 2 (step_000002: one update per step)
local ds4 = require("ds4")
local real_save = ds4.checkpoints.save
ds4.checkpoints.save = function(root, step, ...)
    local r = real_save(root, step, ...)
    if step == 2 then os.exit(0, true) end
    return r
end
arg = { [0] = "$SRC/examples/dapo.lua", $(printf '"%s", ' "${small[@]}" "${res[@]}") "--out", "$out/part" }
dofile("$SRC/examples/dapo.lua")
EOF
"$DS4" run stop2.lua >part1.log 2>&1 || { cat part1.log; fail "the interrupted run"; }
[ -f part/ckpt/step_000002/COMPLETE ] && [ ! -e part/ckpt/step_000004 ] || fail "not stopped after step 2"
dapo "${res[@]}" --out part --resume >part2.log 2>&1 || { cat part2.log; fail "the resumed run"; }
grep -q "greedy accuracy before SFT" part1.log || fail "the first run did no SFT warm-up"
if grep -q "greedy accuracy before SFT" part2.log; then fail "the resumed run did the SFT warm-up again"; fi
"$DS4" run - full/metrics.jsonl part/metrics.jsonl <<'LUA' || fail "resumed metrics differ"
local json = require("ds4.chat.json")
local TIMING = { seconds = 1, tokens_per_s = 1, ["time/generate"] = 1, ["time/reward"] = 1, ["time/train"] = 1,
    ["time/eval"] = 1 }
local function rows(p) local t = {} for l in io.lines(p) do t[#t + 1] = json.decode(l) end return t end
local a, b = rows(arg[1]), rows(arg[2])
assert(#a == #b, ("%d records uninterrupted, %d resumed"):format(#a, #b))
for i, r in ipairs(a) do
    for k, v in pairs(r) do
        if not TIMING[k] then assert(b[i][k] == v, ("record %d (step %s): %s = %s, resumed %s"):format(i, r.step, k,
            tostring(v), tostring(b[i][k]))) end
    end
end
print(("resume: %d records equal"):format(#a))
LUA
cmp full/ckpt/step_000004/model.safetensors part/ckpt/step_000004/model.safetensors ||
    fail "the final weights differ after a resume"
cmp full/ckpt/step_000004/optimizer.safetensors part/ckpt/step_000004/optimizer.safetensors ||
    fail "the final optimizer state differs after a resume"
[ -f part/ckpt/step_000004/tokenizer.json ] || fail "an RL checkpoint carries the tokenizer"

# ------------------------------------------------------------------------------------------------ 4. run directory
for t in "reward and held-out accuracy" "policy loss" ">KL<" ">entropy<"; do
    grep -qF -- "$t" full/metrics.svg || fail "metrics.svg lacks the panel '$t'"
done
[ -s full/completions.jsonl ] || fail "no completions.jsonl"
if "$DS4" run - <<<'os.exit(require("ds4").tensorboard.available() and 0 or 1)'; then
    ls full/events.out.tfevents.* >/dev/null 2>&1 || fail "no TensorBoard events"
fi
echo "1 passed, 0 failed"
