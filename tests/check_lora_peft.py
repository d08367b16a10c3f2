#!/usr/bin/env python3
"""Check that an adapter saved by ds4 (model:save_lora) loads in PEFT onto transformers' DeepseekV4ForCausalLM and
gives the logits ds4 computed with it. Needs torch, transformers 5.17 and peft; runs on the CPU in fp32.

    DS4_KEEP_SAVED=1 build/ds4 run tests/lua/test_lora.lua tests/fixtures     (keeps ./saved_lora_hf, trained by one
                                                                               LoRA step, with ds4_logits.safetensors)
    python3 tests/check_lora_peft.py saved_lora_hf tests/fixtures/tiny_hf

It loads BASE_DIR with DeepseekV4ForCausalLM.from_pretrained (fp32, eager attention), applies ADAPTER_DIR with
PeftModel.from_pretrained, checks that every tensor of adapter_model.safetensors was taken by PEFT (no key left
unused or missing), runs ds4_logits.safetensors' input_ids and compares:
  logits   max |diff| <= 1e-4 * max(1, max |ref|)   (the forward test's bound)
Exit status 0 on PASS, 1 on FAIL.
"""
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4ForCausalLM
from peft import PeftModel


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    adapter, base = sys.argv[1], sys.argv[2]
    failures = []
    model = DeepseekV4ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    pm = PeftModel.from_pretrained(model, adapter).eval()
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    missing = sorted(set(saved) - set(loaded))
    extra = sorted(set(loaded) - set(saved))
    print(f"adapter tensors: {len(saved)} saved, {len(loaded)} in the PEFT model")
    if missing or extra:
        failures.append(f"keys: {len(missing)} saved but not in the model ({missing[:3]}), {len(extra)} in the model "
                        f"but not saved ({extra[:3]})")
    for k, v in saved.items():
        if k in loaded and not torch.equal(loaded[k].detach().float(), v.float()):
            failures.append(f"{k}: the model holds other values than the file")
            break
    io = load_file(os.path.join(adapter, "ds4_logits.safetensors"))
    with torch.no_grad():
        got = pm(input_ids=io["input_ids"], use_cache=False).logits.float()
    ref = io["logits"].float()
    d = (got - ref).abs().max().item()
    m = ref.abs().max().item()
    tol = 1e-4 * max(1.0, m)
    print(f"logits: max |diff| {d:.3g} (max |ds4| {m:.3g}, tol {tol:.3g})")
    if not d <= tol:
        failures.append(f"logits differ by {d:.3g} > {tol:.3g}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
