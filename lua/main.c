/* main.c — the `ds4` program: runs Lua scripts against libds4, and the interactive REPL.
 *
 *   ds4 run [--device D] FILE.lua [args...]   run a script (FILE "-" = stdin)
 *   ds4 repl [--model DIR] [--tokenizer FILE] [--threads N] [--device D]   interactive Lua prompt (lua/repl.c,
 *                                lua/ds4/repl.lua)
 *   ds4 worker --connect EP ...  a rollout worker (lua/ds4/rollout/worker.lua parses the rest of the options)
 *   ds4 keygen [--out PREFIX]    a CURVE key pair for ZeroMQ (lua/zmq_lua.c: ds4l_keygen_main)
 *   ds4 version                  versions of ds4 and of the libraries it was built with
 *   ds4 help                     usage
 *
 * The host owns one lua_State (luaL_newstate: LuaJIT's own allocator, required on 64-bit; luaL_openlibs:
 * that includes the jit library, without which the JIT stays off). Everything that touches the state runs
 * inside lua_cpcall, so an out-of-memory error during setup is reported instead of reaching the panic
 * function. Exit status: 0 success, 1 script error, 2 usage error; os.exit(n) in a script exits with n.
 *
 * File-scope mutable state: two variables for Ctrl-C (see "Ctrl-C" below and lua/repl.h): the interrupt flag
 * ds4l_interrupt and the state the SIGINT handler interrupts, ds4l_signal_state; and lua/repl.c's complete_state,
 * the state libedit's Tab completion asks while the REPL reads at a terminal. */
#define _XOPEN_SOURCE 700 /* realpath (XSI), stat, sigaction */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>
#include <msgpack.h>
#include <zmq.h>

#include "ds4lua.h"
#include "repl.h"

#ifndef DS4_SOURCE_LUA_DIR
#error "DS4_SOURCE_LUA_DIR must be defined by the build (the lua/ directory of the source tree)"
#endif
#ifndef DS4_INSTALL_LUA_SUBDIR
#define DS4_INSTALL_LUA_SUBDIR "share/ds4/lua"
#endif
#ifndef DS4_INSTALL_BINDIR
#define DS4_INSTALL_BINDIR "bin"
#endif

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds4 <command> [arguments]\n"
            "\n"
            "commands:\n"
            "  run [--device D] [--dtype T] FILE [ARGS...]\n"
            "                      run the Lua script FILE (\"-\" reads it from stdin); the script gets\n"
            "                      arg[0] = FILE, arg[1..n] = ARGS, and ARGS as `...`\n"
            "      --device D          where models compute unless the script says otherwise: cpu (default),\n"
            "                          cuda or cuda:N (ds4.set_device)\n"
            "      --dtype T           the GPU's working dtype: bf16 (default) or fp32 (the reference)\n"
            "  repl [OPTIONS]      interactive Lua prompt with `ds4`, `model`, `tok` and helpers (help() lists\n"
            "                      them); with stdin not a terminal, runs stdin line by line as the prompt would\n"
            "      --model DIR         load this checkpoint (default: a small random demo model: its outputs\n"
            "                          are noise)\n"
            "      --tokenizer FILE    a tokenizer.json (default: DIR/tokenizer.json when present, else the\n"
            "                          built-in byte-level tokenizer)\n"
            "      --threads N         CPU threads (0 = one per physical core, at most 16)\n"
            "      --device D, --dtype T   as for run\n"
            "  worker --connect ENDPOINT [--model DIR|CONFIG.json] [--threads N] [--device D] [--dtype T]\n"
            "         [--key FILE --server-key FILE | --insecure] [--id NAME] [--max-batch N] [--credits N]\n"
            "                      a rollout worker for a trainer's ds4.rollout.pool (`ds4 worker --help`);\n"
            "                      Ctrl-C or SIGTERM: says bye to the trainer and exits 0\n"
            "  keygen [--out PREFIX] [--force]\n"
            "                      make a CURVE key pair (Z85) for ZeroMQ: PREFIX.key (secret, mode 0600)\n"
            "                      and PREFIX.pub (public); without --out, print both to stdout\n"
            "  version             print the versions of ds4, LuaJIT, ZeroMQ and msgpack-c\n"
            "  help                print this help\n"
            "\n"
            "Scripts load the engine with `local ds4 = require(\"ds4\")`. Ctrl-C stops running Lua code with\n"
            "\"interrupted!\" and a generation with finish_reason \"cancelled\".\n"
            "\n"
            "environment:\n"
            "  DS4_LUA_PATH        ':'-separated directories searched for Lua modules before ds4's own\n");
}

static int print_version(void) {
    int zmaj = 0, zmin = 0, zpat = 0;
    zmq_version(&zmaj, &zmin, &zpat);
    printf("ds4 %s\n", DS4_VERSION_STRING);
    printf("build: %s\n", ds4_build_info());
    printf("%s\n", LUAJIT_VERSION);
    printf("ZeroMQ %d.%d.%d\n", zmaj, zmin, zpat);
    printf("msgpack-c %s\n", msgpack_version());
    return 0;
}

/* ------------------------------------------------------------------------------------------------ Ctrl-C */

/* As in lua.c / luajit.c: SIGINT sets a hook, and the hook raises "interrupted!" at the next Lua
 * instruction, so a runaway Lua loop stops with a traceback. A long C call (a forward pass) finishes first,
 * and a loop already compiled by the JIT does not look at hooks. The handler also sets the interrupt flag,
 * which a running generation polls (it ends with finish_reason "cancelled").
 *
 * The program's only file-scope mutable state: these two variables (declared in repl.h, which says who clears
 * the flag and when the state is NULL). Both are written by the signal handler or read by it, hence volatile. */
volatile sig_atomic_t ds4l_interrupt;
lua_State *volatile ds4l_signal_state;

/* The registry's lightuserdata points at the flag as a `volatile int` (ds4_gen_args.cancel). */
_Static_assert(_Generic((sig_atomic_t)0, int: 1, default: 0), "sig_atomic_t must be int");

static void lstop(lua_State *L, lua_Debug *ar) {
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    if (ds4l_interrupt > 1) ds4l_interrupt = 1; /* this Ctrl-C took effect: the count of futile ones restarts */
    luaL_error(L, "interrupted!");
}

/* `ds4 run` installs this with SA_RESETHAND: a second Ctrl-C kills the process, as before. The REPL keeps it
 * installed; there a third Ctrl-C in a row that the running code has not noticed (a loop compiled by the JIT
 * never sees the hook) ends the process. */
static void on_sigint(int sig) {
    if (ds4l_interrupt < 1000) ds4l_interrupt = ds4l_interrupt + 1;
    lua_State *L = ds4l_signal_state;
    if (L) lua_sethook(L, lstop, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
    if (ds4l_interrupt >= 3) {
        static const char msg[] = "\nds4: Ctrl-C three times without effect: exiting\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)w;
        signal(sig, SIG_DFL);
        raise(sig); /* delivered when this handler returns */
    }
}

/* keep = 0: one Ctrl-C, then the default action (ds4 run); keep = 1: stays installed (the REPL). SA_RESTART:
 * reads and writes of Lua code are not cut short by EINTR (the REPL's prompt waits with pselect, which is). */
static void install_sigint(int keep) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | (keep ? 0 : SA_RESETHAND);
    sigaction(SIGINT, &sa, NULL);
}

static void uninstall_sigint(void) {
    signal(SIGINT, SIG_DFL);
    ds4l_signal_state = NULL;
}

/* ------------------------------------------------------------------------------------------------ paths */

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The directory holding ds4's Lua library, into out (PATH_MAX bytes). An installed binary sits in
 * <prefix>/<DS4_INSTALL_BINDIR> and finds <prefix>/<DS4_INSTALL_LUA_SUBDIR>; anything else (the build tree)
 * uses the source tree. Requiring the bindir suffix keeps a build-tree binary from picking up an unrelated
 * <build>/../share/ds4/lua. */
static void find_lua_dir(char *out) {
    char exe[PATH_MAX];
    snprintf(out, PATH_MAX, "%s", DS4_SOURCE_LUA_DIR);
    if (!realpath("/proc/self/exe", exe)) return;
    char *slash = strrchr(exe, '/');
    if (!slash) return;
    *slash = 0; /* exe is now the executable's directory */
    const char *bindir = DS4_INSTALL_BINDIR;
    char prefix[PATH_MAX];
    if (bindir[0] == '/') {
        /* Absolute bindir: installed only when we run from exactly there; the Lua dir must be absolute too. */
        if (strcmp(exe, bindir) != 0 || DS4_INSTALL_LUA_SUBDIR[0] != '/') return;
        if (is_dir(DS4_INSTALL_LUA_SUBDIR)) snprintf(out, PATH_MAX, "%s", DS4_INSTALL_LUA_SUBDIR);
        return;
    }
    size_t el = strlen(exe), bl = strlen(bindir);
    if (bl == 0 || el <= bl + 1 || exe[el - bl - 1] != '/' || strcmp(exe + el - bl, bindir) != 0) return;
    snprintf(prefix, sizeof prefix, "%.*s", (int)(el - bl - 1), exe);
    char cand[PATH_MAX], real[PATH_MAX];
    if (DS4_INSTALL_LUA_SUBDIR[0] == '/')
        snprintf(cand, sizeof cand, "%s", DS4_INSTALL_LUA_SUBDIR);
    else if (snprintf(cand, sizeof cand, "%s/%s", prefix, DS4_INSTALL_LUA_SUBDIR) >= (int)sizeof cand)
        return;
    if (is_dir(cand) && realpath(cand, real)) snprintf(out, PATH_MAX, "%s", real);
}

static void add_dir_templates(luaL_Buffer *b, const char *dir, size_t len) {
    for (int k = 0; k < 2; k++) {
        luaL_addlstring(b, dir, len);
        luaL_addstring(b, k == 0 ? "/?.lua;" : "/?/init.lua;");
    }
}

/* package.path = DS4_LUA_PATH dirs, ds4's Lua dir, then whatever LuaJIT set up (LUA_PATH or its defaults). */
static void setup_package_path(lua_State *L) {
    char dir[PATH_MAX];
    find_lua_dir(dir);
    lua_getglobal(L, "package");
    int pkg = lua_gettop(L);
    luaL_Buffer b; /* Lua 5.1 buffers live on the stack: nothing else may be pushed until pushresult */
    luaL_buffinit(L, &b);
    const char *env = getenv("DS4_LUA_PATH");
    while (env && *env) {
        const char *end = strchr(env, ':');
        size_t len = end ? (size_t)(end - env) : strlen(env);
        if (len) add_dir_templates(&b, env, len);
        env = end ? end + 1 : NULL;
    }
    add_dir_templates(&b, dir, strlen(dir));
    luaL_pushresult(&b);
    lua_getfield(L, pkg, "path");
    lua_concat(L, 2);
    lua_setfield(L, pkg, "path");
    lua_pop(L, 1);
}

/* ------------------------------------------------------------------------------------------------ running */

/* Message handler: append a traceback, as luajit's standalone interpreter does. */
static int traceback(lua_State *L) {
    if (!lua_isstring(L, 1)) {
        /* A non-string error object: use its __tostring if it has one. */
        if (lua_isnoneornil(L, 1) || !luaL_callmeta(L, 1, "__tostring") || !lua_isstring(L, -1)) {
            lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
        }
        lua_replace(L, 1);
        lua_settop(L, 1);
    }
    luaL_traceback(L, L, lua_tostring(L, 1), 1);
    return 1;
}

static void report(lua_State *L) {
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, "ds4: %s\n", msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
}

typedef struct run_ctx {
    int argc;
    char **argv;
    int script;                 /* argv index of the script (ds4 run) */
    const char *device, *dtype; /* --device / --dtype of ds4 run and ds4 repl, or NULL */
    const ds4l_repl_opts *repl; /* ds4 repl: its options; NULL for ds4 run */
    int worker;                 /* ds4 worker: argv[2..] go to require("ds4.rollout.worker").main(arg) */
    int status;                 /* exit status */
} run_ctx;

/* What both commands start from: the standard libraries, the package path, ds4.core preloaded, and the interrupt
 * flag in the registry (model:generate polls it). */
static void setup_state(lua_State *L) {
    lua_gc(L, LUA_GCSTOP, 0); /* as luajit.c: no collections while the libraries are opened */
    luaL_openlibs(L);
    lua_gc(L, LUA_GCRESTART, 0);
    setup_package_path(L);

    lua_getglobal(L, "package");
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, luaopen_ds4_core);
    lua_setfield(L, -2, "ds4.core");
    lua_pop(L, 2);

    lua_pushlightuserdata(L, (void *)&ds4l_interrupt);
    lua_setfield(L, LUA_REGISTRYINDEX, DS4L_INTERRUPT_KEY);
}

/* ds4 worker: SIGINT and SIGTERM only set the interrupt flag (no hook: ds4l_signal_state stays NULL), which the
 * worker loop polls (and a running generation sees as a cancel); it then says bye and returns 0. A third signal
 * that went unnoticed ends the process (on_sigint). */
static int run_worker(lua_State *L, run_ctx *ctx) {
    lua_createtable(L, ctx->argc, 0);
    for (int i = 2; i < ctx->argc; i++) {
        lua_pushstring(L, ctx->argv[i]);
        lua_rawseti(L, -2, i - 1);
    }
    lua_setglobal(L, "arg");
    lua_pushcfunction(L, traceback);
    if (luaL_loadstring(L, "return require('ds4.rollout.worker').main(arg)") != 0) {
        report(L);
        ctx->status = 1;
        return 0;
    }
    install_sigint(1);
    signal(SIGTERM, on_sigint);
    int rc = lua_pcall(L, 0, 1, -2);
    signal(SIGTERM, SIG_DFL);
    uninstall_sigint();
    if (rc != 0) {
        report(L);
        ctx->status = 1;
    } else {
        ctx->status = lua_isnumber(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    }
    return 0;
}

/* --device / --dtype: require("ds4.core").set_device(device, dtype) (the spelling was checked by parse_device). */
static int apply_device(lua_State *L, const run_ctx *ctx) {
    if (!ctx->device && !ctx->dtype) return 1;
    lua_pushcfunction(L, traceback);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "ds4.core");
    if (lua_pcall(L, 1, 1, -3) != 0) {
        report(L);
        return 0;
    }
    lua_getfield(L, -1, "set_device");
    lua_pushstring(L, ctx->device ? ctx->device : "cuda");
    if (ctx->dtype) lua_pushstring(L, ctx->dtype);
    else lua_pushnil(L);
    if (lua_pcall(L, 2, 0, -5) != 0) {
        report(L);
        return 0;
    }
    lua_pop(L, 2);
    return 1;
}

static int pmain(lua_State *L) {
    run_ctx *ctx = lua_touserdata(L, 1);
    lua_settop(L, 0);
    setup_state(L);
    if (!apply_device(L, ctx)) {
        ctx->status = 2;
        return 0;
    }

    if (ctx->repl) {
        install_sigint(1); /* stays installed: every Ctrl-C is seen (repl.c says what it does) */
        ctx->status = ds4l_repl(L, ctx->repl);
        uninstall_sigint();
        return 0;
    }
    if (ctx->worker) return run_worker(L, ctx);

    /* arg as the luajit interpreter builds it: arg[0] = the script, positive indices its arguments, negative
     * ones everything before the script (arg[-1] = "run", arg[-2] = the ds4 program). */
    lua_createtable(L, ctx->argc - ctx->script, ctx->script);
    for (int i = 0; i < ctx->argc; i++) {
        lua_pushstring(L, ctx->argv[i]);
        lua_rawseti(L, -2, i - ctx->script);
    }
    lua_setglobal(L, "arg");

    const char *script = ctx->argv[ctx->script];
    if (luaL_loadfile(L, strcmp(script, "-") == 0 ? NULL : script) != 0) {
        report(L); /* syntax error or unreadable file: no traceback to give */
        ctx->status = 1;
        return 0;
    }
    int nargs = ctx->argc - ctx->script - 1;
    luaL_checkstack(L, nargs + 3, "too many script arguments");
    for (int i = ctx->script + 1; i < ctx->argc; i++) lua_pushstring(L, ctx->argv[i]);
    int base = lua_gettop(L) - nargs; /* the chunk's slot */
    lua_pushcfunction(L, traceback);
    lua_insert(L, base);
    ds4l_signal_state = L;
    install_sigint(0);
    int rc = lua_pcall(L, nargs, 0, base);
    uninstall_sigint();
    lua_remove(L, base);
    if (rc != 0) {
        report(L);
        ctx->status = 1;
    }
    return 0;
}

static int run_state(run_ctx *ctx) {
    lua_State *L = luaL_newstate();
    if (!L) {
        fprintf(stderr, "ds4: cannot create the Lua state (out of memory)\n");
        return 1;
    }
    if (lua_cpcall(L, pmain, ctx) != 0) {
        report(L);
        ctx->status = 1;
    }
    uninstall_sigint(); /* when an error skipped it */
    lua_close(L);       /* runs every __gc: models, engine, tensors */
    fflush(stdout);
    return ctx->status;
}

/* Check a --device / --dtype pair's spelling now, so that a typo is a usage error before anything loads. */
static int parse_device(const char *cmd, const char *device, const char *dtype) {
    if (!device && !dtype) return 1;
    ds4_device_options o;
    ds4_error err = {0};
    if (ds4_device_parse(device ? device : "cuda", dtype, &o, &err) == DS4_OK) return 1;
    fprintf(stderr, "ds4 %s: %s\n", cmd, err.msg);
    return 0;
}

/* The value of option `name` at argv[*i] ("--name VALUE" or "--name=VALUE"), advancing *i past it; NULL when
 * argv[*i] is not that option; "" when the value is missing. */
static const char *option_value(int argc, char **argv, int *i, const char *name) {
    const char *a = argv[*i];
    const size_t n = strlen(name);
    if (strncmp(a, name, n) != 0 || (a[n] != 0 && a[n] != '=')) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (*i + 1 < argc) return argv[++*i];
    return "";
}

/* ds4 repl's options: --model DIR, --tokenizer FILE, --threads N, --device D, --dtype T (also --opt=VALUE).
 * Returns -1 when they are fine, else the exit status (0 for --help, 2 for a usage error). */
static int parse_repl_args(int argc, char **argv, ds4l_repl_opts *o, run_ctx *ctx) {
    o->model = NULL;
    o->tokenizer = NULL;
    o->threads = -1;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        static const char *const names[] = {"--model", "--tokenizer", "--threads", "--device", "--dtype"};
        int which = -1;
        const char *val = NULL;
        for (int k = 0; k < 5; k++) {
            size_t n = strlen(names[k]);
            if (strncmp(a, names[k], n) == 0 && (a[n] == 0 || a[n] == '=')) {
                which = k;
                if (a[n] == '=') val = a + n + 1;
                else if (i + 1 < argc) val = argv[++i];
                break;
            }
        }
        if (which < 0) {
            fprintf(stderr, "ds4 repl: unknown option '%s'\n\n", a);
            usage(stderr);
            return 2;
        }
        if (!val || !*val) {
            fprintf(stderr, "ds4 repl: %s needs a value\n\n", names[which]);
            usage(stderr);
            return 2;
        }
        if (which == 0) {
            o->model = val;
        } else if (which == 1) {
            o->tokenizer = val;
        } else if (which == 3) {
            ctx->device = val;
        } else if (which == 4) {
            ctx->dtype = val;
        } else {
            char *end = NULL;
            errno = 0;
            long n = strtol(val, &end, 10);
            if (errno || end == val || *end || n < 0 || n > 4096) {
                fprintf(stderr, "ds4 repl: --threads needs an integer in [0, 4096] (0 = one per physical core, at most 16), got '%s'\n",
                        val);
                return 2;
            }
            o->threads = (int)n;
        }
    }
    return parse_device("repl", ctx->device, ctx->dtype) ? -1 : 2;
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) return print_version();
    if (strcmp(cmd, "run") == 0) {
        run_ctx ctx = {.argc = argc, .argv = argv, .script = 2, .repl = NULL, .status = 0};
        for (const char *v; ctx.script < argc; ctx.script++) { /* ds4's own options come before the script */
            int i = ctx.script;
            if ((v = option_value(argc, argv, &i, "--device"))) ctx.device = v;
            else if ((v = option_value(argc, argv, &i, "--dtype"))) ctx.dtype = v;
            else break;
            if (!*v) {
                fprintf(stderr, "ds4 run: %s needs a value\n\n", argv[ctx.script]);
                usage(stderr);
                return 2;
            }
            ctx.script = i;
        }
        if (ctx.script >= argc) {
            fprintf(stderr, "ds4 run: missing script (a .lua file, or - for stdin)\n\n");
            usage(stderr);
            return 2;
        }
        if (!parse_device("run", ctx.device, ctx.dtype)) return 2;
        return run_state(&ctx);
    }
    if (strcmp(cmd, "keygen") == 0) return ds4l_keygen_main(argc, argv);
    if (strcmp(cmd, "worker") == 0) {
        run_ctx ctx = {.argc = argc, .argv = argv, .script = 0, .repl = NULL, .worker = 1, .status = 0};
        return run_state(&ctx);
    }
    if (strcmp(cmd, "repl") == 0) {
        ds4l_repl_opts o;
        run_ctx ctx = {.argc = argc, .argv = argv, .script = 0, .repl = &o, .status = 0};
        int rc = parse_repl_args(argc, argv, &o, &ctx);
        if (rc >= 0) return rc;
        return run_state(&ctx);
    }
    fprintf(stderr, "ds4: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
