#!/usr/bin/env bash
# run-main.sh — install what is missing, build ds4 (Release, in build/), and run the main job.
#
#   bash scripts/run-main.sh                 # on a fresh Debian 12 machine, as root
#   JOB=examples/other.lua bash scripts/run-main.sh
#
# Environment:
#   JOB          the Lua script `ds4 run` executes (default below)
#   BUILD_DIR    build directory (default build)
#   JOBS         parallel build jobs (default: number of cores)
#   SKIP_DEPS=1  do not run scripts/install-deps.sh
# Extra arguments are passed to the job script.
set -euo pipefail

# The main job: DAPO on a verifiable task, end to end on the CPU (README "RL").
JOB="${JOB:-examples/dapo.lua}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

say() { printf '== run-main: %s\n' "$*"; }

if [ "${SKIP_DEPS:-0}" != 1 ]; then
    say "installing missing packages"
    bash scripts/install-deps.sh
fi

say "configure ($BUILD_DIR, Release)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
say "build (-j$JOBS)"
cmake --build "$BUILD_DIR" -j "$JOBS"

if [ ! -f "$JOB" ]; then
    say "job script $JOB not found" >&2
    exit 1
fi
say "$BUILD_DIR/ds4 run $JOB $*"
exec "$BUILD_DIR/ds4" run "$JOB" "$@"
