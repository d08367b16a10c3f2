-- dist_data_parallel_lora.lua — data parallelism by hand with LoRA adapters (run with the argument "lora"): N ranks, each with some of the batch's rows (4 ranks: one each;
-- 2 ranks: 1 and 3 rows, unequal on purpose), all-reduce their
-- gradients (ds4.dist.all_reduce_grads) and step AdamW; every rank also trains a second copy of the model on the
-- whole batch alone (the single-process reference, computed in the same process, independent of MPI). After each
-- of K steps the all-reduced gradients and the weights must match the reference's.
--
-- Normalisation: the loss of a forward is the mean over its scored tokens. A rank's loss is the mean over its
-- n_r tokens, the batch's over N = sum n_r, so dL/dθ = sum_r (n_r / N) dL_r/dθ: each rank's gradient is
-- scaled by n_r / N before the sum (all_reduce_grads(model, n_r / N)). MTP's loss is a mean over its own tokens
-- (S - 2 per row); every row is fully scored, so its ratio m_r / M equals n_r / N (= rows_r / B) too.
--
-- Bound: the reference sums each gradient over all B·S positions in the engine's order; DP sums per-rank partial
-- sums, MPI adds N of them, then one multiply by n_r / N: the same fp32 terms in another order. Step 1 (same
-- weights on both sides) measures that alone: gradient rel ≤ 2e-6 per tensor (measured 3.3e-7 on 2 ranks; for
-- scale, one process summing the two half-batch gradients in double gives 3.2e-7 against the whole batch, and
-- permuting the batch's rows 5.7e-7). Later steps start from weights that already differ by that much, and AdamW
-- (g / sqrt(v)) turns a tiny relative change of a near-zero gradient into an update change of up to ~lr, so the
-- bounds widen: gradient rel ≤ 5e-5, weights |Δw| ≤ 5e-5 = lr / 20 after K = 3 steps (measured 5.8e-6 and
-- 1.2e-5 on 4 ranks). A wrong normalisation (a missing 1/N, or n_r / N left out) is off by a factor of 2 to 4:
-- gradient rel ≥ 0.5, far outside either bound (weights alone would not show it: Adam is scale-invariant).
--
-- With the argument "lora" after the fixtures both copies carry the same rank-4 LoRA adapters (attention, shared and
-- routed experts), so only they train: all_reduce_grads sums the adapters' gradient buffer, and the adapters'
-- gradients (lora_grads) and values (lora_tensors) are compared under the same bounds by the same argument (their
-- gradients are sums over the same positions; the frozen weights must stay bitwise what they were). At step 1 every
-- B is 0, so every A's gradient is exactly 0 on both sides (checked: a zero stays zero).
--
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): both copies live on this rank's GPU
-- (ds4.dist.init{device = "cuda"}, fp32 mode) and the gradients are all-reduced there through NCCL. The same bounds
-- hold by the same argument: the CUDA backend's sums are fixed-order fp32 too, and differ from the whole batch's
-- only in how the tokens are grouped.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local lora = arg[2] == "lora"
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local dir = H.fixtures() .. "/tiny_a"
local B, S, V, K = 4, 37, 256, 3
assert(n == 1 or n == 2 or n == 4, "the test's batch of 4 rows is split for 1, 2 or 4 ranks")

-- The global batch: the same on every rank (a fixed LCG), each row fully scored (labels = ids, HF shift inside).
local rows = H.lcg_rows(12345, B, S, V)
local all_ids = H.batch(rows, 1, B)
local split = ({ [1] = { 4 }, [2] = { 1, 3 }, [4] = { 1, 1, 1, 1 } })[n] -- rows per rank
local first = 1
for k = 1, r do first = first + split[k] end
local my_ids = H.batch(rows, first, split[r + 1])

local function opts() return { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 } end
local ref, dp = ds4.load(dir), ds4.load(dir)
if lora then
    ref:lora{ rank = 4, seed = 7 }
    dp:lora{ rank = 4, seed = 7 }
end
local frozen = dp:params()
-- what trains: the adapters with LoRA, else the weights
local function trained(m) return lora and m:lora_tensors() or { all = m:params() } end
local function grads(m) return lora and m:lora_grads() or m:grads({ canonical = true }) end
if on_device then
    H.eq(ds4.dist.device():match("^cuda:%d+$") ~= nil, true, "ds4.dist.device() names this rank's GPU")
    ref:to(ds4.dist.device(), "fp32")
    dp:to(ds4.dist.device(), "fp32")
end
local ref_opt, dp_opt = ds4.adamw(ref, opts()), ds4.adamw(dp, opts())

-- max |a - b| and ‖a − b‖ / ‖b‖ over two F32 tensors of equal size
local function diff(a, b)
    local pa, pb = ffi.cast("const float *", a:data_ptr()), ffi.cast("const float *", b:data_ptr())
    local mx, dd, bb = 0, 0, 0
    for i = 0, b:numel() - 1 do
        local e = math.abs(pa[i] - pb[i])
        if e > mx then mx = e end
        dd, bb = dd + e * e, bb + pb[i] * pb[i]
    end
    return mx, math.sqrt(dd) / math.sqrt(bb)
end

local worst_g, worst_w = 0, 0
for k = 1, K do
    ref:zero_grad()
    local out_ref = ref:forward(all_ids, { labels = all_ids })
    ref:backward()
    dp:zero_grad()
    local out = dp:forward(my_ids, { labels = my_ids })
    dp:backward()
    -- token-mean over the global batch: the global count comes from the ranks, not from an assumption
    local cnt = ds4.tensor({ out.loss_tokens }, "F64")
    ds4.dist.all_reduce(cnt)
    local N = cnt[1]
    H.eq(N, out_ref.loss_tokens, "global scored tokens = the whole batch's")
    ds4.dist.all_reduce_grads(dp, out.loss_tokens / N)
    -- the global loss the same way: sum of n_r * loss_r over N
    local l = ds4.tensor({ out.loss * out.loss_tokens }, "F64")
    ds4.dist.all_reduce(l)
    H.near(l[1] / N, out_ref.loss, 1e-6 * math.abs(out_ref.loss), "global loss, step " .. k)

    local gmax, grel = 0, 0
    local gd, gr = grads(dp), grads(ref)
    for name, g in pairs(gr) do
        local m, rel = diff(gd[name], g)
        gmax = math.max(gmax, m)
        if rel == rel then grel = math.max(grel, rel) end -- NaN: a tensor whose reference gradient is all zero
        if rel ~= rel then H.eq(m, 0, "zero gradient of " .. name .. " stays zero") end
    end
    worst_g = math.max(worst_g, grel)
    if os.getenv("DS4_TEST_VERBOSE") and r == 0 then print(("step %d: gradient rel %.3g"):format(k, grel)) end
    H.check(grel <= (k == 1 and 2e-6 or 5e-5), ("step %d: all-reduced gradients vs the whole batch's: rel %.3g (max |Δ| %.3g)"):format(
        k, grel, gmax))
    ref_opt:step()
    dp_opt:step()
    local wmax, td, tr = 0, trained(dp), trained(ref)
    for name, t in pairs(tr) do wmax = math.max(wmax, (diff(td[name], t))) end
    worst_w = math.max(worst_w, wmax)
    H.check(wmax <= 5e-5, ("step %d: weights max |Δ| %.3g vs one process on the whole batch"):format(k, wmax))
end
-- the ranks hold the same weights (broadcast rank 0's and compare)
local tw, names = trained(dp), {}
for name in pairs(tw) do names[#names + 1] = name end
table.sort(names) -- a collective per tensor: the same order on every rank
for _, name in ipairs(names) do
    local w0 = ds4.dist.broadcast(tw[name]:clone(), 0)
    H.eq((diff(tw[name], w0)), 0, "every rank's " .. name .. " equals rank 0's")
end
if lora then H.eq((diff(dp:params(), frozen)), 0, "LoRA: the frozen weights did not move") end
if r == 0 then
    print(("dist_data_parallel%s: %d ranks (%s, %s), %d steps: worst gradient rel %.3g, worst weight |Δ| %.3g"):format(
        lora and " (LoRA)" or "", n, ds4.dist.backend(), ds4.dist.device(), K, worst_g, worst_w))
end
ds4.dist.finalize()
H.done("dist_data_parallel rank " .. r .. " of " .. n)
