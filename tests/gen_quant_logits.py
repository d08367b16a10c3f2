#!/usr/bin/env python3
"""gen_quant_logits.py — transformers' logits of the dequantised quantised fixtures (run where torch and
transformers 5.17 are installed; the reference runs in fp32 on the CPU).

For each of tests/fixtures/quant_official_ref, quant_hf_ref and quant_fp4_ref (written by gen_quant_fixtures.py: the
quantised checkpoints' weights dequantised exactly to F32), DeepseekV4ForCausalLM is built from the dequantised
weights under transformers' names (the official names mapped back, the per-expert matrices packed back into
gate_up_proj [E, 2I, D] and down_proj [E, D, I]) and run on tiny_hf's input_ids. Writes <ref>/hf_logits.safetensors:
input_ids (I64 [B, S]) and logits (F32 [B, S, V]). tests/test_quant_load.c compares ds4's logits on the quantised
checkpoints with them.

Usage: python3 tests/gen_quant_logits.py [FIXTURES_DIR]
"""
import json
import os
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_quant_fixtures as q  # noqa: E402  (the fixtures' names and readers)


def hf_names(ref, hf_like):
    """Tensors of `ref` (official names) under the names of `hf_like` (a dict of transformers' names)."""
    out = {}
    for name in hf_like:
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            pre = "layers.%s.ffn.experts." % name.split(".")[2]
            E = hf_like[name][1].shape[0]
            if name.endswith("gate_up_proj"):  # rows [0, I) w1 (gate), [I, 2I) w3 (up)
                out[name] = np.stack([np.concatenate([ref[pre + "%d.w1.weight" % e][1], ref[pre + "%d.w3.weight" % e][1]])
                                      for e in range(E)])
            else:
                out[name] = np.stack([ref[pre + "%d.w2.weight" % e][1] for e in range(E)])
        else:
            out[name] = ref[q.official_name(name)][1]
    return out


def logits_of(state, cfg_dir, ids):
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(cfg_dir, "config.json")) as f, open(os.path.join(tmp, "config.json"), "w") as g:
            g.write(f.read())
        model = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits.float().contiguous()


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    ids = load_file(os.path.join(root, "tiny_hf", "io.safetensors"))["input_ids"]
    tiny = q.st_read(os.path.join(root, "tiny_hf", "model.safetensors"))
    with open(os.path.join(root, "tiny_hf", "config.json")) as f:
        fp4_like, _ = q.fp4_variant(tiny, json.load(f))  # for its names and expert counts
    for sub, like in (("quant_official_ref", tiny), ("quant_hf_ref", None), ("quant_fp4_ref", fp4_like)):
        d = os.path.join(root, sub)
        ref = q.st_read(os.path.join(d, "model.safetensors"))
        state = {k: v for k, (_, v) in ref.items()} if like is None else hf_names(ref, like)
        logits = logits_of(state, d, ids)
        save_file({"input_ids": ids.contiguous(), "logits": logits}, os.path.join(d, "hf_logits.safetensors"),
                  metadata={"format": "pt"})
        os.chmod(os.path.join(d, "hf_logits.safetensors"), 0o644)
        print(f"{sub}: logits {tuple(logits.shape)}, max |logit| {logits.abs().max().item():.4f}")


if __name__ == "__main__":
    main()
