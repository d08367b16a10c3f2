#!/usr/bin/env bash
# test.sh — install what is missing, build, and run the whole test suite. This is what CI runs.
#
#   bash scripts/test.sh                       # all stages
#   STAGES="release" bash scripts/test.sh      # a subset: any of release, asan, fuzz
#   FUZZ_SECONDS=600 bash scripts/test.sh      # fuzz each target 10 minutes instead of 30 s
#
# Stages (each one builds in its own directory; a failing stage does not stop the next one):
#   release  Release build in build/ (CUDA backend on when nvcc is found), then ctest
#   asan     AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer) Debug build in build-asan/, ctest
#   fuzz     clang libFuzzer build in build-fuzz/; every tests/fuzz/fuzz_* target runs FUZZ_SECONDS (default 30)
#            on a temporary copy of its corpus (scripts/fuzz.sh; run that directly for long sessions)
# The last line is "tests: N passed, N failed, N skipped" over all stages (a stage that fails before its tests
# run counts as one failure); the exit status is non-zero when any stage failed.
#
# Environment: STAGES, FUZZ_SECONDS, JOBS (build parallelism, default: cores), CTEST_JOBS (default 2),
# SKIP_DEPS=1 (do not run scripts/install-deps.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exec </dev/null   # CI has no stdin; nothing under test may wait for input

STAGES="${STAGES:-release asan fuzz}"
FUZZ_SECONDS="${FUZZ_SECONDS:-30}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
CTEST_JOBS="${CTEST_JOBS:-2}"
export FUZZ_SECONDS JOBS

say() { printf '== test: %s\n' "$*"; }

# Per-test tallies across stages ("passed failed skipped" lines), for the closing summary line.
COUNTS="$(mktemp "${TMPDIR:-/tmp}/ds4-counts.XXXXXX")"
# What failed, with the end of each failing test's output: printed again just before the closing line, because
# a CI log is often read from its tail only, and the fuzz stage prints a lot after the release stage's ctest.
FAILURES="$(mktemp "${TMPDIR:-/tmp}/ds4-failures.XXXXXX")"
trap 'rm -f "$COUNTS" "$FAILURES"' EXIT

# Run ctest in build dir $1, echo its output, and add its pass/fail/skip counts to $COUNTS.
run_ctest() {
    local log rc=0 total failed skipped
    log="$(mktemp "${TMPDIR:-/tmp}/ds4-ctest.XXXXXX")"
    ctest --test-dir "$1" --output-on-failure --no-tests=error -j "$CTEST_JOBS" 2>&1 | tee "$log" || rc=$?
    total="$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' "$log" | tail -n1)"
    failed="$(sed -n 's/.* \([0-9]*\) tests failed out of .*/\1/p' "$log" | tail -n1)"
    skipped="$(grep -c '(Skipped)' "$log" || true)"
    if [ "$rc" -ne 0 ]; then
        {
            printf '== test: failures in %s:\n' "$1"
            sed -n '/The following tests FAILED:/,$p' "$log"
            # The last 40 lines each failing test printed (ctest --output-on-failure puts them after the
            # test's status line, up to the next test's status line).
            awk '/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: / { keep = ($0 ~ /\*\*\*|Failed|Timeout/) }
                 keep { print }' "$log" | tail -n 120
        } >>"$FAILURES"
    fi
    rm -f "$log"
    if [ -n "$total" ] && [ -n "$failed" ]; then
        echo "$((total - failed - skipped)) $failed $skipped" >>"$COUNTS"
    fi
    return "$rc"
}

# ------------------------------------------------------------------------------------------- environment
if [ "${SKIP_DEPS:-0}" != 1 ]; then
    say "installing missing packages"
    bash scripts/install-deps.sh
fi
say "$(uname -srm), $(nproc) cores, CI=${CI:-}"
say "cc: $(cc --version | head -n1)"
say "clang: $(clang --version 2>/dev/null | head -n1 || echo absent)"
if command -v nvcc >/dev/null 2>&1; then
    say "nvcc: $(nvcc --version | tail -n1) (the release build includes the CUDA backend)"
else
    say "nvcc: absent (CPU-only build; CUDA tests skip)"
fi

# ------------------------------------------------------------------------------------------- stages
stage_release() {
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j "$JOBS"
    run_ctest build
}

# Does LeakSanitizer work here? It stops the world with ptrace; some containers forbid that (seccomp, Yama
# ptrace_scope=3, or running under a tracer), and then every sanitized process would die at exit with
# "LeakSanitizer has encountered a fatal error". Probe with a program that leaks on purpose.
# Prints 1 when leak detection works, 0 when it cannot run here.
lsan_probe() {
    local dir out rc
    dir="$(mktemp -d "${TMPDIR:-/tmp}/ds4-lsan.XXXXXX")"
    printf '#include <stdlib.h>\nvoid *volatile p;\nint main(void) { p = malloc(77); p = 0; return 0; }\n' \
        >"$dir/leak.c"
    if ! "${1:-cc}" -fsanitize=address -g -O0 "$dir/leak.c" -o "$dir/leak" 2>"$dir/cc.log"; then
        cat "$dir/cc.log" >&2
        rm -rf "$dir"
        echo "compile-failed"
        return 0
    fi
    rc=0
    out="$(ASAN_OPTIONS=detect_leaks=1 "$dir/leak" 2>&1)" || rc=$?
    rm -rf "$dir"
    if [ "$rc" -ne 0 ] && grep -q 'detected memory leaks' <<<"$out"; then
        echo 1
    elif grep -q -i -e 'LeakSanitizer has encountered a fatal error' -e 'does not work under ptrace' <<<"$out"; then
        printf '%s\n' "$out" | head -n 5 >&2
        echo 0
    else
        printf 'unexpected LeakSanitizer probe result (exit %s):\n%s\n' "$rc" "$out" | head -n 8 >&2
        echo 0
    fi
}

# Prints the detect_leaks value for sanitized runs built by compiler $1.
detect_leaks() {
    local v
    v="$(lsan_probe "$1")"
    case "$v" in
        1) say "LeakSanitizer works here ($1): leak checking on" >&2 ;;
        0) say "LeakSanitizer cannot run here ($1; ptrace refused?): leak checking OFF, ASan/UBSan still on" >&2 ;;
        *) say "could not build an ASan probe program with $1" >&2; return 1 ;;
    esac
    echo "$v"
}

stage_asan() {
    local leaks
    leaks="$(detect_leaks cc)"
    # DS4_CUDA=OFF: CI machines have no GPU (test_cuda would only skip), and the CUDA runtime under ASan needs
    # ASAN_OPTIONS=protect_shadow_gap=0 on a GPU host. The CUDA backend is exercised by the release stage
    # (test_cuda, on a GPU host); leaving it out here also saves the nvcc compile.
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DDS4_SANITIZE=ON -DDS4_CUDA=OFF
    cmake --build build-asan -j "$JOBS"
    ASAN_OPTIONS="detect_leaks=$leaks:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:abort_on_error=0" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    LSAN_OPTIONS="print_suppressions=0" \
        run_ctest build-asan
}

stage_fuzz() {
    local leaks
    leaks="$(detect_leaks clang)"
    local log rc=0
    log="$(mktemp "${TMPDIR:-/tmp}/ds4-fuzz.XXXXXX")"
    SKIP_DEPS=1 FUZZ_DETECT_LEAKS="$leaks" bash scripts/fuzz.sh 2>&1 | tee "$log" || rc=$?
    echo "$(grep -c '^== fuzz: fuzz_[a-z_]*: ok' "$log" || true) $(grep -c '^== fuzz: fuzz_[a-z_]*: FAILED' "$log" || true) 0" >>"$COUNTS"
    rm -f "$log"
    return "$rc"
}

# ------------------------------------------------------------------------------------------- run
passed=()
failed=()
for stage in $STAGES; do
    case "$stage" in
        release | asan | fuzz) ;;
        *) say "unknown stage '$stage' (known: release asan fuzz)" >&2; failed+=("$stage"); continue ;;
    esac
    say "stage $stage: start"
    t0=$SECONDS
    lines_before="$(wc -l <"$COUNTS")"
    # A subshell outside any `if`/`||`, so that set -e applies inside the stage.
    set +e
    ( set -euo pipefail; "stage_$stage" )
    rc=$?
    set -e
    if [ "$rc" -ne 0 ] && [ "$(wc -l <"$COUNTS")" -eq "$lines_before" ]; then
        echo "0 1 0" >>"$COUNTS" # the stage failed before any test ran (configure or build): count it once
    fi
    if [ "$rc" -eq 0 ]; then
        passed+=("$stage")
        say "stage $stage: passed ($((SECONDS - t0)) s)"
    else
        failed+=("$stage")
        say "stage $stage: FAILED with exit $rc ($((SECONDS - t0)) s)"
    fi
done

if [ -s "$FAILURES" ]; then
    say "what failed (repeated from above):"
    cat "$FAILURES"
fi
say "passed stages: ${passed[*]:-none}; failed stages: ${failed[*]:-none}"
# Closing line: individual tests over all stages (ctest tests of the release and sanitizer builds, fuzz targets).
read -r tp tf ts < <(awk '{p += $1; f += $2; s += $3} END {print p + 0, f + 0, s + 0}' "$COUNTS")
echo "tests: $tp passed, $tf failed, $ts skipped"
[ "${#failed[@]}" -eq 0 ]
