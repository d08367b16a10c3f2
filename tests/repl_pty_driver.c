/* repl_pty_driver.c — `ds4 repl` on a real terminal: runs it on a pseudo-terminal (forkpty) and types at it as a
 * person would, checking what comes back:
 *   (a) the prompt appears; "=6*7" prints 42; an expression prints its value; a multi-line function definition
 *       continues at ">> " and can then be called;
 *   (b) streaming: a generation's tokens reach the terminal while it is still running (a gate in on_token stops
 *       the generation after 5 tokens until the driver answers; the tokens must be on the screen by then);
 *   (c) Ctrl-C during a long generation stops it (finish "cancelled"), the prompt returns, and the REPL works on;
 *   (d) Ctrl-C stops a running Lua loop ("interrupted!");
 *   (e) an error prints its message and the prompt returns;
 *   (f) Ctrl-C at the prompt abandons the line; the process stays;
 *   (g) Ctrl-D at an empty prompt exits with status 0, and the history file has the lines typed;
 *   (h) (before g) Tab completes a model's method (model:n_pa -> model:n_params), a global and a module's field,
 *       and a Tab at the start of a line is indentation, not a completion.
 * Every wait is bounded (EXPECT_SECONDS per expectation, plus an overall alarm), so it never hangs. On failure it
 * prints the step, what it waited for and the end of the transcript (control characters escaped).
 *
 * usage: repl_pty_driver <path-to-ds4> <fixtures_dir>      exit 0 pass, 1 fail, 77 skipped (no pseudo-terminal)
 * REPL_PTY_VERBOSE=1 prints the transcript after a pass too. */
#define _GNU_SOURCE /* forkpty, mkdtemp, memmem */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define EXPECT_SECONDS 20.0
#define OVERALL_SECONDS 280
#define TRANSCRIPT_TAIL 12000

typedef struct drv {
    int fd;
    pid_t pid;
    char *buf; /* everything read from the terminal, NUL-terminated */
    size_t len, cap;
    size_t mark; /* expectations search from here */
    const char *step;
    int exited, status;
} drv;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void print_escaped(FILE *f, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') fputs("\\n\n", f);
        else if (c == '\r') fputs("\\r", f);
        else if (c == '\\') fputs("\\\\", f);
        else if (c < 0x20 || c == 0x7f) fprintf(f, "\\x%02x", c);
        else fputc(c, f);
    }
}

static void dump(drv *d) {
    size_t from = d->len > TRANSCRIPT_TAIL ? d->len - TRANSCRIPT_TAIL : 0;
    fprintf(stderr, "---- transcript (%zu bytes%s; searching from byte %zu; \\n ends a line, \\r shown) ----\n",
            d->len, from ? ", the end only" : "", d->mark);
    if (from) fprintf(stderr, "[... %zu bytes ...]", from);
    if (d->mark >= from && d->mark <= d->len) {
        print_escaped(stderr, d->buf + from, d->mark - from);
        fputs("<<<MARK>>>", stderr);
        print_escaped(stderr, d->buf + d->mark, d->len - d->mark);
    } else {
        print_escaped(stderr, d->buf + from, d->len - from);
    }
    fputs("\n---- end of transcript ----\n", stderr);
}

static void fail(drv *d, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "FAIL [%s]: ", d->step);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    dump(d);
    if (!d->exited) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
    }
    exit(1);
}

/* Read what is there (waiting at most timeout_ms for the first byte). Returns 1 data, 0 nothing, -1 the terminal
 * closed (the child exited). */
static int pump(drv *d, int timeout_ms) {
    struct pollfd p = {.fd = d->fd, .events = POLLIN};
    int r = poll(&p, 1, timeout_ms);
    if (r < 0) return errno == EINTR ? 0 : -1;
    if (r == 0) return 0;
    char tmp[4096];
    ssize_t n = read(d->fd, tmp, sizeof tmp);
    if (n <= 0) {
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
        return -1; /* EIO: the slave side is closed */
    }
    if (d->len + (size_t)n + 1 > d->cap) {
        while (d->len + (size_t)n + 1 > d->cap) d->cap = d->cap ? 2 * d->cap : 65536;
        d->buf = realloc(d->buf, d->cap);
        if (!d->buf) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
    }
    memcpy(d->buf + d->len, tmp, (size_t)n);
    d->len += (size_t)n;
    d->buf[d->len] = 0;
    return 1;
}

static const char *find(drv *d, const char *needle) {
    if (!d->buf) return NULL;
    size_t n = strlen(needle);
    for (size_t i = d->mark; i + n <= d->len; i++)
        if (memcmp(d->buf + i, needle, n) == 0) return d->buf + i;
    return NULL;
}

/* Wait for needle after the mark; moves the mark past it and returns its offset. */
static size_t expect(drv *d, const char *needle) {
    double end = now() + EXPECT_SECONDS;
    for (;;) {
        const char *p = find(d, needle);
        if (p) {
            size_t off = (size_t)(p - d->buf);
            d->mark = off + strlen(needle);
            return off;
        }
        double left = end - now();
        if (left <= 0) {
            fprintf(stderr, "waited %.0f s for \"", EXPECT_SECONDS);
            print_escaped(stderr, needle, strlen(needle));
            fprintf(stderr, "\"\n");
            fail(d, "expected output did not come");
        }
        if (pump(d, (int)(left * 1000) + 1) < 0) {
            fprintf(stderr, "waiting for \"");
            print_escaped(stderr, needle, strlen(needle));
            fprintf(stderr, "\"\n");
            fail(d, "the terminal closed (ds4 exited)");
        }
    }
}

/* Wait until at least n bytes have arrived after offset `from`. */
static void expect_bytes(drv *d, size_t from, size_t n) {
    double end = now() + EXPECT_SECONDS;
    while (d->len < from + n) {
        double left = end - now();
        if (left <= 0) fail(d, "waited %.0f s for %zu bytes of output", EXPECT_SECONDS, n);
        if (pump(d, (int)(left * 1000) + 1) < 0) fail(d, "the terminal closed (ds4 exited)");
    }
}

/* Read for ms milliseconds (lets the program react before the next keys). */
static void settle(drv *d, int ms) {
    double end = now() + ms / 1000.0;
    for (double left; (left = end - now()) > 0;)
        if (pump(d, (int)(left * 1000) + 1) < 0) return;
}

static void send(drv *d, const char *s) {
    size_t n = strlen(s);
    while (n > 0) {
        ssize_t w = write(d->fd, s, n);
        if (w < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            fail(d, "cannot write to the terminal: %s", strerror(errno));
        }
        s += w;
        n -= (size_t)w;
    }
}

/* Type a line and press Enter; expectations then search from what it causes. */
static void type_line(drv *d, const char *line) {
    d->mark = d->len;
    send(d, line);
    send(d, "\r");
}

/* libedit flushes its prompt before it switches the terminal to raw mode, so keys sent the moment the prompt shows
 * may still meet the cooked terminal (kernel echo, then libedit's own). A person is never that fast: wait, as
 * they would, until the line editor has the terminal (echo off). */
static void wait_raw(drv *d) {
    double end = now() + EXPECT_SECONDS;
    for (;;) {
        struct termios t;
        if (tcgetattr(d->fd, &t) == 0 && !(t.c_lflag & ECHO)) return;
        if (now() > end) fail(d, "the terminal stayed in cooked mode (echo on) at the prompt");
        if (pump(d, 5) < 0) fail(d, "the terminal closed (ds4 exited)");
    }
}

static void prompt(drv *d) {
    expect(d, "\n> ");
    wait_raw(d);
}

static void prompt2(drv *d) {
    expect(d, ">> ");
    wait_raw(d);
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "FAIL: repl_pty_driver ran out of time (overall limit)\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(1);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <path-to-ds4> <fixtures_dir>\n", argv[0]);
        return 2;
    }
    char model[4096];
    snprintf(model, sizeof model, "%s/tiny_a", argv[2]);
    char home[] = "/tmp/ds4-repl-pty.XXXXXX";
    if (!mkdtemp(home)) {
        perror("mkdtemp");
        return 1;
    }

    drv d;
    memset(&d, 0, sizeof d);
    d.step = "start";
    struct winsize ws = {.ws_row = 50, .ws_col = 250};
    d.pid = forkpty(&d.fd, NULL, NULL, &ws);
    if (d.pid < 0) {
        fprintf(stderr, "SKIP: cannot open a pseudo-terminal (forkpty: %s)\n", strerror(errno));
        rmdir(home);
        return 77;
    }
    if (d.pid == 0) {
        setenv("HOME", home, 1);
        setenv("TERM", "xterm", 1);
        setenv("LANG", "C.UTF-8", 1);
        unsetenv("LC_ALL");
        unsetenv("LC_CTYPE");
        execl(argv[1], argv[1], "repl", "--model", model, (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", argv[1], strerror(errno));
        _exit(127);
    }
    signal(SIGALRM, on_alarm);
    alarm(OVERALL_SECONDS);

    /* (a) the prompt, values, multi-line input */
    d.step = "a: banner and prompt";
    expect(&d, "repl: model");
    prompt(&d);
    d.step = "a: =6*7";
    type_line(&d, "=6*7");
    expect(&d, "\n42\r");
    prompt(&d);
    d.step = "a: expression 1+2";
    type_line(&d, "1+2");
    expect(&d, "\n3\r");
    prompt(&d);
    d.step = "a: multi-line definition";
    type_line(&d, "function twice(x)");
    prompt2(&d);
    type_line(&d, "  return 2 * x");
    prompt2(&d);
    type_line(&d, "end");
    prompt(&d);
    type_line(&d, "=twice(21)");
    expect(&d, "\n42\r");
    prompt(&d);

    /* (b) streaming: the 5th token's on_token blocks on io.read() after writing a marker to stderr (unbuffered,
     * so the marker shows no matter how stdout is buffered); the first tokens must already be on the screen. The
     * marker is built at run time so that the echo of the typed line does not contain it. */
    d.step = "b: streaming";
    type_line(&d, "k = 0; generate{prompt = \"ab\", max_new_tokens = 30, ignore_eos = true, seed = 7, on_token = "
                  "function() k = k + 1; if k == 5 then io.stderr:write(\"<W\" .. \"AIT>\"); io.read() end end}");
    size_t echo = expect(&d, "end end}");
    size_t gate = expect(&d, "<WAIT>");
    const char *nl = memchr(d.buf + echo, '\n', gate - echo); /* the end of the echoed line */
    size_t start = nl ? (size_t)(nl - d.buf) + 1 : echo;
    if (!nl || start > gate || gate - start < 5)
        fail(&d, "the generation's first tokens were not on the terminal before it ended (%zu bytes before the "
                 "gate)", nl && start <= gate ? gate - start : (size_t)0);
    if (memmem(d.buf + start, gate - start, "tokens, finish", 14))
        fail(&d, "the generation had ended before the gate");
    send(&d, "\r"); /* io.read() returns; the generation goes on */
    expect(&d, "[30 tokens, finish length");
    prompt(&d);
    type_line(&d, "=k");
    expect(&d, "\n30\r");
    prompt(&d);

    /* (c) Ctrl-C during a long generation */
    d.step = "c: Ctrl-C during a generation";
    type_line(&d, "t, r = generate{prompt = \"ab\", max_new_tokens = 100000, ignore_eos = true}");
    expect(&d, "ignore_eos = true}");
    size_t enl = expect(&d, "\n"); /* the end of the echoed line */
    expect_bytes(&d, enl + 1, 64); /* the generation is streaming */
    double t0 = now();
    send(&d, "\x03");
    expect(&d, "finish cancelled");
    prompt(&d);
    double dt = now() - t0;
    if (dt > 10) fail(&d, "the prompt came back %.1f s after Ctrl-C", dt);
    type_line(&d, "=r.finish_reason, #r.ids > 0");
    expect(&d, "\ncancelled\ttrue\r");
    prompt(&d);
    type_line(&d, "=1+1");
    expect(&d, "\n2\r");
    prompt(&d);

    /* (d) Ctrl-C in a Lua loop (one that calls a C function each time: the interpreter runs it and sees the hook) */
    d.step = "d: Ctrl-C in a Lua loop";
    type_line(&d, "io.write(\"LO\" .. \"OP\\n\") io.flush() n = 0 while true do n = n + 1 local _ = os.clock() end");
    expect(&d, "LOOP"); /* the loop is running (a Ctrl-C before it would be one at the prompt) */
    settle(&d, 100);
    send(&d, "\x03");
    expect(&d, "interrupted!");
    prompt(&d);
    type_line(&d, "=n > 0");
    expect(&d, "\ntrue\r");
    prompt(&d);

    /* (e) an error */
    d.step = "e: error";
    type_line(&d, "error(\"bo\" .. \"om\")");
    expect(&d, "boom");
    expect(&d, "stack traceback");
    prompt(&d);
    type_line(&d, "=3*3");
    expect(&d, "\n9\r");
    prompt(&d);

    /* (f) Ctrl-C at the prompt: a half-typed line is abandoned; an empty prompt just comes back */
    d.step = "f: Ctrl-C at the prompt";
    d.mark = d.len;
    send(&d, "abc");
    expect(&d, "abc"); /* libedit has the keys (a Ctrl-C first would leave them for the next line) */
    send(&d, "\x03");
    expect(&d, "^C");
    prompt(&d);
    send(&d, "\x03");
    expect(&d, "^C");
    prompt(&d);
    type_line(&d, "=3+4");
    expect(&d, "\n7\r");
    prompt(&d);

    /* (h) Tab completion: a method of the model, a global, a module's field; a Tab at the start of a line is
     * indentation (pasted code keeps it) */
    d.step = "h: Tab completion";
    d.mark = d.len;
    /* libedit redraws only the completed tail of the word: what the completed line evaluates to is the check */
    send(&d, "=model:n_pa\t");
    expect(&d, "rams");
    type_line(&d, "() > 0");
    expect(&d, "\ntrue\r");
    prompt(&d);
    send(&d, "=#chat_hi\t");
    expect(&d, "story");
    type_line(&d, "()");
    expect(&d, "\n0\r");
    prompt(&d);
    send(&d, "=type(ds4.config_su\t");
    expect(&d, "mmary");
    type_line(&d, ")");
    expect(&d, "\nfunction\r");
    prompt(&d);
    send(&d, "\tindent = 6");
    expect(&d, "indent = 6");
    type_line(&d, "");
    prompt(&d);
    type_line(&d, "=indent");
    expect(&d, "\n6\r");
    prompt(&d);

    /* (g) Ctrl-D at an empty prompt */
    d.step = "g: Ctrl-D";
    send(&d, "\x04");
    double end = now() + EXPECT_SECONDS;
    while (!d.exited) {
        pid_t w = waitpid(d.pid, &d.status, WNOHANG);
        if (w == d.pid) {
            d.exited = 1;
            break;
        }
        if (now() > end) fail(&d, "ds4 repl did not exit after Ctrl-D");
        pump(&d, 50);
    }
    while (pump(&d, 100) > 0) {
    }
    if (!WIFEXITED(d.status) || WEXITSTATUS(d.status) != 0) {
        if (WIFSIGNALED(d.status)) fail(&d, "ds4 repl was killed by signal %d", WTERMSIG(d.status));
        fail(&d, "ds4 repl exited with status %d, expected 0", WEXITSTATUS(d.status));
    }

    d.step = "g: history file";
    char hist[4200];
    snprintf(hist, sizeof hist, "%s/.ds4_history", home);
    FILE *hf = fopen(hist, "r");
    if (!hf) fail(&d, "no history file %s", hist);
    char hb[65536];
    size_t hn = fread(hb, 1, sizeof hb - 1, hf);
    fclose(hf);
    hb[hn] = 0;
    if (!strstr(hb, "=6*7") || !strstr(hb, "=3+4")) fail(&d, "the history file lacks the lines typed:\n%s", hb);
    unlink(hist);
    rmdir(home);
    if (getenv("REPL_PTY_VERBOSE")) dump(&d);
    free(d.buf);
    printf("repl_pty: all checks passed (prompt, values, multi-line, streaming, Ctrl-C in a generation, in a loop "
           "and at the prompt, errors, Tab completion, Ctrl-D, history)\n");
    return 0;
}
