#!/usr/bin/env bash
# test_external_readers.sh — the files ds4 writes load in the tools users bring (issue 17):
#   1. TensorBoard's own reader (EventAccumulator) loads the event files of an examples/sft.lua run: its scalars
#      (loss at every step, the held-out loss), and a text table written through ds4.runlog;
#   2. Hugging Face `tokenizers` loads the tokenizer.json a saved model carries and gives ds4's ids.
# Each part needs python3 with the package (pip install tensorboard tokenizers): a part whose package is missing is
# skipped, and the test exits 77 (ctest: skipped) when every part was. CI does not install them.
#   bash tests/test_external_readers.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$1"
SRC="$3"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-readers.XXXXXX")"
trap 'rm -rf "$out"' EXIT
has() { command -v python3 >/dev/null 2>&1 && python3 -c "import $1" >/dev/null 2>&1; }
ran=0

if has tensorboard && "$DS4" run - <<<'os.exit(require("ds4").tensorboard.available() and 0 or 1)'; then
    "$DS4" run "$SRC/examples/sft.lua" --steps 6 --batch 4 --eval 8 --out "$out/sft" --quiet >/dev/null
    "$DS4" run - "$out/sft" <<'LUA'
local log = require("ds4").runlog.open(arg[1] .. "/table", { tensorboard = true })
log:table(3, "completions", { "prompt", "completion" }, { { "1+1=", "\\boxed{2}" }, { "2+2=", "5" } })
log:close()
LUA
    python3 - "$out/sft" <<'PY'
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
run = sys.argv[1]
ea = EventAccumulator(run)
ea.Reload()
steps = [e.step for e in ea.Scalars("loss")]
assert steps == list(range(1, 7)), steps
held = [(e.step, e.value) for e in ea.Scalars("eval/loss")]
assert [s for s, _ in held] == [0, 6], held
assert held[1][1] < held[0][1], held
lr = [e.value for e in ea.Scalars("lr")]
assert all(v > 0 for v in lr), lr
t = EventAccumulator(run + "/table", size_guidance={"tensors": 0})
t.Reload()
ev = t.Tensors("completions")
assert len(ev) == 1 and ev[0].step == 3, ev
cells = [s.decode() for s in ev[0].tensor_proto.string_val]
assert cells == ["prompt", "completion", "1+1=", "\\boxed{2}", "2+2=", "5"], cells
assert [d.size for d in ev[0].tensor_proto.tensor_shape.dim] == [3, 2]
print("tensorboard: loss at steps 1..6, held-out loss 0 and 6 (falling), a 3x2 completions table")
PY
    ran=$((ran + 1))
else
    echo "tensorboard part skipped (python3 with tensorboard, and a ds4 built with protobuf-c, needed)"
fi

if has tokenizers; then
    "$DS4" run - "$out/model" <<'LUA'
local ds4 = require("ds4")
local m = ds4.new_model({ vocab_size = 280, hidden_size = 16, num_hidden_layers = 1, num_attention_heads = 2,
    head_dim = 8, qk_rope_head_dim = 4, q_lora_rank = 8, o_groups = 1, o_lora_rank = 8, sliding_window = 8,
    layer_types = { "sliding_attention" }, mlp_layer_types = { "moe" }, n_routed_experts = 2,
    num_experts_per_tok = 1, moe_intermediate_size = 8, hc_mult = 1, num_nextn_predict_layers = 0 }, 1)
m:set_tokenizer(ds4.tokenizer())
m:save(arg[1])
local f = assert(io.open(arg[1] .. "/ids.txt", "w"))
for _, s in ipairs({ "hello world", "wörld <｜User｜>hi<｜Assistant｜>", "a+b=\\boxed{12}" }) do
    f:write(table.concat(ds4.tokenizer():encode(s), ","), "\n")
end
f:close()
LUA
    python3 - "$out/model" <<'PY'
import sys
from tokenizers import Tokenizer
d = sys.argv[1]
t = Tokenizer.from_file(d + "/tokenizer.json")
want = [list(map(int, l.split(","))) for l in open(d + "/ids.txt").read().split()]
texts = ["hello world", "wörld <｜User｜>hi<｜Assistant｜>", "a+b=\\boxed{12}"]
for s, w in zip(texts, want):
    got = t.encode(s, add_special_tokens=False).ids
    assert got == w, (s, got, w)
print("tokenizers: a saved model's tokenizer.json loads and gives ds4's ids")
PY
    ran=$((ran + 1))
else
    echo "tokenizers part skipped (python3 with tokenizers needed)"
fi

[ "$ran" -gt 0 ] || exit 77
echo "1 passed, 0 failed"
