-- dist_buckets.lua FIXTURES — the gradient reduction overlapped with the backward (ds4.dist.overlap_backward, buckets
-- of ds4.dist.bucket_mb) and ZeRO-1's reduce-scatter (ds4.dist.shard_optimizer(opt, {reduce_scatter = true})) on N
-- CPU ranks, run by tests/test_dist_mpi.sh and tests/test_dist_tcp.sh (and, DS4_TEST_DEVICE=cuda, by
-- tests/test_dist_nccl.sh on GPUs).
--
-- Every rank trains copies of tiny_a data-parallel, MTP on (λ 0.3), 2 micro-batches per rank accumulated (so the
-- step's last backward adds set-aside gradients back, region by region), 3 steps, clipping active:
--   plain       today's path: bucket_mb 0, one all-reduce after the backward (the reference)
--   b<size>     overlap_backward before each step's last backward, buckets of 0.01 MiB (2,621 elements: smaller
--               than any block, boundaries inside parameters), 0.37 MiB (boundaries inside some parameters) and
--               25 MiB (one bucket, the whole buffer)
--   zero        ZeRO-1 as today (all-reduce, then the sharded step)
--   zero_rs     ZeRO-1 with the reduce-scatter, unbucketed
--   zero_rs_b   ZeRO-1 with the reduce-scatter in 0.01 MiB buckets overlapped with the backward
-- The bucketed copies' summed gradients and weights must equal plain's bit for bit after every step (host ranks: the
-- rank-order sum of every element is formed whole in one bucket; NCCL: bitwise for 2 ranks; beyond, where NCCL's
-- order depends on the sizes, gradients within norm rel 1e-6 and weights within 2 lr per step), the reduce-scatter
-- copies' weights and gradient norms zero's (each rank's optimizer reads only its region, whose sums are the same
-- bits; NCCL over more than 2 ranks: within the same bounds), and their gradients outside the rank's region must
-- differ from the summed ones (the reduce-scatter did not sum them: the test would not notice an all-reduce otherwise;
-- except on the TCP star's rank 0, which forms every sum; NCCL over more than 2 ranks: by more than its summation
-- order can make, as ncclReduce's sums may differ from ncclAllReduce's in the last bits inside the region too). And a
-- rank that runs no backward after overlap_backward sends its buffer in the same buckets (the others' sums are
-- plain's).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local bitwise = not on_device or n <= 2
local fixture = H.fixtures() .. "/tiny_a"
local S, V, M, STEPS, LAMBDA = 37, 256, 2, 3, 0.3
local LR = 2e-3
local rows = H.lcg_rows(777, n * M, S, V)
local mine = {} -- this rank's micro-batches: rows r·M + 1 .. r·M + M
for k = 1, M do mine[k] = H.batch(rows, r * M + k, 1) end
local N = n * M * (S - 1) -- the global batch's scored tokens (labels = ids)

local function opts() return { lr = LR, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 0.05 } end
local function load()
    local m = ds4.load(fixture)
    m:set_train_options({ mtp_lambda = LAMBDA })
    if on_device then m:to(ds4.dist.device(), "fp32") end
    return m
end

-- two {name = F32 tensor} tables, or two F32 tensors: the elements that differ (bitwise), the largest difference and
-- the norm of the difference relative to b's
local function compare(a, b)
    local acc = { differ = 0, max = 0, dd = 0, bb = 0 }
    local function one(x, y)
        local px, py = ffi.cast("const float *", x:data_ptr()), ffi.cast("const float *", y:data_ptr())
        for i = 0, x:numel() - 1 do
            local e = math.abs(px[i] - py[i])
            if px[i] ~= py[i] then acc.differ = acc.differ + 1 end
            if not (e <= acc.max) then acc.max = e end
            acc.dd, acc.bb = acc.dd + e * e, acc.bb + py[i] * py[i]
        end
    end
    if type(a) == "table" then
        for k, t in pairs(b) do one(a[k], t) end
    else
        one(a, b)
    end
    acc.rel = math.sqrt(acc.dd) / math.max(math.sqrt(acc.bb), 1e-30)
    return acc
end

-- NCCL over more than 2 ranks sums in an order that depends on the buffer's size and offset, so there the summed
-- gradients may differ in the last bits (norm rel 1e-6), and the weights by what AdamW makes of that: a last-bit
-- change of a near-zero gradient can turn its update around, at most 2 lr per step
local function agree(acc, what, weights)
    if bitwise then
        H.eq(acc.differ, 0, what .. ": elements that differ")
    elseif weights then
        H.check(acc.max <= 2 * LR * STEPS, ("%s: max |diff| %.3g > %.3g"):format(what, acc.max, 2 * LR * STEPS))
    else
        H.check(acc.rel <= 1e-6, ("%s: norm rel %.3g > 1e-6"):format(what, acc.rel))
    end
end

-- one data-parallel step: M micro-batches accumulated; `mb` (a number): buckets of that many MiB overlapped with the
-- last backward
local function step(model, opt, mb)
    model:zero_grad()
    for k, ids in ipairs(mine) do
        model:forward(ids, { labels = ids })
        if k == M and mb then
            ds4.dist.bucket_mb(mb)
            ds4.dist.overlap_backward(model)
        end
        model:backward(1 / N)
    end
    ds4.dist.all_reduce_grads(model)
    ds4.dist.bucket_mb(0)
    local grads = model:grads()
    return opt:step(), grads
end

local SIZES = { 0.01, 0.37, 25 }
local plain = load()
local popt = ds4.adamw(plain, opts())
local copies = {}
for i, mb in ipairs(SIZES) do
    local m = load()
    copies[i] = { mb = mb, model = m, opt = ds4.adamw(m, opts()) }
end

-- the layout the small buckets cut: a tensor at least twice the bucket holds a boundary; a block is larger
plain:zero_grad()
local g0 = plain:grads()
local largest, elems = 0, math.floor(0.01 * 1048576 / 4)
for _, t in pairs(g0) do largest = math.max(largest, t:numel()) end
H.check(largest >= 2 * elems, ("the largest tensor (%d elements) holds a boundary of %d-element buckets"):format(largest,
    elems))
H.eq(ds4.dist.bucket_mb(0.01), elems * 4 / 1048576, "bucket_mb rounds to whole elements")
ds4.dist.bucket_mb(0)

for s = 1, STEPS do
    local pst, pg = step(plain, popt, nil)
    for _, c in ipairs(copies) do
        local st, g = step(c.model, c.opt, c.mb)
        agree(compare(g, pg), ("step %d, %g MiB buckets: summed gradients"):format(s, c.mb))
        H.eq(st.grad_norm == pst.grad_norm or not bitwise, true, ("step %d, %g MiB: gradient norm"):format(s, c.mb))
        agree(compare(c.model:params(), plain:params()), ("step %d, %g MiB buckets: weights"):format(s, c.mb), true)
    end
end

-- a rank without a micro-batch (the RL trainer's ranks when a minibatch has fewer samples than ranks): it arms,
-- runs no backward, and its buffer (zeros) goes in the same buckets as the others'
local function idle_step(model, mb)
    model:zero_grad()
    if r < n - 1 then
        for _, ids in ipairs(mine) do model:forward(ids, { labels = ids }) end -- (the tape: the last forward's)
    end
    if mb then
        ds4.dist.bucket_mb(mb)
        ds4.dist.overlap_backward(model)
    end
    if r < n - 1 then model:backward(1 / N) end
    ds4.dist.all_reduce_grads(model)
    ds4.dist.bucket_mb(0)
    return model:grads()
end
agree(compare(idle_step(copies[1].model, copies[1].mb), idle_step(plain, nil)),
    "a rank without a backward: the bucketed sums = the unbucketed")

-- ZeRO-1: today's all-reduce against the reduce-scatter, unbucketed and bucketed
local z = { { name = "zero" }, { name = "zero_rs", rs = true }, { name = "zero_rs_b", rs = true, mb = 0.01 } }
for _, c in ipairs(z) do
    c.model = load()
    c.opt = ds4.adamw(c.model, opts())
    c.off, c.len = ds4.dist.shard_optimizer(c.opt, c.rs and { reduce_scatter = true } or nil)
end
local total = z[1].model:params():numel()
for s = 1, STEPS do
    local results = {}
    for i, c in ipairs(z) do
        -- reduce_scatter is the communicator's: the last optimizer sharded with it set the regions, which every
        -- copy shares (same model size, same ranks)
        local st, g = step(c.model, c.opt, c.mb)
        results[i] = { st = st, g = g }
    end
    for i = 2, #z do
        H.eq(results[i].st.grad_norm == results[1].st.grad_norm or not bitwise, true,
            ("step %d, %s: gradient norm"):format(s, z[i].name))
        agree(compare(z[i].model:params(), z[1].model:params()), ("step %d, %s: weights = zero's"):format(s, z[i].name),
            true)
        -- (the TCP star's rank 0 forms every sum, for the others, so its whole buffer holds them)
        if n > 1 and not (ds4.dist.backend() == "tcp" and r == 0) then
            -- (NCCL over more than 2 ranks: the reduce-scatter's sums, ncclReduce per region, and the all-reduce's may
            -- differ in the last bits inside the region too, so there only differences beyond that order count)
            local d = H.count_differ(results[i].g, results[1].g, not bitwise)
            H.check(d > 0 and d <= total - z[i].len, ("step %d, %s: %d gradients differ from the summed ones%s, want "
                .. "some, at most the %d outside this rank's region"):format(s, z[i].name, d,
                bitwise and "" or " by more than NCCL's order can make", total - z[i].len))
        end
    end
end
-- plain's weights, which zero's equal (ZeRO-1 is tested against the unsharded step in dist_zero.lua)
H.eq(compare(z[1].model:params(), plain:params()).differ == 0 or not bitwise, true, "zero's weights = plain's")

print(("dist_buckets rank %d of %d (%s): %d steps, buckets of %s MiB = unbucketed%s; ZeRO-1 reduce-scatter = all-reduce")
    :format(r, n, ds4.dist.backend(), STEPS, table.concat(SIZES, ", "),
        bitwise and " (bitwise)" or " (NCCL over more than 2 ranks: within the bounds)"))
ds4.dist.finalize()
H.done(("dist_buckets rank %d of %d"):format(r, n))
