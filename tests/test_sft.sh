#!/usr/bin/env bash
# test_sft.sh — examples/sft.lua trains a small model from scratch: it exits 0 only when the held-out loss
# fell (the script checks that itself against its own pre-training loss), and every step appends one JSON
# line with step, loss, lr, grad_norm, tokens and tokens_per_s (plus the held-out loss at steps 0 and N).
#   bash tests/test_sft.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
SRC="$3"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-sft.XXXXXX")"
trap 'rm -rf "$out"' EXIT
steps=40
"$DS4" run "$SRC/examples/sft.lua" --steps "$steps" --out "$out" --quiet | tee "$out/log"
grep -q "held-out loss after training" "$out/log"
[ "$(wc -l <"$out/metrics.jsonl")" -eq $((steps + 2)) ] || { echo "metrics.jsonl: expected $steps + 2 lines"; exit 1; }
"$DS4" run - "$out/metrics.jsonl" <<'LUA'
local json = require("ds4.chat.json")
local first, last, n = nil, nil, 0
local held = {}
for line in io.lines(arg[1]) do
    local m = json.decode(line)
    if m["eval/loss"] then held[#held + 1] = m goto continue end
    for _, k in ipairs({ "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s" }) do
        assert(type(m[k]) == "number", "metrics line " .. (n + 1) .. " lacks " .. k)
    end
    n = n + 1
    assert(m.step == n, "steps are consecutive")
    first = first or m.loss
    last = m.loss
    ::continue::
end
assert(#held == 2 and held[1].step == 0 and held[2].step == n, "the held-out loss at steps 0 and " .. n)
assert(held[2]["eval/loss"] < held[1]["eval/loss"], "the held-out loss fell")
-- the training loss falls well below its random-initialisation value (ln 280 ≈ 5.6)
assert(last < 0.6 * first, ("training loss %g -> %g did not fall"):format(first, last))
print(("sft metrics ok: %d steps, loss %.3f -> %.3f"):format(n, first, last))
LUA
echo "1 passed, 0 failed"
