#!/usr/bin/env bash
# cpu_vs_torch.sh — ds4's CPU forward and training step against transformers' DeepseekV4ForCausalLM on torch's CPU
# backend: the same ~50M config (bench_forward --print-config 50m), the same thread count, the same shapes, in one run.
# Prints both engines' tokens/s and the ratio ds4 / transformers per shape, and the median ratio.
#
#   bash bench/cpu_vs_torch.sh [--threads N[,N...]] [--runs N] [--quick] [--build DIR] [--python PY] [--no-torch]
#
# Thread scaling: with several thread counts (--threads 2,4,8,16) every engine runs at each in turn, and a last table
# gives ds4's tokens/s per shape at each count and the ratio of the last count to the first (the 16/2 figure of
# issue 15); --no-torch runs ds4 alone (no Python packages needed):
#
#   bash bench/cpu_vs_torch.sh --threads 2,4,8,16 --no-torch
#
# It builds nothing: build/bench_forward and build/bench_train must exist (cmake --build build). The Python side
# needs torch and transformers 5.17; by default it uses .venv/bin/python when that exists, else python3 (or --python,
# or $PYTHON). Without them it says how to make the virtual environment and stops; it never installs anything.
# --threads defaults to every online core. Benchmarks measure and print; they never pass or fail (exit status 1 only
# when something could not run). The engines and thread counts run one after the other, never at the same time.
set -euo pipefail

threads=0 runs=5 quick="" build=build py="${PYTHON:-}" torch=1
while [ $# -gt 0 ]; do
    case "$1" in
        --threads) threads="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --quick) quick="--quick"; shift ;;
        --build) build="$2"; shift 2 ;;
        --python) py="$2"; shift 2 ;;
        --no-torch) torch=0; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "cpu_vs_torch.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
[ "$threads" = 0 ] && threads="$(getconf _NPROCESSORS_ONLN)"
IFS=, read -r -a counts <<< "$threads"
for t in "${counts[@]}"; do
    [ "$t" -gt 0 ] 2>/dev/null || { echo "cpu_vs_torch.sh: --threads wants counts > 0 (N or N,N,...), got $threads" >&2; exit 2; }
done
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
for b in bench_forward bench_train; do
    if [ ! -x "$build/$b" ]; then
        echo "cpu_vs_torch.sh: $build/$b not found: cmake -S . -B $build -DCMAKE_BUILD_TYPE=Release && cmake --build $build -j" >&2
        exit 1
    fi
done
if [ "$torch" = 1 ] && ! "$py" -c 'import torch, transformers; from transformers import DeepseekV4ForCausalLM' 2>/dev/null; then
    cat >&2 <<EOF
cpu_vs_torch.sh: $py cannot import torch and transformers' DeepseekV4ForCausalLM. Make a virtual environment
(it is ignored by git; nothing here installs into the system, and CI never runs this script):
    python3 -m venv .venv && .venv/bin/pip install "torch==2.11.*" "transformers==5.17.*"
then run this script again (it picks up .venv/bin/python), or pass --python PATH.
EOF
    exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$build/bench_forward" --print-config 50m > "$tmp/config.json"

echo "== cpu_vs_torch: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(getconf _NPROCESSORS_ONLN) online CPUs ($(lscpu 2>/dev/null | sed -n 's/^Thread(s) per core: *//p') per core), threads $threads, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for t in "${counts[@]}"; do
    echo "== ds4 forward, $t threads"
    "$build/bench_forward" --only 50m --threads "$t" --runs "$runs" $quick | tee "$tmp/fwd.$t.txt"
    echo "== ds4 training step, $t threads"
    "$build/bench_train" --threads "$t" --runs "$runs" $quick | tee "$tmp/train.$t.txt"
    [ "$torch" = 1 ] || continue
    echo "== transformers, $t threads"
    OMP_NUM_THREADS="$t" MKL_NUM_THREADS="$t" "$py" bench/hf_cpu.py --config "$tmp/config.json" --threads "$t" \
        --runs "$runs" $quick 2> "$tmp/hf.err" | tee "$tmp/hf.$t.txt" || { cat "$tmp/hf.err" >&2; exit 1; }
done

# Tables: per thread count one row per (kind, shape), ratio = ds4 tokens/s / transformers tokens/s; then, with several
# counts, ds4's tokens/s at each and the last count's over the first's.
python3 - "$tmp" "$threads" <<'EOF'
import os, re, statistics, sys
tmp, counts = sys.argv[1], sys.argv[2].split(",")
def ds4(path):
    out = {}
    for line in open(path):
        m = re.match(r"50m\s+B x S =\s*(\d+) x (\d+)\s+([\d.]+) tokens/s", line)
        if m: out[f"{m[1]}x{m[2]}"] = float(m[3])
    return out
runs = {t: {"forward": ds4(f"{tmp}/fwd.{t}.txt"), "train": ds4(f"{tmp}/train.{t}.txt")} for t in counts}
for t in counts:
    if not os.path.exists(f"{tmp}/hf.{t}.txt"): continue
    hf = {"forward": {}, "train": {}}
    for line in open(f"{tmp}/hf.{t}.txt"):
        f = line.split()
        if len(f) == 5 and f[0] == "hf": hf[f[1]][f[2]] = float(f[3])
    print(f"\n{'':9} {'B x S':7} {'ds4 tok/s':>10} {'hf tok/s':>10} {'ratio':>6}   ({t} threads each)")
    for kind, d in runs[t].items():
        ratios = []
        for shp, v in d.items():
            h = hf[kind].get(shp)
            if h:
                ratios.append(v / h)
                print(f"{kind:9} {shp:7} {v:10.1f} {h:10.1f} {v / h:6.2f}")
        if ratios: print(f"{kind:9} median ratio {statistics.median(ratios):.2f}")
if len(counts) > 1:
    first, last = counts[0], counts[-1]
    print(f"\nds4 tokens/s by thread count; scaling = {last} threads / {first} threads")
    print(f"{'':9} {'B x S':7} " + " ".join(f"{t + ' thr':>10}" for t in counts) + f" {'scaling':>8}")
    for kind in ("forward", "train"):
        scal = []
        for shp in runs[first][kind]:
            row = [runs[t][kind].get(shp) for t in counts]
            s = row[-1] / row[0] if row[0] and row[-1] else float("nan")
            scal.append(s)
            print(f"{kind:9} {shp:7} " + " ".join(f"{x:10.1f}" if x else f"{'-':>10}" for x in row) + f" {s:8.2f}")
        if scal: print(f"{kind:9} median scaling {statistics.median(scal):.2f}")
EOF
