-- dist_data_parallel.lua — data parallelism by hand: N ranks, each with some of the batch's rows (4 ranks: one each;
-- 2 ranks: 1 and 3 rows, unequal on purpose), all-reduce their gradients (ds4.dist.all_reduce_grads) and step AdamW,
-- with the MTP loss (λ = 0.3) and the indexer KL loss (1.0) on, and labels masked unevenly, so that the three parts
-- of the loss have different counts on every rank; and the router-bias balancing on (γ = 1e-3), whose update after
-- each step must see the global batch's expert loads (all_reduce_grads sums them over the ranks): a rank that used
-- its own loads would move its biases by up to 2γ from the others' and from acc's. Every rank also trains two more copies in the same process:
--   acc   one process accumulating the ranks' micro-batches in rank order (the same normalisation): the DP result
--         must be the same BITS (the backward adds its gradient once, and the ranks' gradients are summed in rank
--         order: ((G1 + G2) + G3) + G4 either way; docs/distributed.md, "Bitwise data parallelism"). Not checked for
--         4 ranks on GPUs: NCCL's sum order is its own (with 2 ranks it is one addition, so the same bits);
--   ref   one forward over the whole batch with the default backward (each part the mean over its own count): the
--         independent reference, within bounds (below).
--
-- Normalisation: each part is normalised by its own GLOBAL count, counts all-reduced: model:backward{ce = 1/N,
-- mtp = λ/M, ikl = κ/Q} with N the scored tokens, M the MTP-scored tokens, Q the indexer's queries of the global batch.
--
-- Bound against ref, at step 1 (the same weights on both sides): the same fp32 terms grouped differently (per
-- micro-batch, then summed): gradient rel ≤ 2e-6 per tensor (measured ~3e-7; for scale, permuting the batch's rows
-- gives 5.7e-7), the loss within 1e-6 relative, and the weights after the update |Δw| ≤ 5e-5 = lr / 20 (AdamW's first
-- update is ~lr·sign(g), so a near-zero gradient element's last bits move it the most). A wrong normalisation (a
-- missing 1/N, a per-rank mean, MTP divided by the main count) is off by factors of 1.3 to 4 on some tensor: rel ≥
-- 0.2, far outside. Later steps are compared with acc only: with the indexer trained by its KL loss, its top-k picks
-- (a discrete choice) flip under last-bit weight differences, and ref's gradients then move by up to 1e-2 (measured),
-- a discontinuity, not an error; acc must stay the same bits through all K steps.
--
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): the copies live on this rank's GPU
-- (ds4.dist.init{device = "cuda"}, fp32 mode) and the gradients are all-reduced there through NCCL.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local dir = H.fixtures() .. "/tiny_a"
local B, S, V, K = 4, 37, 256, 3
assert(n == 1 or n == 2 or n == 4, "the test's batch of 4 rows is split for 1, 2 or 4 ranks")

-- The global batch: the same on every rank (a fixed LCG), each row fully scored (labels = ids, HF shift inside).
local rows = H.lcg_rows(12345, B, S, V)
-- labels: row b's first 3·b positions unscored (the main and MTP counts then differ from row to row)
local lrows = {}
for b = 1, B do
    lrows[b] = {}
    for s = 1, S do lrows[b][s] = s <= 3 * b and -100 or rows[b][s] end
end
local batch = H.batch
local all_ids, all_labels = batch(rows, 1, B), batch(lrows, 1, B)
local split = ({ [1] = { 4 }, [2] = { 1, 3 }, [4] = { 1, 1, 1, 1 } })[n] -- rows per rank
local firsts = { 1 }
for k = 1, n do firsts[k + 1] = firsts[k] + split[k] end
local mb = {} -- every rank's micro-batch: {ids, labels}
for k = 1, n do mb[k] = { batch(rows, firsts[k], split[k]), batch(lrows, firsts[k], split[k]) } end
local my_ids, my_labels = mb[r + 1][1], mb[r + 1][2]

local function opts() return { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 } end
local LAMBDA, KAPPA = 0.3, 1.0
local ref, dp, acc = ds4.load(dir), ds4.load(dir), ds4.load(dir)
for _, m in ipairs({ ref, dp, acc }) do
    m:set_train_options({ mtp_lambda = LAMBDA, indexer_kl = KAPPA, router_bias_gamma = 1e-3 })
    if on_device then m:to(ds4.dist.device(), "fp32") end
end
if on_device then H.eq(ds4.dist.device():match("^cuda:%d+$") ~= nil, true, "ds4.dist.device() names this rank's GPU") end
local ref_opt, dp_opt, acc_opt = ds4.adamw(ref, opts()), ds4.adamw(dp, opts()), ds4.adamw(acc, opts())
local bitwise = not on_device or n <= 2

local diff = H.f32_diff

-- the number of elements of a and b (F32 tensors of equal size) that differ
local function differ(a, b)
    local pa, pb = ffi.cast("const float *", a:data_ptr()), ffi.cast("const float *", b:data_ptr())
    local c = 0
    for i = 0, b:numel() - 1 do
        if pa[i] ~= pb[i] then c = c + 1 end
    end
    return c
end

local worst_g, worst_w, bits_g, bits_w = 0, 0, 0, 0
for k = 1, K do
    ref:zero_grad()
    local out_ref = ref:forward(all_ids, { labels = all_labels })
    ref:backward()
    dp:zero_grad()
    local out = dp:forward(my_ids, { labels = my_labels })
    -- each part's global count, from the ranks (not from an assumption)
    local cnt = ds4.dist.all_reduce(ds4.tensor({ out.loss_tokens, out.mtp_loss_tokens, out.indexer_queries }, "F64"))
    local N, M, Q = cnt[1], cnt[2], cnt[3]
    H.eq(N, out_ref.loss_tokens, "global scored tokens = the whole batch's")
    H.eq(M, out_ref.mtp_loss_tokens, "global MTP tokens = the whole batch's")
    H.eq(Q, out_ref.indexer_queries, "global indexer queries = the whole batch's")
    local scales = { ce = 1 / N, mtp = LAMBDA / M, ikl = KAPPA / Q }
    dp:backward(scales)
    ds4.dist.all_reduce_grads(dp)
    -- one process accumulating the ranks' micro-batches in rank order, with the same normalisation
    acc:zero_grad()
    for q = 1, n do
        acc:forward(mb[q][1], { labels = mb[q][2] })
        acc:backward(scales)
    end
    -- the global loss the same way: the CE part sum of n_r * loss_r over N (out.loss holds CE + λ·MTP)
    local l = ds4.dist.all_reduce(ds4.tensor({ (out.loss - LAMBDA * out.mtp_loss) * out.loss_tokens,
        out.mtp_loss * out.mtp_loss_tokens }, "F64"))
    if k == 1 then H.near(l[1] / N + LAMBDA * l[2] / M, out_ref.loss, 1e-6 * math.abs(out_ref.loss), "global loss") end

    local gmax, grel = 0, 0
    local gd, gr, ga = dp:grads({ canonical = true }), ref:grads({ canonical = true }), acc:grads({ canonical = true })
    for name, g in pairs(gr) do
        local m, rel = diff(gd[name], g)
        gmax = math.max(gmax, m)
        if rel == rel then grel = math.max(grel, rel) end -- NaN: a tensor whose reference gradient is all zero
        if rel ~= rel then H.eq(m, 0, "zero gradient of " .. name .. " stays zero") end
        if bitwise then bits_g = bits_g + differ(gd[name], ga[name]) end
    end
    if os.getenv("DS4_TEST_VERBOSE") and r == 0 then print(("step %d: gradient rel %.3g"):format(k, grel)) end
    if k == 1 then
        worst_g = grel
        H.check(grel <= 2e-6, ("all-reduced gradients vs the whole batch's: rel %.3g (max |Δ| %.3g)"):format(grel, gmax))
    end
    ref_opt:step()
    dp_opt:step()
    acc_opt:step()
    if k == 1 then
        worst_w = diff(dp:params(), ref:params())
        H.check(worst_w <= 5e-5, ("weights max |Δ| %.3g after one update vs one process on the whole batch"):format(worst_w))
    end
    if bitwise then bits_w = bits_w + differ(dp:params(), acc:params()) end
end
if bitwise then
    H.eq(bits_g, 0, "gradients that differ from one process accumulating the same micro-batches")
    H.eq(bits_w, 0, "weights that differ from one process accumulating the same micro-batches")
end
-- the ranks hold the same weights (broadcast rank 0's and compare)
local w = dp:params()
local w0 = ds4.dist.broadcast(w:clone(), 0)
H.eq((diff(w, w0)), 0, "every rank's weights equal rank 0's")
if r == 0 then
    print(("dist_data_parallel: %d ranks (%s, %s), %d steps, MTP and indexer KL on: vs the whole batch gradient "
        .. "rel %.3g, weight |Δ| %.3g (step 1); vs one process accumulating the micro-batches %s"):format(n,
        ds4.dist.backend(), ds4.dist.device(), K, worst_g, worst_w, bitwise and ("%d gradients and %d weights differ")
        :format(bits_g, bits_w) or "not compared (NCCL's order)"))
end
ds4.dist.finalize()
H.done("dist_data_parallel rank " .. r .. " of " .. n)
