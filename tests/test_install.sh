#!/usr/bin/env bash
# test_install.sh — ds4 embedded from an installed prefix (issue 17), with nothing from the source or build tree:
#   1. cmake --install into a temporary prefix gives libds4.so and libds4.a, the headers, lib/pkgconfig/ds4.pc,
#      lib/cmake/ds4/ds4Config.cmake, the Lua binding as a C module (lib/lua/5.1/ds4/core.so, which must not link
#      LuaJIT itself) and the Lua library under share/lua/5.1;
#   2. tests/embed/embed.c (load the fixture, forward, compare the loss with transformers'; tokenize) built with
#      `cc $(pc --cflags --libs)` against libds4.so, and with --static against libds4.a;
#   3. the same program built by a CMake project through find_package(ds4): ds4::ds4 and ds4::ds4_static;
#   4. the system `luajit` runs `require("ds4")` with the prefix in LUA_PATH / LUA_CPATH: a forward pass (the loss
#      against transformers'), the tokenizer, ds4.rl, a saved model's tokenizer coming back through ds4.load.
# In a sanitizer build (DS4_SANITIZE in the build's CMakeCache.txt) the programs are compiled with the same
# -fsanitize flags, and luajit (not instrumented) runs with the sanitizer runtimes preloaded and leak checking off.
#   bash tests/test_install.sh <path-to-ds4> <fixtures_dir> <source_dir>     (run from the build directory)
set -euo pipefail
FIX="$(realpath "$2")"
SRC="$(realpath "$3")"
BUILD="$(pwd)"
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-install.XXXXXX")"
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
P="$out/prefix"
cmake --install "$BUILD" --prefix "$P" >"$out/install.log" 2>&1 || { cat "$out/install.log"; fail "cmake --install"; }
LIBDIR="$(dirname "$(find "$P" -name libds4.a | head -n 1)")"
[ -n "$LIBDIR" ] || fail "no libds4.a installed"

# ------------------------------------------------------------------------------------------------ 1. files
for f in "$LIBDIR/libds4.so" "$LIBDIR/pkgconfig/ds4.pc" "$LIBDIR/cmake/ds4/ds4Config.cmake" "$P/include/ds4.h" \
    "$P/include/ds4_tokenizer.h" "$LIBDIR/lua/5.1/ds4/core.so" "$P/share/lua/5.1/ds4/init.lua" \
    "$P/share/lua/5.1/ds4/rl/trainer.lua"; do
    [ -e "$f" ] || fail "$f was not installed"
done
# (ldd into a file: with pipefail, grep -q closing the pipe early would fail the pipeline)
ldd "$LIBDIR/lua/5.1/ds4/core.so" >"$out/ldd.txt"
if grep -qi luajit "$out/ldd.txt"; then
    fail "core.so links LuaJIT: a second LuaJIT in the process of whoever loads it"
fi

SAN=()
LUAJIT_ENV=(env)
if grep -q '^DS4_SANITIZE:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null; then
    SAN=(-fsanitize=address,undefined)
    LUAJIT_ENV=(env "LD_PRELOAD=$(cc -print-file-name=libasan.so) $(cc -print-file-name=libubsan.so)"
                "ASAN_OPTIONS=detect_leaks=0:${ASAN_OPTIONS:-}")
fi
export PKG_CONFIG_PATH="$LIBDIR/pkgconfig"
# pkg-config for ds4. Where the dependencies come from packages unpacked into a folder (PKG_CONFIG_SYSROOT_DIR, as on
# a machine without package access), pkg-config puts that folder before every -I / -L path, also the ones that lie
# outside it (the installed prefix, the CUDA toolkit): a path that is missing under the folder but present without
# it is given back without it.
pc() {
    local out tok p root res=()
    out="$(pkg-config "$@" ds4)" || return 1
    root="${PKG_CONFIG_SYSROOT_DIR:-}"
    root="${root%/}"
    [ -n "$root" ] || { echo "$out"; return 0; }
    for tok in $out; do
        case "$tok" in
        -I"$root"/* | -L"$root"/*)
            p="${tok:2}"
            if [ ! -e "$p" ] && [ -e "${p#"$root"}" ]; then tok="${tok:0:2}${p#"$root"}"; fi
            ;;
        esac
        res+=("$tok")
    done
    echo "${res[*]}"
}

# ------------------------------------------------------------------------------------------------ 2. pkg-config
# shellcheck disable=SC2046
cc "${SAN[@]}" "$SRC/tests/embed/embed.c" -o "$out/embed_pc" $(pc --cflags --libs) ||
    fail "cc with pkg-config --cflags --libs ds4"
LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$out/embed_pc" "$FIX/tiny_a" ||
    fail "the pkg-config build (libds4.so)"
ldd "$out/embed_pc" >"$out/ldd.txt"
grep -q "libds4.so" "$out/ldd.txt" || fail "pkg-config --libs ds4 did not link libds4.so"
# --static: libds4.a and its private dependencies (-Bstatic picks the archive over the .so for -lds4 only)
# shellcheck disable=SC2046
cc "${SAN[@]}" "$SRC/tests/embed/embed.c" -o "$out/embed_pc_static" $(pc --cflags) \
    -L"$LIBDIR" -Wl,-Bstatic -lds4 -Wl,-Bdynamic $(pc --static --libs | sed 's/ -lds4 / /') ||
    fail "cc with pkg-config --static --libs ds4"
ldd "$out/embed_pc_static" >"$out/ldd.txt"
if grep -q "libds4.so" "$out/ldd.txt"; then fail "the static build links libds4.so"; fi
"$out/embed_pc_static" "$FIX/tiny_a" || fail "the pkg-config build (libds4.a)"

# ------------------------------------------------------------------------------------------------ 3. find_package
cmake -S "$SRC/tests/embed" -B "$out/cmake" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="${SAN[*]}" >"$out/cmake.log" 2>&1 || { cat "$out/cmake.log"; fail "find_package(ds4)"; }
cmake --build "$out/cmake" >>"$out/cmake.log" 2>&1 || { cat "$out/cmake.log"; fail "building against ds4::ds4"; }
"$out/cmake/embed_shared" "$FIX/tiny_a" || fail "ds4::ds4"
"$out/cmake/embed_static" "$FIX/tiny_a" || fail "ds4::ds4_static"

# ------------------------------------------------------------------------------------------------ 4. plain LuaJIT
command -v luajit >/dev/null || fail "no luajit on PATH (scripts/install-deps.sh installs it)"
cat >"$out/plain.lua" <<'LUA'
local fix, tmp = arg[1], arg[2]
local ds4 = require("ds4")
assert(package.loaded["ds4.core"], "ds4.core")
local m = ds4.load(fix .. "/tiny_a")
local io_t = ds4.load_tensors(fix .. "/tiny_a/io.safetensors")
local out = m:forward(io_t.input_ids, { labels = io_t.labels })
local ref = io_t.loss:item()
assert(math.abs(out.loss - ref) < 1e-4, ("loss %.6f, transformers %.6f"):format(out.loss, ref))
local tok = ds4.tokenizer()
assert(tok:decode(tok:encode("héllo")) == "héllo", "tokenizer round trip")
assert(ds4.rl.preset("dapo").loss.eps_high == 0.28, "ds4.rl")
m:set_tokenizer(tok)
m:save(tmp .. "/saved")
assert(ds4.load(tmp .. "/saved"):tokenizer(), "a saved model's tokenizer through ds4.load")
print(("luajit: %s, ds4 %s, loss %.6f (transformers %.6f)"):format(jit.version, ds4.version, out.loss, ref))
LUA
(cd "$out" && "${LUAJIT_ENV[@]}" LUA_PATH="$P/share/lua/5.1/?.lua;$P/share/lua/5.1/?/init.lua;;" \
    LUA_CPATH="$LIBDIR/lua/5.1/?.so;;" luajit "$out/plain.lua" "$FIX" "$out") || fail "require(\"ds4\") in luajit"
echo "1 passed, 0 failed"
