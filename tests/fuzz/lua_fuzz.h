/* lua_fuzz.h — what a libFuzzer target needs to fuzz Lua code of the ds4 library (lua/ds4/): a LuaJIT state with
 * the ds4 module (ds4.core, the C binding, linked into the target), and coverage of the Lua code fed to libFuzzer.
 * Included by one target's .c file each; CMakeLists.txt links the binding into every target that includes it.
 *
 * Coverage: libFuzzer instruments C, not Lua. A line hook counts edges between consecutive Lua lines (source,
 * line) in an array placed in the __libfuzzer_extra_counters section, which libFuzzer reads as coverage — so
 * inputs that reach new Lua code are kept. The JIT is off (compiled traces would not call the hook).
 *
 * The target's Lua chunk defines fuzz_one(bytes); it raises on a property violation (an unexpected error, a broken
 * invariant), and ds4f_lua_run aborts with the message, which libFuzzer reports as a crash with the input.
 *
 * Leaks: LuaJIT allocates its heap itself (mmap), where LeakSanitizer does not look, so C objects held only by Lua
 * values (a tokenizer and the scratch buffers it keeps between calls) would look leaked to libFuzzer's per-input
 * leak check. The chunk returns the tokenizers it keeps; their C pointers are kept in ds4f_roots, a global. */
#ifndef DS4_LUA_FUZZ_H
#define DS4_LUA_FUZZ_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#include "ds4lua.h"

#define DS4F_COUNTERS (1u << 16)
__attribute__((used, section("__libfuzzer_extra_counters"))) static uint8_t ds4f_counters[DS4F_COUNTERS];
static uintptr_t ds4f_prev; /* the previous line's location (per process: targets are single-threaded) */
static const void *ds4f_roots[8];

static void ds4f_hook(lua_State *L, lua_Debug *ar) {
    if (!lua_getinfo(L, "S", ar)) return;
    uintptr_t loc = ((uintptr_t)ar->source * 2654435761u) ^ ((uintptr_t)ar->currentline * 40503u);
    size_t i = (size_t)((loc ^ ds4f_prev) % DS4F_COUNTERS);
    if (ds4f_counters[i] < 255) ds4f_counters[i]++;
    ds4f_prev = loc >> 1;
}

/* A state with the standard libraries, ds4.core preloaded, package.path on the source tree's lua/, the JIT off,
 * the coverage hook on, and `chunk` run (it defines fuzz_one). Aborts on any failure: nothing can be fuzzed. */
static lua_State *ds4f_lua_state(const char *chunk) {
    lua_State *L = luaL_newstate();
    if (!L) abort();
    luaL_openlibs(L);
    luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
    lua_getglobal(L, "package");
    lua_pushstring(L, DS4_SOURCE_LUA_DIR "/?.lua;" DS4_SOURCE_LUA_DIR "/?/init.lua");
    lua_setfield(L, -2, "path");
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, luaopen_ds4_core);
    lua_setfield(L, -2, "ds4.core");
    lua_pop(L, 2);
    if (luaL_loadstring(L, chunk) != 0 || lua_pcall(L, 0, LUA_MULTRET, 0) != 0) {
        fprintf(stderr, "lua_fuzz: setting up the target failed: %s\n", lua_tostring(L, -1));
        abort();
    }
    for (int i = 1, k = 0; i <= lua_gettop(L) && k < 8; i++) {
        int freed = 0;
        const ds4_tokenizer *t = ds4l_tokenizer_test(L, i, &freed);
        if (t) ds4f_roots[k++] = t;
    }
    lua_settop(L, 0); /* the globals of the chunk keep the values alive */
    lua_sethook(L, ds4f_hook, LUA_MASKLINE, 0);
    return L;
}

/* fuzz_one(the input as a string); a raised error is a finding. */
static void ds4f_lua_run(lua_State *L, const uint8_t *data, size_t size) {
    lua_getglobal(L, "fuzz_one");
    lua_pushlstring(L, (const char *)data, size);
    ds4f_prev = 0;
    if (lua_pcall(L, 1, 0, 0) != 0) {
        fprintf(stderr, "lua_fuzz: %s\n", lua_tostring(L, -1) ? lua_tostring(L, -1) : "(non-string error)");
        abort();
    }
}

/* The target's entry point: fuzz_one of `chunk`, in a state made on the first input and kept. */
#define DS4F_LUA_TARGET(chunk)                                       \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {  \
        static lua_State *L;                                         \
        if (!L) L = ds4f_lua_state(chunk);                           \
        ds4f_lua_run(L, data, size);                                 \
        return 0;                                                    \
    }

#endif
