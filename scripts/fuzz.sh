#!/usr/bin/env bash
# fuzz.sh — build the libFuzzer targets (clang, DS4_FUZZ=ON, in build-fuzz/) and run each for a bounded time.
#
#   bash scripts/fuzz.sh                       # every tests/fuzz/fuzz_*.c target, FUZZ_SECONDS each
#   FUZZ_SECONDS=3600 bash scripts/fuzz.sh fuzz_safetensors   # one target, for an hour
#   FUZZ_MERGE=1 bash scripts/fuzz.sh          # afterwards, merge new coverage into tests/fuzz/corpus/
#
# Environment:
#   FUZZ_SECONDS   seconds per target (default 600 here; scripts/test.sh runs it with 30)
#   FUZZ_MERGE=1   merge the inputs that found new coverage back into the committed corpus (minimised with
#                  libFuzzer's -merge=1); without it the tree is never written to
#   FUZZ_ARGS      extra libFuzzer flags, e.g. "-max_len=65536 -jobs=2"
#   BUILD_DIR      build directory (default build-fuzz)
#   SKIP_DEPS=1    do not run scripts/install-deps.sh
#
# The seed corpus of fuzz_NAME is tests/fuzz/corpus/NAME/ (may be absent). It is copied to a temporary
# directory, which libFuzzer grows; crash/timeout/OOM reproducers are written to BUILD_DIR/artifacts/NAME/.
# Any crash, sanitizer report, leak, timeout or OOM makes the script exit non-zero. To replay a reproducer:
#   build-fuzz/fuzz_NAME build-fuzz/artifacts/NAME/crash-...
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FUZZ_SECONDS="${FUZZ_SECONDS:-600}"
BUILD_DIR="${BUILD_DIR:-build-fuzz}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
read -r -a EXTRA <<<"${FUZZ_ARGS:-}"

say() { printf '== fuzz: %s\n' "$*"; }

case "$FUZZ_SECONDS" in
    '' | *[!0-9]*) say "FUZZ_SECONDS must be a whole number of seconds, got '$FUZZ_SECONDS'" >&2; exit 2 ;;
esac

if [ "${SKIP_DEPS:-0}" != 1 ]; then
    bash scripts/install-deps.sh
fi

# Which targets: the arguments, or every tests/fuzz/fuzz_*.c.
targets=()
if [ "$#" -gt 0 ]; then
    for t in "$@"; do
        t="$(basename "$t" .c)"
        [ -f "tests/fuzz/$t.c" ] || { say "no such target: tests/fuzz/$t.c" >&2; exit 2; }
        targets+=("$t")
    done
else
    shopt -s nullglob
    for src in tests/fuzz/fuzz_*.c; do
        targets+=("$(basename "$src" .c)")
    done
    shopt -u nullglob
fi
if [ "${#targets[@]}" -eq 0 ]; then
    say "no fuzz targets (tests/fuzz/fuzz_*.c): nothing to do"
    exit 0
fi

CLANG="${FUZZ_CC:-clang}"
command -v "$CLANG" >/dev/null 2>&1 || { say "$CLANG not found (scripts/install-deps.sh installs clang)" >&2; exit 1; }

# The CUDA backend stays off: DS4_FUZZ adds -fsanitize=fuzzer-no-link to every compile, which nvcc hands to
# its host compiler (gcc), which rejects it; and no fuzz target touches the GPU. -O1 -g with assertions on is the usual fuzzing
# trade-off between speed and reports.
say "configure $BUILD_DIR (clang, DS4_FUZZ=ON)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_C_COMPILER="$CLANG" -DDS4_FUZZ=ON -DDS4_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g"
say "build ${targets[*]}"
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"

# LeakSanitizer needs ptrace; scripts/test.sh probes it and passes FUZZ_DETECT_LEAKS=0 where it cannot run.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=${FUZZ_DETECT_LEAKS:-1}}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

work="$(mktemp -d "${TMPDIR:-/tmp}/ds4-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT

failed=()
for t in "${targets[@]}"; do
    name="${t#fuzz_}"
    seed="tests/fuzz/corpus/$name"
    corpus="$work/$name"
    artifacts="$BUILD_DIR/artifacts/$name"
    mkdir -p "$corpus" "$artifacts"
    nseed=0
    if [ -d "$seed" ]; then
        cp -R "$seed/." "$corpus/"
        nseed="$(find "$seed" -type f | wc -l)"
    fi
    say "$t: ${FUZZ_SECONDS}s, $nseed seed inputs from $seed"
    rc=0
    # timeout: a hard stop well past -max_total_time in case the target hangs outside libFuzzer's control.
    timeout --kill-after=30 "$((FUZZ_SECONDS + 300))" \
        "$BUILD_DIR/$t" -max_total_time="$FUZZ_SECONDS" -timeout=30 -rss_limit_mb=4096 \
        -print_final_stats=1 -detect_leaks="${FUZZ_DETECT_LEAKS:-1}" \
        -artifact_prefix="$artifacts/" "${EXTRA[@]}" "$corpus" </dev/null || rc=$?
    if [ "$rc" -ne 0 ]; then
        say "$t: FAILED (exit $rc); reproducers in $artifacts/:"
        ls -l "$artifacts" >&2 || true
        failed+=("$t")
        continue
    fi
    say "$t: ok ($(find "$corpus" -type f | wc -l) corpus inputs after the run)"
    if [ "${FUZZ_MERGE:-0}" = 1 ]; then
        mkdir -p "$seed"
        say "$t: merging new coverage into $seed"
        "$BUILD_DIR/$t" -merge=1 -detect_leaks=0 "$seed" "$corpus" </dev/null
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    say "failed: ${failed[*]}"
    exit 1
fi
say "all ${#targets[@]} targets ran ${FUZZ_SECONDS}s without a finding"
