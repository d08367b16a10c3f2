#!/usr/bin/env python3
"""Regenerate the reference fixtures under tests/fixtures/ (run on a host with torch + transformers 5.17).

    python3 tests/gen_fixtures.py OUTDIR

For each configuration it writes OUTDIR/<name>/:
  config.json                      the checkpoint config (modern HF form, or the legacy/official spelling)
  model.safetensors | shards+index  the checkpoint, as `save_pretrained` writes it, plus `mtp.0.*` weights
  io.safetensors                   input_ids, labels (I64 [B,S]), logits (F32 [B,S,V]), loss (F32 [1]),
                                   hidden.<l> (F32 [B,S,n,D], the streams after decoder layer l),
                                   and for MTP configs mtp_logits (F32 [B,S-1,V]), mtp_loss (F32 [1])
  names.txt                        the tensor names found in the checkpoint (for humans)
  grads.safetensors                torch autograd gradients of the loss for every parameter, under the canonical
                                   official names ("main.<name>"; zeros where torch has none: indexer, MTP);
                                   tiny_a also "mtp.<name>" = gradients of loss + MTP_LAMBDA * mtp_loss
and OUTDIR/adamw.safetensors: a torch.optim.AdamW reference (see adamw_fixture) and, in tiny_a/, train.safetensors:
the loss of 10 AdamW steps on the fixture batch (see train_fixture).

The reference is transformers' `DeepseekV4ForCausalLM` in fp32 on the CPU (eager attention, TF32 off).
Parameters that HF initialises to zero (sinks, position_bias, mHC base, e_score_correction_bias, tid2eid)
get random values so those paths are exercised. Seeds are re-drawn until no near-tie sits at a top-k
boundary (indexer or learned router): which of two tied entries torch.topk returns is unspecified, so a
fixture with ties could not be matched by any independent implementation.

MTP (not implemented by transformers) is built from transformers' own DeepseekV4DecoderLayer for block index
num_hidden_layers (sliding attention, learned routing) plus the official MTPBlock equations
(docs/architecture.md, "MTP"): for position i < S-1,
  Z_i[k] = e_proj(enorm(Embed[t_{i+1}])) + h_proj(hnorm(X^L_i[k]))
  mtp_logits_i = head(mtp.norm(mtp.HyperHead(Block(Z)_i)))        (predicts t_{i+2})
with the block's attention running causally over positions 0..S-2.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_grad_enabled(False)

ROPE_MAIN = lambda f: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": f}


def yarn(f, theta, factor, orig):
    return {"rope_type": "yarn", "rope_theta": theta, "partial_rotary_factor": f, "factor": factor,
            "original_max_position_embeddings": orig, "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0}


# tiny_a: modern HF config, every attention type, hash + learned routing, hc_mult 4, MTP, clamps that bind.
TINY_A = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=8,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    index_n_heads=8, index_head_dim=32, index_topk=3,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=0.25,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, partial_rotary_factor=0.5,
    rope_parameters={"main": ROPE_MAIN(0.5), "compress": yarn(0.5, 160000.0, 16, 65536)},
    max_position_embeddings=1048576, num_nextn_predict_layers=1, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, initializer_range=0.08,
)

# tiny_b: the legacy/official spelling (compress_ratios with the MTP entry, num_hash_layers, qk_rope_head_dim,
# compress_rate_hca, rope_scaling), hc_mult 2, rotary fraction 1/4, other window/rates, no MTP weights, sharded checkpoint.
TINY_B_JSON = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
    vocab_size=192, hidden_size=48, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=1,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=24, o_groups=3, o_lora_rank=16, sliding_window=16,
    compress_ratios=[4, 128, 0, 128, 4, 0], compress_rate_hca=16, num_hash_layers=1,
    index_n_heads=8, index_head_dim=32, index_topk=2,
    n_routed_experts=6, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=24,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=2.5, swiglu_limit=10.0,
    hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=40000.0,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=65536, num_nextn_predict_layers=1, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, initializer_range=0.1, torch_dtype="float32",
)

# tiny_hf: checkpoint stored under the in-memory HF module names (packed experts), as state_dict() gives them.
TINY_HF = dict(TINY_A, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
               q_lora_rank=16, o_groups=1, o_lora_rank=16, sliding_window=4,
               layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
               mlp_layer_types=["hash_moe", "moe"], index_n_heads=8, index_head_dim=16, index_topk=2,
               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=3,
               swiglu_limit=1.0, num_nextn_predict_layers=0,
               rope_parameters={"main": ROPE_MAIN(0.5), "compress": yarn(0.5, 160000.0, 16, 65536)})


def randomise_zero_inits(model, cfg, gen):
    """Give every parameter HF initialises to zero a random value; tid2eid rows get distinct experts."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith("position_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith(".base") or name.endswith("hc_base"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith(".scale") or name.endswith("hc_scale"):
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
        elif name.endswith("e_score_correction_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif name.endswith("tid2eid"):
            E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
            rows = [torch.randperm(E, generator=gen)[:K] for _ in range(p.shape[0])]
            p.copy_(torch.stack(rows).to(p.dtype))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)


class TieWatch:
    """Records top-k margins at the indexer and learned routers during a forward."""

    def __init__(self):
        self.min_gap = math.inf
        self._orig_scorer = M.DeepseekV4IndexerScorer.forward
        self._orig_router = M.DeepseekV4TopKRouter.forward
        self.topk = None

    def gap(self, scores, k):
        finite = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, -1e30))
        n = scores.shape[-1]
        if k >= n:
            return
        s = finite.sort(dim=-1, descending=True).values
        kth, nxt = s[..., k - 1], s[..., k]
        valid = nxt > -1e29
        if valid.any():
            scale = s[..., 0].abs().clamp(min=1e-3)
            self.min_gap = min(self.min_gap, float(((kth - nxt) / scale)[valid].min()))

    def __enter__(self):
        watch = self

        def router(mod, hidden_states):
            flat = hidden_states.reshape(-1, mod.hidden_dim)
            scores = mod.score_fn(F.linear(flat, mod.weight))
            watch.gap(scores + mod.e_score_correction_bias, mod.top_k)
            return watch._orig_router(mod, hidden_states)

        orig_indexer = M.DeepseekV4Indexer.forward

        def indexer(mod, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
            captured = {}

            def sc(m2, q, ckv, hs):
                out = watch._orig_scorer(m2, q, ckv, hs)
                captured["s"] = out
                return out

            M.DeepseekV4IndexerScorer.forward = sc
            try:
                res = orig_indexer(mod, hidden_states, q_residual, position_ids, past_key_values, layer_idx)
            finally:
                M.DeepseekV4IndexerScorer.forward = watch._orig_scorer
            s = captured.get("s")
            if s is not None and s.shape[-1] > 0:
                T = s.shape[-1]
                thr = (position_ids + 1) // mod.compress_rate
                idx = torch.arange(T)
                masked = s.masked_fill(idx.view(1, 1, -1) >= thr.unsqueeze(-1), float("-inf"))
                # only rows with more valid entries than k can have a boundary tie
                watch.gap(masked, min(mod.index_topk, T))
            return res

        self._orig_indexer = orig_indexer
        M.DeepseekV4TopKRouter.forward = router
        M.DeepseekV4Indexer.forward = indexer
        return self

    def __exit__(self, *a):
        M.DeepseekV4TopKRouter.forward = self._orig_router
        M.DeepseekV4Indexer.forward = self._orig_indexer


def sliding_mask(S, window):
    t = torch.arange(S).view(-1, 1)
    j = torch.arange(S).view(1, -1)
    keep = (j <= t) & (t - j < window)
    return torch.where(keep, 0.0, float("-inf")).view(1, 1, S, S)


def official_name(hf_name):
    """HF module name -> official checkpoint name, for the MTP block's decoder-layer weights."""
    n = hf_name
    rules = [
        ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
        ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
        ("self_attn.", "attn."), ("mlp.", "ffn."),
        ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
        ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
        ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
        ("attn.sinks", "attn.attn_sink"), ("q_a_proj.", "wq_a."), ("q_b_proj.", "wq_b."), ("q_a_norm.", "q_norm."),
        ("kv_proj.", "wkv."), ("gate_proj.", "wgate."), ("o_a_proj.", "wo_a."), ("o_b_proj.", "wo_b."),
        ("kv_norm.", "norm."), ("position_bias", "ape"), ("gate.e_score_correction_bias", "gate.bias"),
    ]
    for a, b in rules:
        n = n.replace(a, b)
    # kv_norm -> norm inside attention means the attention's own kv_norm must come back
    n = n.replace("attn.norm.", "attn.kv_norm.")
    n = n.replace("shared_experts.wgate.", "shared_experts.w1.").replace("shared_experts.down_proj.", "shared_experts.w2.")
    n = n.replace("shared_experts.up_proj.", "shared_experts.w3.")
    return n


def build_mtp(model, cfg, gen, std):
    """An MTP block (official equations) around transformers' own decoder layer at index num_hidden_layers."""
    n = cfg.num_hidden_layers
    d = cfg.to_dict()
    d.update(num_hidden_layers=n + 1, layer_types=list(cfg.layer_types) + ["sliding_attention"],
             mlp_layer_types=list(cfg.mlp_layer_types) + ["moe"])
    for k in ("qk_rope_head_dim",):
        d.pop(k, None)
    cfg2 = DeepseekV4Config(**d)
    layer = M.DeepseekV4DecoderLayer(cfg2, n).float()
    D = cfg.hidden_size
    for name, p in list(layer.named_parameters()) + list(layer.named_buffers()):
        p.copy_(torch.randn(p.shape, generator=gen) * std)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
    randomise_zero_inits(layer, cfg, gen)
    extra = {
        "e_proj.weight": torch.randn(D, D, generator=gen) * std,
        "h_proj.weight": torch.randn(D, D, generator=gen) * std,
        "enorm.weight": 1.0 + torch.randn(D, generator=gen) * 0.2,
        "hnorm.weight": 1.0 + torch.randn(D, generator=gen) * 0.2,
        "norm.weight": 1.0 + torch.randn(D, generator=gen) * 0.2,
        "hc_head_fn": torch.randn(cfg.hc_mult, cfg.hc_mult * D, generator=gen) * std,
        "hc_head_base": torch.randn(cfg.hc_mult, generator=gen) * 0.5,
        "hc_head_scale": 1.0 + torch.randn(1, generator=gen) * 0.3,
    }
    tensors = {}
    for name, p in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            I = p.shape[1] // 2
            for e in range(p.shape[0]):
                tensors[f"mtp.0.ffn.experts.{e}.w1.weight"] = p[e, :I].clone()
                tensors[f"mtp.0.ffn.experts.{e}.w3.weight"] = p[e, I:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                tensors[f"mtp.0.ffn.experts.{e}.w2.weight"] = p[e].clone()
        else:
            tensors["mtp.0." + official_name(name)] = p.clone()
    for k, v in extra.items():
        tensors["mtp.0." + k] = v
    return layer, extra, tensors, cfg2


def rmsnorm(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))


def mtp_forward(model, cfg, layer, extra, ids, final_streams):
    """Official MTPBlock equations; returns logits [B, S-1, V] for positions 0..S-2 (target t_{i+2})."""
    eps = cfg.rms_norm_eps
    nxt = ids[:, 1:]
    X = final_streams[:, :-1]  # [B, S-1, n, D]
    e = model.model.embed_tokens(nxt)
    z = F.linear(rmsnorm(e, extra["enorm.weight"], eps), extra["e_proj.weight"]).unsqueeze(2) + \
        F.linear(rmsnorm(X, extra["hnorm.weight"], eps), extra["h_proj.weight"])
    S1 = z.shape[1]
    pos = torch.arange(S1).unsqueeze(0)
    pe = {"main": model.model.rotary_emb(z, position_ids=pos, layer_type="main"),
          "compress": model.model.rotary_emb(z, position_ids=pos, layer_type="compress")}
    out = layer(z, position_embeddings=pe, position_ids=pos, attention_mask=sliding_mask(S1, cfg.sliding_window),
                input_ids=nxt, past_key_values=None)
    flat = out.flatten(2).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(F.linear(flat, extra["hc_head_fn"]) * extra["hc_head_scale"] + extra["hc_head_base"]) + cfg.hc_eps
    y = (pre.unsqueeze(-1) * out).sum(dim=2)
    return model.lm_head(rmsnorm(y, extra["norm.weight"], eps))


MTP_LAMBDA = 0.3


def canonical(hf_name):
    """HF module name of a DeepseekV4ForCausalLM parameter -> our canonical official name (None: packed experts)."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    if hf_name in top:
        return top[hf_name]
    assert hf_name.startswith("model.layers."), hf_name
    i, rest = hf_name[len("model.layers."):].split(".", 1)
    rest = rest.replace("self_attn.compressor.indexer.scorer.weights_proj.", "self_attn.indexer.weights_proj.")
    rest = rest.replace("self_attn.compressor.indexer.q_b_proj.", "self_attn.indexer.wq_b.")
    rest = rest.replace("self_attn.compressor.indexer.", "self_attn.indexer.compressor.")
    return f"layers.{i}." + official_name(rest)


def named_grads(model, prefix):
    """{prefix + canonical name: gradient} for every parameter; zeros where autograd left None."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            i = name.split(".")[2]
            I = g.shape[1] // 2
            for e in range(g.shape[0]):
                if name.endswith("gate_up_proj"):
                    out[f"{prefix}layers.{i}.ffn.experts.{e}.w1.weight"] = g[e, :I].clone()
                    out[f"{prefix}layers.{i}.ffn.experts.{e}.w3.weight"] = g[e, I:].clone()
                else:
                    out[f"{prefix}layers.{i}.ffn.experts.{e}.w2.weight"] = g[e].clone()
        else:
            out[prefix + canonical(name)] = g.detach().clone()
    for name, b in model.named_buffers():  # selection-only bias: a buffer in torch, zero gradient for us
        if name.endswith("e_score_correction_bias"):
            out[prefix + canonical(name)] = torch.zeros_like(b)
    return out


def record_grads(model, cfg, ids, labels, mtp_parts, d):
    """torch autograd gradients of the LM loss (and, with MTP, of loss + MTP_LAMBDA * mtp_loss)."""
    grads = {}
    with torch.enable_grad():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        grads.update(named_grads(model, "main."))
        if mtp_parts is not None:
            layer, extra = mtp_parts
            for v in extra.values():
                v.requires_grad_(True)
            model.zero_grad(set_to_none=True)
            layer.zero_grad(set_to_none=True)
            cap = {}
            h = model.model.layers[-1].register_forward_hook(lambda m, i, o: cap.__setitem__("x", o))
            out = model(input_ids=ids, labels=labels, use_cache=False)
            h.remove()
            mtp_logits = mtp_forward(model, cfg, layer, extra, ids, cap["x"])
            tgt = labels[:, 2:]
            mtp_loss = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, cfg.vocab_size), tgt.reshape(-1), ignore_index=-100)
            (out.loss + MTP_LAMBDA * mtp_loss).backward()
            grads.update(named_grads(model, "mtp."))
            for name, p in layer.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if name.endswith("experts.gate_up_proj"):
                    I = g.shape[1] // 2
                    for e in range(g.shape[0]):
                        grads[f"mtp.mtp.0.ffn.experts.{e}.w1.weight"] = g[e, :I].clone()
                        grads[f"mtp.mtp.0.ffn.experts.{e}.w3.weight"] = g[e, I:].clone()
                elif name.endswith("experts.down_proj"):
                    for e in range(g.shape[0]):
                        grads[f"mtp.mtp.0.ffn.experts.{e}.w2.weight"] = g[e].clone()
                else:
                    grads["mtp.mtp.0." + official_name(name)] = g.detach().clone()
            grads["mtp.mtp.0.ffn.gate.bias"] = torch.zeros(cfg.n_routed_experts)
            for k, v in extra.items():
                grads["mtp.mtp.0." + k] = v.grad.detach().clone()
                v.requires_grad_(False)
        model.zero_grad(set_to_none=True)
    save_file({k: v.contiguous() for k, v in grads.items()}, os.path.join(d, "grads.safetensors"),
              metadata={"format": "pt", "mtp_lambda": str(MTP_LAMBDA)})


NO_DECAY = ("norm.weight", "_base", "_scale", "attn_sink", "ape")


def train_fixture(model, cfg, ids, labels, d, steps=10):
    """10 AdamW steps on the fixture batch: lr 1e-3 with 3 linear warm-up steps then cosine to 1e-4 at step 10,
    betas (0.9, 0.95), eps 1e-8, weight decay 0.1 except on norms, biases, sinks, mHC base/scale; gradients
    clipped to global norm 1.0. Parameters without a gradient (indexer, buffers) are not touched, as in torch."""
    import copy
    m = copy.deepcopy(model)
    decay, no_decay = [], []
    for name, p in m.named_parameters():
        n = canonical(name) if not name.endswith(("gate_up_proj", "down_proj")) else name
        (no_decay if n.endswith(NO_DECAY) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):  # step = number of completed updates
        if step < 3:
            return (step + 1) / 3
        prog = (step - 3) / (steps - 3)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses, lrs, norms = [], [], []
    with torch.enable_grad():
        for step in range(steps + 1):
            opt.zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=labels, use_cache=False)
            losses.append(out.loss.item())
            if step == steps:
                break
            out.loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    save_file({"loss": torch.tensor(losses, dtype=torch.float64), "lr": torch.tensor(lrs, dtype=torch.float64),
               "grad_norm": torch.tensor(norms, dtype=torch.float64)},
              os.path.join(d, "train.safetensors"), metadata={"format": "pt"})
    print(f"train: losses {[round(x, 5) for x in losses]}")


def adamw_fixture(outdir):
    """torch.optim.AdamW on two synthetic tensors with given gradients: a decayed [7, 13] weight and a
    non-decayed [13] vector, 10 steps, lr schedule as train_fixture, global-norm clipping at 1.0."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(7, 13, generator=gen, dtype=torch.float32).requires_grad_(True)
    v = torch.randn(13, generator=gen, dtype=torch.float32).requires_grad_(True)
    rec = {"w.0": w.detach().clone(), "v.0": v.detach().clone()}
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [v], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(10):
        gw = torch.randn(7, 13, generator=gen) * (0.2 + step)  # growing gradients: clipping engages
        gv = torch.randn(13, generator=gen) * 0.5
        rec[f"gw.{step}"], rec[f"gv.{step}"] = gw.clone(), gv.clone()
        w.grad, v.grad = gw.clone(), gv.clone()
        rec[f"norm.{step}"] = torch.nn.utils.clip_grad_norm_([w, v], 1.0).reshape(1).float()
        opt.step()
        rec[f"w.{step + 1}"], rec[f"v.{step + 1}"] = w.detach().clone(), v.detach().clone()
    save_file(rec, os.path.join(outdir, "adamw.safetensors"),
              metadata={"format": "pt", "lr": "0.01", "betas": "0.9,0.95", "eps": "1e-8", "weight_decay": "0.1",
                        "clip": "1.0", "steps": "10"})


def run_config(name, cfg, outdir, B, S, seed, mtp=True, hf_names=False, shard=None, legacy_json=None):
    for attempt in range(50):
        gen = torch.Generator().manual_seed(seed + 1000 * attempt)
        torch.manual_seed(seed + 1000 * attempt)
        model = DeepseekV4ForCausalLM(cfg).float().eval()
        std = cfg.initializer_range
        for pname, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        randomise_zero_inits(model, cfg, gen)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        labels = ids.clone()
        labels[0, 3] = -100
        labels[-1, S // 2] = -100
        captured = {}
        hooks = [layer.register_forward_hook(lambda m, i, o, l=l: captured.__setitem__(l, o.detach().clone()))
                 for l, layer in enumerate(model.model.layers)]
        with TieWatch() as tw:
            out = model(input_ids=ids, labels=labels, use_cache=False)
        for h in hooks:
            h.remove()
        print(f"{name}: attempt {attempt} min relative top-k gap {tw.min_gap:.3g}")
        if tw.min_gap > 1e-4:
            break
    else:
        raise SystemExit(f"{name}: could not find a seed without top-k near-ties")

    d = os.path.join(outdir, name)
    os.makedirs(d, exist_ok=True)
    if hf_names:
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(d)
    else:
        model.save_pretrained(d, max_shard_size=shard) if shard else model.save_pretrained(d)
    io = {"input_ids": ids.contiguous(), "labels": labels.contiguous(),
          "logits": out.logits.float().contiguous(), "loss": out.loss.float().reshape(1)}
    for l, h in captured.items():
        io[f"hidden.{l}"] = h.float().contiguous()
    if mtp:
        gen2 = torch.Generator().manual_seed(seed + 7)
        layer, extra, mtp_tensors, _ = build_mtp(model, cfg, gen2, cfg.initializer_range)
        final_streams = captured[cfg.num_hidden_layers - 1]
        with TieWatch() as tw:
            mtp_logits = mtp_forward(model, cfg, layer, extra, ids, final_streams)
        print(f"{name}: mtp min relative top-k gap {tw.min_gap:.3g}")
        assert tw.min_gap > 1e-4, "MTP router near-tie: change the seed"
        io["mtp_logits"] = mtp_logits.float().contiguous()
        mtp_parts = (layer, extra)
        # loss of position i against t_{i+2}; positions whose target falls off the end are dropped
        tgt = labels[:, 2:]
        mtp_loss = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, cfg.vocab_size), tgt.reshape(-1), ignore_index=-100)
        io["mtp_loss"] = mtp_loss.float().reshape(1)
        # append the mtp.* tensors to the (single-file) checkpoint
        path = os.path.join(d, "model.safetensors")
        assert os.path.exists(path), "MTP weights go into a single-file checkpoint"
        sd = load_file(path)
        sd.update({k: v.contiguous() for k, v in mtp_tensors.items()})
        save_file(sd, path, metadata={"format": "pt"})
    save_file(io, os.path.join(d, "io.safetensors"), metadata={"format": "pt"})
    record_grads(model, cfg, ids, labels, mtp_parts if mtp else None, d)
    if name == "tiny_a":
        train_fixture(model, cfg, ids, labels, d)
    if legacy_json is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(legacy_json, f, indent=2)
    names = []
    for fn in sorted(os.listdir(d)):
        if fn.startswith("model") and fn.endswith(".safetensors"):
            names += [f"{fn}\t{k}\t{list(v.shape)}\t{v.dtype}" for k, v in load_file(os.path.join(d, fn)).items()]
    with open(os.path.join(d, "names.txt"), "w") as f:
        f.write("\n".join(sorted(names)) + "\n")
    with open(os.path.join(d, "resolved_config.json"), "w") as f:
        json.dump({k: cfg.to_dict().get(k) for k in ("layer_types", "mlp_layer_types", "compress_rates",
                                                     "rope_parameters", "partial_rotary_factor")}, f, indent=1)
    print(f"{name}: loss {out.loss.item():.6f} logits max {out.logits.abs().max().item():.4f}",
          f"mtp_loss {io['mtp_loss'].item():.6f}" if mtp else "")


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    os.makedirs(outdir, exist_ok=True)
    cfg_a = DeepseekV4Config(**TINY_A)
    run_config("tiny_a", cfg_a, outdir, B=2, S=37, seed=1, mtp=True)

    # legacy spelling: let transformers itself fold the JSON, then write that same JSON back
    tmp = os.path.join(outdir, "_legacy_b")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(TINY_B_JSON, f)
    cfg_b = DeepseekV4Config.from_pretrained(tmp)
    print("tiny_b resolved:", cfg_b.layer_types, cfg_b.mlp_layer_types, cfg_b.compress_rates, cfg_b.rope_parameters)
    run_config("tiny_b", cfg_b, outdir, B=3, S=40, seed=2, mtp=False, shard="100KB", legacy_json=TINY_B_JSON)
    os.remove(os.path.join(tmp, "config.json"))
    os.rmdir(tmp)

    cfg_hf = DeepseekV4Config(**TINY_HF)
    run_config("tiny_hf", cfg_hf, outdir, B=2, S=11, seed=3, mtp=False, hf_names=True)
    adamw_fixture(outdir)


if __name__ == "__main__":
    main()
