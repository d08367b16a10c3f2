#!/usr/bin/env python3
"""hf_generate.py — what a user would run instead of ds4: transformers' DeepseekV4ForCausalLM in bf16, eager, greedy
`generate` of 64 new tokens after a 128-token prompt, on the same config (bench/config_599m.json) and GPU as
bench_gpu. Random weights (speed does not depend on them); EOS is suppressed so every sequence generates all 64.

    python3 bench/hf_generate.py [--config bench/config_599m.json] [--batches 1,8,64] [--new 64] [--prompt 128]
                                 [--compile]

--compile wraps the model's forward in torch.compile (dynamic shapes; the KV cache grows, so static shapes would
recompile at every step) and prints its keys as "hf_compile ...".

Prints "hf KEY VALUE" lines for bench/gpu_bench.sh. It measures, never passes or fails."""
import argparse
import json
import time

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--config", default="bench/config_599m.json")
p.add_argument("--batches", default="1,8,64")
p.add_argument("--new", type=int, default=64)
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--compile", action="store_true")
a = p.parse_args()
tag = "hf_compile" if a.compile else "hf"

cfg = DeepseekV4Config.from_dict(json.load(open(a.config)))
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
t0 = time.time()
with torch.device("cuda"):
    model = DeepseekV4ForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
n = sum(p.numel() for p in model.parameters())
if a.compile:
    model.forward = torch.compile(model.forward, dynamic=True)
print(f"{tag} params {n}")
print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"{n / 1e6:.1f}M parameters, init {time.time() - t0:.1f} s{', torch.compile' if a.compile else ''}",
      flush=True)


def generate(ids, new):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return out


g = torch.Generator().manual_seed(1)
t0 = time.time()
for b in [int(x) for x in a.batches.split(",")]:  # warm-up (and, with --compile, the compilations)
    generate(torch.randint(0, cfg.vocab_size, (b, a.prompt), generator=g).cuda(), 4)
print(f"# warm-up {time.time() - t0:.1f} s", flush=True)
for b in [int(x) for x in a.batches.split(",")]:
    ids = torch.randint(0, cfg.vocab_size, (b, a.prompt), generator=g).cuda()
    t0 = time.time()
    out = generate(ids, a.new)
    dt = time.time() - t0
    assert out.shape[1] == a.prompt + a.new, out.shape
    print(f"{tag} generate_b{b} {b * a.new / dt:.1f}", flush=True)
    print(f"# batch {b}: {b * a.new} new tokens in {dt:.2f} s", flush=True)
