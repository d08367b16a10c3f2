#!/usr/bin/env python3
"""Regenerate tests/fixtures/lora_hf/: a PEFT LoRA adapter on the tiny_hf fixture model with its reference outputs
(run on a host with torch, transformers 5.17 and peft; the reference runs in fp32 on the CPU).

    python3 tests/gen_lora_fixtures.py [OUTDIR]        (default tests/fixtures/lora_hf)

Writes OUTDIR/:
  adapter_config.json, adapter_model.safetensors   the adapter as PEFT's save_pretrained writes it: rank 4, alpha 8,
                                                   every projection ds4 adapts (attention q_a/q_b/kv/o_a/o_b, the
                                                   indexer's q_b_proj and weights_proj, the shared expert, and the
                                                   routed experts through target_parameters), A and B random and
                                                   non-zero (PEFT's default B = 0 would hide the B path)
  io.safetensors                                   input_ids, labels (tiny_hf's), logits [B, S, V] and loss of the
                                                   model with the adapter, and grad.<PEFT key> = d loss / d adapter
                                                   (torch autograd, the base model frozen)
The indexer adapters receive no gradient from the cross-entropy (the indexer's picks are discrete), as in ds4.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM
from peft import LoraConfig, get_peft_model

torch.backends.cuda.matmul.allow_tf32 = False

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj",
           "self_attn.o_b_proj", "self_attn.compressor.indexer.q_b_proj",
           "self_attn.compressor.indexer.scorer.weights_proj", "mlp.shared_experts.gate_proj",
           "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "fixtures", "lora_hf")
    base = os.path.join(HERE, "fixtures", "tiny_hf")
    model = DeepseekV4ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], init_lora_weights=False)
    pm = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(14)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pm.save_pretrained(out)
    # the model card PEFT writes beside the adapter is not part of the fixture; the base is named by the fixture's
    # directory, not by this host's path
    card = os.path.join(out, "README.md")
    if os.path.exists(card):
        os.remove(card)
    with open(os.path.join(out, "adapter_config.json")) as f:
        acfg = json.load(f)
    acfg["base_model_name_or_path"] = "tiny_hf"
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
    io = load_file(os.path.join(base, "io.safetensors"))
    ids, labels = io["input_ids"], io["labels"]
    res = pm(input_ids=ids, labels=labels, use_cache=False)
    res.loss.backward()
    ref = {"input_ids": ids.contiguous(), "labels": labels.contiguous(), "logits": res.logits.detach().float().contiguous(),
           "loss": res.loss.detach().float().reshape(1)}
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    grads = {}
    for name, p in pm.named_parameters():
        if "lora_" in name:
            key = name.replace(".default", "")
            grads[key] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().contiguous()
    missing = sorted(set(saved) - set(grads))
    assert not missing, f"saved keys without a gradient: {missing[:4]}"
    for k in saved:
        ref["grad." + k] = grads[k]
    save_file(ref, os.path.join(out, "io.safetensors"), metadata={"format": "pt"})
    for fn in os.listdir(out):
        os.chmod(os.path.join(out, fn), 0o644)
    print(f"lora_hf: {len(saved)} adapter tensors, loss {res.loss.item():.6f}, "
          f"logits max {res.logits.abs().max().item():.4f}")


if __name__ == "__main__":
    main()
