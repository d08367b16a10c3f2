#!/usr/bin/env python3
"""Greedy-continuation fixtures for the generation tests: transformers' DeepseekV4ForCausalLM (fp32, eager, CPU)
continues two prompts by an argmax loop over FULL forwards (no cache), which is the reference ds4's cached
generation must reproduce. Run on the torch host:

    python3 tests/gen_greedy_fixtures.py FIXTURES_DIR NAME=SAVED_DIR [NAME=SAVED_DIR ...]

SAVED_DIR is the fixture as ds4 saved it with save_pretrained names (`DS4_KEEP_SAVED=1 build/test_save
tests/fixtures` keeps saved_<name>/; tests/check_hf_roundtrip.py shows those load into transformers with the
fixture's exact logits). Writes FIXTURES_DIR/NAME/greedy.safetensors:

  prompt_<k>       I64 [P_k]   prompt ids (k = 0, 1; lengths 5 and 11)
  greedy_<k>       I64 [N]     argmax continuation, N = 40 new tokens (no stop on eos)
  logprob_<k>      F64 [N]     log-softmax of each chosen token
  gap_<k>          F64 [N]     top-1 minus top-2 logit at each step
  hf_cached_<k>    I64 [N]     transformers' own model.generate(do_sample=False) with its cache (informational)

The prompts are drawn from a seeded generator and redrawn while any step's top-2 gap is below 1e-3 relative, so
fp32 rounding differences between two correct implementations cannot flip an argmax.
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM

N_NEW = 40
PROMPT_LENS = (5, 11)


def greedy(model, prompt):
    ids = prompt.clone()
    out, lps, gaps = [], [], []
    with torch.no_grad():
        for _ in range(N_NEW):
            logits = model(input_ids=ids[None], use_cache=False).logits[0, -1].double()
            top = torch.topk(logits, 2)
            tok = int(top.indices[0])
            out.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, torch.tensor([tok])])
    return torch.tensor(out), torch.tensor(lps, dtype=torch.float64), torch.tensor(gaps, dtype=torch.float64)


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        sys.exit(2)
    fixtures = sys.argv[1]
    torch.manual_seed(0)
    for spec in sys.argv[2:]:
        name, saved = spec.split("=", 1)
        model = DeepseekV4ForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation="eager")
        model = model.float().eval()
        V = model.config.vocab_size
        gen = torch.Generator().manual_seed(1234)
        rec = {}
        for k, plen in enumerate(PROMPT_LENS):
            for attempt in range(100):
                prompt = torch.randint(0, V, (plen,), generator=gen)
                cont, lps, gaps = greedy(model, prompt)
                scale = 1.0  # logits of these models are O(1); an absolute gap is also a relative one
                if float(gaps.min()) > 1e-3 * scale:
                    break
            else:
                raise SystemExit(f"{name}: no prompt without near-ties in 100 draws")
            with torch.no_grad():
                hf = model.generate(prompt[None], max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, min_new_tokens=N_NEW)[0, plen:]
            agree = int((hf == cont).all())
            print(f"{name} prompt {k}: len {plen}, attempt {attempt}, min gap {float(gaps.min()):.3g}, "
                  f"hf cached generate agrees: {agree}, continuation {cont.tolist()[:12]}...")
            rec[f"prompt_{k}"] = prompt.to(torch.int64)
            rec[f"greedy_{k}"] = cont.to(torch.int64)
            rec[f"logprob_{k}"] = lps
            rec[f"gap_{k}"] = gaps
            rec[f"hf_cached_{k}"] = hf.to(torch.int64)
        save_file(rec, os.path.join(fixtures, name, "greedy.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
