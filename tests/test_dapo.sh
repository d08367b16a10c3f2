#!/usr/bin/env bash
# test_dapo.sh — examples/dapo.lua (and its GRPO / GSPO variants) run end to end in a few seconds with small
# settings: every RL step writes a metrics line with the keys the issue names, the run ends with an SVG plot,
# and the trainer's recomputed old log-probabilities equal the rollout engine's (logprob_mismatch/max < 1e-4:
# the same fp32 kernels on the same tokens; a misaligned gather of response positions would show up as O(1)).
# The accuracy gain itself is a 10-minute run, measured and reported in README.md, not asserted here.
#   bash tests/test_dapo.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
SRC="$3"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-dapo.XXXXXX")"
trap 'rm -rf "$out"' EXIT
check() { # $1 = run directory, $2 = steps
    "$DS4" run - "$1/metrics.jsonl" "$2" <<'LUA'
local json = require("ds4.chat.json")
local want, n, evals = tonumber(arg[2]), 0, 0
for line in io.lines(arg[1]) do
    local m = json.decode(line)
    if m.step > 0 then -- every step trains here (see the dataset below)
        n = n + 1
        for _, k in ipairs({ "step", "reward/mean", "kl", "clip_frac", "entropy", "response_len/mean",
                             "logprob_mismatch/max", "tokens_per_s" }) do
            assert(type(m[k]) == "number", ("metrics line %d lacks %s"):format(n, k))
        end
        assert(m["logprob_mismatch/max"] < 1e-4, "rollout vs recomputed log-probs differ by " .. m["logprob_mismatch/max"])
        assert(m.entropy > 0, "entropy must be positive")
    end
    if m["eval/accuracy"] then evals = evals + 1 end
end
assert(n == want, ("%d RL metrics lines, expected %d"):format(n, want))
assert(evals >= 2, "accuracy evaluated before and after")
print(("metrics ok: %d steps, %d evaluations"):format(n, evals))
LUA
    grep -q "<svg" "$1/metrics.svg"
}
# a small dataset in the user format ({"prompt", "answer"} lines): easy enough that 40 SFT steps give mixed
# groups (some samples right, some wrong), so every RL step trains and reports its metrics
for i in $(seq 1 40); do echo "{\"prompt\": \"$i+1=\", \"answer\": \"$((i + 1))\"}"; done >"$out/mine.jsonl"
echo '{"prompt": "3+4=", "answer": 7}' >>"$out/mine.jsonl"   # a numeric answer is accepted too
# The first run does the SFT warm-up and saves its model; the others start from that checkpoint (--model, the
# HF-checkpoint path a user takes), which keeps the test short under the sanitizers.
small=(--data "$out/mine.jsonl" --eval 8 --steps 3 --prompts 6 --n 4 --max-new-tokens 14 --minibatches 1)
"$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" --sft-steps 40 --sft-batch 32 --save "$out/model" \
    --out "$out/dapo" --quiet | tee "$out/log"
grep -q "greedy accuracy on 8 held-out problems" "$out/log"
grep -q "model saved to" "$out/log"
check "$out/dapo" 3
from=(--model "$out/model" --tokenizer byte --sft-steps 0)
for v in grpo gspo; do
    "$DS4" run "$SRC/examples/$v.lua" "${small[@]}" "${from[@]}" --out "$out/$v" --quiet >"$out/$v.log"
    check "$out/$v" 3
done
# routing replay: the training forwards use the rollout's experts and indexer picks (mismatch still 0)
"$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" "${from[@]}" --routing-replay --out "$out/replay" --quiet \
    >"$out/replay.log"
check "$out/replay" 3
# the indexer KL loss in RL (--indexer-kl), over 2 micro-batches: every step logs indexer_kl, finite and positive
# (its normalisation over micro-batches and ranks is tests/lua/test_rl_indexer_kl.lua's and dist_rl_indexer_kl.lua's)
"$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" "${from[@]}" --indexer-kl 0.5 --micro-batches 2 --out "$out/ikl" \
    --quiet >"$out/ikl.log"
check "$out/ikl" 3
"$DS4" run - "$out/ikl/metrics.jsonl" <<'LUA'
local json = require("ds4.chat.json")
local n = 0
for line in io.lines(arg[1]) do
    local m = json.decode(line)
    if m.step > 0 then
        assert(type(m.indexer_kl) == "number" and m.indexer_kl > 0 and m.indexer_kl < math.huge,
            "step " .. m.step .. ": indexer_kl " .. tostring(m.indexer_kl))
        n = n + 1
    end
end
print(("indexer KL: logged on %d steps"):format(n))
LUA
# LoRA: the same loop trains only rank-4 adapters; the rollout's and the trainer's log-probabilities agree exactly.
# Two steps with a checkpoint (adapters beside the frozen weights), then a new process resumes for the third.
"$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" "${from[@]}" --lora 4 --steps 2 --save-every 2 --out "$out/lora" \
    --quiet >/dev/null
test -f "$out/lora/ckpt/step_000002/adapter_model.safetensors"
"$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" "${from[@]}" --lora 4 --save-every 2 --resume --save "$out/adapter" \
    --out "$out/lora" --quiet >"$out/lora.log"
check "$out/lora" 3 # each step once: a resume that started over would have logged steps 1 and 2 twice
grep -q "LoRA adapter saved to" "$out/lora.log"
test -f "$out/adapter/adapter_config.json" && test -f "$out/adapter/adapter_model.safetensors"
"$DS4" run - "$out/lora/metrics.jsonl" <<'LUA'
local json = require("ds4.chat.json")
for line in io.lines(arg[1]) do
    local m = json.decode(line)
    if m.step > 0 then assert(m["logprob_mismatch/max"] == 0, "LoRA: mismatch " .. m["logprob_mismatch/max"]) end
end
print("lora: logprob_mismatch exactly 0")
LUA
# the built-in task (generated data, held-out problems excluded from training) runs end to end
"$DS4" run "$SRC/examples/dapo.lua" --steps 1 --sft-steps 2 --eval 16 --prompts 4 --n 2 --out "$out/builtin" \
    --quiet >"$out/builtin.log"
grep -q "greedy accuracy on 16 held-out problems" "$out/builtin.log"
grep -q '"prompt"' "$out/builtin/train.jsonl"
# what a dataset or the options get wrong is refused before anything trains, naming the line or the option:
# too few rows for --eval (they all became held-out problems and SFT crashed on an empty set), a null answer
# (it became the string "json.null"), an empty prompt (it crashed the run after SFT)
k=0
fails() { # expected-exit-status expected-message args...
    local want="$1" msg="$2" rc=0
    shift 2
    k=$((k + 1)) # a directory per run: one that holds a run is refused
    "$DS4" run "$SRC/examples/dapo.lua" --out "$out/fail$k" --quiet "$@" >/dev/null 2>"$out/fail.err" || rc=$?
    [ "$rc" = "$want" ] || { echo "dapo.lua $*: exit $rc, want $want"; cat "$out/fail.err"; exit 1; }
    grep -qF -- "$msg" "$out/fail.err" || { echo "dapo.lua $*: no message '$msg'"; cat "$out/fail.err"; exit 1; }
}
head -n 3 "$out/mine.jsonl" >"$out/three.jsonl"
fails 2 "has 3 problems and --eval 200 would hold out more than all of them" --data "$out/three.jsonl"
head -n 1 "$out/mine.jsonl" >"$out/one.jsonl"
fails 2 "has 1 problem: nothing can be held out" --data "$out/one.jsonl" --eval 2
fails 2 "--eval must be an integer >= 1" --eval 0
fails 2 "--indexer-kl must be a finite number >= 0" --indexer-kl -1
{ cat "$out/three.jsonl"; echo '{"prompt": "1+1=", "answer": null}'; } >"$out/null.jsonl"
fails 1 'null.jsonl:4: "answer" must be a string or a finite number, got null' --data "$out/null.jsonl" --eval 1
{ cat "$out/three.jsonl"; echo '{"prompt": "", "answer": 2}'; } >"$out/empty.jsonl"
fails 1 'empty.jsonl:4: "prompt" is empty' --data "$out/empty.jsonl" --eval 1
# a diverging policy (lr 1e3) stops with the step and the metric named instead of finishing with exit status 0
fails 1 "trainer.run: step 1: kl = " "${small[@]}" "${from[@]}" --minibatches 2 --lr 1e3 --steps 4
echo '{"prompt": 5}' >"$out/bad.jsonl"
if "$DS4" run "$SRC/examples/dapo.lua" --data "$out/bad.jsonl" --out "$out/bad" --quiet 2>"$out/bad.err"; then
    echo "a malformed dataset must fail"; exit 1
fi
grep -q "bad.jsonl:1" "$out/bad.err" || { cat "$out/bad.err"; exit 1; }
if "$DS4" run "$SRC/examples/dapo.lua" --nope 2>/dev/null; then echo "unknown option must fail"; exit 1; fi
echo "1 passed, 0 failed"
