#!/usr/bin/env bash
# test_repl.sh — `ds4 repl` with stdin not a terminal: the lines are evaluated as at the prompt (values printed,
# errors reported and execution going on, multi-line chunks), the helpers (top, generate, logprobs, chat), Ctrl-C
# (SIGINT) during a generation and during a Lua loop, exit statuses, and bad flags. The terminal side (libedit,
# the prompt, Ctrl-C / Ctrl-D keys) is tests/repl_pty_driver.c.
#
# usage: bash tests/test_repl.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -u

DS4=$(realpath "$1")
FIXTURES=$(realpath "$2")
TINY="$FIXTURES/tiny_a"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export HOME="$WORK" # no history file is written without a terminal; make sure of it below

fails=0
checks=0
fail() { fails=$((fails + 1)); echo "FAIL: $*" >&2; }
expect_rc() { checks=$((checks + 1)); [ "$3" -eq "$2" ] || fail "$1: exit status $3, expected $2"; }
show() { sed 's/^/    | /' "$1" >&2; }
expect_in() {
    checks=$((checks + 1))
    grep -qF -- "$3" "$2" || { fail "$1: output lacks '$3'"; show "$2"; }
}
expect_not_in() {
    checks=$((checks + 1))
    if grep -qF -- "$3" "$2"; then fail "$1: output contains '$3'"; show "$2"; fi
}
# expect_line NAME FILE LINE: FILE has exactly this line
expect_line() {
    checks=$((checks + 1))
    grep -qxF -- "$3" "$2" || { fail "$1: no line '$3'"; show "$2"; }
}
# repl ARGS... < input: stdout in $WORK/out, stderr in $WORK/err, status in $rc (not in a pipeline: that would
# run it in a subshell)
repl() { "$DS4" repl "$@" >"$WORK/out" 2>"$WORK/err"; rc=$?; }

# ---------------------------------------------------------------------------------------------- evaluation
cat >"$WORK/basic.lua" <<'EOF'
=1+1
1+2
=6*7, "x", nil

function twice(x)
  local y = 2 * x
  return y
end
=twice(21)
error("boom")
print("after the error")
x = = 1
print("after the syntax error")
local t = {
  1, 2,
}
={1, "a", x = true, ["two words"] = 2, nested = {1}}
=ds4.zeros({2, 3})
="line one\nline two"
EOF
repl --model "$TINY" <"$WORK/basic.lua"
expect_rc "basic" 0 $rc
# stdout holds the values only (the banner went to stderr)
checks=$((checks + 1))
[ "$(head -n 3 "$WORK/out")" = "$(printf '2\n3\n42\tx\tnil')" ] || { fail "basic: first values"; show "$WORK/out"; }
expect_line "multi-line function" "$WORK/out" "42"
expect_in "error" "$WORK/err" "stdin:1: boom"
expect_in "error traceback" "$WORK/err" "stack traceback"
expect_line "runs on after an error" "$WORK/out" "after the error"
expect_in "syntax error" "$WORK/err" "stdin:1:"
expect_line "runs on after a syntax error" "$WORK/out" "after the syntax error"
expect_line "table rendering" "$WORK/out" '{1, "a", nested = {...}, ["two words"] = 2, x = true}'
expect_line "tensor __tostring" "$WORK/out" "ds4.tensor F32 [2, 3]"
expect_line "strings as they are" "$WORK/out" "line two"
expect_in "banner" "$WORK/err" "repl: model $TINY"
expect_in "banner" "$WORK/err" "tokenizer built-in byte-level"
expect_not_in "no noise note for a real checkpoint" "$WORK/err" "noise"
checks=$((checks + 1))
[ ! -e "$WORK/.ds4_history" ] || fail "a history file was written without a terminal"

# os.exit(n) exits with n (closing the state: under LeakSanitizer a plain os.exit reports the loaded model, which
# only the Lua state referenced); an unfinished chunk at the end is reported and the status stays 0
repl --model "$TINY" < <(printf 'print("a")\nos.exit(3, true)\nprint("not reached")\n')
expect_rc "os.exit(3)" 3 $rc
expect_not_in "os.exit(3)" "$WORK/out" "not reached"
repl --model "$TINY" < <(printf '=1\nfunction f()\n')
expect_rc "unfinished chunk at EOF" 0 $rc
expect_in "unfinished chunk at EOF" "$WORK/err" "'end' expected near '<eof>'"
repl --model "$TINY" </dev/null
expect_rc "empty input" 0 $rc

# ---------------------------------------------------------------------------------------------- helpers
cat >"$WORK/helpers.lua" <<'EOF'
r3 = top("ab", 3)
=#r3, r3[1].p >= r3[2].p, r3[2].p >= r3[3].p, r3[1].p > 0 and r3[1].p < 1
t1, g1 = generate{prompt = "ab", max_new_tokens = 12, seed = 5, temperature = 1}
t2, g2 = generate{prompt = {97, 98}, max_new_tokens = 12, seed = 5, temperature = 1, stream = false}
=t1 == t2, #g1.ids, g1.finish_reason, #t1 == 12
lp = logprobs{text = "hello", prompt = "ab"}
=#lp.logprobs, lp.logprobs[1] < 0, math.abs(lp.sum - (lp.logprobs[1] + lp.logprobs[2] + lp.logprobs[3] + lp.logprobs[4] + lp.logprobs[5])) < 1e-9
help()
chat("hi")
EOF
repl --model "$TINY" <"$WORK/helpers.lua"
expect_rc "helpers" 0 $rc
expect_in "top" "$WORK/out" "token"
expect_in "top" "$WORK/out" "| p"
checks=$((checks + 1))
[ "$(grep -cE '^  .* \| +[0-9]+ \| 0\.[0-9]{4}$' "$WORK/out")" -eq 3 ] || { fail "top: three rows"; show "$WORK/out"; }
expect_line "top values" "$WORK/out" $'3\ttrue\ttrue\ttrue'
expect_in "generate streams a summary" "$WORK/out" "[12 tokens, finish length"
expect_line "generate: fixed seed, same text; ids and text agree" "$WORK/out" $'true\t12\tlength\ttrue'
expect_in "logprobs table" "$WORK/out" "| logprob"
expect_in "logprobs table" "$WORK/out" "sum "
expect_line "logprobs values" "$WORK/out" $'5\ttrue\ttrue'
expect_in "help" "$WORK/out" "chat_reset()"
# tiny_a's vocabulary (256 ids) has no room for the byte-level tokenizer's chat specials
expect_in "chat on a model without the chat specials" "$WORK/err" "outside this model's vocabulary"

# the same seed gives the same stream in two processes
repl --model "$TINY" < <(printf 'generate{prompt = "ab", max_new_tokens = 16, seed = 9}\n')
cp "$WORK/out" "$WORK/gen1"
repl --model "$TINY" < <(printf 'generate{prompt = "ab", max_new_tokens = 16, seed = 9}\n')
checks=$((checks + 1))
# (the summary's tokens/s differ)
cmp -s <(sed 's|, [0-9.]* tokens/s]|]|' "$WORK/out") <(sed 's|, [0-9.]* tokens/s]|]|' "$WORK/gen1") ||
    { fail "generate with a fixed seed differs between runs"; show "$WORK/gen1"; show "$WORK/out"; }

# no --model: the random demo model covers the byte-level tokenizer, chat works and keeps the history
cat >"$WORK/chat.lua" <<'EOF'
reply, res = chat("hello", {max_new_tokens = 8})
=type(reply), reply == chat_history()[2].content, res.finish_reason
=#chat_history(), chat_history()[1].role, chat_history()[2].role
chat("again", {max_new_tokens = 4, thinking = true})
=#chat_history(), type(chat_history()[4].reasoning_content)
chat_reset()
=#chat_history()
=model:config().vocab_size == tok:vocab_size()
EOF
repl <"$WORK/chat.lua"
expect_rc "demo model" 0 $rc
expect_in "demo model banner" "$WORK/err" "random demo model"
expect_in "demo model banner" "$WORK/err" "noise"
expect_line "chat returns the reply and the result" "$WORK/out" $'string\ttrue\tlength'
expect_in "chat prints its finish line" "$WORK/out" "[8 tokens, finish length"
expect_line "chat history" "$WORK/out" $'2\tuser\tassistant'
expect_line "chat history, thinking" "$WORK/out" $'4\tstring'
expect_line "chat_reset" "$WORK/out" "0"
expect_line "demo vocabulary" "$WORK/out" "true"
expect_not_in "demo model" "$WORK/err" "stack traceback"

# a reply that ends with EOS also gets its finish line (it used to get none); the model is made to end the turn at
# once by replacing its generate with one whose result says so
cat >"$WORK/chat_eos.lua" <<'EOF'
local mt = getmetatable(model).__index; local g = mt.generate; mt.generate = function(m, p, o) o.max_new_tokens = 2; local r = g(m, p, o); r[1].ids[#r[1].ids] = tok:special("eos"); r[1].finish_reason = "eos"; return r end
reply = chat("hello")
=#reply
EOF
repl <"$WORK/chat_eos.lua"
expect_in "chat ended by EOS prints its finish line" "$WORK/out" "[2 tokens, finish eos"
expect_line "the reply without the EOS" "$WORK/out" "1"
# Tab completion's candidates (the terminal side is repl_pty): methods, fields, globals, keywords
cat >"$WORK/complete.lua" <<'EOF'
=table.concat(require("ds4.repl").complete("model:n_pa"), ",")
=table.concat(require("ds4.repl").complete("ds4.chat.get"), ",")
=table.concat(require("ds4.repl").complete("chat_h"), ",")
=table.concat(require("ds4.repl").complete("ds4.r"), ",")
=#require("ds4.repl").complete("model.nothing.x"), #require("ds4.repl").complete("1+")
=table.concat(require("ds4.repl").complete("whi"), ",")
EOF
repl <"$WORK/complete.lua"
expect_line "complete a method" "$WORK/out" "model:n_params"
expect_line "complete a field" "$WORK/out" "ds4.chat.get"
expect_line "complete a global" "$WORK/out" "chat_history"
expect_line "complete lazy modules" "$WORK/out" "ds4.random_model,ds4.random_model_json,ds4.reward,ds4.rl,ds4.rollout,ds4.rundir,ds4.runlog"
expect_line "nothing to complete" "$WORK/out" $'0\t0'
expect_line "complete a keyword" "$WORK/out" "while"

# ---------------------------------------------------------------------------------------------- Ctrl-C (SIGINT)
# wait_for FILE TEXT: until FILE contains TEXT (at most 20 s)
wait_for() {
    for _ in $(seq 200); do
        grep -qF -- "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}
cat >"$WORK/int_gen.lua" <<'EOF'
t, r = generate{prompt = "ab", max_new_tokens = 100000, ignore_eos = true}
=r.finish_reason
=1+1
EOF
# the generation prints to stdout as it goes; once something is there, SIGINT
"$DS4" repl --model "$TINY" <"$WORK/int_gen.lua" >"$WORK/out" 2>"$WORK/err" &
pid=$!
checks=$((checks + 1))
if wait_for "$WORK/out" "" && sleep 0.5 && kill -INT $pid 2>/dev/null; then
    wait $pid
    rc=$?
    expect_rc "SIGINT during a generation" 0 $rc
    expect_in "SIGINT during a generation" "$WORK/out" "finish cancelled"
    expect_line "SIGINT during a generation: finish_reason" "$WORK/out" "cancelled"
    expect_line "SIGINT during a generation: goes on" "$WORK/out" "2"
    expect_not_in "SIGINT during a generation" "$WORK/err" "interrupted!"
else
    fail "SIGINT during a generation: could not signal ds4 ($pid)"
    kill -9 $pid 2>/dev/null
fi

cat >"$WORK/int_loop.lua" <<'EOF'
io.write("LOOP\n") io.flush() n = 0 while true do n = n + 1 local _ = os.clock() end
=n > 0
EOF
"$DS4" repl --model "$TINY" <"$WORK/int_loop.lua" >"$WORK/out" 2>"$WORK/err" &
pid=$!
checks=$((checks + 1))
if wait_for "$WORK/out" "LOOP" && sleep 0.2 && kill -INT $pid 2>/dev/null; then
    wait $pid
    rc=$?
    expect_rc "SIGINT in a Lua loop" 0 $rc
    expect_in "SIGINT in a Lua loop" "$WORK/err" "interrupted!"
    expect_line "SIGINT in a Lua loop: goes on" "$WORK/out" "true"
else
    fail "SIGINT in a Lua loop: could not signal ds4 ($pid)"
    kill -9 $pid 2>/dev/null
fi

# ---------------------------------------------------------------------------------------------- flags
for bad in "--bogus" "--model" "--threads x" "--threads -1" "extra"; do
    # shellcheck disable=SC2086
    "$DS4" repl $bad </dev/null >"$WORK/out" 2>"$WORK/err"
    rc=$?
    expect_rc "bad flags '$bad'" 2 $rc
    expect_in "bad flags '$bad'" "$WORK/err" "ds4 repl:"
done
expect_in "bad flags" "$WORK/err" "usage: ds4"
"$DS4" repl --help >"$WORK/out" 2>"$WORK/err"
rc=$?
expect_rc "repl --help" 0 $rc
expect_in "repl --help" "$WORK/out" "repl [OPTIONS]"
"$DS4" help >"$WORK/out" 2>&1
expect_in "help lists repl" "$WORK/out" "--tokenizer FILE"

repl --model "$WORK/no_such_dir" < <(printf '=1\n')
expect_rc "missing model" 1 $rc
expect_in "missing model" "$WORK/err" "ds4 repl: "
expect_in "missing model" "$WORK/err" "no_such_dir"
repl --model "$TINY" --tokenizer "$FIXTURES/tokenizer/deepseek.json" --threads 1 <<<'=tok:vocab_size()'
expect_rc "--tokenizer, --threads" 0 $rc
expect_in "--tokenizer" "$WORK/err" "tokenizer $FIXTURES/tokenizer/deepseek.json"
repl --model="$TINY" --threads=2 < <(printf '=ds4.threads()\n')
expect_rc "--opt=value" 0 $rc
expect_line "--threads=2" "$WORK/out" "2"

# DIR/tokenizer.json is used when present
mkdir -p "$WORK/with_tok"
for f in "$TINY"/*; do ln -s "$f" "$WORK/with_tok/"; done
cp "$FIXTURES/tokenizer/deepseek.json" "$WORK/with_tok/tokenizer.json"
repl --model "$WORK/with_tok" <<<'=tok:special("eos") ~= nil'
expect_rc "DIR/tokenizer.json" 0 $rc
expect_in "DIR/tokenizer.json" "$WORK/err" "tokenizer $WORK/with_tok/tokenizer.json"
expect_line "DIR/tokenizer.json" "$WORK/out" "true"
# a checkpoint without a tokenizer says so in the banner instead of falling back silently
repl --model "$TINY" <<<'=1'
expect_in "no tokenizer.json" "$WORK/err" "built-in byte-level (the checkpoint has no tokenizer.json)"
# a model saved from the REPL carries its tokenizer and chat template: a new REPL on it picks both up
repl <<<"model:save(\"$WORK/saved\")"
expect_rc "model:save in the REPL" 0 $rc
[ -f "$WORK/saved/tokenizer_config.json" ] || fail "model:save wrote no tokenizer_config.json"
repl --model "$WORK/saved" < <(printf '=tok:special("assistant") ~= nil\nchat("hi", {max_new_tokens = 2})\n')
expect_rc "saved model" 0 $rc
expect_in "saved model" "$WORK/err" "tokenizer $WORK/saved/tokenizer.json"
expect_line "saved model: its tokenizer has the chat tokens" "$WORK/out" "true"
expect_not_in "saved model: chat works" "$WORK/err" "outside this model's vocabulary"

echo "test_repl: $checks checks, $fails failures"
[ $fails -eq 0 ]
