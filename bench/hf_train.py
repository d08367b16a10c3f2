#!/usr/bin/env python3
"""hf_train.py — what a user would run instead of ds4 for training: transformers' DeepseekV4ForCausalLM in bf16 with
torch.optim.AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1) and clip_grad_norm_(1.0), one step = forward with labels,
backward, clip, step, zero_grad, on random tokens: what bench/bench_train_gpu.c times ds4 doing, on the same config.

    python3 bench/hf_train.py [--config bench/config_599m.json] [--batch 8] [--seq 1024] [--steps 5] [--compile]

--compile wraps the model in torch.compile first (its compilation time is printed apart). Prints "hf KEY VALUE" (or
"hf_compile ...") lines for scripts; it measures, never passes or fails."""
import argparse
import json
import time

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--config", default="bench/config_599m.json")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=1024)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--compile", action="store_true")
a = p.parse_args()
tag = "hf_compile" if a.compile else "hf"

cfg = DeepseekV4Config.from_dict(json.load(open(a.config)))
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = DeepseekV4ForCausalLM(cfg).train()
torch.set_default_dtype(torch.float32)
n = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
fwd = torch.compile(model) if a.compile else model
print(f"{tag} params {n}")
print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"{n / 1e6:.1f}M parameters, bf16 weights and AdamW states, batch {a.batch} x {a.seq}"
      f"{', torch.compile' if a.compile else ', eager'}", flush=True)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).cuda()


def step():
    out = fwd(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss


t0 = time.time()
for _ in range(2):  # warm-up (and, with --compile, the compilation)
    step()
torch.cuda.synchronize()
print(f"# warm-up {time.time() - t0:.1f} s", flush=True)
torch.cuda.reset_peak_memory_stats()
best = 1e30
for _ in range(a.steps):
    t0 = time.time()
    loss = step()
    torch.cuda.synchronize()
    best = min(best, time.time() - t0)
tok = a.batch * a.seq
peak = torch.cuda.max_memory_allocated() / 2**30
print(f"{tag} train_tokens_per_s {tok / best:.1f}")
print(f"{tag} train_ms_per_step {1e3 * best:.2f}")
print(f"{tag} train_peak_gib {peak:.2f}")
print(f"# best of {a.steps} steps: {1e3 * best:.1f} ms, {tok / best:.0f} tokens/s, loss {loss.item():.4f}, "
      f"peak allocated {peak:.2f} GiB", flush=True)
