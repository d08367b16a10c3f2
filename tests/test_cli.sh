#!/usr/bin/env bash
# test_cli.sh — the ds4 program as a user meets it: commands, exit codes, error output, script arguments,
# the Lua module search path, and an installed copy (cmake --install) running outside the source tree.
#
# usage: bash tests/test_cli.sh <path-to-ds4> <fixtures_dir> <source_dir>
# Run from the build directory (ctest does): the install check installs that build into a temporary prefix.
set -u

DS4=$(realpath "$1")
FIXTURES=$(realpath "$2")
SRC=$(realpath "$3")
BUILD=$(pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

fails=0
checks=0
fail() { fails=$((fails + 1)); echo "FAIL: $*" >&2; }
# expect_rc NAME WANT GOT
expect_rc() { checks=$((checks + 1)); [ "$3" -eq "$2" ] || fail "$1: exit status $3, expected $2"; }
# expect_in NAME FILE TEXT: FILE contains TEXT (fixed string)
expect_in() {
    checks=$((checks + 1))
    grep -qF -- "$3" "$2" || { fail "$1: output lacks '$3'"; sed 's/^/    | /' "$2" >&2; }
}
expect_not_in() {
    checks=$((checks + 1))
    if grep -qF -- "$3" "$2"; then fail "$1: output contains '$3'"; sed 's/^/    | /' "$2" >&2; fi
}
# run NAME ARGS...: runs ds4 with ARGS; stdout in $WORK/out, stderr in $WORK/err, status in $rc
run() { "$DS4" "$@" >"$WORK/out" 2>"$WORK/err"; rc=$?; }

# The version string from the header, not from the binary under test.
VERSION=$(sed -n 's/^#define DS4_VERSION_STRING "\(.*\)"$/\1/p' "$SRC/core/include/ds4.h")
[ -n "$VERSION" ] || fail "cannot read DS4_VERSION_STRING from $SRC/core/include/ds4.h"

# ---------------------------------------------------------------------------------------------- commands
run version
expect_rc version 0 $rc
expect_in version "$WORK/out" "ds4 $VERSION"
expect_in version "$WORK/out" "LuaJIT"
expect_in version "$WORK/out" "ZeroMQ"
expect_in version "$WORK/out" "msgpack-c"
expect_in version "$WORK/out" "build: cpu"

for h in help --help -h; do
    run $h
    expect_rc "$h" 0 $rc
    expect_in "$h" "$WORK/out" "usage: ds4"
    expect_in "$h" "$WORK/out" "run [--device D] [--dtype T] FILE"
    expect_in "$h" "$WORK/out" "version"
done
"$DS4" >"$WORK/out" 2>"$WORK/err"; rc=$?
expect_rc "no arguments" 0 $rc
expect_in "no arguments" "$WORK/out" "usage: ds4"

run frobnicate
expect_rc "unknown command" 2 $rc
expect_in "unknown command" "$WORK/err" "unknown command 'frobnicate'"
expect_in "unknown command" "$WORK/err" "usage: ds4"

# ---------------------------------------------------------------------------------------------- --device
printf 'local ds4 = require("ds4")\nprint("device=" .. ds4.device(), select("#", ...))\n' >"$WORK/dev.lua"
run run --device cpu "$WORK/dev.lua" a b
expect_rc "run --device cpu" 0 $rc
expect_in "run --device cpu" "$WORK/out" "device=cpu	2"
run run --device=cuda:1 --dtype fp32 - <"$WORK/dev.lua"
expect_rc "run --device=cuda:1 --dtype fp32" 0 $rc
expect_in "run --device=cuda:1 --dtype fp32" "$WORK/out" "device=cuda:1 fp32"
run run --dtype bf16 "$WORK/dev.lua"
expect_in "run --dtype alone: the GPU" "$WORK/out" "device=cuda:0 bf16"
run run --device tpu "$WORK/dev.lua"
expect_rc "run --device tpu" 2 $rc
expect_in "run --device tpu" "$WORK/err" "ds4 run: device 'tpu': expected cpu, cuda or cuda:N"
run run --device cpu --dtype bf16 "$WORK/dev.lua"
expect_rc "run --device cpu --dtype bf16" 2 $rc
expect_in "run --device cpu --dtype bf16" "$WORK/err" "fp32 only"
run run --device
expect_rc "run --device (no value)" 2 $rc
expect_in "run --device (no value)" "$WORK/err" "--device needs a value"
run run --device cpu
expect_rc "run --device cpu (no script)" 2 $rc
expect_in "run --device cpu (no script)" "$WORK/err" "missing script"
run repl --device cuda:z </dev/null
expect_rc "repl --device cuda:z" 2 $rc
expect_in "repl --device cuda:z" "$WORK/err" "index after cuda:"
run worker --connect "ipc://$WORK/none" --model "$FIXTURES/tiny_a" --device tpu
expect_rc "worker --device tpu" 2 $rc
expect_in "worker --device tpu" "$WORK/err" "ds4 worker: ds4.set_device: device 'tpu'"

run run
expect_rc "run without a script" 2 $rc
expect_in "run without a script" "$WORK/err" "missing script"

# ---------------------------------------------------------------------------------------------- script errors
cat >"$WORK/rt_error.lua" <<'EOF'
local function inner() error("boom from inner") end
local function outer() inner() end
outer()
EOF
run run "$WORK/rt_error.lua"
expect_rc "runtime error" 1 $rc
expect_in "runtime error" "$WORK/err" "ds4: "
expect_in "runtime error" "$WORK/err" "rt_error.lua:1: boom from inner"
expect_in "runtime error" "$WORK/err" "stack traceback"
expect_in "runtime error" "$WORK/err" "in function 'inner'"

printf 'local x = = 1\n' >"$WORK/syntax.lua"
run run "$WORK/syntax.lua"
expect_rc "syntax error" 1 $rc
expect_in "syntax error" "$WORK/err" "ds4: "
expect_in "syntax error" "$WORK/err" "syntax.lua:1:"

printf 'error(setmetatable({}, {__tostring = function() return "custom error object" end}))\n' >"$WORK/obj.lua"
run run "$WORK/obj.lua"
expect_rc "error object" 1 $rc
expect_in "error object" "$WORK/err" "custom error object"

printf 'error({})\n' >"$WORK/tbl.lua"
run run "$WORK/tbl.lua"
expect_rc "table error" 1 $rc
expect_in "table error" "$WORK/err" "error object is a table value"

run run "$WORK/does_not_exist.lua"
expect_rc "missing script" 1 $rc
expect_in "missing script" "$WORK/err" "does_not_exist.lua"

# ---------------------------------------------------------------------------------------------- arguments
cat >"$WORK/args.lua" <<'EOF'
print("arg0=" .. arg[0])
print("arg1=" .. arg[1])
print("arg2=" .. arg[2])
print("n=" .. #arg)
print("argm1=" .. tostring(arg[-1]))
print("argm2=" .. tostring(arg[-2]))
print("argm3=" .. tostring(arg[-3]))
local a, b, c = ...
print("dots=" .. a .. "|" .. b .. "|" .. tostring(c) .. "|" .. select("#", ...))
print("jit=" .. tostring(jit and jit.status()))
EOF
run run "$WORK/args.lua" "first arg" second
expect_rc "arguments" 0 $rc
expect_in "arguments" "$WORK/out" "arg0=$WORK/args.lua"
expect_in "arguments" "$WORK/out" "arg1=first arg"
expect_in "arguments" "$WORK/out" "arg2=second"
expect_in "arguments" "$WORK/out" "n=2"
# luajit's convention: negative indices hold everything before the script ("run", then the program)
expect_in "arguments" "$WORK/out" "argm1=run"
expect_in "arguments" "$WORK/out" "argm2=$DS4"
expect_in "arguments" "$WORK/out" "argm3=nil"
expect_in "arguments" "$WORK/out" "dots=first arg|second|nil|2"
expect_in "arguments" "$WORK/out" "jit=true"

printf 'io.write("before exit\\n")\nos.exit(3)\nprint("not reached")\n' >"$WORK/exit3.lua"
run run "$WORK/exit3.lua"
expect_rc "os.exit(3)" 3 $rc
expect_in "os.exit(3)" "$WORK/out" "before exit"
expect_not_in "os.exit(3)" "$WORK/out" "not reached"

printf 'os.exit(true)\n' >"$WORK/exit_true.lua"
run run "$WORK/exit_true.lua"
expect_rc "os.exit(true)" 0 $rc

printf 'print("from stdin", arg[0], ...)\nlocal ds4 = require("ds4")\nprint("version " .. ds4.version)\n' |
    "$DS4" run - x y >"$WORK/out" 2>"$WORK/err"
rc=$?
expect_rc "run -" 0 $rc
expect_in "run -" "$WORK/out" $'from stdin	-	x	y'
expect_in "run -" "$WORK/out" "version $VERSION"

printf 'error("stdin boom")\n' | "$DS4" run - >"$WORK/out" 2>"$WORK/err"
rc=$?
expect_rc "run - error" 1 $rc
expect_in "run - error" "$WORK/err" "stdin boom"

# ---------------------------------------------------------------------------------------------- the module
printf 'local ds4 = require("ds4")\nds4.load("/nonexistent/ckpt_dir")\n' >"$WORK/load_missing.lua"
run run "$WORK/load_missing.lua"
expect_rc "load missing" 1 $rc
expect_in "load missing" "$WORK/err" "ds4.load: "
expect_in "load missing" "$WORK/err" "/nonexistent/ckpt_dir"
expect_in "load missing" "$WORK/err" "stack traceback"

# require works from any working directory, without environment variables, in the build tree.
cat >"$WORK/req.lua" <<'EOF'
local ds4 = require("ds4")
assert(type(ds4.tensor) == "function" and type(ds4.load) == "function", "module functions missing")
assert(require("ds4.core").version == ds4.version, "ds4.core is the C module")
print("version=" .. ds4.version)
print("path=" .. package.path)
EOF
(cd "$WORK" && env -u DS4_LUA_PATH "$DS4" run req.lua >"$WORK/out" 2>"$WORK/err"); rc=$?
expect_rc "require from elsewhere" 0 $rc
expect_in "require from elsewhere" "$WORK/out" "version=$VERSION"
expect_in "require from elsewhere" "$WORK/out" "path=$SRC/lua/?.lua;$SRC/lua/?/init.lua;"

# DS4_LUA_PATH directories come first.
mkdir -p "$WORK/extra"
printf 'return { hello = "from extra" }\n' >"$WORK/extra/mymod.lua"
printf 'print(require("mymod").hello)\nprint("path=" .. package.path)\nprint(require("ds4").version)\n' >"$WORK/env.lua"
DS4_LUA_PATH="$WORK/extra" "$DS4" run "$WORK/env.lua" >"$WORK/out" 2>"$WORK/err"; rc=$?
expect_rc "DS4_LUA_PATH" 0 $rc
expect_in "DS4_LUA_PATH" "$WORK/out" "from extra"
expect_in "DS4_LUA_PATH" "$WORK/out" "path=$WORK/extra/?.lua;$WORK/extra/?/init.lua;$SRC/lua/?.lua"

# The example runs on the fixture and reproduces the reference loss.
run run "$SRC/examples/hello.lua" "$FIXTURES/tiny_a"
expect_rc "hello.lua" 0 $rc
expect_in "hello.lua" "$WORK/out" "loss:"
expect_in "hello.lua" "$WORK/out" "OK"

# ---------------------------------------------------------------------------------------------- install
PREFIX="$WORK/prefix"
if cmake --install "$BUILD" --prefix "$PREFIX" >"$WORK/install.log" 2>&1; then
    PREFIX=$(realpath "$PREFIX")
    checks=$((checks + 1))
    [ -x "$PREFIX/bin/ds4" ] || fail "install: $PREFIX/bin/ds4 missing"
    checks=$((checks + 1))
    [ -f "$PREFIX/share/lua/5.1/ds4/init.lua" ] || fail "install: share/lua/5.1/ds4/init.lua missing"
    mkdir -p "$WORK/elsewhere"
    cp "$WORK/req.lua" "$WORK/elsewhere/req.lua"
    # A clean environment, but the loader keeps a non-default library path where the machine has one (a GPU host
    # that runs ds4 against unpacked packages): this test is about where ds4 finds its Lua library, not libc's loader.
    clean=(env -i PATH=/usr/bin:/bin ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH=$LD_LIBRARY_PATH})
    (cd "$WORK/elsewhere" && "${clean[@]}" "$PREFIX/bin/ds4" run req.lua >"$WORK/out" 2>"$WORK/err")
    rc=$?
    expect_rc "installed ds4" 0 $rc
    expect_in "installed ds4" "$WORK/out" "version=$VERSION"
    # The installed binary must find its own library, not the source tree's.
    expect_in "installed ds4" "$WORK/out" "path=$PREFIX/share/lua/5.1/?.lua;$PREFIX/share/lua/5.1/?/init.lua;"
    expect_not_in "installed ds4" "$WORK/out" "$SRC/lua"

    # Relocated: the whole prefix moved elsewhere still works and uses its new location.
    mv "$PREFIX" "$WORK/moved"
    MOVED=$(realpath "$WORK/moved")
    (cd "$WORK/elsewhere" && "${clean[@]}" "$MOVED/bin/ds4" run req.lua >"$WORK/out" 2>"$WORK/err")
    rc=$?
    expect_rc "relocated ds4" 0 $rc
    expect_in "relocated ds4" "$WORK/out" "path=$MOVED/share/lua/5.1/?.lua;"
    expect_not_in "relocated ds4" "$WORK/out" "$SRC/lua"
else
    fail "cmake --install $BUILD --prefix $PREFIX failed"
    sed 's/^/    | /' "$WORK/install.log" >&2
fi

echo "test_cli: $checks checks, $fails failures"
[ $fails -eq 0 ]
