-- dist_zero.lua FIXTURES MODE DIR SAVE_WORLD — ZeRO-1 (ds4.dist.shard_optimizer) on N CPU ranks, run by tests/test_dist_zero.sh.
--
-- Every rank trains two copies of tiny_a data-parallel on a 4-row batch (ranks' rows as in dist_data_parallel.lua:
-- 2 ranks 1 + 3, 4 ranks one each), with the same gradients (token-mean over the global batch, all-reduced): `plain`
-- with the unsharded AdamW, `zero` with its optimizer sharded. Clipping is active (clip 0.05 < the gradient norms)
-- and weight decay on, so every stage of the step is exercised. After every step the two must hold the same weights
-- bit for bit, report the same gradient norm, and zero's gathered state (opt:state()) must equal plain's. Each
-- rank's shard must be its own (regions disjoint, in rank order).
--
-- MODE save: K1 = 2 steps, then rank 0 writes a checkpoint (weights + the gathered optimizer state) into DIR, then
-- K2 = 2 more steps. MODE resume: load DIR's checkpoint on this world (any size), shard, K2 steps.
-- In both, the final weights must equal those of one process that ran all K1 + K2 steps uninterrupted, in memory,
-- with the unsharded optimizer, accumulating the saving world's micro-batches for the first K1 steps and this
-- world's after (one micro-batch per rank, in rank order, is one process's sequence of micro-batches: the same bits,
-- docs/distributed.md "Bitwise data parallelism"). So a checkpoint saved by 2 ranks resumes on 1 and on 4 exactly.
--
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): every copy on this rank's GPU (ds4.dist.init{device
-- = "cuda"}, in DS4_TEST_DTYPE: fp32 by default, or bf16), gradients all-reduced through NCCL; zero's optimizer keeps
-- its shard's moments and the fp32 master weights of its region only on the GPU, casts them into its working copy and
-- gathers every region's working copy through NCCL (in bf16 half the master's bytes); reading the weights back
-- (model:params(), opt:state(), the checkpoint) gathers the master's regions from their owners. Each rank prints both
-- copies' training state on the device (model:memory()): zero's moments must take 2 x its region x 4 bytes and its
-- master its region x 4, plain's 2 x every parameter x 4 and every parameter x 4. The check against the uninterrupted
-- process runs for 1 and 2 ranks only (NCCL's sum over more is in an order of its own).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local MODE, DIR, SAVE_WORLD = arg[2], arg[3], tonumber(arg[4] or "2")
assert(MODE == "save" or MODE == "resume", "usage: dist_zero.lua FIXTURES save|resume DIR SAVE_WORLD")
local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local dtype = os.getenv("DS4_TEST_DTYPE") or "fp32"
assert(dtype == "fp32" or dtype == "bf16", "DS4_TEST_DTYPE: fp32 or bf16")
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local function place(m)
    if on_device then m:to(ds4.dist.device(), dtype) end
    return m
end
local fixture = H.fixtures() .. "/tiny_a"
local B, S, V, K1, K2 = 4, 37, 256, 2, 2
local SPLIT = { [1] = { 4 }, [2] = { 1, 3 }, [4] = { 1, 1, 1, 1 } }
assert(SPLIT[n] and SPLIT[SAVE_WORLD], "1, 2 or 4 ranks")

local rows = H.lcg_rows(4242, B, S, V)
-- the micro-batches of a world: {ids} per rank, in rank order
local function micro_batches(world)
    local out, first = {}, 1
    for _, count in ipairs(SPLIT[world]) do
        out[#out + 1] = H.batch(rows, first, count)
        first = first + count
    end
    return out
end
local N = B * (S - 1) -- every row fully scored (labels = ids, the shift inside)

local function opts() return { lr = 2e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 0.05 } end

local function differ(a, b)
    local pa, pb = ffi.cast("const float *", a:data_ptr()), ffi.cast("const float *", b:data_ptr())
    local c = 0
    for i = 0, a:numel() - 1 do
        if pa[i] ~= pb[i] then c = c + 1 end
    end
    return c
end

-- one data-parallel update of model on this rank's micro-batch
local function dp_step(model, opt, ids)
    model:zero_grad()
    model:forward(ids, { labels = ids })
    model:backward(1 / N)
    ds4.dist.all_reduce_grads(model)
    return opt:step()
end

-- the uninterrupted single-process reference: steps 1..K1 on the saving world's micro-batches, then this world's
local ref = place(ds4.load(fixture))
local ref_opt = ds4.adamw(ref, opts())
local function ref_step(world)
    ref:zero_grad()
    for _, ids in ipairs(micro_batches(world)) do
        ref:forward(ids, { labels = ids })
        ref:backward(1 / N)
    end
    return ref_opt:step()
end

local mine = micro_batches(n)[r + 1]
local zero, zopt, plain, popt
if MODE == "save" then
    zero, plain = place(ds4.load(fixture)), place(ds4.load(fixture))
    zopt, popt = ds4.adamw(zero, opts()), ds4.adamw(plain, opts())
else
    local dir, _, _, step = ds4.checkpoints.load(DIR)
    H.eq(step, K1, "the checkpoint's step")
    zero, plain = place(ds4.load(dir)), place(ds4.load(dir))
    zopt, popt = ds4.adamw(zero, opts()), ds4.adamw(plain, opts())
    local st = ds4.checkpoints.read_state(dir, "optimizer")
    for _, o in ipairs({ zopt, popt }) do
        o:load_state({ m = st.m, v = st.v, tensor_steps = st.tensor_steps, step = step })
    end
end
local off, len = ds4.dist.shard_optimizer(zopt)
-- the shards: disjoint, in rank order
local regions = ds4.dist.all_gather(ds4.tensor({ off, len }, "F64"))
local ok_regions, prev_end = true, 0
for q = 0, n - 1 do
    local o, l = regions[2 * q + 1], regions[2 * q + 2]
    if l > 0 then
        if o < prev_end then ok_regions = false end
        prev_end = o + l
    end
end
H.check(ok_regions and prev_end <= zero:params():numel(), "shards disjoint and in rank order")
H.check(n == 1 or len < zero:params():numel(), "a rank of several holds part of the optimizer only")

local function check_state(k)
    local zs, ps = zopt:state(), popt:state()
    H.eq(differ(zs.m, ps.m) + differ(zs.v, ps.v), 0, "step " .. k .. ": gathered moments = the unsharded optimizer's")
    H.eq(differ(zs.tensor_steps, ps.tensor_steps), 0, "step " .. k .. ": per-tensor step counts")
    H.eq(zs.step, ps.step, "step " .. k .. ": update count")
end

local steps = MODE == "save" and K1 + K2 or K2
local first_step = MODE == "save" and 1 or K1 + 1
if MODE == "resume" then for _ = 1, K1 do ref_step(SAVE_WORLD) end end
local clipped = false
for k = first_step, first_step + steps - 1 do
    local zs = dp_step(zero, zopt, mine)
    local ps = dp_step(plain, popt, mine)
    local rs = ref_step(k <= K1 and SAVE_WORLD or n)
    clipped = clipped or zs.grad_norm > opts().clip
    H.eq(zs.grad_norm, ps.grad_norm, "step " .. k .. ": gradient norm, sharded vs unsharded")
    H.eq(differ(zero:params(), plain:params()), 0, "step " .. k .. ": weights, sharded vs unsharded optimizer")
    if not on_device or n <= 2 then
        H.eq(zs.grad_norm, rs.grad_norm, "step " .. k .. ": gradient norm vs the single process")
    end
    check_state(k)
    if on_device and k == first_step then -- the training state on the GPU, both copies
        local P = zero:params():numel()
        local zm, pm = zero:memory(), plain:memory()
        H.eq(zm.device_moments, 2 * len * 4, "zero's moments on the GPU: its region's")
        H.eq(pm.device_moments, 2 * P * 4, "plain's moments on the GPU: every parameter's")
        H.eq(zm.device_master, len * 4, "zero's fp32 master weights on the GPU: its region's")
        H.eq(pm.device_master, P * 4, "plain's fp32 master weights on the GPU: every parameter's")
        print(("dist_zero memory: rank %d of %d on %s (%s): moments %.3f MB sharded (%d of %d parameters), %.3f MB "
            .. "unsharded; master weights %.3f / %.3f MB, gradients %.3f / %.3f MB, weights %.3f / %.3f MB")
            :format(r, n, ds4.dist.device(), dtype, zm.device_moments / 1e6, len, P, pm.device_moments / 1e6,
            zm.device_master / 1e6, pm.device_master / 1e6, zm.device_grads / 1e6, pm.device_grads / 1e6,
            zm.device / 1e6, pm.device / 1e6))
    end
    if MODE == "save" and k == K1 then
        -- gathered: every rank calls it; on a GPU it also reads zero's sharded master back, which rank 0 saves
        local st = zopt:state()
        if r == 0 then
            ds4.checkpoints.save(DIR, K1, zero, { states = { optimizer = { tensors = { m = st.m, v = st.v,
                tensor_steps = st.tensor_steps }, meta = { step = st.step } } } })
        end
        ds4.dist.barrier()
    end
end
H.check(clipped, "the clip was active (the test exercises the clip coefficient)")
local d = differ(zero:params(), ref:params())
if not on_device or n <= 2 then
    H.eq(d, 0, ("final weights vs one uninterrupted process (%s)"):format(MODE == "save" and ("%d ranks"):format(n)
        or ("saved on %d ranks, resumed on %d"):format(SAVE_WORLD, n)))
end
if r == 0 then
    print(("dist_zero %s: %d ranks (%s%s), rank 0's shard %d of %d parameters; weights differing from one process: %d")
        :format(MODE, n, ds4.dist.backend(), on_device and ", " .. ds4.dist.device() .. ", " .. dtype or "", len,
            zero:params():numel(), d))
end
ds4.dist.finalize()
H.done("dist_zero rank " .. r .. " of " .. n)
