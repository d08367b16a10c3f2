"""nccl_torch_bw.py — NCCL's own all-reduce and all-to-all bandwidth through torch.distributed, at the sizes and in
the columns of bench/bench_collectives.c, so that ds4's communicator has NCCL's figures beside it in the same run
(nccl-tests is not installed on the GPU machines; torch.distributed's NCCL backend is a thin layer over
ncclAllReduce and ncclSend / ncclRecv). One process per rank, one GPU each, launched with torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: plain processes as bench/collectives_bench.sh starts them,
or `python3 -m torch.distributed.run --nproc-per-node N bench/nccl_torch_bw.py`).

    python3 bench/nccl_torch_bw.py [--sizes 1M,4M,...] [--iters 20] [--warmup 5]

all_reduce: `size` bytes of fp32, dist.all_reduce in place (SUM). all_to_all: dist.all_to_all_single of `size` bytes
per rank, size / n to each (int64 rows; rounded down to a multiple of 8n). Each size's result is checked once against
the closed forms bench_collectives checks (a wrong value fails every rank: exit 1); then warm-up calls, a barrier,
and a host clock around `iters` calls enqueued back to back and one torch.cuda.synchronize(): nccl-tests' method.
The time is the slowest rank's; algbw = bytes / time, busbw = algbw * 2(n-1)/n (all-reduce) or algbw * (n-1)/n
(all-to-all), nccl-tests' definitions, GB = 1e9 bytes. Rank 0 prints the table and "coll OP SIZE BYTES TIME_US ALGBW
BUSBW" lines. Without torch, CUDA or NCCL it prints a SKIP line and exits 0.
"""
import argparse
import os
import sys
import time


def parse_sizes(s):
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in s.split(","):
        part = part.strip()
        k = mul.get(part[-1:].upper(), 1)
        out.append(int(part[:-1] if k > 1 else part) * k)
    if not out or min(out) <= 0:
        raise SystemExit(f"nccl_torch_bw.py: --sizes wants sizes like 1M,4M,1G, got {s}")
    return out


def nccl_version(torch):
    v = torch.cuda.nccl.version()  # a tuple (2, 21, 5); an int 22105 in older torch
    return ".".join(map(str, v)) if isinstance(v, tuple) else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    sizes = parse_sizes(a.sizes)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"nccl_torch_bw.py: SKIP: no torch ({e})")
        return 0
    if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
        print("nccl_torch_bw.py: SKIP: torch without CUDA devices or without NCCL")
        return 0
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a world of one needs a store too
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    n = world

    def slowest(t):  # seconds: the slowest rank's
        x = torch.tensor([t], dtype=torch.float64, device=dev)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x.item()

    def agree(op, size, bad, total):  # every rank's count of wrong values; exit 1 everywhere when any
        x = torch.tensor([bad], dtype=torch.int64, device=dev)
        dist.all_reduce(x)
        if bad:
            print(f"nccl_torch_bw.py: rank {rank}: {op} of {size} bytes: {bad} of {total} values wrong", file=sys.stderr)
        if x.item():
            if rank == 0:
                print(f"nccl_torch_bw.py: FAIL: {op} of {size} bytes gave wrong values on some rank", file=sys.stderr)
            dist.destroy_process_group()
            sys.exit(1)

    def timed(call):
        for _ in range(a.warmup):
            call()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[dev.index])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            call()
        torch.cuda.synchronize()
        return slowest((time.perf_counter() - t0) / a.iters)

    results = []

    def report(op, size, nbytes, t, factor):
        results.append((op, size, nbytes, t, factor))
        if rank == 0:
            algbw = nbytes / t / 1e9
            print(f"{size:14d} {nbytes:14d} {t * 1e6:12.2f} {algbw:12.2f} {algbw * factor:12.2f}  {op}", flush=True)

    if rank == 0:
        print(f"coll ranks {n}\ncoll device cuda\ncoll backend torch-nccl")
        print(f"# nccl_torch_bw.py: {n} ranks, torch {torch.__version__}, NCCL {nccl_version(torch)}, "
              f"{a.iters} iterations after {a.warmup} warm-up; time: the slowest rank's, per call; busbw: nccl-tests'")
        print(f"# {'size(B)':>12} {'moved(B)':>14} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    for size in sizes:
        count = size // 4  # [count] fp32
        if count > 0:
            i = torch.arange(count, device=dev, dtype=torch.int64) % 1000 + 1
            x = (i * (rank + 1)).to(torch.float32)
            dist.all_reduce(x)
            bad = int((x != (i * (n * (n + 1) // 2)).to(torch.float32)).sum().item())  # NaN counts as wrong
            agree("all_reduce", size, bad, count)
            del i
            x.zero_()  # zeros stay zeros over the iterations
            report("all_reduce", size, count * 4, timed(lambda: dist.all_reduce(x)), 2 * (n - 1) / n)
            del x
        m = size // (8 * n)  # rows to each rank: [n, m] int64 tags (source << 48 | destination << 32 | row)
        if m > 0:
            j = torch.arange(n * m, device=dev, dtype=torch.int64)
            send = (rank << 48) | ((j // m) << 32) | (j % m)
            recv = torch.full_like(send, -1)
            dist.all_to_all_single(recv, send)
            want = ((j // m) << 48) | (rank << 32) | (j % m)
            bad = int((recv != want).sum().item())
            agree("all_to_all", size, bad, n * m)
            del j, want
            report("all_to_all", size, n * m * 8, timed(lambda: dist.all_to_all_single(recv, send)), (n - 1) / n)
            del send, recv
        torch.cuda.empty_cache()
    if rank == 0:
        for op, size, nbytes, t, factor in results:
            algbw = nbytes / t / 1e9
            print(f"coll {op} {size} {nbytes} {t * 1e6:.2f} {algbw:.3f} {algbw * factor:.3f}")
    dist.barrier(device_ids=[dev.index])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
