/* repl.h — between lua/main.c (the program: arguments, the Lua state, Ctrl-C) and lua/repl.c (`ds4 repl`).
 *
 * The Ctrl-C state below is the program's only file-scope mutable state; main.c defines it and owns the SIGINT
 * handler, repl.c reads the flag at its prompt and says when the handler may interrupt Lua code. */
#ifndef DS4_REPL_H
#define DS4_REPL_H

#include <signal.h>

#include <lua.h>

/* The interrupt flag: how many Ctrl-C (SIGINT) arrived since it was last cleared; nonzero = interrupt requested.
 * The Lua registry holds a lightuserdata pointing to it (key DS4L_INTERRUPT_KEY, "ds4.interrupt"): model:generate
 * polls it before every step and stops with finish_reason "cancelled". `ds4 run` never clears it; the REPL clears
 * it before each evaluation and when it takes a Ctrl-C at its prompt. sig_atomic_t is int here (checked in main.c),
 * so the generation's `const volatile int *` reads it as it is. */
extern volatile sig_atomic_t ds4l_interrupt;

/* The state the SIGINT handler interrupts: it sets a hook that raises "interrupted!" at the next Lua instruction
 * (as lua.c does). NULL: the handler only sets the flag (the REPL at its prompt, and while a generation runs in
 * the REPL, so that the generation ends "cancelled" instead of with an error). */
extern lua_State *volatile ds4l_signal_state;

typedef struct ds4l_repl_opts {
    const char *model;     /* --model DIR, or NULL: a small random demo model */
    const char *tokenizer; /* --tokenizer FILE, or NULL: DIR/tokenizer.json when present, else the byte-level one */
    int threads;           /* --threads N (0 = one per physical core, at most 16), or -1: the engine's default */
} ds4l_repl_opts;

/* Run the REPL on a state that has the standard libraries, the package path, ds4.core and the interrupt key set
 * up, with the SIGINT handler installed (staying installed across Ctrl-C). Returns the exit status: 0 at end of
 * input (Ctrl-D), 1 when the model or tokenizer could not be set up; os.exit(n) exits with n from inside. */
int ds4l_repl(lua_State *L, const ds4l_repl_opts *o);

#endif
