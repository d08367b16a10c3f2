#!/usr/bin/env python3
"""Check that a directory written by ds4 (model:save / ds4_model_save) loads in transformers and computes the
reference logits. Run on a host with torch + transformers 5.17 (the GPU host); it runs on the CPU in fp32.

    python3 tests/check_hf_roundtrip.py SAVED_DIR IO_SAFETENSORS

SAVED_DIR       a directory saved by ds4 from one of the fixtures, e.g. the saved_tiny_a/ that
                `DS4_KEEP_SAVED=1 build/test_save tests/fixtures` keeps (its path is printed)
IO_SAFETENSORS  that fixture's io.safetensors (input_ids, labels, logits, loss as transformers computed them
                from the original checkpoint)

It loads SAVED_DIR with DeepseekV4ForCausalLM.from_pretrained(dtype=torch.float32, output_loading_info=True),
prints the loading info (missing, unexpected and mismatched keys), runs input_ids and compares:
  logits   max |diff| <= 1e-4 * max(1, max |ref|)   (the forward test's bound)
  loss     |diff| <= 1e-5 * |ref|                    (when the file has labels and loss)
PASS needs both bounds, no missing or mismatched key, no error message, and unexpected keys only under
"mtp." (transformers has no MTP module; ds4 keeps those weights in the same file, as the official release
does). Exit status 0 on PASS, 1 on FAIL.
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4ForCausalLM

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    saved, io_path = sys.argv[1], sys.argv[2]
    failures = []

    # eager attention and the CPU: how tests/gen_fixtures.py computed the reference
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        saved, dtype=torch.float32, output_loading_info=True, attn_implementation="eager")
    model = model.float().eval()
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        items = sorted(str(k) for k in (info.get(kind) or []))
        print(f"{kind}: {len(items)}")
        for k in items:
            print(f"  {k}")
    if info.get("missing_keys"):
        failures.append(f"{len(info['missing_keys'])} missing keys")
    if info.get("mismatched_keys"):
        failures.append(f"{len(info['mismatched_keys'])} mismatched keys")
    if info.get("error_msgs"):
        failures.append(f"{len(info['error_msgs'])} loading errors")
    odd = [k for k in (info.get("unexpected_keys") or []) if not str(k).startswith("mtp.")]
    if odd:
        failures.append(f"{len(odd)} unexpected keys outside mtp.*")

    io = load_file(io_path)
    ids = io["input_ids"]
    labels = io.get("labels")
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels if "loss" in io else None, use_cache=False)
    got, ref = out.logits.float(), io["logits"].float()
    if got.shape != ref.shape:
        failures.append(f"logits shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    else:
        d = (got - ref).abs().max().item()
        m = ref.abs().max().item()
        tol = 1e-4 * max(1.0, m)
        print(f"logits: max |diff| {d:.3g} (max |ref| {m:.3g}, tol {tol:.3g})")
        if not d <= tol:
            failures.append(f"logits differ by {d:.3g} > {tol:.3g}")
    if "loss" in io and out.loss is not None:
        lref = io["loss"].float().item()
        lgot = out.loss.float().item()
        print(f"loss: {lgot:.7f} reference {lref:.7f}")
        if not abs(lgot - lref) <= 1e-5 * abs(lref):
            failures.append(f"loss {lgot:.8f} vs {lref:.8f}")

    if failures:
        print("FAIL: " + "; ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
