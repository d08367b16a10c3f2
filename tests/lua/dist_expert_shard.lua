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
--
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): rep, sh and one live on this rank's GPU in fp32
-- (sh sharded there: its working copy, gradients, fp32 master and moments hold only its experts; pre and the reloaded
-- checkpoint sharded at load, then moved), the rows exchanged and the replicated runs summed through NCCL, the AdamW
-- step on the GPU. The same equalities are expected: NCCL's sum of 2 ranks is one addition per element, so the
-- replicated runs' sums are the whole buffer's bits. Over more than 2 ranks NCCL's order may depend on the buffer it
-- sums, so there the non-expert gradients, the norm and the weights are compared within dist_buckets.lua's bounds
-- (H.count_differ's near; norm rel 1e-6) and each step restarts sh from rep's weights. Also on the GPU: each rank's
-- device memory (model:memory(): the working copy, gradients, master and moments) is the replicated model's less
-- (E - E / N) experts' (to the working copy's 16-byte alignment of each expert block), and 2 steps of a bf16 pair
-- (rep16, sh16) give the same logits, loss, gradients, norm and weights.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local dir = H.fixtures() .. "/tiny_a"
local S, V, STEPS = 19, 256, 3
local _, all_ids, my_ids, first, mine = H.rank_batch(1313, S, V, r, n)

-- clip 0.05: below this batch's gradient norm (checked), so the clip coefficient is in every update
local function opts() return { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 0.05 } end
local topt = { mtp_lambda = 0.3, router_bias_gamma = 1e-3 }
local EXPERT = "%.experts%.(%d+)%.w[123]%.weight$"
-- a model to train: on this rank's GPU with DS4_TEST_DEVICE=cuda (fp32 unless dtype says), else on the CPU
local function load(path, o, dtype)
    local m = ds4.load(path, o)
    if on_device then m:to(ds4.dist.device(), dtype or "fp32") end
    return m
end
-- the all-reduce of the replicated runs is the whole buffer's rank-order sum on the host and with NCCL over 2 ranks
local bitwise = not on_device or n <= 2

local rep, sh, one = load(dir), load(dir), load(dir)
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
    local early, late = load(dir), load(dir)
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
local pre = load(dir, { expert_shard = { rank = r, world = n } })
ds4.dist.expert_parallel(pre, { shard = true })
H.eq(pre:memory().params, sh:memory().params, "sharded at load: the same buffer")
H.eq(pre:memory().device, sh:memory().device, "sharded at load: the same working copy on the device")
H.check(H.same_bytes(pre:params(), sh:params()), "sharded at load: the same weights (gathered)")
pre:free()
H.raises(function() ds4.load(dir, { expert_shard = { rank = 0, world = 3 } }) end, { "expert_shard rank 0 of 3",
    "multiple" }, "8 experts over 3 ranks")
H.raises(function() ds4.load(dir, { expert_shard = { rank = 2, world = 2 } }) end, { "0 <= r < n" }, "rank 2 of 2")

local function row_bytes_equal(a, b, first_row, nrows, row)
    return ffi.C.memcmp(a:data_ptr(), ffi.cast("const char *", b:data_ptr()) + (first_row - 1) * row, nrows * row) == 0
end

-- the elements of two F32 tensors (or {name = tensor} tables) that differ: bitwise, or beyond NCCL's order (harness)
local function differ(x, y) return H.count_differ(x, y, not bitwise) end

-- One training step of a pair {rep, sh, rep_opt, sh_opt, tag}, compared throughout; with p.one, step 1 against it too.
local compared = 0
local function step(k, p)
    local rep, sh, rep_opt, sh_opt = p.rep, p.sh, p.rep_opt, p.sh_opt
    local even = k % 2 == 0
    k = p.tag .. " step " .. k
    rep:zero_grad()
    sh:zero_grad()
    local o_rep = rep:forward(my_ids, { labels = my_ids })
    local o_sh = sh:forward(my_ids, { labels = my_ids })
    local N = ds4.dist.all_reduce(ds4.tensor({ o_sh.loss_tokens }, "F64"))[1]
    -- even steps through the overlapped, bucketed sum: it must leave a sharded model's expert gradients unsummed
    -- (the buckets are not armed there) and give the replicated model the same sum as after the backward. Buckets of
    -- 0.01 MiB (2,621 elements, smaller than every block): many are enqueued between the expert exchanges of rep's
    -- backward and are still being summed during sh's (on GPUs one NCCL stream: each exchange after those before it)
    local mb = ds4.dist.bucket_mb()
    if even then
        ds4.dist.bucket_mb(0.01)
        ds4.dist.overlap_backward(rep)
        ds4.dist.overlap_backward(sh)
    end
    rep:backward(1 / N)
    sh:backward(1 / N)
    ds4.dist.all_reduce_grads(rep)
    ds4.dist.all_reduce_grads(sh)
    ds4.dist.bucket_mb(mb)
    H.check(H.same_bytes(o_sh.logits, o_rep.logits), ("%s: logits bitwise"):format(k))
    H.check(o_sh.loss == o_rep.loss, ("%s: loss bitwise (%.9g, %.9g)"):format(k, o_sh.loss, o_rep.loss))
    H.check(H.same_bytes(sh:router_loads(), rep:router_loads()), ("%s: expert loads bitwise"):format(k))
    local gs, gr = sh:grads({ canonical = true }), rep:grads({ canonical = true })
    local nz = 0
    for name, g in pairs(gr) do
        if gs[name] then
            compared = compared + 1
            if name:match(EXPERT) then -- never summed over the ranks: bitwise everywhere
                H.check(H.same_bytes(gs[name], g), ("%s: gradient of %s bitwise"):format(k, name))
                if select(3, H.f32_diff(g, g)) > 0 then nz = nz + 1 end -- ‖g‖² > 0
            else
                H.eq(differ(gs[name], g), 0, ("%s: gradient of %s, elements differing"):format(k, name))
            end
        else
            H.check(name:match(EXPERT) and not held[name], ("%s: %s left out: another rank's expert"):format(k, name))
        end
    end
    H.check(nz > 0, ("%s: some of this rank's expert gradients are non-zero"):format(k))
    if p.one then -- one process on the whole batch: logits and the experts' gradients bitwise
        local one = p.one
        p.one = nil
        one:zero_grad()
        local o1 = one:forward(all_ids, { labels = all_ids })
        one:backward()
        H.check(row_bytes_equal(o_sh.logits, o1.logits, first, mine, S * V * 4), k .. ": logits = one process's")
        local g1 = one:grads({ canonical = true })
        for name in pairs(held) do
            H.check(H.same_bytes(gs[name], g1[name]), k .. ": " .. name .. " gradient = one process's")
        end
    end
    local s_rep, s_sh = rep_opt:step(), sh_opt:step()
    if bitwise then
        H.check(s_sh.grad_norm == s_rep.grad_norm, ("%s: gradient norm bitwise (%.9g)"):format(k, s_sh.grad_norm))
    else
        H.near(s_sh.grad_norm, s_rep.grad_norm, 1e-6 * s_rep.grad_norm, ("%s: gradient norm"):format(k))
    end
    H.check(s_sh.grad_norm > opts().clip, ("%s: clipping active (norm %.3g)"):format(k, s_sh.grad_norm))
    local w_rep = rep:params()
    H.eq(differ(sh:params(), w_rep), 0, ("%s: weights after AdamW, elements differing"):format(k))
    -- the router biases follow the loads summed over the ranks: integers, then the same fp32 update on every rank
    local ts, tr = sh:tensors(), rep:tensors()
    for name, t in pairs(tr) do
        if name:find("ffn%.gate%.bias$") then
            H.check(H.same_bytes(ts[name], t), ("%s: %s (aux-loss-free update) bitwise"):format(k, name))
        end
    end
    if not bitwise then sh:set_params(w_rep) end -- the next step from the same weights (NCCL's order, above)
end
local main = { rep = rep, sh = sh, rep_opt = rep_opt, sh_opt = sh_opt, one = one, tag = "fp32" }
for k = 1, STEPS do step(k, main) end
local st_sh, st_rep = sh_opt:state(), rep_opt:state()
H.eq(differ(st_sh.m, st_rep.m) + differ(st_sh.v, st_rep.v), 0, "Adam moments (gathered), elements differing")
H.eq(st_sh.m:numel() * 4, whole_bytes, "the gathered moments are the whole model's")

local mem_line
if on_device then
    -- each rank's training state on its GPU: the replicated model's less the other ranks' experts, exactly for the
    -- flat fp32 buffers (gradients, master, the two moments); the working copy (fp32 here) starts every tensor but
    -- an expert after the first of its block at a 16-byte boundary, so its padding may differ by up to 15 bytes a
    -- tensor (none here: tiny_a's experts are 8 KiB each)
    local ms, mr = sh:memory(), rep:memory()
    local less, blocks = (whole_expert_numel - expert_numel) * 4, 0
    for _, t in pairs(rep:tensors()) do
        if t:dtype() == "F32" then blocks = blocks + 1 end
    end
    H.check(ms.device_grads > 0 and ms.device_master > 0 and ms.device_moments > 0, "the training state is on the GPU")
    H.eq(mr.device_grads - ms.device_grads, less, "device gradients: the other ranks' experts' fewer bytes")
    H.eq(mr.device_master - ms.device_master, less, "device fp32 master: the other ranks' experts' fewer bytes")
    H.eq(mr.device_moments - ms.device_moments, 2 * less, "device Adam moments: the other ranks' experts' fewer bytes")
    H.check(math.abs(mr.device - ms.device - less) < 16 * blocks, ("device working copy: %d fewer bytes, want %d "
        .. "(to 16 per tensor, %d tensors)"):format(mr.device - ms.device, less, blocks))
    local function state(x) return x.device + x.device_grads + x.device_master + x.device_moments end
    mem_line = ("dist_expert_shard memory: rank %d of %d (%s): on the GPU, sharded %d bytes (weights %d, grads %d, "
        .. "master %d, moments %d), replicated %d; routed experts' state %d of %d bytes"):format(r, n,
        ds4.dist.device(), state(ms), ms.device, ms.device_grads, ms.device_master, ms.device_moments, state(mr),
        5 * expert_numel * 4, 5 * whole_expert_numel * 4)
    print(mem_line)

    -- bf16 (the working copy in bf16; master, gradients and moments fp32): the same equalities, 2 steps
    local r16, s16 = load(dir, nil, "bf16"), load(dir, nil, "bf16")
    ds4.dist.expert_parallel(r16)
    ds4.dist.expert_parallel(s16, { shard = true })
    for _, m in ipairs({ r16, s16 }) do m:set_train_options(topt) end
    local p16 = { rep = r16, sh = s16, rep_opt = ds4.adamw(r16, opts()), sh_opt = ds4.adamw(s16, opts()), tag = "bf16" }
    for k = 1, 2 do step(k, p16) end
    H.check(r16:memory().device - s16:memory().device >= less / 2 - 16 * blocks, "bf16: the working copy shrinks too")
    p16.rep_opt:free()
    p16.sh_opt:free()
    r16:free()
    s16:free()
end

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
local again = load(d_sh, { expert_shard = { rank = r, world = n } }) -- this rank's experts only
again:set_train_options(topt)
ds4.dist.expert_parallel(again, { shard = true })
local again_opt = ds4.adamw(again, opts())
again_opt:load_state(st_sh) -- the gathered moments, this rank's part kept
sh:free()
sh = again
main.sh, main.sh_opt = again, again_opt
step(STEPS + 1, main)
H.check(compared > 0, "gradients compared")
ds4.dist.barrier()
if r == 0 then os.execute("rm -rf " .. H.shell_quote(d_sh) .. " " .. H.shell_quote(d_rep) .. " " .. H.shell_quote(base .. "_ckpt")) end

local exp_bytes = expert_numel * 4
if r == 0 or n > 1 then
    print(("dist_expert_shard: rank %d of %d (%s, %s): flat buffer %d of %d bytes; routed experts: weights %d + grads %d + Adam m, v %d = %d bytes (whole: %d); %d steps %s replicated EP, step 1 = one process"):format(
        r, n, ds4.dist.backend(), ds4.dist.device(), sh:memory().params, whole_bytes, exp_bytes, exp_bytes,
        2 * exp_bytes, 4 * exp_bytes, 4 * whole_expert_numel * 4, STEPS + 1,
        bitwise and "bitwise =" or "within NCCL's order of"))
end
ds4.dist.finalize()
H.raises(function() sh:forward(my_ids, { labels = my_ids }) end, { "sharded", "expert parallelism is off" },
    "a pass after finalize turned expert parallelism off")
H.done("dist_expert_shard rank " .. r .. " of " .. n)
