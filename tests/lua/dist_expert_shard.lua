-- dist_expert_shard.lua — sharded experts (ds4.dist.expert_parallel(model, {shard = true})): each of N ranks keeps
-- only its routed experts' weights, gradients and Adam moments. Every rank runs three copies of tiny_a (8 experts,
-- 2 hash-routed layers, 2 learned and the MTP block, its loss on; clipping active): `rep`, today's replicated expert
-- parallelism on this rank's rows; `sh`, the same with sharded experts; and for the first step `one`, one process on
-- the whole batch (the EP = 1 reference).
--
-- What must hold, and why:
--  * sh = rep bit for bit, for every step: logits, loss, every gradient this rank holds, the gradient norm (clipping
--    on), the weights and Adam's moments after each AdamW step. Sharding moves no arithmetic: the experts' rows
--    are computed by the same owner with the same kernels; the replicated tensors' all-reduce is the same rank-order
--    sum over fewer elements; the norm adds the same per-tensor sums of squares in the same order (the experts' summed
--    over the ranks, where each has one owner and the others add zeros: exact).
--  * against one process on the whole batch (step 1): logits and the routed experts' gradients bitwise, as for
--    replicated expert parallelism (dist_expert_parallel.lua says why; the other gradients differ there in their
--    last bits, so they are compared with rep only).
--  * memory: this rank's flat buffer holds the replicated tensors and E / N experts per layer and kind; the
--    optimizer's moments are that size too (opt:state() gathers them whole).
--  * checkpoints: sh:save on every rank writes (rank 0) the same files as rep:save, byte for byte, so it loads
--    under any EP (or none); loaded with only this rank's experts (ds4.load{expert_shard}: the same model as loading
--    whole and sharding), with the gathered optimizer state, one more step equals rep's.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

local r, n = ds4.dist.init()
local dir = H.fixtures() .. "/tiny_a"
local S, V, STEPS = 19, 256, 3
local _, all_ids, my_ids, first, mine = H.rank_batch(1313, S, V, r, n)

-- clip 0.05: below this batch's gradient norm (checked), so the clip coefficient is in every update
local function opts() return { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 0.05 } end
local topt = { mtp_lambda = 0.3, router_bias_gamma = 1e-3 }
local EXPERT = "%.experts%.(%d+)%.w[123]%.weight$"

local rep, sh, one = ds4.load(dir), ds4.load(dir), ds4.load(dir)
H.raises(function() ds4.dist.expert_parallel(sh, { shard = 1 }) end, { "shard must be a boolean" }, "shard = 1")
H.raises(function() ds4.dist.expert_parallel(sh, { shards = true }) end, { "unknown option 'shards'" }, "a misspelt option")
local whole_bytes = sh:memory().params
ds4.dist.expert_parallel(rep)
ds4.dist.expert_parallel(sh, { shard = true })
ds4.dist.expert_parallel(sh, { shard = true }) -- again: the same shard, nothing moves
for _, m in ipairs({ rep, sh, one }) do m:set_train_options(topt) end
H.raises(function() ds4.dist.expert_parallel(sh) end, { "sharded", "turn expert parallelism on sharded" },
    "expert parallelism without sharding on a sharded model")
H.raises(function() sh:generate({ { 1, 2, 3 } }, { max_new_tokens = 2 }) end, { "sharded", "decoding" }, "generation")
H.raises(function() sh:lora({ rank = 2, targets = { "shared" } }) end, { "sharded" }, "LoRA on sharded experts")
local rep_opt, sh_opt, one_opt = ds4.adamw(rep, opts()), ds4.adamw(sh, opts()), ds4.adamw(one, opts())
H.raises(function() ds4.dist.shard_optimizer(sh_opt) end, { "ZeRO-1 on top of sharded experts" }, "ZeRO-1 on top")

-- what this rank holds: every replicated tensor, and E / n experts of each layer and kind
local E = 8
local held, expert_numel, repl_numel = {}, 0, 0
for name, t in pairs(sh:tensors()) do
    local e = name:match(EXPERT)
    if e then
        e = tonumber(e)
        H.check(e >= r * E / n and e < (r + 1) * E / n, name .. " is one of this rank's experts")
        held[name] = true
        expert_numel = expert_numel + t:numel()
    elseif t:dtype() == "F32" then
        repl_numel = repl_numel + t:numel()
    end
end
local whole_expert_numel = 0
for name, t in pairs(rep:tensors()) do
    if name:match(EXPERT) then whole_expert_numel = whole_expert_numel + t:numel() end
end
H.eq(expert_numel * n, whole_expert_numel, "this rank holds 1/" .. n .. " of the experts")
H.eq(sh:memory().params, (repl_numel + expert_numel) * 4, "the flat buffer: replicated tensors + this rank's experts")
H.eq(#sh:params() * 4, whole_bytes, "params() gathers the whole model")
-- an optimizer created before the sharding: refused at its step, saying so (n = 1: nothing moved, nothing to refuse);
-- gradients enabled before it are cut down with the weights
-- (their values: those of a model sharded before its gradients existed)
if n > 1 then
    local early, late = ds4.load(dir), ds4.load(dir)
    early:zero_grad()
    local early_opt = ds4.adamw(early, opts())
    ds4.dist.expert_parallel(early, { shard = true })
    ds4.dist.expert_parallel(late, { shard = true })
    for _, m in ipairs({ early, late }) do
        m:zero_grad()
        local o = m:forward(my_ids, { labels = my_ids })
        m:backward(1 / ds4.dist.all_reduce(ds4.tensor({ o.loss_tokens }, "F64"))[1])
        ds4.dist.all_reduce_grads(m)
    end
    local ge, gl, k = early:grads({ canonical = true }), late:grads({ canonical = true }), 0
    for name, g in pairs(gl) do
        k = k + 1
        H.check(H.same_bytes(ge[name], g), name .. ": gradients enabled before the sharding, bitwise")
    end
    H.check(k > 0, "gradients compared")
    H.raises(function() early_opt:step() end, { "sharded", "after this optimizer was created" }, "an optimizer made before")
    early_opt:free()
    early:free()
    late:free()
end
-- sharded while loading: the other experts are never kept; the same model as loading whole, then sharding
local pre = ds4.load(dir, { expert_shard = { rank = r, world = n } })
ds4.dist.expert_parallel(pre, { shard = true })
H.eq(pre:memory().params, sh:memory().params, "sharded at load: the same buffer")
H.check(H.same_bytes(pre:params(), sh:params()), "sharded at load: the same weights (gathered)")
pre:free()
H.raises(function() ds4.load(dir, { expert_shard = { rank = 0, world = 3 } }) end, { "expert_shard rank 0 of 3",
    "multiple" }, "8 experts over 3 ranks")
H.raises(function() ds4.load(dir, { expert_shard = { rank = 2, world = 2 } }) end, { "0 <= r < n" }, "rank 2 of 2")

local function row_bytes_equal(a, b, first_row, nrows, row)
    return ffi.C.memcmp(a:data_ptr(), ffi.cast("const char *", b:data_ptr()) + (first_row - 1) * row, nrows * row) == 0
end

local compared = 0
local function step(k)
    rep:zero_grad()
    sh:zero_grad()
    local o_rep = rep:forward(my_ids, { labels = my_ids })
    local o_sh = sh:forward(my_ids, { labels = my_ids })
    local N = ds4.dist.all_reduce(ds4.tensor({ o_sh.loss_tokens }, "F64"))[1]
    -- even steps through the overlapped, bucketed sum: it must leave a sharded model's expert gradients unsummed
    -- (the buckets are not armed there) and give the replicated model the same sum as after the backward
    if k % 2 == 0 then
        ds4.dist.overlap_backward(rep)
        ds4.dist.overlap_backward(sh)
    end
    rep:backward(1 / N)
    sh:backward(1 / N)
    ds4.dist.all_reduce_grads(rep)
    ds4.dist.all_reduce_grads(sh)
    H.check(H.same_bytes(o_sh.logits, o_rep.logits), ("step %d: logits bitwise"):format(k))
    H.check(o_sh.loss == o_rep.loss, ("step %d: loss bitwise (%.9g, %.9g)"):format(k, o_sh.loss, o_rep.loss))
    local gs, gr = sh:grads({ canonical = true }), rep:grads({ canonical = true })
    local nz = 0
    for name, g in pairs(gr) do
        if gs[name] then
            compared = compared + 1
            H.check(H.same_bytes(gs[name], g), ("step %d: gradient of %s bitwise"):format(k, name))
            if name:match(EXPERT) and select(3, H.f32_diff(g, g)) > 0 then nz = nz + 1 end -- ‖g‖² > 0
        else
            H.check(name:match(EXPERT) and not held[name], ("step %d: %s left out: another rank's expert"):format(k, name))
        end
    end
    H.check(nz > 0, ("step %d: some of this rank's expert gradients are non-zero"):format(k))
    if k == 1 then -- one process on the whole batch: logits and the experts' gradients bitwise
        one:zero_grad()
        local o1 = one:forward(all_ids, { labels = all_ids })
        one:backward()
        H.check(row_bytes_equal(o_sh.logits, o1.logits, first, mine, S * V * 4), "step 1: logits = one process's")
        local g1 = one:grads({ canonical = true })
        for name in pairs(held) do
            H.check(H.same_bytes(gs[name], g1[name]), "step 1: " .. name .. " gradient = one process's")
        end
    end
    local s_rep, s_sh = rep_opt:step(), sh_opt:step()
    H.check(s_sh.grad_norm == s_rep.grad_norm, ("step %d: gradient norm bitwise (%.9g)"):format(k, s_sh.grad_norm))
    H.check(s_sh.grad_norm > opts().clip, ("step %d: clipping active (norm %.3g)"):format(k, s_sh.grad_norm))
    H.check(H.same_bytes(sh:params(), rep:params()), ("step %d: weights after AdamW bitwise"):format(k))
end
for k = 1, STEPS do step(k) end
local st_sh, st_rep = sh_opt:state(), rep_opt:state()
H.check(H.same_bytes(st_sh.m, st_rep.m) and H.same_bytes(st_sh.v, st_rep.v), "Adam moments (gathered) bitwise")
H.eq(st_sh.m:numel() * 4, whole_bytes, "the gathered moments are the whole model's")

-- checkpoints: a shared directory named by rank 0
local id = ds4.dist.broadcast(ds4.tensor({ os.time() * 1000 + math.floor(os.clock() * 1000) % 1000 }, "F64"), 0)[1]
local base = (os.getenv("TMPDIR") or "/tmp") .. ("/ds4_expert_shard_%d_%d"):format(n, id)
local d_sh, d_rep = base .. "_sh", base .. "_rep"
sh:save(d_sh) -- every rank: the gather; rank 0 writes
if r == 0 then rep:save(d_rep) end
ds4.dist.barrier()
if r == 0 then
    for _, f in ipairs({ "model.safetensors", "config.json" }) do
        local a, b = H.read_file(d_sh .. "/" .. f), H.read_file(d_rep .. "/" .. f)
        H.check(a ~= nil and a == b, f .. ": the sharded save writes the replicated model's bytes")
    end
end
-- sharded while loading, from the other checkpoint layouts: HF's packed experts (tiny_hf: gate_up_proj, down_proj)
-- and FP4 experts dequantised (quant_fp4): the same buffer, weights and saved files as loading whole, then sharding
for _, fx in ipairs({ "tiny_hf", "quant_fp4" }) do
    local a, b = ds4.load(H.fixtures() .. "/" .. fx), ds4.load(H.fixtures() .. "/" .. fx, { expert_shard = { rank = r, world = n } })
    ds4.dist.expert_parallel(a, { shard = true })
    ds4.dist.expert_parallel(b, { shard = true })
    H.eq(b:memory().params, a:memory().params, fx .. ": sharded at load, the same buffer")
    H.check(H.same_bytes(b:params(), a:params()), fx .. ": sharded at load, the same weights")
    a:save(base .. "_" .. fx .. "_a")
    b:save(base .. "_" .. fx .. "_b")
    if r == 0 then
        for _, f in ipairs({ "model.safetensors", "config.json" }) do
            local x, y = H.read_file(base .. "_" .. fx .. "_a/" .. f), H.read_file(base .. "_" .. fx .. "_b/" .. f)
            H.check(x ~= nil and x == y, fx .. ": " .. f .. " saved the same from either")
        end
        os.execute("rm -rf " .. H.shell_quote(base .. "_" .. fx .. "_a") .. " " .. H.shell_quote(base .. "_" .. fx .. "_b"))
    end
    a:free()
    b:free()
end

if n > 1 then -- the training-checkpoint writer reads the tensors in place: another rank's expert is refused, named
    H.raises(function() ds4.checkpoints.save(base .. "_ckpt", 1, sh) end, { "is held by rank", "sharded over " .. n },
        "ds4.checkpoints.save of a sharded model")
end

local whole = ds4.load(d_sh) -- EP = 1
H.check(H.same_bytes(whole:params(), rep:params()), "the checkpoint loads whole (no expert parallelism), bitwise")
local again = ds4.load(d_sh, { expert_shard = { rank = r, world = n } }) -- this rank's experts only
again:set_train_options(topt)
ds4.dist.expert_parallel(again, { shard = true })
local again_opt = ds4.adamw(again, opts())
again_opt:load_state(st_sh) -- the gathered moments, this rank's part kept
sh:free()
sh = again
sh_opt = again_opt
step(STEPS + 1)
H.check(compared > 0, "gradients compared")
ds4.dist.barrier()
if r == 0 then os.execute("rm -rf " .. H.shell_quote(d_sh) .. " " .. H.shell_quote(d_rep) .. " " .. H.shell_quote(base .. "_ckpt")) end

local exp_bytes = expert_numel * 4
if r == 0 or n > 1 then
    print(("dist_expert_shard: rank %d of %d (%s): flat buffer %d of %d bytes; routed experts: weights %d + grads %d + Adam m, v %d = %d bytes (whole: %d); %d steps bitwise = replicated EP, step 1 = one process"):format(
        r, n, ds4.dist.backend(), sh:memory().params, whole_bytes, exp_bytes, exp_bytes, 2 * exp_bytes, 4 * exp_bytes,
        4 * whole_expert_numel * 4, STEPS + 1))
end
ds4.dist.finalize()
H.raises(function() sh:forward(my_ids, { labels = my_ids }) end, { "sharded", "expert parallelism is off" },
    "a pass after finalize turned expert parallelism off")
H.done("dist_expert_shard rank " .. r .. " of " .. n)
