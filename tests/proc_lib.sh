# proc_lib.sh — what the multi-process shell tests share (sourced, not run): a temporary directory $out, removed at
# exit after every process in the array pids is killed (KEEP=1 keeps the directory and says where); fail MESSAGE,
# which prints the last lines of every log in $out and exits 1; wait_for FILE SECONDS [TEXT], true once FILE exists
# (and holds TEXT).
#   . "$(dirname "${BASH_SOURCE[0]}")/proc_lib.sh" NAME      # $out is ${TMPDIR:-/tmp}/ds4-NAME.XXXXXX
out="$(mktemp -d "${TMPDIR:-/tmp}/ds4-$1.XXXXXX")"
pids=()
proc_lib_cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    if [ -n "${KEEP:-}" ]; then echo "kept $out"; else rm -rf "$out"; fi
}
trap proc_lib_cleanup EXIT
fail() {
    echo "FAIL: $*"
    for f in "$out"/*.log "$out"/*.err; do
        [ -s "$f" ] || continue
        echo "=== $f"
        tail -n 25 "$f"
    done
    exit 1
}
wait_for() {
    local i
    for i in $(seq 1 $(($2 * 10))); do
        if [ -e "$1" ] && { [ -z "${3:-}" ] || grep -qF -- "$3" "$1"; }; then return 0; fi
        sleep 0.1
    done
    return 1
}
