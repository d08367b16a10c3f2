#!/usr/bin/env bash
# bench_async.sh — wall-clock of examples/dapo.lua with two `ds4 worker` processes, synchronous (--max-staleness 0)
# against asynchronous (--async K), from the same warmed-up model (same seed: the SFT warm-up is deterministic).
#
#   bash bench/bench_async.sh [DS4 [STEPS [K]]]        defaults: build/ds4, 40, 1 (dapo.lua's other defaults: 150
#                                                      SFT steps, 32 prompts x 8 samples, 200 held-out problems)
#   EXTRA="--prompts 32 --n 8" bash bench/bench_async.sh   more dapo.lua options for both runs
#   REPEAT=3 bash bench/bench_async.sh                 sync and async alternately, 3 times each (a shared machine's
#                                                      load moves single runs by tens of percent)
#   WORKER_THREADS=2 EXTRA="--threads 12" bash ...     threads per worker (default 1) and the trainer's: generation
#                                                      and training balanced on the cores of one machine
#   WORKER_OPTS="--max-batch 128" bash ...             more `ds4 worker` options for both runs (here: every
#                                                      sequence of a worker's share of a step in one decode batch)
#   KEEP=DIR bash bench/bench_async.sh                 keep each run's metrics.jsonl (per-step times) in DIR
#   SEEDS="1 2 3" bash bench/bench_async.sh            one round per seed (dapo.lua --seed: data, model, rollouts),
#                                                      then each mode's mean held-out accuracy over the rounds: 200
#                                                      held-out problems give one run's accuracy a binomial spread of
#                                                      ~3.5 points, so one seed cannot tell ±3 points apart
#
# Prints per mode: the RL steps' wall-clock (the sum of metrics.jsonl's seconds, warm-up and first evaluation
# excluded), the time the trainer waited for rollouts (time/generate), trained (time/train) and evaluated, the mean
# version lag of the samples, and the held-out accuracy after RL; then the speed-up. It measures, never fails.
# On a machine with fewer cores than trainer + workers need, generation and training share the cores and the
# overlap buys little: record the core count with the numbers (bench/RESULTS.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DS4="${1:-$ROOT/build/ds4}"
STEPS="${2:-40}"
K="${3:-1}"
EXTRA="${EXTRA:-}"
WT="${WORKER_THREADS:-1}"
WOPTS="${WORKER_OPTS:-}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/ds4-bench-async.XXXXXX")"
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
echo "bench_async: $(nproc) cores, $STEPS RL steps, K = $K, two workers ($WT thread(s) each${WOPTS:+, $WOPTS}); dapo.lua ${EXTRA:-(defaults)}"

run() { # name, dapo options...
    local name="$1"
    shift
    local sock="ipc://$tmp/$name.sock"
    # shellcheck disable=SC2086
    "$DS4" run "$ROOT/examples/dapo.lua" --steps "$STEPS" --eval-every 100000 --log-completions 0 --quiet \
        --tensorboard=false $EXTRA \
        --out "$tmp/$name" --workers "$sock" --n-workers 2 "$@" >"$tmp/$name.log" 2>"$tmp/$name.err" &
    local d=$!
    pids+=("$d")
    local cmd=""
    for _ in $(seq 1 3000); do
        cmd="$(sed -n 's/^start a worker: //p' "$tmp/$name.log" 2>/dev/null)"
        [ -n "$cmd" ] && break
        kill -0 "$d" 2>/dev/null || break
        sleep 0.1
    done
    [ -n "$cmd" ] || { echo "dapo.lua printed no worker command"; cat "$tmp/$name.err"; exit 1; }
    local w ws=()
    for w in 1 2; do
        eval "exec $cmd --threads $WT $WOPTS --id $name-w$w --quiet" >"$tmp/$name-w$w.log" 2>&1 &
        ws+=("$!")
        pids+=("$!")
    done
    wait "$d" || { echo "dapo.lua ($name) failed"; tail -n 20 "$tmp/$name.err"; exit 1; }
    for w in "${ws[@]}"; do kill -TERM "$w" 2>/dev/null || true; wait "$w" 2>/dev/null || true; done
    if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$tmp/$name/metrics.jsonl" "$KEEP/$name.jsonl"; fi
    "$DS4" run - "$tmp/$name/metrics.jsonl" "$name" <<'LUA'
local rows = require("ds4.plot").read_jsonl(arg[1])
local s, g, t, e, lag, n, acc, acc0 = 0, 0, 0, 0, 0, 0, nil, nil
for _, r in ipairs(rows) do
    if r.step == 0 then acc0 = r["eval/accuracy"] end
    if r.step > 0 then
        s, g, t, e = s + r.seconds, g + r["time/generate"], t + r["time/train"], e + r["time/eval"]
        lag, n = lag + (r["staleness/mean"] or 0), n + 1
    end
    acc = r["eval/accuracy"] or acc
end
print(("%-7s RL %6.1f s (%d steps): waited for rollouts %5.1f s, trained %5.1f s, evaluated %4.1f s; mean lag %.2f; "
    .. "held-out accuracy %.1f%% -> %.1f%%"):format(arg[2], s, n, g, t, e, lag / math.max(n, 1), 100 * (acc0 or 0),
    100 * (acc or 0)))
local f = io.open(arg[1] .. ".total", "w")
f:write(s)
f:close()
f = io.open(arg[1] .. ".acc", "w")
f:write(100 * (acc or 0), "\n")
f:close()
LUA
}

ratios=()
read -r -a seeds <<<"${SEEDS:-}"
rounds="${REPEAT:-1}"
[ "${#seeds[@]}" -gt 0 ] && rounds="${#seeds[@]}"
for i in $(seq 1 "$rounds"); do
    seed=()
    [ "${#seeds[@]}" -gt 0 ] && seed=(--seed "${seeds[$((i - 1))]}") && echo "round $i: seed ${seeds[$((i - 1))]}"
    run "sync$i" --max-staleness 0 "${seed[@]}"
    run "async$i" --async "$K" "${seed[@]}"
    ratios+=("$(awk -v a="$(cat "$tmp/sync$i/metrics.jsonl.total")" -v b="$(cat "$tmp/async$i/metrics.jsonl.total")" \
        'BEGIN { printf "%.2f", a / b }')")
    echo "round $i: sync / async wall-clock ${ratios[-1]}"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{ r[NR] = $1 } END { printf "median sync / async wall-clock over %d rounds: %.2f\n", NR, r[int((NR + 1) / 2)] }'
for m in sync async; do
    cat "$tmp"/"$m"[0-9]*/metrics.jsonl.acc | awk -v m="$m" '{ s += $1; q += $1 * $1; n++ } END {
        sd = n > 1 ? sqrt((q - s * s / n) / (n - 1)) : 0
        printf "%s: mean held-out accuracy over %d rounds %.1f%% (sd %.1f)\n", m, n, s / n, sd }'
done
