#!/usr/bin/env bash
# kernel_profile.sh BUILD_DIR [N] [-- bench_train_gpu options] — where a GPU training step's time goes, kernel by
# kernel: Nsight Compute (ncu) times every kernel launch of `bench_train_gpu --steps 1` (two warm-up steps and the
# timed one: 3 steps; the options after -- go to it as well), and the table lists the N (default 40) kernels with the
# most time: ms per step (their total over the run / 3), launches per step, µs per launch, grid and block, then the
# sum over every kernel. The per-op profile (`bench_train_gpu --profile FILE`) says which operation takes the time;
# this says which of an operation's kernels does (a rounding copy, a transpose, a fold).
#
#   bash bench/kernel_profile.sh build-gpu                 # the 599M config, 8 x 1024, bf16
#   bash bench/kernel_profile.sh build-gpu 80 -- --batch 4
#
# ncu replays each kernel alone (its clocks left as they are: --clock-control none), so a kernel's time is its own;
# the first step's one-off kernels (the optimizer's exact finiteness check) count a third. It takes about 100 s for
# the 599M config on an H100. It measures, never passes or fails; without ncu or a GPU it says so and exits 0.
set -uo pipefail
BUILD="${1:?usage: kernel_profile.sh BUILD_DIR [N] [-- bench_train_gpu options]}"
shift
TOP=40
if [ $# -gt 0 ] && [ "$1" != "--" ]; then TOP="$1"; shift; fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
if ! command -v ncu >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "kernel_profile: needs Nsight Compute (ncu) and an NVIDIA GPU; nothing measured"
    exit 0
fi
csv="$(mktemp "${TMPDIR:-/tmp}/ds4-kernels.XXXXXX")"
trap 'rm -f "$csv" "$csv.err"' EXIT
if ! ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-summary per-kernel \
    "$BUILD/bench_train_gpu" --steps 1 "$@" >"$csv" 2>"$csv.err"; then
    echo "kernel_profile: ncu failed:"
    tail -n 5 "$csv.err"
    exit 1
fi
python3 - "$csv" "$TOP" <<'EOF'
import csv, sys
STEPS = 3  # bench_train_gpu --steps 1: two warm-up steps, then the timed one
unit_ms = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
rows, hdr = [], None
for r in csv.reader(open(sys.argv[1])):
    if "Kernel Name" in r and "Invocations" in r:
        hdr = r
    elif hdr and len(r) == len(hdr):
        rows.append(dict(zip(hdr, r)))
if not rows:
    sys.exit("kernel_profile: no kernel rows in ncu's summary")
out, total = [], 0.0
for d in rows:
    calls = int(d["Invocations"])
    avg = float(d["Average"].replace(",", "")) * unit_ms[d["Metric Unit"]]
    ms = calls * avg / STEPS
    total += ms
    out.append((ms, calls / STEPS, avg * 1e3, d["Kernel Name"], d["Grid Size"], d["Block Size"]))
out.sort(reverse=True)
print(f"{'ms/step':>8} {'calls':>6} {'us/call':>9}  kernel (grid, block)")
for ms, calls, us, name, grid, block in out[: int(sys.argv[2])]:
    name = name if len(name) <= 100 else name[:97] + "..."
    print(f"{ms:8.3f} {calls:6.1f} {us:9.1f}  {name} {grid} {block}")
print(f"{total:8.3f} ms per step in {len(out)} kernels (ncu, each kernel alone)")
EOF
