#!/usr/bin/env bash
# test_resume.sh — exact resume: examples/sft.lua trained 12 updates in one process, versus 5 updates, a
# checkpoint, a NEW process resuming from it, and 7 more updates. The per-step losses (as printed to
# metrics.jsonl, full double precision) and the final weights must be bit-identical, and the resumed run
# must really have started from the checkpoint (its metrics begin at step 6).
#   bash tests/test_resume.sh <path-to-ds4> <fixtures_dir> <source_dir> [SFT OPTION ...]
# Options after the third argument go to every sft.lua run (tests/test_resume_cuda.sh: --device cuda --dtype ...;
# tests/test_resume_lora.sh: --lora 4, where the adapters in the final checkpoint must be bit-identical too).
set -euo pipefail
DS4="$1"
SRC="$3"
shift 3
tmp="$(mktemp -d "${TMPDIR:-/tmp}/ds4-resume.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
common=(--steps 12 --batch 8 --quiet "$@")
"$DS4" run "$SRC/examples/sft.lua" "${common[@]}" --out "$tmp/full" --save-every 12 >/dev/null
# interrupted: the same schedule (--steps 12), stopped after update 5 by a one-line wrapper
cat >"$tmp/stop5.lua" <<LUA
-- run sft.lua but stop the process right after the checkpoint of update 5 is written
local real_save = nil
local ds4 = require("ds4")
real_save = ds4.checkpoints.save
ds4.checkpoints.save = function(root, step, ...)
    local r = real_save(root, step, ...)
    if step == 5 then os.exit(0, true) end -- close the state: no leak reports under LeakSanitizer
    return r
end
arg = { [0] = "$SRC/examples/sft.lua", $(printf '"%s", ' "${common[@]}") "--out", "$tmp/part", "--save-every", "5" }
dofile("$SRC/examples/sft.lua")
LUA
"$DS4" run "$tmp/stop5.lua" >/dev/null
[ -d "$tmp/part/ckpt/step_000005" ] || { echo "no checkpoint at update 5"; exit 1; }
# 5 training records and the held-out loss at step 0
[ "$(grep -c '"loss"' "$tmp/part/metrics.jsonl")" -eq 5 ] || { echo "the interrupted run did more than 5 updates"; exit 1; }
"$DS4" run "$SRC/examples/sft.lua" "${common[@]}" --out "$tmp/part" --save-every 12 --resume >/dev/null
lossline() { sed -n 's/.*[{ ]"loss": \([^,]*\),.*"step": \([0-9]*\),.*/\2 \1/p' "$1"; }
if ! diff <(lossline "$tmp/full/metrics.jsonl") <(lossline "$tmp/part/metrics.jsonl"); then
    echo "per-step losses differ between the uninterrupted and the resumed run"
    exit 1
fi
cmp "$tmp/full/ckpt/step_000012/model.safetensors" "$tmp/part/ckpt/step_000012/model.safetensors" ||
    { echo "final weights differ"; exit 1; }
cmp "$tmp/full/ckpt/step_000012/optimizer.safetensors" "$tmp/part/ckpt/step_000012/optimizer.safetensors" ||
    { echo "final optimizer state differs"; exit 1; }
if [ -f "$tmp/full/ckpt/step_000012/adapter_model.safetensors" ]; then # --lora: the adapters beside the weights
    cmp "$tmp/full/ckpt/step_000012/adapter_model.safetensors" "$tmp/part/ckpt/step_000012/adapter_model.safetensors" ||
        { echo "final LoRA adapters differ"; exit 1; }
    cmp "$tmp/part/ckpt/step_000005/model.safetensors" "$tmp/full/ckpt/step_000012/model.safetensors" ||
        { echo "LoRA: the frozen weights moved"; exit 1; }
fi
echo "resume${*:+ ($*)}: 12 losses and the final weights and moments are bit-identical"
echo "1 passed, 0 failed"
