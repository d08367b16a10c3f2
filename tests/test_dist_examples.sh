#!/usr/bin/env bash
# test_dist_examples.sh DS4 FIXTURES SOURCE — data parallelism inside the examples (docs/distributed.md): sft.lua
# and dapo.lua launched on 2 and 4 CPU ranks (under mpirun, and torchrun-style over the TCP rendezvous) train the
# same model as one process running the same micro-batches (tests/lua/dist_compare_runs.lua compares the saved
# weights and metrics.jsonl); sft.lua --zero and dapo.lua --zero (ZeRO-1) too, and their 2-rank checkpoints resumed by
# one process.
#
# Bitwise: N ranks of one micro-batch each against one process with --micro-batches N (sft) or the same prompts
# (dapo): the ranks' gradients are summed in rank order and a backward adds its gradient once, so the sums are the
# same fp32 operations in the same order.
# Within a bound: 2 ranks of 2 micro-batches against one process of 4 micro-batches: the process adds
# ((G1 + G2) + G3) + G4, the ranks (G1 + G2) + (G3 + G4), which differ in the last bits; AdamW (g / sqrt(v)) turns a
# last-bit change of a near-zero gradient into an update change of up to ~lr, so after 6 steps at lr 3e-3 the weights
# may differ by up to a few lr: bound |Δw| <= 3e-3 (measured 2.4e-4), metrics (loss, grad_norm) within 1e-4
# relative (measured 1e-7). A normalisation error (a factor 2 or 4 in the token count) moves step 1's grad_norm by
# 50% or more, far outside.
# MPI parts skip without mpirun or an MPI build; the torchrun-style parts need nothing but loopback TCP.
set -uo pipefail
DS4="$1"; FIX="$2"; SRC="$3"
# shellcheck source=tests/dist_launch.sh
. "$SRC/tests/dist_launch.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
export DS4_DIST_TIMEOUT=120
# Under the sanitizer build (scripts/test.sh's asan stage sets ASAN_OPTIONS) only the torchrun-style sft runs are
# made (leak-checked; ~1.5 min there): the C paths they take are the ones the mpirun and dapo runs take, and those
# cost ~6 min under ASan (the release stage runs them all).
SAN=0
[ -n "${ASAN_OPTIONS:-}" ] && SAN=1

fail=0
bad() { echo "FAIL: $*"; fail=1; }
W="$(mktemp -d "${TMPDIR:-/tmp}/ds4-dist-ex.XXXXXX")"
trap 'rm -rf "$W"' EXIT

have_mpi=0
if [ "$SAN" = 1 ]; then
    echo "note: sanitizer build: the mpirun and dapo runs are left to the release stage"
elif command -v mpirun >/dev/null 2>&1 &&
    [ "$(echo 'io.write(tostring(require("ds4").dist.have_mpi))' | "$DS4" run - 2>&1)" = "true" ]; then
    have_mpi=1
else
    echo "note: no mpirun or no MPI in this build: the mpirun runs are skipped"
fi

compare() { # A B [bound] WHAT
    local what="${*: -1}"
    "$DS4" run "$SRC/tests/lua/dist_compare_runs.lua" "${@:1:$#-1}" >"$W/cmp.log" 2>&1 || { cat "$W/cmp.log"; bad "$what"; return; }
    echo "$what: $(grep 'dist_compare_runs:' "$W/cmp.log" | head -1)"
}
one() { # OUT ARGS...: one process
    local out="$1"; shift
    timeout -k 5 300 "$DS4" run "$@" --out "$out" --quiet >"$out.log" 2>&1 || { tail -20 "$out.log"; bad "one process: $*"; }
}
mpi() { # NP OUT ARGS...
    local np="$1" out="$2"; shift 2
    ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0" timeout -k 5 300 mpirun -np "$np" --oversubscribe "$DS4" run "$@" \
        --out "$out" --quiet >"$out.log" 2>&1 ||
        { tail -20 "$out.log"; bad "mpirun -np $np: $*"; }
}
tcp() { # NP OUT ARGS...
    local np="$1" out="$2"; shift 2
    launch "$np" "$out.log" 300 "$DS4" run "$@" --out "$out" --quiet ||
        { tail -20 "$out.log".*; bad "$np torchrun-style ranks (exit codes ${RCS[*]}): $*"; }
}

# ---- sft.lua: 8 rows per update, 6 updates on the generated toy set
SFT=("$SRC/examples/sft.lua" --steps 6 --batch 8)
one "$W/sft_m2" "${SFT[@]}" --micro-batches 2
[ "$SAN" = 1 ] || one "$W/sft_m4" "${SFT[@]}" --micro-batches 4
tcp 2 "$W/sft_tcp2" "${SFT[@]}"
compare "$W/sft_m2" "$W/sft_tcp2" "sft, 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
# ZeRO-1 (its gradients reduce-scattered, in buckets of 0.05 MiB overlapped with the backward), with a checkpoint
# at step 3 (gathered on every rank, written by rank 0) resumed by one process
tcp 2 "$W/sft_zero2" "${SFT[@]}" --zero --save-every 3 --bucket-mb 0.05
compare "$W/sft_m2" "$W/sft_zero2" "sft --zero, 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
cp -r "$W/sft_zero2" "$W/sft_resume1" # the run as it stood at step 3: its checkpoint, data, config and metrics
rm -rf "$W/sft_resume1/ckpt/step_000006" "$W/sft_resume1/model"
timeout -k 5 300 "$DS4" run "${SFT[@]}" --micro-batches 2 --resume --out "$W/sft_resume1" --quiet >"$W/sft_resume1.log" 2>&1 ||
    { tail -20 "$W/sft_resume1.log"; bad "resume of the --zero checkpoint by one process"; }
compare "$W/sft_m2" "$W/sft_resume1" "sft: a 2-rank --zero checkpoint at step 3 resumed by 1 process = uninterrupted (bitwise)"
if [ "$have_mpi" = 1 ]; then
    mpi 2 "$W/sft_mpi2" "${SFT[@]}"
    compare "$W/sft_m2" "$W/sft_mpi2" "sft, mpirun -np 2 = 1 process of 2 micro-batches (bitwise)"
    mpi 4 "$W/sft_mpi4" "${SFT[@]}" --bucket-mb 0.05
    compare "$W/sft_m4" "$W/sft_mpi4" "sft, mpirun -np 4, 0.05 MiB buckets = 1 process of 4 micro-batches (bitwise)"
    mpi 2 "$W/sft_mpi2x2" "${SFT[@]}" --micro-batches 2
    compare "$W/sft_m4" "$W/sft_mpi2x2" 3e-3 "sft, mpirun -np 2 x 2 micro-batches vs 1 process of 4 (bound)"
elif [ "$SAN" = 0 ]; then
    tcp 4 "$W/sft_tcp4" "${SFT[@]}"
    compare "$W/sft_m4" "$W/sft_tcp4" "sft, 4 torchrun-style ranks = 1 process of 4 micro-batches (bitwise)"
fi
[ "$SAN" = 1 ] && exit "$fail"

# ---- dapo.lua: a model warmed up once (40 SFT steps on "i+1=" problems: mixed groups, so every RL step trains,
# as in tests/test_dapo.sh), then 3 RL steps of 6 prompts x 4 samples, 2 minibatches, from it. The ranks generate
# their prompts' samples (the same random streams as one process: generate's prompt_base), the rollouts and rewards
# are gathered, the groups' advantages computed on the whole batch, each minibatch split into the ranks' micro-batches.
for i in $(seq 1 40); do echo "{\"prompt\": \"$i+1=\", \"answer\": \"$((i + 1))\"}"; done >"$W/mine.jsonl"
timeout -k 5 300 "$DS4" run "$SRC/examples/dapo.lua" --data "$W/mine.jsonl" --eval 8 --steps 0 --sft-steps 40 \
    --sft-batch 32 --save "$W/warm_model" --out "$W/warm" --quiet >"$W/warm.log" 2>&1 || { tail -20 "$W/warm.log"; bad "dapo warm-up"; }
RL=("$SRC/examples/dapo.lua" --data "$W/mine.jsonl" --eval 8 --steps 3 --prompts 6 --n 4 --max-new-tokens 14
    --minibatches 2 --model "$W/warm_model" --tokenizer byte --sft-steps 0 --save-every 0)
trains() { # RUN: some step trained (a gradient norm above 0), or the comparison would say little
    grep -q '"grad_norm": [0-9.]*[1-9]' "$1/metrics.jsonl" || bad "dapo $1: no step trained (every group's rewards equal)"
}
rl_one() { one "$1" "${RL[@]}" "${@:2}" --save "$1/final"; }
rl_one "$W/rl_m2" --micro-batches 2
trains "$W/rl_m2"
rl_one "$W/rl_m4" --micro-batches 4
tcp 2 "$W/rl_tcp2" "${RL[@]}" --save "$W/rl_tcp2/final"
compare "$W/rl_m2" "$W/rl_tcp2" "dapo, 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
# the indexer KL loss (--indexer-kl): every backward takes κ / Q, Q the whole minibatch's real queries (sft: the
# update's), so N ranks train what one process of N micro-batches does, indexer_kl metric included
rl_one "$W/rl_ikl_m2" --micro-batches 2 --indexer-kl 0.5
trains "$W/rl_ikl_m2"
grep -q '"indexer_kl": [0-9.]*[1-9]' "$W/rl_ikl_m2/metrics.jsonl" || bad "dapo --indexer-kl: no indexer_kl logged"
tcp 2 "$W/rl_ikl_tcp2" "${RL[@]}" --indexer-kl 0.5 --save "$W/rl_ikl_tcp2/final"
compare "$W/rl_ikl_m2" "$W/rl_ikl_tcp2" "dapo --indexer-kl, 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
one "$W/sft_ikl_m2" "${SFT[@]}" --micro-batches 2 --indexer-kl 0.5
grep -q '"indexer_kl": [0-9.]*[1-9]' "$W/sft_ikl_m2/metrics.jsonl" || bad "sft --indexer-kl: no indexer_kl logged"
tcp 2 "$W/sft_ikl_tcp2" "${SFT[@]}" --indexer-kl 0.5
compare "$W/sft_ikl_m2" "$W/sft_ikl_tcp2" "sft --indexer-kl, 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
if [ "$have_mpi" = 1 ]; then
    mpi 2 "$W/rl_ikl_mpi2" "${RL[@]}" --indexer-kl 0.5 --save "$W/rl_ikl_mpi2/final"
    compare "$W/rl_ikl_m2" "$W/rl_ikl_mpi2" "dapo --indexer-kl, mpirun -np 2 = 1 process of 2 micro-batches (bitwise)"
fi
# ZeRO-1 in the RL trainer, with checkpoints after RL steps 2 and 3 (every rank gathers the moments, rank 0 writes)
tcp 2 "$W/rl_zero2" "${RL[@]}" --zero --save-every 2 --save "$W/rl_zero2/final" --bucket-mb 0.05
compare "$W/rl_m2" "$W/rl_zero2" "dapo --zero, 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
# the run as it stood after RL step 2 (its newest checkpoint, step 3's, dropped), resumed by one process
cp -r "$W/rl_zero2" "$W/rl_zres1"
rm -rf "$W/rl_zres1/final" "$W/rl_zres1/ckpt/$(ls "$W/rl_zres1/ckpt" | grep '^step_' | sort | tail -1)"
# (--quiet=false, over the saved config's: the log must say it resumed, as a run from scratch would end with the same
# bits)
timeout -k 5 300 "$DS4" run "${RL[@]}" --micro-batches 2 --resume --save "$W/rl_zres1/final" --out "$W/rl_zres1" --quiet=false \
    >"$W/rl_zres1.log" 2>&1 || { tail -20 "$W/rl_zres1.log"; bad "resume of the dapo --zero checkpoint by one process"; }
grep -q "trainer: resuming from .*step_000004 (RL step 2)" "$W/rl_zres1.log" ||
    { tail -20 "$W/rl_zres1.log"; bad "dapo: the resumed run did not start from the step-2 checkpoint"; }
compare "$W/rl_m2" "$W/rl_zres1" "dapo: a 2-rank --zero checkpoint after RL step 2 resumed by 1 process = uninterrupted (bitwise)"
# Remote rollout workers with several ranks: rank 0 binds the pool (--workers) and sends every prompt to it with one
# process's random streams, the other ranks take their shares of its results. 2 torchrun-style ranks and one worker
# against one process and one worker, bitwise (--max-staleness 0: every batch is generated by the newest weights, not
# by whichever version the worker holds when the tasks arrive). The worker starts from nothing (the pool sends it the
# model).
worker_on() { # SOCK LOG: a `ds4 worker` in the background (WPID)
    "$DS4" worker --connect "$1" --threads 1 --give-up 120 >"$2" 2>&1 &
    WPID=$!
}
worker_off() { kill -TERM "$WPID" 2>/dev/null; wait "$WPID" 2>/dev/null || true; }
WK=(--workers "ipc://$W/wk.sock" --n-workers 1 --max-staleness 0)
worker_on "ipc://$W/wk.sock" "$W/wk1.log"
rl_one "$W/rl_wk1" --micro-batches 2 "${WK[@]}"
worker_off
trains "$W/rl_wk1"
grep -q "workers: 24 tasks completed" "$W/rl_wk1.log" || { tail -5 "$W/rl_wk1.log"; bad "dapo with a worker: no worker summary"; }
worker_on "ipc://$W/wk.sock" "$W/wk2.log"
tcp 2 "$W/rl_wk2" "${RL[@]}" "${WK[@]}" --save "$W/rl_wk2/final"
worker_off
grep -q "workers: 24 tasks completed" "$W/rl_wk2.log.0" || { tail -5 "$W/rl_wk2.log.0"; bad "dapo on 2 ranks with a worker: no worker summary"; }
compare "$W/rl_wk1" "$W/rl_wk2" "dapo with a remote worker: 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
# Routing replay on several ranks: each sample's recorded experts and indexer picks travel with it (raw bytes beside
# the JSON), so the ranks train with the routes the rollout used: 2 ranks = 1 process, in process and with the worker.
# In process with --async 1: the samples are a version old, so their recorded routes are not the ones the training
# forward would take (replay on and off give different weights there), and a rank that lost or shuffled them would
# differ from the process.
rl_one "$W/rl_rr1" --micro-batches 2 --routing-replay --async 1
tcp 2 "$W/rl_rr2" "${RL[@]}" --routing-replay --async 1 --save "$W/rl_rr2/final"
compare "$W/rl_rr1" "$W/rl_rr2" "dapo --routing-replay --async 1: 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
worker_on "ipc://$W/wk.sock" "$W/wk4.log"
rl_one "$W/rl_rrw1" --micro-batches 2 --routing-replay "${WK[@]}"
worker_off
worker_on "ipc://$W/wk.sock" "$W/wk5.log"
tcp 2 "$W/rl_rrw2" "${RL[@]}" --routing-replay "${WK[@]}" --save "$W/rl_rrw2/final"
worker_off
compare "$W/rl_rrw1" "$W/rl_rrw2" "dapo --routing-replay with a worker: 2 torchrun-style ranks = 1 process (bitwise)"
# tis.normalize (the importance weights scaled to mean 1) over each whole minibatch, whatever its split: 2 and 4
# micro-batches within the bound above (measured: metrics 5e-5 relative; normalised per micro-batch instead, the kl
# metric moved by 80%). --async 1 so that the weights are not all 1; mode mask so that some are 0.
NRM=(--async 1 --algorithm.tis.mode mask --algorithm.tis.normalize true)
rl_one "$W/rl_nm2" --micro-batches 2 "${NRM[@]}"
rl_one "$W/rl_nm4" --micro-batches 4 "${NRM[@]}"
compare "$W/rl_nm2" "$W/rl_nm4" 3e-3 "dapo tis.normalize: 2 vs 4 micro-batches (bound)"
# Asynchronous RL on several ranks (--async 1): generating in process, 2 ranks = 1 process of 2 micro-batches
# (bitwise: a batch of the step ahead is generated at its submission, by the weights of that moment, on every rank
# alike); with the worker, the run finishes and no sample trained is more than 1 version old (which version a worker
# generates a batch with depends on timing: no bitwise reference).
rl_one "$W/rl_as1" --micro-batches 2 --async 1
tcp 2 "$W/rl_as2" "${RL[@]}" --async 1 --save "$W/rl_as2/final"
compare "$W/rl_as1" "$W/rl_as2" "dapo --async 1: 2 torchrun-style ranks = 1 process of 2 micro-batches (bitwise)"
worker_on "ipc://$W/wk.sock" "$W/wk3.log"
tcp 2 "$W/rl_aw2" "${RL[@]}" --async 1 --workers "ipc://$W/wk.sock" --n-workers 1 --save "$W/rl_aw2/final"
worker_off
lags="$(grep -o '"staleness/max": [0-9]*' "$W/rl_aw2/metrics.jsonl" | awk '{print $2}' | sort -n | tail -1)"
[ "$(wc -l <"$W/rl_aw2/metrics.jsonl")" -ge 3 ] && [ -n "$lags" ] && [ "$lags" -le 1 ] ||
    { tail -5 "$W/rl_aw2.log.0"; bad "dapo --async 1 on 2 ranks with a worker: steps or staleness (max $lags, want <= 1)"; }
echo "dapo --async 1 with a worker on 2 ranks: $(wc -l <"$W/rl_aw2/metrics.jsonl") steps, staleness/max <= $lags"
# a rollout source on a rank other than 0: every rank stops with the same message
cat >"$W/src_rank1.lua" <<'LUA'
local ds4 = require("ds4")
ds4.dp.init()
local m = ds4.load(arg[1])
local ok, err = pcall(require("ds4.rl.trainer").run, { model = m, algorithm = require("ds4.rl").preset("grpo"),
    prompts = function() return {} end, reward = function() return 0 end, decode = function() return "" end,
    rollout = { source = ds4.dp.rank() == 1 and { generate = function() end } or nil } })
io.stderr:write(tostring(err), "\n")
os.exit(not ok and tostring(err):find("only rank 0 may hold the rollout source", 1, true) and 3 or 1)
LUA
launch 2 "$W/src_rank1.log" 60 "$DS4" run "$W/src_rank1.lua" "$FIX/tiny_a"
[ "${RCS[*]}" = "3 3" ] || { cat "$W/src_rank1.log".*; bad "a source on rank 1: exit codes ${RCS[*]}, want 3 3"; }
if [ "$have_mpi" = 1 ]; then
    mpi 4 "$W/rl_mpi4" "${RL[@]}" --save "$W/rl_mpi4/final"
    compare "$W/rl_m4" "$W/rl_mpi4" "dapo, mpirun -np 4 = 1 process of 4 micro-batches (bitwise)"
else
    tcp 4 "$W/rl_tcp4" "${RL[@]}" --save "$W/rl_tcp4/final"
    compare "$W/rl_m4" "$W/rl_tcp4" "dapo, 4 torchrun-style ranks = 1 process of 4 micro-batches (bitwise)"
fi
exit "$fail"
