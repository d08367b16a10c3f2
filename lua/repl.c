/* repl.c — `ds4 repl`: the interactive Lua prompt. This file only reads lines, evaluates them, prints the results
 * and handles Ctrl-C; the globals and helpers (model, tok, chat, generate, ...) come from lua/ds4/repl.lua.
 *
 * Semantics, as the lua.c REPL (Lua 5.4):
 *   - a line starting with "=" is "return <rest>"; otherwise "return <line>" is tried first (so an expression
 *     prints its values), then the line as a statement;
 *   - while the chunk is incomplete (the parser stops at '<eof>'), more lines are read with the prompt ">> ";
 *   - the values of an expression are printed, tab-separated, as tostring would (strings as they are, tables as a
 *     short one-level rendering, ds4 tensors and other objects by their __tostring);
 *   - an error prints its message and a short traceback to stderr and the prompt returns;
 *   - end of input (Ctrl-D at an empty prompt) exits with status 0.
 *
 * Interactive (stdin is a terminal): libedit's readline with line editing, history in ~/.ds4_history (failures
 * to read or write it are ignored), Tab completion of globals, keywords, table fields and methods (model:<Tab>;
 * lua/ds4/repl.lua's complete) and a Tab at the start of a line or after a space inserted as indentation. Otherwise stdin is read line by line with the same
 * semantics and no prompt; errors are reported and execution continues; the exit status is 0 at the end of the
 * input (as lua.c does with piped input; use `ds4 run` when an error must fail).
 *
 * Ctrl-C (the handler is in main.c; the state it uses is described in repl.h):
 *   - at the prompt: abandons the line (and an unfinished multi-line chunk) and shows a fresh prompt. libedit's
 *     own signal handling is off (rl_catch_signals = 0); it reads keys through repl_getc, which waits in pselect
 *     with SIGINT unblocked only there, so a Ctrl-C is seen at once and never lost between the check and the wait;
 *     repl_getc then reports end of input, readline returns NULL, and the flag tells that apart from Ctrl-D;
 *   - while Lua code runs: "interrupted!" is raised at the next Lua instruction (a loop the JIT compiled does not
 *     look at hooks: there a third Ctrl-C ends the program) and the prompt returns;
 *   - while model:generate runs: the interrupt flag stops the generation, which returns with finish_reason
 *     "cancelled" (what was streamed stays printed); the REPL wraps model:generate so that the handler sets only
 *     the flag while it runs, instead of raising "interrupted!" from inside the on_token callback.
 * The flag is cleared before each evaluation. */
#define _XOPEN_SOURCE 700 /* pselect, sigprocmask, nl_langinfo */
#include <errno.h>
#include <langinfo.h>
#include <limits.h>
#include <locale.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <time.h>
#include <unistd.h>

#include <editline/readline.h>
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include "repl.h"

#define CHUNKNAME "=stdin"
#define HISTORY_FILE ".ds4_history"
#define HISTORY_MAX 1000
#define PRINT_MAX_ITEMS 24  /* entries shown of a table */
#define PRINT_MAX_STRING 60 /* bytes shown of a string inside a table */
#define LINE_MT "ds4.repl.line"
#define PROMPT_POLL_MS 200 /* the prompt's wait looks at the interrupt flag at least this often */

typedef struct repl {
    lua_State *L;
    int tty;                /* stdin is a terminal: libedit, prompts, history */
    int line_slot;          /* stack slot of the line box (a libedit line until it is copied into Lua) */
    int tostring_slot;      /* stack slot of the global tostring as the REPL found it */
    char history[PATH_MAX]; /* history file, or "" */
} repl;

/* ------------------------------------------------------------------------------------------------ reading */

/* libedit hands back malloc'd lines: one is owned by this box until it has been copied into a Lua string, so a
 * Lua error (out of memory) in between cannot leak it. */
typedef struct line_box {
    char *s;
} line_box;

static int line_gc(lua_State *L) {
    line_box *b = lua_touserdata(L, 1);
    if (b) {
        free(b->s);
        b->s = NULL;
    }
    return 0;
}

/* One byte of stdin, or -1 at end of input, on an error, or when Ctrl-C has set the interrupt flag. SIGINT is
 * blocked from the check of the flag until pselect, which unblocks it atomically: a Ctrl-C either came before the
 * check or interrupts the wait. While this thread blocks SIGINT the kernel may hand the signal to another thread
 * (the engine's workers): the wait then ends by its timeout, and the flag is seen within PROMPT_POLL_MS. */
static int read_byte(void) {
    for (;;) {
        sigset_t block, old;
        sigemptyset(&block);
        sigaddset(&block, SIGINT);
        sigprocmask(SIG_BLOCK, &block, &old);
        if (ds4l_interrupt) {
            sigprocmask(SIG_SETMASK, &old, NULL);
            return -1;
        }
        fd_set rd;
        FD_ZERO(&rd);
        FD_SET(STDIN_FILENO, &rd);
        struct timespec poll_ts = {.tv_sec = 0, .tv_nsec = PROMPT_POLL_MS * 1000000L};
        int r = pselect(STDIN_FILENO + 1, &rd, NULL, NULL, &poll_ts, &old);
        int e = errno;
        sigprocmask(SIG_SETMASK, &old, NULL);
        if (r < 0) {
            if (e == EINTR) continue;
            return -1;
        }
        if (r == 0) continue; /* timeout: look at the flag again */
        unsigned char ch;
        ssize_t n = read(STDIN_FILENO, &ch, 1);
        if (n == 1) return ch;
        if (n == 0) return -1;
        if (errno != EINTR && errno != EAGAIN) return -1;
    }
}

/* libedit's key reader (rl_getc_function): one character as a Unicode code point, decoded from UTF-8 (libedit
 * works in wide characters and encodes the line back in the locale's codeset). A malformed sequence gives U+FFFD.
 * -1: end of input, for libedit; readline then returns NULL. */
static int repl_getc(FILE *f) {
    (void)f;
    int c = read_byte();
    if (c < 0x80) return c;
    int more = c >= 0xF8 ? -1 : c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : -1;
    if (more < 0) return 0xFFFD;
    int cp = c & (0x3F >> more);
    for (int i = 0; i < more; i++) {
        int d = read_byte();
        if (d < 0) return -1;
        if ((d & 0xC0) != 0x80) return 0xFFFD;
        cp = (cp << 6) | (d & 0x3F);
    }
    return cp;
}

/* Push the next line (without its newline). Returns 1, 0 at end of input, or -1 for a Ctrl-C at the prompt. */
static int read_line(repl *r, const char *prompt) {
    lua_State *L = r->L;
    if (r->tty) {
        fflush(stdout);
        fflush(stderr);
        line_box *box = lua_touserdata(L, r->line_slot);
        box->s = readline(prompt);
        if (!box->s) {
            if (ds4l_interrupt) {
                ds4l_interrupt = 0;
                fputs("^C\n", stdout);
                return -1;
            }
            fputs("\n", stdout);
            return 0;
        }
        lua_pushstring(L, box->s);
        free(box->s);
        box->s = NULL;
        return 1;
    }
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    int any = 0;
    for (;;) {
        char *p = luaL_prepbuffer(&b);
        if (!fgets(p, LUAL_BUFFERSIZE, stdin)) break;
        size_t n = strlen(p);
        any = 1;
        if (n > 0 && p[n - 1] == '\n') {
            luaL_addsize(&b, n - 1);
            luaL_pushresult(&b);
            return 1;
        }
        luaL_addsize(&b, n);
    }
    luaL_pushresult(&b);
    if (!any) {
        lua_pop(L, 1);
        return 0;
    }
    return 1;
}

static void history_add(repl *r, const char *chunk) {
    if (!r->tty) return;
    add_history(chunk);
    if (r->history[0]) (void)write_history(r->history); /* failures are ignored */
}

/* ------------------------------------------------------------------------------------------------ printing */

static void write_lstr(const char *s, size_t n) {
    fwrite(s, 1, n, stdout);
}

/* tostring(value at idx) with the tostring the REPL started with (upvalue 1 of print_values, whose frame this
 * runs in); leaves the string on the stack. */
static const char *to_string(lua_State *L, int idx, size_t *len) {
    idx = idx < 0 ? lua_gettop(L) + idx + 1 : idx;
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_pushvalue(L, idx);
    lua_call(L, 1, 1);
    const char *s = lua_tolstring(L, -1, len);
    if (!s) luaL_error(L, "'tostring' must return a string");
    return s;
}

/* A string inside a table: quoted, escaped as Lua reads it back, cut after PRINT_MAX_STRING bytes. */
static void write_quoted(const char *s, size_t n) {
    size_t show = n > PRINT_MAX_STRING ? PRINT_MAX_STRING : n;
    fputc('"', stdout);
    for (size_t i = 0; i < show; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        case '\n': fputs("\\n", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        default:
            if (c < 0x20 || c == 0x7f) {
                /* a digit right after \ddd would be read as part of it: always three digits */
                printf("\\%03u", (unsigned)c);
            } else {
                fputc(c, stdout);
            }
        }
    }
    fputc('"', stdout);
    if (show < n) fputs("...", stdout);
}

static int is_identifier(const char *s, size_t n) {
    static const char *const keywords[] = {"and",  "break", "do",     "else", "elseif", "end",   "false", "for",
                                           "function", "goto", "if", "in",  "local",  "nil",  "not",    "or",
                                           "repeat", "return", "then", "true", "until", "while", NULL};
    if (n == 0 || strlen(s) != n) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return 0;
    }
    for (int k = 0; keywords[k]; k++)
        if (strcmp(s, keywords[k]) == 0) return 0;
    return 1;
}

/* A value inside a table: strings quoted, tables without __tostring as {...} / {}, the rest by tostring. */
static void write_inner(lua_State *L, int idx) {
    size_t n;
    int t = lua_type(L, idx);
    if (t == LUA_TSTRING) {
        const char *s = lua_tolstring(L, idx, &n);
        write_quoted(s, n);
        return;
    }
    if (t == LUA_TTABLE && !luaL_getmetafield(L, idx, "__tostring")) {
        lua_pushnil(L);
        if (lua_next(L, idx)) {
            lua_pop(L, 2);
            fputs("{...}", stdout);
        } else {
            fputs("{}", stdout);
        }
        return;
    }
    if (t == LUA_TTABLE) lua_pop(L, 1); /* the __tostring pushed by luaL_getmetafield */
    const char *s = to_string(L, idx, &n);
    write_lstr(s, n);
    lua_pop(L, 1);
}

typedef struct key_ref {
    int pos;        /* index in the keys table */
    int type;       /* 0 string, 1 number, 2 other */
    const char *s;  /* string keys (anchored by the keys table) */
    size_t len;
    double num;
} key_ref;

static int key_cmp(const void *pa, const void *pb) {
    const key_ref *a = pa, *b = pb;
    if (a->type != b->type) return a->type - b->type;
    if (a->type == 0) {
        size_t m = a->len < b->len ? a->len : b->len;
        int c = memcmp(a->s, b->s, m);
        if (c) return c;
        return a->len < b->len ? -1 : a->len > b->len;
    }
    if (a->type == 1 && a->num != b->num) return a->num < b->num ? -1 : 1;
    return a->pos - b->pos;
}

/* A table without __tostring: {v1, v2, ..., key = v, ["odd key"] = v, [3.5] = v, ...}: the array part first, then
 * the other keys (strings sorted, then numbers, then the rest), at most PRINT_MAX_ITEMS entries, one level. */
static void write_table(lua_State *L, int idx) {
    int shown = 0, total = 0;
    size_t alen = lua_objlen(L, idx);
    fputc('{', stdout);
    for (size_t i = 1; i <= alen; i++) {
        total++;
        if (shown >= PRINT_MAX_ITEMS) continue;
        lua_rawgeti(L, idx, (int)i);
        if (shown) fputs(", ", stdout);
        write_inner(L, lua_gettop(L));
        lua_pop(L, 1);
        shown++;
    }
    /* the other keys, collected in a Lua table (anchoring them) and sorted through key_refs */
    lua_newtable(L);
    int keys = lua_gettop(L);
    int nk = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) == LUA_TNUMBER) {
            lua_Number v = lua_tonumber(L, -1);
            if (v >= 1 && v <= (lua_Number)alen && v == (lua_Number)(size_t)v) continue; /* shown above */
        }
        lua_pushvalue(L, -1);
        lua_rawseti(L, keys, ++nk);
    }
    total += nk;
    if (nk > 0 && shown < PRINT_MAX_ITEMS) {
        key_ref *refs = lua_newuserdata(L, (size_t)nk * sizeof *refs);
        for (int k = 0; k < nk; k++) {
            lua_rawgeti(L, keys, k + 1);
            key_ref *kr = &refs[k];
            kr->pos = k + 1;
            kr->s = NULL;
            kr->len = 0;
            kr->num = 0;
            int t = lua_type(L, -1);
            kr->type = t == LUA_TSTRING ? 0 : t == LUA_TNUMBER ? 1 : 2;
            if (t == LUA_TSTRING) kr->s = lua_tolstring(L, -1, &kr->len); /* anchored in keys */
            if (t == LUA_TNUMBER) kr->num = lua_tonumber(L, -1);
            lua_pop(L, 1);
        }
        qsort(refs, (size_t)nk, sizeof *refs, key_cmp);
        for (int k = 0; k < nk && shown < PRINT_MAX_ITEMS; k++, shown++) {
            if (shown) fputs(", ", stdout);
            lua_rawgeti(L, keys, refs[k].pos);
            int key = lua_gettop(L);
            if (refs[k].type == 0 && is_identifier(refs[k].s, refs[k].len)) {
                write_lstr(refs[k].s, refs[k].len);
            } else {
                fputc('[', stdout);
                write_inner(L, key);
                fputc(']', stdout);
            }
            fputs(" = ", stdout);
            lua_pushvalue(L, key);
            lua_rawget(L, idx);
            write_inner(L, lua_gettop(L));
            lua_pop(L, 2);
        }
        lua_pop(L, 1); /* refs */
    }
    lua_pop(L, 1); /* keys */
    if (total > shown) printf("%s... (%d entries)", shown ? ", " : "", total);
    fputc('}', stdout);
}

/* print_values(...): the values of an evaluated expression, tab-separated. Upvalue 1: tostring. Runs under
 * lua_pcall: __tostring may raise. */
static int print_values(lua_State *L) {
    int n = lua_gettop(L);
    luaL_checkstack(L, 16, "printing values");
    for (int i = 1; i <= n; i++) {
        if (i > 1) fputc('\t', stdout);
        int t = lua_type(L, i);
        size_t len;
        if (t == LUA_TSTRING) {
            const char *s = lua_tolstring(L, i, &len);
            write_lstr(s, len);
        } else if (t == LUA_TTABLE && !luaL_getmetafield(L, i, "__tostring")) {
            write_table(L, i);
        } else {
            if (t == LUA_TTABLE) lua_pop(L, 1);
            const char *s = to_string(L, i, &len);
            write_lstr(s, len);
            lua_pop(L, 1);
        }
    }
    fputc('\n', stdout);
    fflush(stdout);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ evaluating */

/* Message handler: the message and a traceback, without the REPL's own C frame at the bottom. */
static int msghandler(lua_State *L) {
    if (!lua_isstring(L, 1)) {
        if (lua_isnoneornil(L, 1) || !luaL_callmeta(L, 1, "__tostring") || !lua_isstring(L, -1))
            lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
        lua_replace(L, 1);
        lua_settop(L, 1);
    }
    luaL_traceback(L, L, lua_tostring(L, 1), 1);
    size_t n;
    const char *s = lua_tolstring(L, -1, &n);
    /* LuaJIT writes the C caller as "[C]: at 0x..." (Lua 5.1: "[C]: ?"): drop such lines at the end */
    size_t keep = n;
    for (;;) {
        size_t i = keep;
        while (i > 0 && s[i - 1] != '\n') i--;
        if (i == 0) break;
        const char *last = s + i; /* "\t[C]: ..." */
        size_t ll = keep - i;
        if ((ll >= 11 && memcmp(last, "\t[C]: at 0x", 11) == 0) || (ll == 7 && memcmp(last, "\t[C]: ?", 7) == 0))
            keep = i - 1;
        else
            break;
    }
    if (keep != n) lua_pushlstring(L, s, keep);
    return 1;
}

static void report(lua_State *L) {
    fflush(stdout);
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, "%s\n", msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
}

/* The parser stopped at the end of the text: the chunk goes on in the next line. */
static int incomplete(lua_State *L) {
    size_t n;
    const char *m = lua_tolstring(L, -1, &n);
    static const char mark[] = "'<eof>'";
    return m && n >= sizeof mark - 1 && memcmp(m + n - (sizeof mark - 1), mark, sizeof mark - 1) == 0;
}

static int load_parts(lua_State *L, const char *pre, const char *s, size_t n, const char *post) {
    lua_pushstring(L, pre);
    lua_pushlstring(L, s, n);
    lua_pushstring(L, post);
    lua_concat(L, 3);
    size_t m;
    const char *src = lua_tolstring(L, -1, &m);
    int st = luaL_loadbuffer(L, src, m, CHUNKNAME);
    lua_remove(L, -2);
    return st;
}

/* Compile s as it is, or as an expression list whose values are returned. The expression list is compiled as
 * "return (function(...) return ... end)(<s>\n)" rather than "return <s>": a call in it is then no tail call, so
 * an error raised by it still has the REPL line as its position and in its traceback (LuaJIT drops the frame of a
 * tail caller); the identity function is a literal, so no global (select, say) that the user may have replaced is
 * involved. Where that does not compile, plain "return <s>" decides (it may be complete, e.g. "=" alone, or
 * incomplete).
 * Pushes the function (returns 0) or the message: 1 syntax error, 2 incomplete. */
static int compile(lua_State *L, const char *s, size_t n, int as_return) {
    int st;
    if (as_return) {
        st = load_parts(L, "return (function(...) return ... end)(", s, n, "\n)");
        if (st != 0) {
            lua_pop(L, 1);
            st = load_parts(L, "return ", s, n, "");
        }
    } else {
        st = luaL_loadbuffer(L, s, n, CHUNKNAME);
    }
    if (st == 0) return 0;
    return st == LUA_ERRSYNTAX && incomplete(L) ? 2 : 1;
}

/* Compile a whole chunk: "=<expr>" is "return <expr>"; anything else is a statement list. */
static int compile_chunk(lua_State *L, const char *s, size_t n) {
    if (n > 0 && s[0] == '=') return compile(L, s + 1, n - 1, 1);
    return compile(L, s, n, 0);
}

/* Call the function on the top of the stack and print what it returns. Ctrl-C may interrupt it, or the
 * printing; the flag is clear before and after. */
static void evaluate(repl *r) {
    lua_State *L = r->L;
    int base = lua_gettop(L); /* the function */
    lua_pushcfunction(L, msghandler);
    lua_insert(L, base);
    ds4l_interrupt = 0;
    ds4l_signal_state = L;
    int st = lua_pcall(L, 0, LUA_MULTRET, base);
    if (st == 0 && lua_gettop(L) > base) {
        int n = lua_gettop(L) - base;
        lua_pushvalue(L, r->tostring_slot);
        lua_pushcclosure(L, print_values, 1);
        lua_insert(L, base + 1);
        st = lua_pcall(L, n, 0, base);
    }
    ds4l_signal_state = NULL;
    lua_sethook(L, NULL, 0, 0); /* a Ctrl-C that came after the last instruction left the hook set */
    int interrupted = ds4l_interrupt != 0;
    ds4l_interrupt = 0;
    fflush(stdout);
    if (st != 0 && interrupted && r->tty) fputc('\n', stderr); /* past the terminal's echoed ^C */
    if (st != 0) report(L);
    lua_settop(L, base - 1);
}

/* ------------------------------------------------------------------------------------------------ generation */

/* model:generate as the REPL installs it (upvalue 1: the original). While it runs, Ctrl-C only sets the flag:
 * the generation ends with finish_reason "cancelled" and returns what it made, rather than an "interrupted!" raised
 * in the middle of an on_token callback. */
static int guarded_generate(lua_State *L) {
    lua_State *prev = ds4l_signal_state;
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    ds4l_signal_state = NULL;
    int st = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
    ds4l_signal_state = prev;
    if (st != 0) lua_error(L);
    return lua_gettop(L);
}

static void guard_generate(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, "ds4.model"); /* the model metatable (lua/binding.c) */
    if (lua_istable(L, -1)) {
        lua_getfield(L, -1, "__index");
        if (lua_istable(L, -1)) {
            lua_getfield(L, -1, "generate");
            if (lua_isfunction(L, -1) && lua_tocfunction(L, -1) != guarded_generate) {
                lua_pushcclosure(L, guarded_generate, 1);
                lua_setfield(L, -2, "generate");
            } else {
                lua_pop(L, 1);
            }
        }
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
}

/* ------------------------------------------------------------------------------------------------ completion */

/* Tab completion asks Lua (require("ds4.repl").complete: globals, keywords, a.b.<field>, obj:<method>), and
 * libedit's completion callbacks take no context: the state is kept here while the REPL reads at a terminal
 * (NULL otherwise). One of the program's file-scope variables (main.c lists them). */
static lua_State *complete_state;

#define COMPLETIONS_KEY "ds4.repl.completions"

/* Run by lua_cpcall (its argument, the word, a C string, is the lightuserdata at index 1): the list of
 * ds4.repl.complete(word) into the registry. */
static int compute_completions(lua_State *L) {
    const char *word = lua_touserdata(L, 1);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "ds4.repl");
    lua_call(L, 1, 1);
    lua_getfield(L, -1, "complete");
    lua_pushstring(L, word);
    lua_call(L, 1, 1);
    if (!lua_istable(L, -1)) return 0;
    lua_setfield(L, LUA_REGISTRYINDEX, COMPLETIONS_KEY);
    return 0;
}

/* libedit's generator: state 0 computes the list, then each call hands out the next entry (malloc'd: libedit
 * frees it); NULL at the end. */
static char *complete_next(const char *text, int state) {
    lua_State *L = complete_state;
    if (!L) return NULL;
    int top = lua_gettop(L);
    if (state == 0) {
        lua_pushnil(L);
        lua_setfield(L, LUA_REGISTRYINDEX, COMPLETIONS_KEY);
        if (lua_cpcall(L, compute_completions, (void *)text) != 0) lua_settop(L, top); /* no completions */
    }
    char *out = NULL;
    lua_getfield(L, LUA_REGISTRYINDEX, COMPLETIONS_KEY);
    if (lua_istable(L, -1)) {
        lua_rawgeti(L, -1, state + 1);
        if (lua_type(L, -1) == LUA_TSTRING) out = strdup(lua_tostring(L, -1));
    }
    lua_settop(L, top);
    return out;
}

static char **repl_completion(const char *text, int start, int end) {
    (void)end;
    rl_attempted_completion_over = 1; /* never libedit's file names */
    /* Tab at the start of a line or after white space is indentation: pasted code keeps its tabs */
    if (text[0] == 0 && (start == 0 || rl_line_buffer[start - 1] == ' ' || rl_line_buffer[start - 1] == '\t')) {
        rl_insert_text("\t");
        return NULL;
    }
    return rl_completion_matches(text, complete_next);
}

/* ------------------------------------------------------------------------------------------------ setup */

/* require("ds4.repl").setup{model = ..., tokenizer = ..., threads = ..., interactive = ...}: the globals, the
 * banner. Returns 0, or 1 after reporting the error. */
static int setup(repl *r, const ds4l_repl_opts *o) {
    lua_State *L = r->L;
    int base = lua_gettop(L);
    lua_pushcfunction(L, msghandler);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "ds4.repl");
    int st = lua_pcall(L, 1, 1, base + 1);
    if (st == 0) {
        lua_getfield(L, -1, "setup");
        lua_createtable(L, 0, 4);
        if (o->model) {
            lua_pushstring(L, o->model);
            lua_setfield(L, -2, "model");
        }
        if (o->tokenizer) {
            lua_pushstring(L, o->tokenizer);
            lua_setfield(L, -2, "tokenizer");
        }
        if (o->threads >= 0) {
            lua_pushinteger(L, o->threads);
            lua_setfield(L, -2, "threads");
        }
        lua_pushboolean(L, r->tty);
        lua_setfield(L, -2, "interactive");
        ds4l_interrupt = 0;
        ds4l_signal_state = L; /* loading a big checkpoint can be interrupted */
        st = lua_pcall(L, 1, 0, base + 1);
        ds4l_signal_state = NULL;
        lua_sethook(L, NULL, 0, 0);
    }
    if (st != 0) {
        fflush(stdout);
        const char *msg = lua_tostring(L, -1);
        fprintf(stderr, "ds4 repl: %s\n", msg ? msg : "(error object is not a string)");
        lua_settop(L, base);
        return 1;
    }
    lua_settop(L, base);
    guard_generate(L);
    return 0;
}

static void setup_tty(repl *r) {
    /* libedit decodes and encodes the line in the locale's codeset: UTF-8, from the environment or C.UTF-8 */
    if (!setlocale(LC_CTYPE, "") || strcmp(nl_langinfo(CODESET), "UTF-8") != 0) setlocale(LC_CTYPE, "C.UTF-8");
    rl_readline_name = "ds4";
    rl_catch_signals = 0;          /* main.c's handler sees every Ctrl-C */
    rl_getc_function = repl_getc;  /* read before rl_initialize: used only when set by then */
    rl_initialize();
    /* Tab completes names (repl_completion); '.' and ':' are part of a word, so model:ge<Tab> is one */
    rl_attempted_completion_function = repl_completion;
    rl_basic_word_break_characters = " \t\n\"\\'`@$><=;|&{(,+-*/%^~#[]";
    rl_completion_append_character = 0;
    stifle_history(HISTORY_MAX);
    const char *home = getenv("HOME");
    int n = home && *home ? snprintf(r->history, sizeof r->history, "%s/%s", home, HISTORY_FILE) : -1;
    if (n > 0 && n < (int)sizeof r->history)
        (void)read_history(r->history); /* a missing or unreadable file is no error */
    else
        r->history[0] = 0;              /* no history file */
}

/* ------------------------------------------------------------------------------------------------ the loop */

int ds4l_repl(lua_State *L, const ds4l_repl_opts *o) {
    repl r;
    memset(&r, 0, sizeof r);
    r.L = L;
    r.tty = isatty(STDIN_FILENO);

    lua_getglobal(L, "tostring");
    r.tostring_slot = lua_gettop(L);
    line_box *box = lua_newuserdata(L, sizeof *box);
    box->s = NULL;
    if (luaL_newmetatable(L, LINE_MT)) {
        lua_pushcfunction(L, line_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_setmetatable(L, -2);
    r.line_slot = lua_gettop(L);

    if (setup(&r, o) != 0) return 1;
    if (r.tty) {
        setup_tty(&r);
        complete_state = L;
    }

    lua_pushnil(L); /* the unfinished chunk, or nil */
    const int pending = lua_gettop(L);
    for (;;) {
        const int has_pending = !lua_isnil(L, pending);
        int got = read_line(&r, has_pending ? ">> " : "> ");
        if (got < 0) { /* Ctrl-C at the prompt */
            lua_pushnil(L);
            lua_replace(L, pending);
            continue;
        }
        if (got == 0) { /* end of input */
            if (has_pending && !r.tty) {
                size_t n;
                const char *s = lua_tolstring(L, pending, &n);
                if (compile_chunk(L, s, n) != 0) report(L);
                else lua_pop(L, 1);
            }
            break;
        }
        size_t n;
        const char *line = lua_tolstring(L, -1, &n);
        if (!has_pending) {
            if (strspn(line, " \t\r") == n) { /* an empty line */
                lua_pop(L, 1);
                continue;
            }
            if (line[0] != '=') {
                /* an expression? then its values are printed */
                if (compile(L, line, n, 1) == 0) {
                    history_add(&r, line);
                    lua_remove(L, -2); /* the line */
                    evaluate(&r);
                    continue;
                }
                lua_pop(L, 1); /* the message */
            }
        } else {
            lua_pushvalue(L, pending);
            lua_insert(L, -2);
            lua_pushliteral(L, "\n");
            lua_insert(L, -2);
            lua_concat(L, 3);
        }
        /* the chunk so far is on the top */
        const char *chunk = lua_tolstring(L, -1, &n);
        int st = compile_chunk(L, chunk, n);
        if (st == 2) { /* incomplete: keep it, read on */
            lua_pop(L, 1);
            lua_replace(L, pending);
            continue;
        }
        history_add(&r, chunk);
        lua_remove(L, -2); /* the chunk */
        lua_pushnil(L);
        lua_replace(L, pending);
        if (st == 1) report(L);
        else evaluate(&r);
    }
    complete_state = NULL;
    lua_settop(L, r.tostring_slot - 1);
    fflush(stdout);
    return 0;
}
