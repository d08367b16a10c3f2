#!/usr/bin/env bash
# install-deps.sh — install, on Debian 12, the packages ds4 needs to build and test. Idempotent: a package
# that is already installed is left alone, and `apt-get update` runs only when something is missing.
#
#   bash scripts/install-deps.sh            # as root (or through sudo when it is available)
#
# What each package is for:
#   build-essential cmake pkg-config  the C toolchain and the build
#   libluajit-5.1-dev luajit          the Lua host (`ds4`) and its FFI
#   libmsgpack-dev libzmq3-dev        the rollout wire (msgpack codec, ZeroMQ transport)
#   libpcre2-dev libutf8proc-dev      the tokenizer: PCRE2 runs the pre-tokenizer regexes (\p{L}, \p{N}, ...),
#                                     utf8proc gives NFC and Unicode categories
#   libedit-dev                       `ds4 repl`: line editing and history (BSD-licensed, readline-compatible API)
#   libprotobuf-c-dev protobuf-c-compiler  TensorBoard event files (the Event protobuf, lua/tb_event.proto); the
#                                     build leaves them out, and writes no event files, where they are missing
#   clang libclang-rt-14-dev          libFuzzer targets and the sanitizer runtimes (ASan, UBSan, LSan)
#   llvm-14                           llvm-symbolizer, so sanitizer and fuzzer reports show file:line
#   openmpi-bin libopenmpi-dev        ds4.dist on CPU ranks (mpirun, MPI collectives); the build leaves the MPI
#                                     communicator out, and its tests skip, where they are missing
# The CUDA toolkit is optional and is not installed here: the build switches the CUDA backend on when nvcc is
# found and builds a CPU-only ds4 otherwise. No Python is needed to build or test (tests/gen_fixtures.py runs
# only on a torch host, to regenerate fixtures).
set -euo pipefail

PACKAGES=(
    build-essential
    cmake
    pkg-config
    libluajit-5.1-dev
    luajit
    libmsgpack-dev
    libzmq3-dev
    libpcre2-dev
    libutf8proc-dev
    libedit-dev
    libprotobuf-c-dev
    protobuf-c-compiler
    clang
    libclang-rt-14-dev
    llvm-14
    openmpi-bin
    libopenmpi-dev
)

log() { printf 'install-deps: %s\n' "$*"; }

if ! command -v dpkg >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    log "this script is for Debian/Ubuntu (dpkg + apt-get); install by hand: ${PACKAGES[*]}" >&2
    exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
    # dpkg -s succeeds for removed-but-not-purged packages too; require the "install ok installed" state.
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ]; then
        log "have $p"
    else
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    log "all ${#PACKAGES[@]} packages present, nothing to do"
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        log "missing ${missing[*]} and not root (no sudo): run this script as root" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
log "missing: ${missing[*]}"
log "apt-get update"
"${SUDO[@]}" apt-get update -q
log "apt-get install ${missing[*]}"
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
log "done"
