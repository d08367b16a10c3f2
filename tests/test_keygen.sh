#!/usr/bin/env bash
# test_keygen.sh — `ds4 keygen`: CURVE key pairs for ZeroMQ as files (PREFIX.key mode 0600, PREFIX.pub) or on
# stdout; Z85 lengths; the public key matches the secret (checked through ds4.zmq.public_from_secret); existing
# files are kept unless --force; missing directories of PREFIX are created (mode 0700); bad arguments exit 2.
#
# usage: bash tests/test_keygen.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -u

DS4=$(realpath "$1")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

fails=0
checks=0
fail() { fails=$((fails + 1)); echo "FAIL: $*" >&2; }
expect_rc() { checks=$((checks + 1)); [ "$3" -eq "$2" ] || { fail "$1: exit status $3, expected $2"; sed 's/^/    | /' "$WORK/err" >&2; }; }
expect_in() {
    checks=$((checks + 1))
    grep -qF -- "$3" "$2" || { fail "$1: output lacks '$3'"; sed 's/^/    | /' "$2" >&2; }
}
expect_eq() { checks=$((checks + 1)); [ "$2" = "$3" ] || fail "$1: got '$2', expected '$3'"; }
run() { "$DS4" "$@" >"$WORK/out" 2>"$WORK/err"; rc=$?; }

# The Z85 key on the first line of a file that is not a comment.
key_of() { grep -v '^#' "$1" | grep -v '^$' | head -n 1; }
# The public key ds4.zmq derives from a secret key.
public_of() {
    printf 'io.write(require("ds4").zmq.public_from_secret(arg[1]))\n' >"$WORK/pub.lua"
    "$DS4" run "$WORK/pub.lua" "$1"
}
# 40 characters, all from the Z85 alphabet (\133 \135: the brackets, which tr would read as a class otherwise)
is_z85_40() { [ "${#1}" -eq 40 ] && [ -z "$(printf '%s' "$1" | tr -d '0-9a-zA-Z.:+=^!/*?&<>(){}@%$#\133\135-')" ]; }

printf 'os.exit(require("ds4").zmq.has("curve") and 0 or 3)\n' >"$WORK/has.lua"
"$DS4" run "$WORK/has.lua"
if [ $? -eq 3 ]; then
    echo "test_keygen: libzmq without CURVE support: skipped"
    run keygen
    expect_rc "keygen without CURVE" 1 $rc
    echo "test_keygen: $checks checks, $fails failures"
    [ $fails -eq 0 ]
    exit
fi

# ---------------------------------------------------------------------------------------------- help
run help
expect_in "help lists keygen" "$WORK/out" "keygen [--out PREFIX]"
run keygen --help
expect_rc "keygen --help" 0 $rc
expect_in "keygen --help" "$WORK/out" "usage: ds4 keygen"

# ---------------------------------------------------------------------------------------------- stdout
run keygen
expect_rc "keygen to stdout" 0 $rc
pub=$(sed -n 's/^public //p' "$WORK/out")
sec=$(sed -n 's/^secret //p' "$WORK/out")
checks=$((checks + 2))
is_z85_40 "$pub" || fail "stdout: public key '$pub' is not 40 Z85 characters"
is_z85_40 "$sec" || fail "stdout: secret key '$sec' is not 40 Z85 characters"
expect_eq "stdout: public matches secret" "$(public_of "$sec")" "$pub"
run keygen
pub2=$(sed -n 's/^public //p' "$WORK/out")
checks=$((checks + 1))
[ "$pub2" != "$pub" ] || fail "two runs gave the same key"

# ---------------------------------------------------------------------------------------------- files
(umask 000 && "$DS4" keygen --out "$WORK/k" >"$WORK/out" 2>"$WORK/err")
rc=$?
expect_rc "keygen --out" 0 $rc
expect_in "keygen --out" "$WORK/out" "$WORK/k.key"
checks=$((checks + 2))
[ -f "$WORK/k.key" ] || fail "k.key missing"
[ -f "$WORK/k.pub" ] || fail "k.pub missing"
expect_eq "k.key mode (umask 000)" "$(stat -c %a "$WORK/k.key")" "600"
expect_eq "k.pub mode" "$(stat -c %a "$WORK/k.pub")" "644"
checks=$((checks + 1))
head -n 1 "$WORK/k.key" | grep -q '^# ' || fail "k.key: no comment line first"
sec=$(key_of "$WORK/k.key")
pub=$(key_of "$WORK/k.pub")
checks=$((checks + 2))
is_z85_40 "$sec" || fail "k.key: '$sec' is not 40 Z85 characters"
is_z85_40 "$pub" || fail "k.pub: '$pub' is not 40 Z85 characters"
expect_eq "files: public matches secret" "$(public_of "$sec")" "$pub"
expect_eq "k.pub holds just the key" "$(cat "$WORK/k.pub")" "$pub"
# ds4.zmq.read_key reads both files
printf 'local z = require("ds4").zmq\nio.write(z.public_from_secret(z.read_key(arg[1])) == z.read_key(arg[2]) and "same" or "differ")\n' \
    >"$WORK/read.lua"
expect_eq "read_key of both files" "$("$DS4" run "$WORK/read.lua" "$WORK/k.key" "$WORK/k.pub")" "same"

# existing files are kept unless --force
run keygen --out "$WORK/k"
expect_rc "keygen over existing files" 1 $rc
expect_in "keygen over existing files" "$WORK/err" "exists"
expect_eq "existing key untouched" "$(key_of "$WORK/k.key")" "$sec"
chmod 644 "$WORK/k.key"
run keygen --out="$WORK/k" --force
expect_rc "keygen --force" 0 $rc
checks=$((checks + 1))
[ "$(key_of "$WORK/k.key")" != "$sec" ] || fail "--force did not replace the key"
expect_eq "--force: mode back to 600" "$(stat -c %a "$WORK/k.key")" "600"
expect_eq "--force: public matches secret" "$(public_of "$(key_of "$WORK/k.key")")" "$(key_of "$WORK/k.pub")"

# missing directories are created (issue 17: `ds4 keygen --out keys/w1` failed when keys/ did not exist), mode 0700
(cd "$WORK" && "$DS4" keygen --out new/keys/w1 >"$WORK/out" 2>"$WORK/err")
rc=$?
expect_rc "keygen into a missing directory" 0 $rc
checks=$((checks + 2))
[ -f "$WORK/new/keys/w1.key" ] && [ -f "$WORK/new/keys/w1.pub" ] || fail "new/keys/w1.key and .pub missing"
expect_eq "a created key directory is private" "$(stat -c %a "$WORK/new/keys")" "700"
expect_eq "keys in a created directory: public matches secret" \
    "$(public_of "$(key_of "$WORK/new/keys/w1.key")")" "$(key_of "$WORK/new/keys/w1.pub")"
: >"$WORK/plainfile"
run keygen --out "$WORK/plainfile/k"
expect_rc "keygen under a file" 1 $rc
expect_in "keygen under a file" "$WORK/err" "cannot create the directory $WORK/plainfile: Not a directory"

# ---------------------------------------------------------------------------------------------- bad arguments
for args in "--bogus" "--out" "--out=" "--force" "extra" "--out $WORK/a --out $WORK/b"; do
    # shellcheck disable=SC2086
    run keygen $args
    expect_rc "keygen $args" 2 $rc
    expect_in "keygen $args" "$WORK/err" "usage: ds4 keygen"
done
checks=$((checks + 1))
[ ! -e "$WORK/a.key" ] || fail "a bad command line wrote a key"

echo "test_keygen: $checks checks, $fails failures"
[ $fails -eq 0 ]
