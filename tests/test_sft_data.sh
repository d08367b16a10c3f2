#!/usr/bin/env bash
# test_sft_data.sh — examples/sft.lua on a user's dataset and model, configured from a file (issue 17):
#   1. --data with {"messages"} rows (system, user, assistant with a tool call, tool turns) and --eval-data: trains,
#      writes config.lua, metrics.jsonl, and RUN/model with its tokenizer;
#   2. {"prompt", "completion"} rows on that saved model (--model: its tokenizer and template are picked up), and
#      conversational prompt/completion rows with --chat-template chatml;
#   3. --config FILE: the options from a Lua file, the command line over it (--lr, --columns.messages dotted);
#      the effective configuration written by one run reproduces its losses exactly in another (--config
#      RUN/config.lua --out OTHER);
#   4. run directories: without --out each run gets runs/sft/<id> and runs/sft/latest; a directory holding a run
#      is refused without --resume; --resume continues runs/sft/latest;
#   5. bad data and options fail before training, naming the file, line and field or the option.
#   bash tests/test_sft_data.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
DS4="$(realpath "$1")"
SRC="$(realpath "$3")"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-sftdata.XXXXXX")"
trap 'rm -rf "$out"' EXIT
cd "$out"
fail() { echo "FAIL: $*"; exit 1; }
sft() { "$DS4" run "$SRC/examples/sft.lua" --quiet --steps 4 --batch 2 "$@"; }
# fails WANT_STATUS MESSAGE ARGS...: sft.lua exits WANT_STATUS and stderr holds MESSAGE
fails() {
    local want="$1" msg="$2" rc=0
    shift 2
    sft "$@" >/dev/null 2>err.txt || rc=$?
    [ "$rc" = "$want" ] || { cat err.txt; fail "sft.lua $*: exit $rc, want $want"; }
    grep -qF -- "$msg" err.txt || { cat err.txt; fail "sft.lua $*: no message '$msg'"; }
}
# the training losses of a run, one per line
losses() { sed -n 's/.*[{ ]"loss": \([^,]*\),.*"step": \([0-9]*\),.*/\2 \1/p' "$1/metrics.jsonl"; }

# ------------------------------------------------------------------------------------------------ 1. messages
cat >chat.jsonl <<'EOF'
{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Oslo?"}, {"role": "assistant", "content": null, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}, {"role": "tool", "content": "rain, 8C"}, {"role": "assistant", "content": "Rain, 8C."}]}
{"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]}
{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
EOF
echo '{"messages": [{"role": "user", "content": "capital of France?"}, {"role": "assistant", "content": "Paris"}]}' \
    >chat_eval.jsonl
sft --data chat.jsonl --eval-data chat_eval.jsonl --out r1 >r1.log
grep -q "3 train / 1 held-out rows (chat.jsonl)" r1.log || { cat r1.log; fail "messages rows"; }
for f in config.lua metrics.jsonl model/model.safetensors model/tokenizer.json model/tokenizer_config.json; do
    [ -e "r1/$f" ] || fail "r1/$f missing"
done
[ "$(grep -c '"loss"' r1/metrics.jsonl)" = 4 ] || fail "4 training records"

# ------------------------------------------------------------------------------------------------ 2. prompt/completion
printf '{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": "4"}\n{"prompt": "3+3=", "completion": "6"}\n' \
    >pc.jsonl
sft --data pc.jsonl --eval 1 --model r1/model --out r2 >r2.log
grep -q "2 train / 1 held-out rows (pc.jsonl)" r2.log || { cat r2.log; fail "prompt/completion rows"; }
grep -q '"ds4_chat_template": "deepseek_v4"' r2/model/tokenizer_config.json || fail "the template travels with --model"
cat >pcchat.jsonl <<'EOF'
{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]}
{"prompt": [{"role": "user", "content": "bye"}], "completion": [{"role": "assistant", "content": "see you"}]}
EOF
sft --data pcchat.jsonl --eval 1 --chat-template chatml --out r3 >r3.log
grep -q '"ds4_chat_template": "chatml"' r3/model/tokenizer_config.json || fail "--chat-template chatml is saved"

# ------------------------------------------------------------------------------------------------ 3. config files
sed 's/"messages"/"conv"/' chat.jsonl >conv.jsonl
cat >run.lua <<EOF
-- a run configuration: any option of sft.lua
data = "$out/conv.jsonl"
eval = 1
lr = 1e-2
steps = 3
EOF
sft --config run.lua --lr 2e-3 --columns.messages conv --out r4 >r4.log
grep -q 'lr = 0.002,' r4/config.lua || fail "the command line wins over the config file (config.lua: lr)"
grep -q 'steps = 4,' r4/config.lua || fail "--steps 4 given after nothing in the file"
grep -q 'messages = "conv"' r4/config.lua || fail "--columns.messages is a field of the columns table"
grep -q '"lr": 0.002,' r4/metrics.jsonl || fail "training runs at the command line's lr"
sft --config r4/config.lua --out r5 >/dev/null
diff <(losses r4) <(losses r5) || fail "the effective configuration does not reproduce the run"
[ "$(losses r4 | wc -l)" = 4 ] || fail "4 losses"

# ------------------------------------------------------------------------------------------------ 4. run directories
sft --data pc.jsonl --eval 1 --run-id first >/dev/null
[ "$(readlink runs/sft/latest)" = first ] || fail "runs/sft/latest -> first"
sft --data pc.jsonl --eval 1 >/dev/null
latest="$(readlink runs/sft/latest)"
[ "$latest" != first ] && [ -f "runs/sft/$latest/metrics.jsonl" ] || fail "a second run gets its own directory"
fails 2 "holds a run already" --data pc.jsonl --eval 1 --out runs/sft/first
sft --steps 6 --save-every 2 --data pc.jsonl --eval 1 --run-id ck >/dev/null
sft --steps 8 --resume >resume.log # continues runs/sft/latest (= ck) with its configuration, 8 steps now
grep -q "resuming from runs/sft/ck/ckpt/step_000006" resume.log || { cat resume.log; fail "--resume continues latest"; }
[ "$(grep -c '"loss"' runs/sft/ck/metrics.jsonl)" = 8 ] || fail "the resumed run has steps 1..8 once"
grep -q '"ds4_chat_template": "deepseek_v4"' runs/sft/ck/ckpt/step_000008/tokenizer_config.json ||
    fail "an SFT checkpoint carries its tokenizer and template"

# ------------------------------------------------------------------------------------------------ 5. errors
fails 2 "--data pc.jsonl has 3 rows and --eval 3 would hold out all of them" --data pc.jsonl --eval 3
printf '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}\n' >>chat.jsonl
fails 1 'chat.jsonl:4: messages[2].content must be a string' --data chat.jsonl --eval 1
printf '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n' >rl.jsonl
fails 1 'rl.jsonl: rows are {"prompt", "answer"} (RL prompts' --data rl.jsonl --eval 1
fails 2 "unknown option '--stpes' (did you mean --steps?)" --stpes 3
fails 2 "--steps needs a number, got 'many'" --steps many
echo 'lrr = 1' >typo.lua
fails 2 "typo.lua: unknown option 'lrr' (did you mean --lr?)" --config typo.lua
mkdir -p bare && cp "$SRC/tests/fixtures/tiny_a/config.json" "$SRC/tests/fixtures/tiny_a/model.safetensors" bare/
fails 2 "bare has no tokenizer.json: pass --tokenizer FILE" --model bare --data pc.jsonl --eval 1
echo "1 passed, 0 failed"
