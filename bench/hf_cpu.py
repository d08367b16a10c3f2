#!/usr/bin/env python3
"""hf_cpu.py — what a user would run instead of ds4 on a CPU: transformers' DeepseekV4ForCausalLM in fp32 on torch's
CPU backend, timed the way bench_forward / bench_train time ds4, on the same config (bench/cpu_vs_torch.sh passes
the one bench_forward prints with --print-config 50m) and the same thread count.

    python3 bench/hf_cpu.py --config CONFIG.json [--threads N] [--runs N] [--quick] [--skip-train]

forward: logits [B, S, V] under torch.no_grad(), eval mode; median of --runs (>= 5) after 2 warm-ups.
train:   model(ids, labels=ids).loss, backward, clip_grad_norm_(1.0), torch.optim.AdamW (lr 1e-4, betas (0.9, 0.95),
         eps 1e-8, weight decay 0.1), zero_grad; median of --runs after one warm-up (bench_train's step).
Shapes B x S: 1x512, 4x128, 8x64 (--quick: 1x128, 4x32). Random weights (speed does not depend on them), random ids.
Prints "hf forward|train BxS TOKENS_PER_S MS" lines for cpu_vs_torch.sh. It measures, never passes or fails."""
import argparse
import json
import os
import platform
import statistics
import time

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--threads", type=int, default=0)
p.add_argument("--runs", type=int, default=5)
p.add_argument("--quick", action="store_true")
p.add_argument("--skip-train", action="store_true")
a = p.parse_args()

import torch  # noqa: E402  (after argparse so --help works without torch)
import transformers  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

threads = a.threads or os.cpu_count()
torch.set_num_threads(threads)
torch.set_num_interop_threads(1)
runs = max(a.runs, 5)
shapes = [(1, 128), (4, 32)] if a.quick else [(1, 512), (4, 128), (8, 64)]

cfg = DeepseekV4Config.from_dict(json.load(open(a.config)))
cfg._attn_implementation = "eager"  # the implementation transformers runs on a CPU by default for this model
torch.manual_seed(0)
model = DeepseekV4ForCausalLM(cfg).float()
nparam = sum(t.numel() for t in model.parameters())
print(f"# transformers {transformers.__version__}, torch {torch.__version__} (CPU: {torch.backends.cpu.get_cpu_capability()}),"
      f" {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, {nparam} parameters"
      f" (no MTP block: transformers has none)", flush=True)
g = torch.Generator().manual_seed(1)


def median_time(fn, warmup):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


model.eval()
for b, s in shapes:
    ids = torch.randint(2, cfg.vocab_size, (b, s), generator=g)

    def fwd():
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=0)
        assert out.logits.shape == (b, s, cfg.vocab_size)

    med, lo, hi = median_time(fwd, 2)
    print(f"hf forward {b}x{s} {b * s / med:.1f} {1e3 * med:.1f}", flush=True)
    print(f"#   forward {b}x{s}: median {1e3 * med:.1f} ms (min {1e3 * lo:.1f}, max {1e3 * hi:.1f}, {runs} runs)", flush=True)

if not a.skip_train:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for b, s in shapes:
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)

        def step():
            opt.zero_grad(set_to_none=False)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        med, lo, hi = median_time(step, 1)
        print(f"hf train {b}x{s} {b * s / med:.1f} {1e3 * med:.1f}", flush=True)
        print(f"#   train {b}x{s}: median {1e3 * med:.1f} ms (min {1e3 * lo:.1f}, max {1e3 * hi:.1f}, {runs} runs)", flush=True)
