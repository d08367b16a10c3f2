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
    if m.step > 0 then
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
small=(--steps 3 --sft-steps 30 --eval 24 --prompts 6 --n 4 --max-new-tokens 14)
"$DS4" run "$SRC/examples/dapo.lua" "${small[@]}" --out "$out/dapo" --quiet | tee "$out/log"
grep -q "greedy accuracy on 24 held-out problems" "$out/log"
check "$out/dapo" 3
for v in grpo gspo; do
    "$DS4" run "$SRC/examples/$v.lua" "${small[@]}" --out "$out/$v" --quiet >"$out/$v.log"
    check "$out/$v" 3
done
# a user's own dataset: {"prompt", "answer"} lines; a bad line is reported with its line number
printf '{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+4=", "answer": 7}\n' >"$out/mine.jsonl"
for i in $(seq 1 30); do echo "{\"prompt\": \"$i+1=\", \"answer\": \"$((i + 1))\"}"; done >>"$out/mine.jsonl"
"$DS4" run "$SRC/examples/dapo.lua" --data "$out/mine.jsonl" --eval 8 --steps 2 --sft-steps 5 --prompts 4 --n 4 \
    --out "$out/mine" --quiet >"$out/mine.log"
check "$out/mine" 2
echo '{"prompt": 5}' >"$out/bad.jsonl"
if "$DS4" run "$SRC/examples/dapo.lua" --data "$out/bad.jsonl" --out "$out/bad" --quiet 2>"$out/bad.err"; then
    echo "a malformed dataset must fail"; exit 1
fi
grep -q "bad.jsonl:1" "$out/bad.err" || { cat "$out/bad.err"; exit 1; }
if "$DS4" run "$SRC/examples/dapo.lua" --nope 2>/dev/null; then echo "unknown option must fail"; exit 1; fi
echo "1 passed, 0 failed"
