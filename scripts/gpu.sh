#!/usr/bin/env bash
# gpu.sh — on a machine with an NVIDIA GPU: build ds4 with its CUDA backend, run the whole test suite (the GPU tests
# run there instead of skipping) and the GPU benchmarks, and end with ONE summary line. CI has no GPU and cannot run
# this; its summary line goes into the notes and bench/RESULTS.md.
#
#   bash scripts/gpu.sh [LOG_DIR]                 # logs into LOG_DIR (default: $OUT if set, else build-gpu/logs)
#   DEPS_ENV=dir/use-debs.sh DEPS_DIR=dir/debs bash scripts/gpu.sh
#                                                 # a machine without package access: source DEPS_ENV with DEPS_DIR
#                                                 # first (it unpacks Debian packages and points pkg-config and the
#                                                 # loader at them)
#   GPU_STAGES="build tests bench demo"           # a subset (default: build tests bench; demo, the README's GPU RL
#                                                 # demonstration, takes ~4 more minutes; kernels, the training
#                                                 # step's time kernel by kernel through ncu, ~2 more minutes:
#                                                 # bench/kernel_profile.sh into LOG_DIR/kernels.txt)
#   BENCH_ARGS="--quick"                          # passed to bench/gpu_bench.sh
# The bench stage also runs, where there are 2 or more GPUs, bench/dist_bench.sh (training on 1, 2 and 4 ranks: data
# parallel, then data × expert parallel, replicated and sharded experts) and bench/collectives_bench.sh (ds4's NCCL all-reduce and all-to-all
# bandwidth against torch.distributed's NCCL at the same sizes).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG="${1:-${OUT:-$ROOT/build-gpu/logs}}"
STAGES="${GPU_STAGES:-build tests bench}"
mkdir -p "$LOG"
if [ -n "${DEPS_ENV:-}" ]; then
    # shellcheck disable=SC1090
    . "$DEPS_ENV" "${DEPS_DIR:?DEPS_DIR names the folder of .deb files}"
fi
say() { printf '== gpu: %s\n' "$*"; }
gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n1)"
say "device: ${gpu:-none found}; $(nvcc --version 2>/dev/null | tail -n1)"
build_status=skipped tests_status=skipped bench_status=skipped dapo_status=skipped

if [[ " $STAGES " == *" build "* ]]; then
    gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    t0=$SECONDS
    if cmake -S . -B build-gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >"$LOG/configure.log" 2>&1 &&
        cmake --build build-gpu -j "$(nproc)" >"$LOG/build.log" 2>&1; then
        build_status="ok ($((SECONDS - t0)) s)"
        grep -q "CUDA backend ON" "$LOG/configure.log" || build_status="ok, but WITHOUT the CUDA backend"
    else
        build_status=FAILED
        tail -n 30 "$LOG/build.log" "$LOG/configure.log"
    fi
    say "build: $build_status"
fi

if [[ " $STAGES " == *" tests "* ]]; then
    # the GPU tests first, verbose (their numbers are the record), then the whole suite
    for t in test_cuda test_cuda_ops test_cuda_bwd_linear test_cuda_bwd_attn test_cuda_bwd_hc_moe test_cuda_hc_bits \
        test_cuda_row_bits test_cuda_model test_cuda_train test_cuda_kv_qat test_dist_nccl test_cp_device; do
        [ -x "build-gpu/$t" ] || continue
        "build-gpu/$t" "$ROOT/tests/fixtures" >"$LOG/$t.log" 2>&1
        say "$t: exit $? ($(tail -n1 "$LOG/$t.log"))"
    done
    # NCCL on 1 GPU, and on 2 (4) ranks when the machine has 2 (4) GPUs: torchrun-style and mpirun launches, data
    # and expert parallelism on the GPUs, a rank killed or hung (docs/distributed.md)
    if [ -x build-gpu/ds4 ]; then
        bash tests/test_dist_nccl.sh build-gpu/ds4 "$ROOT/tests/fixtures" "$ROOT" >"$LOG/test_dist_nccl_sh.log" 2>&1
        say "test_dist_nccl.sh: exit $? ($(grep -c '^FAIL' "$LOG/test_dist_nccl_sh.log") FAIL lines; $(tail -n1 "$LOG/test_dist_nccl_sh.log"))"
    fi
    ctest --test-dir build-gpu --output-on-failure -j 8 >"$LOG/ctest.log" 2>&1
    # "100% tests passed out of N" (ctest 3.28+) or "..., K tests failed out of N"
    total="$(sed -n 's/.*tests.* out of \([0-9]*\).*/\1/p' "$LOG/ctest.log" | tail -n1)"
    failed="$(sed -n 's/.* \([0-9]*\) tests failed out of .*/\1/p' "$LOG/ctest.log" | tail -n1)"
    [ -z "$failed" ] && grep -q "100% tests passed" "$LOG/ctest.log" && failed=0
    skipped="$(grep -c '(Skipped)' "$LOG/ctest.log" || true)"
    tests_status="${total:-?} tests, ${failed:-?} failed, ${skipped} skipped"
    grep -E "Failed|\*\*\*|Skipped" "$LOG/ctest.log" | head -n 20
    say "ctest: $tests_status"
fi

if [[ " $STAGES " == *" tests "* ]] && [ -x build-gpu/ds4 ]; then
    # RL on the GPU: a short DAPO run (bf16); the trainer's recomputed log-probabilities must equal the rollout's
    # exactly (logprob_mismatch/max 0 at every step)
    rm -rf "$LOG/dapo"
    if timeout 300 build-gpu/ds4 run examples/dapo.lua --device cuda --steps 4 --sft-steps 30 --eval 50 --prompts 16 \
        --out "$LOG/dapo" >"$LOG/dapo.log" 2>&1; then
        steps="$(grep -c '"logprob_mismatch/max"' "$LOG/dapo/metrics.jsonl" 2>/dev/null || true)"
        nonzero="$(grep -o '"logprob_mismatch/max": *[^,}]*' "$LOG/dapo/metrics.jsonl" | grep -vc ': *0$' || true)"
        dapo_status="$steps steps, logprob_mismatch/max nonzero in ${nonzero:-?}"
    else
        dapo_status="FAILED ($(tail -n1 "$LOG/dapo.log"))"
    fi
    say "dapo --device cuda: $dapo_status"
fi

if [[ " $STAGES " == *" bench "* ]]; then
    if [ -x bench/gpu_bench.sh ] || [ -f bench/gpu_bench.sh ]; then
        # shellcheck disable=SC2086
        bash bench/gpu_bench.sh build-gpu "$LOG" ${BENCH_ARGS:-} >"$LOG/bench.log" 2>&1
        bench_status="$(grep '^bench:' "$LOG/bench.log" | tail -n1 | sed 's/^bench: //')"
        [ -n "$bench_status" ] || bench_status="FAILED ($(tail -n1 "$LOG/bench.log"))"
    fi
    # data-parallel training on 1 and every GPU count up to the machine's (2, 4): weak scaling, NCCL all-reduce; then
    # with expert parallelism (DP×EP: the routed experts' rows through NCCL send / recv); then the collectives alone
    ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
    if [ "${ngpu:-0}" -ge 2 ] && [ -x build-gpu/ds4 ]; then
        sizes="1 2"
        [ "$ngpu" -ge 4 ] && sizes="1 2 4"
        # shellcheck disable=SC2086
        bash bench/dist_bench.sh build-gpu/ds4 $sizes >"$LOG/dist_bench.log" 2>&1
        bench_status="$bench_status; $(grep '^dist bench:' "$LOG/dist_bench.log" | tail -n1 | sed 's/^dist bench: //')"
        # shellcheck disable=SC2086
        bash bench/dist_bench.sh build-gpu/ds4 $sizes -- --ep 1 >"$LOG/dist_bench_ep.log" 2>&1
        bench_status="$bench_status; $(grep '^dist bench:' "$LOG/dist_bench_ep.log" | tail -n1 | sed 's/^dist bench: //')"
        # and with sharded experts (each GPU holds only its experts' state; every rank's state in MiB in the log)
        # shellcheck disable=SC2086
        bash bench/dist_bench.sh build-gpu/ds4 $sizes -- --ep 2 >"$LOG/dist_bench_ep_shard.log" 2>&1
        bench_status="$bench_status; $(grep '^dist bench:' "$LOG/dist_bench_ep_shard.log" | tail -n1 | sed 's/^dist bench: //')"
        bash bench/collectives_bench.sh build-gpu >"$LOG/collectives_bench.log" 2>&1
        bench_status="$bench_status; collectives $(grep '^coll bench:' "$LOG/collectives_bench.log" | tail -n1 | sed 's/^coll bench: //')"
    fi
fi
if [[ " $STAGES " == *" kernels "* ]]; then
    timeout 600 bash bench/kernel_profile.sh build-gpu >"$LOG/kernels.txt" 2>&1
    say "kernels: $(tail -n1 "$LOG/kernels.txt") (the table: kernels.txt)"
fi

demo_status=skipped
if [[ " $STAGES " == *" demo "* ]] && [ -x build-gpu/ds4 ]; then
    # the README's GPU demonstration (about 4 minutes on an H100): SFT then DAPO on multiplication, 220M parameters
    rm -rf "$LOG/demo"
    if timeout 900 build-gpu/ds4 run examples/dapo.lua --config examples/configs/dapo_mul_gpu.lua --out "$LOG/demo" \
        >"$LOG/demo.log" 2>&1; then
        demo_status="$(grep -o 'greedy accuracy on .*' "$LOG/demo.log" | tail -n1)"
    else
        demo_status="FAILED ($(tail -n1 "$LOG/demo.log"))"
    fi
    say "demo: $demo_status"
fi
echo "gpu summary: ${gpu:-no GPU}; build $build_status; ctest $tests_status; dapo --device cuda $dapo_status; bench ${bench_status}; demo ${demo_status}"
