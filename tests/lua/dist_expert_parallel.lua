-- dist_expert_parallel.lua — expert parallelism (ds4.dist.expert_parallel): N ranks, each with some rows of a global
-- batch (4 ranks: one row each; 2 ranks: 1 and 3 rows, unequal on purpose; 1 rank: all four, the exchange through
-- a world of one), the routed experts of every MoE layer split over the ranks (tiny_a: 8 experts, 2 hash-routed
-- layers, 2 learned, and the MTP block, whose loss is on here so that its MoE runs too). Every rank also runs a
-- second copy of the model on the whole batch alone: the single-process reference, in the same process.
--
-- What must hold, and why:
--  * logits: bitwise equal to the reference's rows of this rank. Each expert row is computed by the same kernels on
--    the same bits wherever it runs (the grouped GEMMs are batch invariant), and combined at the token's rank in the
--    same order.
--  * routed-expert weight gradients: bitwise equal. The owner sums each expert's rows in (source rank, slot) order:
--    the order of one process holding the ranks' rows one after another, which is the reference's batch. The
--    all-reduce then adds zeros (the other ranks compute no gradient for experts they do not own).
--  * every other gradient, router gates included: bitwise equal to a third copy that accumulates the ranks'
--    micro-batches in rank order without expert parallelism (data parallelism's all-reduce is a rank-order sum:
--    docs/distributed.md, "Bitwise data parallelism"; on GPUs with NCCL for 2 ranks only), and within rel <= 2e-6 per
--    tensor of the whole-batch reference (the same fp32 terms grouped per rank). So the weights after a step differ
--    from the reference's in their last bits (|Δ| <= 5e-5 = lr / 20, as in dist_data_parallel.lua), and every step
--    starts from the reference's weights again (set_params), which keeps each step's equalities bitwise; the
--    optimizer state carries over.
--    The router gates' gradient exists only through the routing weights (dws = <da, ye> at the token's rank, from
--    the expert outputs the forward brought back): the reference's is checked to be non-zero, so a cut of that path
--    (dws = 0) is a relative error of 1.
--  * expert loads: summed over the ranks, equal to the reference's (integers); after the step the router-bias update
--    (router_bias_gamma) used the global loads on every rank: biases bitwise equal to the reference's.
--  * normalisation: with expert parallelism each rank's backward is scaled by 1 / N (N = the global scored tokens),
--    because an expert's gradient mixes rows from every rank; all_reduce_grads then takes scale 1 (and refuses
--    another).
--  * ZeRO-1 on top (ds4.dist.shard_optimizer): two more expert-parallel copies, `zero` (the all-reduce, then the
--    sharded step) and `zero_rs` ({reduce_scatter = true}: each rank's region of the sums only), trained on the same
--    rows from the same weights as the expert-parallel copy (each step starts from the reference's weights, as
--    above). ZeRO-1 changes only where the moments live, so after every step: the gradient norm and the weights
--    bitwise equal to the expert-parallel copy's, and the gathered moments (opt:state()) too; zero's summed gradients
--    bitwise equal; zero_rs's differ outside this rank's region (left unsummed: some differ, at most the region's
--    complement; not on the TCP star's rank 0, which forms every sum). Clipping is active (gradient norm ~4 > clip
--    1), so the norm summed from the ranks' pieces sets the step.
--
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): both copies on this rank's GPU in fp32, the rows
-- exchanged through NCCL. The same equalities are expected (the CUDA kernels are batch invariant too). ZeRO-1's
-- copies keep their moments' shard on the GPU and gather the master through NCCL; with the reduce-scatter over more
-- than 2 ranks ncclReduce's sums may differ from ncclAllReduce's in their last bits, so there the norm is checked
-- within rel 1e-6, the weights within 2 lr per step and the unsummed gradients by more than that order can make
-- (dist_buckets.lua's bounds).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local dir = H.fixtures() .. "/tiny_a"
local S, V, STEPS = 19, 256, 2
assert(n == 1 or n == 2 or n == 4, "the test's batch of 4 rows is split for 1, 2 or 4 ranks")

local rows, all_ids, my_ids, first, mine = H.rank_batch(4242, S, V, r, n)

local function opts() return { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 } end
local ref, ep, acc = ds4.load(dir), ds4.load(dir), ds4.load(dir)
if on_device then
    for _, m in ipairs({ ref, ep, acc }) do m:to(ds4.dist.device(), "fp32") end
end
-- every rank's micro-batch, for the accumulating copy
local mb = {}
for q = 0, n - 1 do mb[q + 1] = H.batch(rows, H.rank_rows(q, n)) end
-- the data-parallel all-reduce is a rank-order sum (MPI by hand, the TCP star; NCCL: with 2 ranks)
local bitwise = not on_device or n <= 2
ds4.dist.expert_parallel(ep)
local ref_opt, ep_opt = ds4.adamw(ref, opts()), ds4.adamw(ep, opts())
-- ZeRO-1 on top: the same expert-parallel training with the moments sharded, after the all-reduce (`zero`) and
-- with the reduce-scatter (`zero_rs`); each compared with ep after every step
local zero = { { name = "zero" }, { name = "zero_rs", rs = true } }
for _, c in ipairs(zero) do
    c.model = ds4.load(dir)
    if on_device then c.model:to(ds4.dist.device(), "fp32") end
    ds4.dist.expert_parallel(c.model)
    c.opt = ds4.adamw(c.model, opts())
    c.off, c.len = ds4.dist.shard_optimizer(c.opt, c.rs and { reduce_scatter = true } or nil)
end
local P = ep:params():numel()
H.check(n == 1 or zero[1].len < P, "ZeRO-1 under expert parallelism: a rank of several holds part of the moments")

local diff = H.f32_diff

-- the elements that differ: bitwise where the sums are (host ranks, NCCL with 2), else beyond NCCL's order (harness)
local function count_differ(a, b) return H.count_differ(a, b, not bitwise) end

local function to_f64(t)
    local p, out = ffi.cast("const int64_t *", t:data_ptr()), {}
    for i = 0, t:numel() - 1 do out[#out + 1] = tonumber(p[i]) end
    return ds4.tensor(out, "F64")
end

local worst_g, worst_w, experts_checked, gates_checked, bits, zero_norm, rs_differ = 0, 0, 0, 0, 0, 0, 0
for k = 1, STEPS do
    -- step 2 with per-block recomputation (the same bits by design): its backward runs each block's forward again,
    -- expert exchanges included
    local topt = { mtp_lambda = 0.3, router_bias_gamma = 1e-3, recompute = k == 2 }
    for _, m in ipairs({ ref, ep, acc, zero[1].model, zero[2].model }) do m:set_train_options(topt) end
    ref:zero_grad()
    local out_ref = ref:forward(all_ids, { labels = all_ids })
    ref:backward()
    ep:zero_grad()
    local out = ep:forward(my_ids, { labels = my_ids })
    local cnt = ds4.dist.all_reduce(ds4.tensor({ out.loss_tokens }, "F64"))
    local N = cnt[1]
    H.eq(N, out_ref.loss_tokens, "global scored tokens = the whole batch's")
    if k == 1 then
        -- a forward without labels in between, on other rows (the next rank's micro-batch): its exchanges replace
        -- no plan that the backward takes from the training forward (core/moe_ep.c); the checks below are then those
        -- of a backward right after its forward
        ep:forward(mb[(r + 1) % n + 1])
    end
    ep:backward(1 / N)
    H.raises(function() ds4.dist.all_reduce_grads(ep, 0.5) end, { "expert parallelism", "scale" },
        "all_reduce_grads with a scale under expert parallelism")
    ds4.dist.all_reduce_grads(ep)
    -- one process accumulating the ranks' micro-batches in rank order, with the same normalisation, no expert
    -- parallelism: what the non-expert gradients must equal bit for bit
    acc:zero_grad()
    for q = 1, n do
        acc:forward(mb[q], { labels = mb[q] })
        acc:backward(1 / N)
    end

    -- logits: this rank's rows of the reference's, bitwise
    local row = S * V * 4
    H.check(ffi.C.memcmp(out.logits:data_ptr(), ffi.cast("const char *", out_ref.logits:data_ptr()) + (first - 1) * row,
        mine * row) == 0, ("step %d: logits of rows %d..%d bitwise equal to one process's"):format(k, first, first + mine - 1))
    -- the global loss (main + λ·MTP; every row fully scored, so each part's share is n_r / N)
    local l = ds4.dist.all_reduce(ds4.tensor({ out.loss * out.loss_tokens }, "F64"))
    H.near(l[1] / N, out_ref.loss, 1e-6 * math.abs(out_ref.loss), "global loss, step " .. k)

    local grel = 0
    local gd, gr, ga = ep:grads({ canonical = true }), ref:grads({ canonical = true }), acc:grads({ canonical = true })
    for name, g in pairs(gr) do
        local mx, rel, norm2 = diff(gd[name], g)
        if name:find("%.experts%.%d+%.w[123]%.weight$") then
            experts_checked = experts_checked + 1
            H.check(H.same_bytes(gd[name], g) or mx == 0, ("step %d: %s bitwise equal (max |Δ| %.3g)"):format(k, name, mx))
        else
            if name:find("ffn%.gate%.weight$") then
                gates_checked = gates_checked + 1
                H.check(norm2 > 0, ("step %d: the reference's %s gradient is not zero"):format(k, name))
            end
            if bitwise then
                local amx = diff(gd[name], ga[name])
                bits = bits + (amx == 0 and 0 or 1)
                H.eq(amx, 0, ("step %d: %s equals the accumulating copy's"):format(k, name))
            end
            if norm2 > 0 then
                grel = math.max(grel, rel)
                H.check(rel <= 2e-6, ("step %d: %s rel %.3g (max |Δ| %.3g)"):format(k, name, rel, mx))
            else
                H.eq(mx, 0, ("step %d: zero gradient of %s stays zero"):format(k, name))
            end
        end
    end
    worst_g = math.max(worst_g, grel)
    -- expert loads: every rank's, summed, equal the whole batch's
    local lr, lf = ep:router_loads(), ref:router_loads()
    local sum = ds4.dist.all_reduce(to_f64(lr))
    H.check(H.same_bytes(sum, to_f64(lf)), ("step %d: expert loads summed over the ranks = one process's"):format(k))

    ref_opt:step()
    local ep_st = ep_opt:step()
    -- ZeRO-1 on top, from the same weights on the same rows: each rank steps its region of the moments and the
    -- regions are gathered, so the weights and the gradient norm are ep's bits (NCCL over more than 2 ranks with the
    -- reduce-scatter: norm rel 1e-6, weights within 2 lr per step, as in dist_buckets.lua)
    local ep_state = ep_opt:state()
    for _, c in ipairs(zero) do
        c.model:zero_grad()
        c.model:forward(my_ids, { labels = my_ids })
        c.model:backward(1 / N)
        ds4.dist.all_reduce_grads(c.model)
        local g = c.model:grads({ canonical = true })
        local st = c.opt:step()
        local what = ("step %d, expert parallelism + %s"):format(k, c.name)
        local w = count_differ(c.model:params(), ep:params())
        if bitwise or not c.rs then
            H.eq(st.grad_norm, ep_st.grad_norm, what .. ": gradient norm")
            H.eq(w, 0, what .. ": weights differing from expert parallelism's without ZeRO-1")
            local zs = c.opt:state() -- gathered (every rank calls it)
            H.eq(count_differ(zs.m, ep_state.m) + count_differ(zs.v, ep_state.v), 0, what .. ": gathered moments")
            H.eq(zs.step, ep_state.step, what .. ": update count")
        else
            H.near(st.grad_norm, ep_st.grad_norm, 1e-6 * ep_st.grad_norm, what .. ": gradient norm")
            local wmx = diff(c.model:params(), ep:params())
            H.check(wmx <= 2 * 1e-3 * k, ("%s: weights max |Δ| %.3g"):format(what, wmx))
        end
        zero_norm = math.max(zero_norm, ep_st.grad_norm)
        if not c.rs then
            H.eq(count_differ(g, gd), 0, what .. ": summed gradients")
        elseif n > 1 and not (ds4.dist.backend() == "tcp" and r == 0) then
            -- outside this rank's region the reduce-scatter left the rank's own gradient unsummed (the other ranks'
            -- experts: zeros): some differ, none beyond the region's complement (the TCP star's rank 0 forms every
            -- sum, for the others, so its whole buffer holds them)
            local d = count_differ(g, gd)
            rs_differ = math.max(rs_differ, d)
            H.check(d > 0 and d <= P - c.len, ("%s: %d gradients differ from the summed ones, want some, at most the "
                .. "%d outside this rank's region"):format(what, d, P - c.len))
        end
    end
    local td, tr = ep:tensors(), ref:tensors()
    for name, t in pairs(tr) do
        if name:find("ffn%.gate%.bias$") then
            H.check(H.same_bytes(td[name], t), ("step %d: %s (aux-loss-free update from the global loads) bitwise"):format(
                k, name))
        end
    end
    local wmax = diff(ep:params(), ref:params())
    worst_w = math.max(worst_w, wmax)
    H.check(wmax <= 5e-5, ("step %d: weights max |Δ| %.3g vs one process on the whole batch"):format(k, wmax))
    -- the next step starts from the reference's weights again, so that its forward and backward can be bitwise too
    -- (the non-expert gradients differed in their last bits, and so the weights: see above)
    ep:set_params(ref:params())
    acc:set_params(ref:params())
    for _, c in ipairs(zero) do c.model:set_params(ref:params()) end
end
H.check(experts_checked > 0 and gates_checked > 0, "expert and router gradients were compared")
H.check(zero_norm > opts().clip, "the clip was active in the ZeRO-1 steps (the sharded norm's coefficient is used)")
local unsummed = ds4.dist.all_reduce(ds4.tensor({ rs_differ }, "F64"))[1]
local w = ep:params()
H.eq((diff(w, ds4.dist.broadcast(w:clone(), 0))), 0, "every rank's weights equal rank 0's")
if r == 0 then
    print(("dist_expert_parallel: %d ranks (%s, %s), %d steps: logits, expert gradients, loads and router biases bitwise; other gradients %s; vs the whole batch: worst rel %.3g, weights |Δ| %.3g after a step"):format(
        n, ds4.dist.backend(), ds4.dist.device(), STEPS,
        bitwise and "bitwise = the accumulated micro-batches'" or "not compared bitwise (NCCL, > 2 ranks)", worst_g, worst_w))
    print(("dist_expert_parallel: ZeRO-1 on top (all-reduce and reduce-scatter; rank 0's region %d of %d parameters): "
        .. "weights, gradient norm (largest %.4g, clip %g) and gathered moments %s expert parallelism's without "
        .. "ZeRO-1; gradients left unsummed by the reduce-scatter outside the regions, over the ranks: %d"):format(zero[1].len, P, zero_norm,
        opts().clip, bitwise and "bitwise =" or "(reduce-scatter: within the bounds of)", unsummed))
end
ds4.dist.finalize()
H.done("dist_expert_parallel rank " .. r .. " of " .. n)
