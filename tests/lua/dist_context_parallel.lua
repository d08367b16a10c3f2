-- dist_context_parallel.lua — context parallelism (ds4.dist.context_parallel): N ranks share two sequences of 19
-- tokens, rank r computing its contiguous slice of each (2 ranks: positions 0-9 and 10-18; 4 ranks: 0-4, 5-9, 10-14,
-- 15-18; 1 rank: all, the gathers through a world of one). tiny_a has a sliding layer, two CSA layers (rate 4,
-- overlapping windows, the indexer keeping 3 of up to 4 entries) and an HCA layer (rate 8): 19 is a multiple of
-- neither, and the slice boundaries 5, 10 and 15 fall inside compressor windows ([4, 8), [8, 12), [12, 16) and
-- [8, 16)), so windows straddle ranks. The MTP block is on (its loss with λ = 0.3), so its next-token roll crosses the
-- slice boundaries. Some labels are -100, so the token counts are not the positions. Every rank also runs a second
-- copy of the model on the whole sequences alone: the single-process reference, in the same process.
--
-- What must hold, and why:
--  * the losses (main and MTP), their token counts, and the log-probabilities of this rank's positions: bitwise equal
--    to the reference's. Every per-token layer computes this rank's rows with the same kernels on the same bits (the
--    kernels are batch invariant); each attention sub-layer runs its key side (window keys, compressors, indexer
--    entries) over the gathered whole sequence and its queries over this rank's positions only (split by query: each
--    query's attention is the same computation as in one process); and the per-row losses are summed over every
--    rank's rows in the reference's row order.
--  * the attention weights' gradients (wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, the sinks, the compressors and
--    the indexer, main blocks and the MTP block): within 1e-5 as the others below (bf16: 2^-8). Each rank's queries
--    give their part of every key's and entry's gradient; the parts are summed over the ranks in rank order (the same
--    sum on every rank) where one process adds the same terms in one running sum per key, so the sums regroup, and
--    the key side's backward, run alike on every rank, carries that into wkv, kv_norm and the compressors (added by
--    rank 0 only); the query side's weights are each rank's sum over its queries, added by the all-reduce. With the
--    script's argument "whole" (ds4.dist.context_parallel(model, {whole_attention = true})) every rank runs each
--    attention sub-layer over the whole sequences instead: bitwise equal after the all-reduce (fp32). Rank 0 runs
--    the whole sequence's attention backward on the gathered output gradients (themselves bitwise the reference's),
--    the other ranks add none, and the all-reduce adds their zeros.
--  * every other gradient (per-token layers: embedding, mHC, norms, MoE, head, the MTP projections): within 2e-6
--    ("whole") or 1e-5 (split by query: the regrouped key gradients above reach every activation gradient below an
--    attention sub-layer, ~1e-7 relative each, and the blocks' backwards carry them on; measured 1.7e-6 at 4 ranks, the mHC
--    scale of a middle layer, whose gradient sums signed terms over every token; 2e-7 with whole-sequence attention)
--    per tensor of the reference's, relative to Σ_r ‖rank r's part‖ (its gradient before the all-reduce). Each rank
--    sums its own rows' terms, the all-reduce adds the ranks' sums: the same fp32 terms grouped per rank (as data
--    parallelism against the whole batch, docs/distributed.md). Not bitwise: see "Context parallelism" there. The
--    scale is the parts', not their sum's: the parts may cancel (a tensor whose ranks' parts are ±0.0246 sums to
--    7.5e-5), and regrouping fp32 sums errs by fractions of the terms, not of the result.
--  * normalisation: the forward returns the whole sequence's token counts on every rank, so model:backward() takes
--    1 / (global count) (and the MTP term λ / its global count), and all_reduce_grads takes scale 1 (another refused).
--
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): both copies on this rank's GPU
-- (ds4.dist.init{device = "cuda"}) in DS4_TEST_DTYPE (fp32, the default, or bf16), the attention rows gathered and the
-- key side's gradient parts summed through NCCL (split by query; "whole": every rank runs each attention sub-layer over
-- the whole sequences, keeping its rows). The reference is the same GPU's kernels on the whole sequences. The forward
-- kernels are batch invariant in both modes (docs/design.md, "Batch invariance"), so the losses, counts and
-- log-probabilities stay bitwise. fp32, "whole": the backward's products are ds4's tiles, whose reduction order
-- depends on the reduction length alone on tiny_a's shapes (no reduction longer than 256, so no split:
-- cuda/cuda_bwd_linear.cu), so the activation gradients, and the attention weights' gradients rank 0 computes from
-- them, are bitwise too; the rest as on the CPU (2e-6); split by query as on the CPU (1e-5). bf16: the backward's
-- plain products go through cuBLAS, whose order may depend on the row count (a rank's slice is not the whole
-- sequence), so an output gradient may differ in its last fp32 bits and then round to another bf16 value where it
-- enters a product: every gradient within 2^-8 (3.9e-3) relative to the parts' scale, bf16's unit roundoff (8
-- significant bits: what one rounding of every term would cost at most). Split by query the regrouped key gradients
-- (~1e-7) cross rounding boundaries that way too, in every layer's products below; measured at most 5.8e-4 on 2
-- ranks and 2.0e-3 on 4 (layer 0's wkv in step 2, the last reached). The measured values are printed.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local whole = arg[2] == "whole" -- attention over the whole sequences on every rank
assert(arg[2] == nil or whole, "usage: dist_context_parallel.lua FIXTURES [whole]")
local dtype = os.getenv("DS4_TEST_DTYPE") or "fp32"
assert(dtype == "fp32" or dtype == "bf16", "DS4_TEST_DTYPE: fp32 or bf16")
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local dir = H.fixtures() .. "/tiny_a"
local B, S, V = 2, 19, 256
assert(n == 1 or n == 2 or n == 4, "the test splits 19 positions over 1, 2 or 4 ranks")

local rnd = H.lcg(1313)
local rows, lab = {}, {}
for b = 1, B do
    rows[b] = H.random_ids(rnd, S, V)
    lab[b] = {}
    for s = 1, S do lab[b][s] = rows[b][s] end
end
lab[1][7], lab[2][12], lab[2][19] = -100, -100, -100 -- unscored positions, one at a slice edge on 2 ranks
local ids, labels = ds4.tensor(rows, "I64"), ds4.tensor(lab, "I64")
-- this rank's positions: the contiguous shard of S (S / n each, the first S % n one more)
local base, extra = math.floor(S / n), S % n
local off = r * base + math.min(r, extra)
local len = base + (r < extra and 1 or 0)

local ref, cp = ds4.load(dir), ds4.load(dir)
if on_device then
    ref:to(ds4.dist.device(), dtype)
    cp:to(ds4.dist.device(), dtype)
end
local bf16 = on_device and dtype == "bf16"
-- attention: bitwise where every rank runs it over the whole sequence ("whole", fp32), else split by query
local whole_rows = whole
local attn_tol = bf16 and 2 ^ -8 or (whole_rows and 0 or 1e-5)
local other_tol = bf16 and 2 ^ -8 or (whole_rows and 2e-6 or 1e-5)
local opt = ds4.adamw(ref, { lr = 1e-2 })
local topt = { mtp_lambda = 0.3 }
ref:set_train_options(topt)
cp:set_train_options(topt)
ds4.dist.context_parallel(cp, whole and { whole_attention = true } or nil)

-- refusals, before anything runs (every rank refuses alike, so no collective is left waiting)
H.raises(function() cp:forward(ids, { labels = labels }) end, { "context parallel", "logits" },
    "logits as an output under context parallelism")
H.raises(function() cp:forward(ds4.tensor({ H.slice(rows[1], 1, 2 * n - 1) }, "I64"), { logits = false,
    labels = ds4.tensor({ H.slice(rows[1], 1, 2 * n - 1) }, "I64") }) end, { "context parallel", "at least 2 positions" },
    "fewer than 2 positions per rank")
H.raises(function() ds4.dist.expert_parallel(cp) end, { "context parallel" }, "expert parallelism on top")
H.raises(function() cp:step({ cp:new_cache(8) }, { { 5, 6, 7 } }) end, { "context parallel" },
    "decoding under context parallelism")

local function f32_at(t, i) return ffi.cast("const float *", t:data_ptr())[i] end
local attn_names, other_names, worst_rel, worst_attn = 0, 0, 0, 0
-- every rank's Σ over the ranks of ‖its part‖ of each tensor (names in one order on every rank: the all-reduce's)
local function part_norms(m)
    local g, names = m:grads({ canonical = true }), {}
    for name in pairs(g) do names[#names + 1] = name end
    table.sort(names)
    local norms = ds4.zeros({ #names }, "F64")
    local p = ffi.cast("double *", norms:data_ptr())
    for i, name in ipairs(names) do
        local x, s = ffi.cast("const float *", g[name]:data_ptr()), 0
        for j = 0, g[name]:numel() - 1 do s = s + x[j] * x[j] end
        p[i - 1] = math.sqrt(s)
    end
    local sum, out = ds4.dist.all_reduce(norms), {}
    for i, name in ipairs(names) do out[name] = sum[i] end
    return out
end
for step = 1, 2 do
    ref:zero_grad()
    local out_ref = ref:forward(ids, { labels = labels, logits = false })
    local lp_ref = ref:logprobs()
    -- step 1: the loss's backward (CE + λ·MTP, normalised by the global counts); step 2: the per-token path RL takes,
    -- dlogp = -1/N at every scored position (backward_logprobs; this rank passes its positions' values)
    local g_ref, g_cp
    if step == 2 then
        g_ref, g_cp = ds4.zeros({ B, S }, "F32"), ds4.zeros({ B, len }, "F32")
        local pr, pc = ffi.cast("float *", g_ref:data_ptr()), ffi.cast("float *", g_cp:data_ptr())
        for b = 0, B - 1 do
            for s = 0, S - 2 do
                if lab[b + 1][s + 2] ~= -100 then pr[b * S + s] = -1 / out_ref.loss_tokens end
            end
            for i = 0, len - 1 do pc[b * len + i] = pr[b * S + off + i] end
        end
        ref:backward_logprobs(g_ref)
    else
        ref:backward()
    end
    cp:zero_grad()
    local out = cp:forward(ids, { labels = labels, logits = false })
    local lp = cp:logprobs()
    -- losses and counts: the whole sequence's, on every rank, bitwise
    H.eq(out.loss_tokens, out_ref.loss_tokens, "step " .. step .. ": scored tokens = the whole sequence's")
    H.eq(out.mtp_loss_tokens, out_ref.mtp_loss_tokens, "step " .. step .. ": MTP scored tokens = the whole sequence's")
    H.eq(out.mtp_loss, out_ref.mtp_loss, "step " .. step .. ": MTP loss bitwise")
    H.eq(out.loss, out_ref.loss, "step " .. step .. ": loss (CE + λ·MTP) bitwise")
    -- log-probabilities of this rank's positions: max |Δ| = 0
    H.eq(lp:shape()[2], len, "logprobs hold this rank's positions")
    local dmax = 0
    for b = 0, B - 1 do
        for i = 0, len - 1 do
            local d = math.abs(f32_at(lp, b * len + i) - f32_at(lp_ref, b * S + off + i))
            if not (d <= dmax) then dmax = d end
        end
    end
    H.eq(dmax, 0, ("step %d: log-probabilities of positions %d..%d max |Δ| = 0"):format(step, off, off + len - 1))
    if step == 2 then cp:backward_logprobs(g_cp) else cp:backward() end
    H.raises(function() ds4.dist.all_reduce_grads(cp, 0.5) end, { "context parallel", "scale" },
        "all_reduce_grads with a scale under context parallelism")
    local parts = part_norms(cp)
    ds4.dist.all_reduce_grads(cp)
    local gc, gr = cp:grads({ canonical = true }), ref:grads({ canonical = true })
    for name, g in pairs(gr) do
        local mx, rel_sum, norm2 = H.f32_diff(gc[name], g)
        local d = mx == 0 and 0 or rel_sum * math.sqrt(norm2) -- ‖Δ‖ (NaN stays NaN)
        local rel = parts[name] > 0 and d / parts[name] or d
        if name:find("%.attn%.") then
            attn_names = attn_names + (norm2 > 0 and 1 or 0)
            if not (rel <= worst_attn) then worst_attn = rel end
            if attn_tol == 0 then
                H.eq(mx, 0, ("step %d: %s bitwise equal (rank 0's whole-sequence attention backward)"):format(step, name))
            else
                H.check(rel <= attn_tol, ("step %d: %s %.3g relative to the parts (max |Δ| %.3g)"):format(step, name,
                    rel, mx))
            end
        else
            other_names = other_names + 1
            if norm2 > 0 then
                if not (rel <= worst_rel) then worst_rel = rel end
                H.check(rel <= other_tol, ("step %d: %s %.3g relative to the parts (max |Δ| %.3g)"):format(step, name,
                    rel, mx))
            else
                H.eq(mx, 0, ("step %d: zero gradient of %s stays zero"):format(step, name))
            end
        end
    end
    -- the next step from other weights, the same on both copies (an AdamW step of the reference's gradient), both
    -- given the same host values (on a bf16 GPU both working copies then come from the same host rounding)
    opt:step()
    local w = ref:params()
    ref:set_params(w)
    cp:set_params(w)
end
H.check(attn_names > 20 and other_names > 20, "non-zero attention and per-token gradients were compared")
-- off again: a plain forward of the whole sequence on one rank equals the reference
ds4.dist.context_parallel(cp, false)
local o1 = cp:forward(ids, { labels = labels, logits = false, train = false })
local o2 = ref:forward(ids, { labels = labels, logits = false, train = false })
H.eq(o1.loss, o2.loss, "context parallelism off: the whole sequence again")
if r == 0 then
    print(("dist_context_parallel: %d ranks (%s, %s%s, attention %s), 2 sequences of %d split %s: losses, counts and log-probabilities bitwise, attention gradients %s, other gradients worst %.3g (relative to the ranks' parts)"):format(
        n, ds4.dist.backend(), ds4.dist.device(), on_device and " " .. dtype or "",
        whole_rows and "whole on every rank" or "split by query", S,
        n == 1 and "not at all" or n == 2 and "10 + 9" or "5 + 5 + 5 + 4",
        worst_attn == 0 and "bitwise" or ("worst %.3g"):format(worst_attn), worst_rel))
end
ds4.dist.finalize()
H.done("dist_context_parallel rank " .. r .. " of " .. n)
