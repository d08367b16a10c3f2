#!/usr/bin/env bash
# test_sft_lora.sh — examples/sft.lua --lora 8 trains LoRA adapters only on a small model built from scratch: the
# held-out loss falls (the script exits 1 otherwise), the frozen weights saved as RUN/base are bitwise the model the
# same seed builds, RUN/model is a PEFT adapter directory naming that base, and ds4.load(RUN/base, {lora = RUN/model})
# scores the held-out rows to the last bit of the loss the training process reported for its trained model (so the
# saved adapter is the trained one, with its rank, scale and targets). A misspelt --lora-targets is a usage error.
#   bash tests/test_sft_lora.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
SRC="$3"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-sft-lora.XXXXXX")"
trap 'rm -rf "$out"' EXIT
"$DS4" run "$SRC/examples/sft.lua" --steps 20 --batch 8 --lora 8 --lora-targets attention,shared,experts --out "$out/run" \
    --quiet >"$out/log"
grep -q "LoRA rank 8 (scale 2)" "$out/log"
[ "$(ls "$out/run/model" | tr '\n' ' ')" = "adapter_config.json adapter_model.safetensors " ] ||
    { echo "RUN/model must hold the adapter only: $(ls "$out/run/model")"; exit 1; }
"$DS4" run - "$out/run" "$SRC" 8 <<'LUA'
local ds4 = require("ds4")
local json = require("ds4.chat.json")
local run, src, B = arg[1], arg[2], tonumber(arg[3])
local cfg = json.decode(io.open(run .. "/model/adapter_config.json"):read("a"))
assert(cfg.r == 8 and cfg.lora_alpha == 16 and cfg.base_model_name_or_path == run .. "/base", "adapter_config.json")
local m = ds4.load(run .. "/base", { lora = run .. "/model" })
local tok, template = m:tokenizer()
-- the frozen weights: the model sft.lua builds for seed 1 (examples/small_model.lua), untouched
local fresh = ds4.new_model(dofile(src .. "/examples/small_model.lua")(tok), 1)
local a, b = m:params(), fresh:params()
assert(a:numel() == b:numel(), "parameter count")
for i = 1, a:numel() do assert(a[i] == b[i], "the frozen weights moved (parameter " .. i .. ")") end
-- the held-out loss as sft.lua computes it: token-mean over batches of --batch rows, EOS / -100 padding at the end
local eos = m:config().eos_token_id
local rows = ds4.data.read_jsonl(run .. "/heldout.jsonl", { format = "auto", tokenizer = tok,
    template = ds4.chat.get(template), render_opts = { thinking = false }, eos = eos })
local sum, n = 0, 0
for s = 1, #rows, B do
    local ids, labels, S = {}, {}, 0
    for i = s, math.min(#rows, s + B - 1) do S = math.max(S, #rows[i].ids) end
    for i = s, math.min(#rows, s + B - 1) do
        local x, l = {}, {}
        for t = 1, S do x[t], l[t] = rows[i].ids[t] or eos, rows[i].labels[t] or -100 end
        ids[#ids + 1], labels[#labels + 1] = x, l
    end
    local o = m:forward(ids, { labels = labels, train = false })
    sum, n = sum + o.loss * o.loss_tokens, n + o.loss_tokens
end
local reported
for line in io.lines(run .. "/metrics.jsonl") do
    local r = json.decode(line)
    if r["eval/loss"] and r.step > 0 then reported = r["eval/loss"] end
end
assert(sum / n == reported, ("reloaded adapter: held-out loss %.17g, the trained model's %.17g"):format(sum / n,
    reported))
print(("sft --lora: the saved adapter reproduces the held-out loss %.6f exactly"):format(reported))
LUA
rc=0
"$DS4" run "$SRC/examples/sft.lua" --steps 1 --lora 4 --lora-targets attention,mlp --out "$out/bad" --quiet \
    >/dev/null 2>"$out/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--lora: .*targets\[2\] = mlp" "$out/err" || { echo "bad --lora-targets: rc $rc"; cat "$out/err"; exit 1; }
echo "1 passed, 0 failed"
