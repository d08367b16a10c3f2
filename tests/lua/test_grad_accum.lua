-- test_grad_accum.lua — accumulating backwards in one gradient buffer gives the same bits as computing each
-- micro-batch's gradient apart and summing them in order, ((G1 + G2) + G3), in fp32 (core/backward.c, set_aside).
-- That is what makes data parallelism bitwise: a rank-order sum over ranks of one micro-batch each equals one
-- process accumulating the same micro-batches (docs/distributed.md).
--
-- The model has the MTP loss and the indexer KL loss on, so the buffer sees every kind of repeated addition inside
-- one backward: norm weights, sinks and mHC base / scale token by token, embedding rows of repeated ids, and the
-- head and embedding shared by the main and the MTP losses. Without the set-aside (the backward adding straight onto
-- the accumulated buffer) 8151 of the 595364 gradients differ from the separate sums, by up to 1.7e-6 (measured), so
-- this test fails on that behaviour.
--
-- The reference sum is formed here in Lua doubles and stored into fp32: the double sum of two floats rounded to
-- float is the correctly rounded fp32 sum (53 >= 2·24 + 2 bits: no double-rounding error), i.e. the fp32 addition.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local dir = H.fixtures() .. "/tiny_a"
local B, S, V = 2, 37, 256
local seed = 777
local function lcg()
    seed = (seed * 1103515245 + 12345) % 2147483648
    return seed
end
-- three micro-batches, with partly masked labels so the counts differ
local mbs = {}
for k = 1, 3 do
    local ids, labels = {}, {}
    for b = 1, B do
        ids[b], labels[b] = {}, {}
        for s = 1, S do
            ids[b][s] = lcg() % V
            labels[b][s] = (s <= 5 * k) and -100 or ids[b][s]
        end
    end
    mbs[k] = { ds4.tensor(ids, "I64"), ds4.tensor(labels, "I64") }
end

local model = ds4.load(dir)
model:set_train_options({ mtp_lambda = 0.3, indexer_kl = 1.0 })
-- DS4_TEST_DEVICE=cuda (tests/test_dist_nccl.sh on a GPU machine): the same on the CUDA backend, fp32 mode (the
-- set-aside copy, fill and add run there)
if os.getenv("DS4_TEST_DEVICE") == "cuda" then model:to("cuda", "fp32") end
local scale = 1 / 150

local function copy(g)
    local out = {}
    for name, t in pairs(g) do out[name] = t:clone() end
    return out
end

-- each micro-batch's gradient apart
local apart = {}
for k = 1, 3 do
    model:zero_grad()
    model:forward(mbs[k][1], { labels = mbs[k][2] })
    model:backward(scale)
    apart[k] = copy(model:grads({ canonical = true }))
end
-- accumulated in one buffer
model:zero_grad()
for k = 1, 3 do
    model:forward(mbs[k][1], { labels = mbs[k][2] })
    model:backward(scale)
end
local acc = model:grads({ canonical = true })

local tmp = ffi.new("float[1]")
local differ, worst, n = 0, 0, 0
for name, g in pairs(acc) do
    local p = ffi.cast("const float *", g:data_ptr())
    local a1 = ffi.cast("const float *", apart[1][name]:data_ptr())
    local a2 = ffi.cast("const float *", apart[2][name]:data_ptr())
    local a3 = ffi.cast("const float *", apart[3][name]:data_ptr())
    for i = 0, g:numel() - 1 do
        tmp[0] = a1[i] + a2[i] -- fp32 (G1 + G2)
        tmp[0] = tmp[0] + a3[i] -- fp32 (... + G3)
        if p[i] ~= tmp[0] then
            differ = differ + 1
            worst = math.max(worst, math.abs(p[i] - tmp[0]))
        end
        n = n + 1
    end
end
H.check(n > 0, "gradients compared")
H.eq(differ, 0, ("accumulated vs separately computed and summed gradients (of %d; worst |d| %.3g)"):format(n, worst))

-- a backward after zero_grad writes onto zeros: the same bits as the first separate gradient
model:zero_grad()
model:forward(mbs[1][1], { labels = mbs[1][2] })
model:backward(scale)
local first = model:grads({ canonical = true })
local same = true
for name, g in pairs(first) do
    local p, q = ffi.cast("const float *", g:data_ptr()), ffi.cast("const float *", apart[1][name]:data_ptr())
    for i = 0, g:numel() - 1 do
        if p[i] ~= q[i] then same = false end
    end
end
H.check(same, "one backward after zero_grad = the micro-batch's gradient")

-- ------------------------------------------------------------------------------------------------ loss parts
-- Each part of the loss normalised by its own global count (model:backward{ce, mtp, ikl}) over micro-batches whose
-- counts differ (their labels are masked differently) against the independent reference: one forward over all
-- their rows as one batch, whose default backward is the mean of each part over the whole batch (CE over N scored
-- tokens, λ·MTP over its M tokens, the indexer KL over the Q queries of each layer). The two differ only in fp32
-- summation order: rel ≤ 2e-5 per tensor (measured 6e-8 to 8.5e-8). Normalising per micro-batch instead (default
-- backward on each, then halved) weights the micro-batches' tokens unequally: rel > 1e-2 on the same tensors, which
-- the test also checks, so it tells the two apart.
local lambda, kappa = 0.3, 1.0
local function rel_frob(a, b)
    local pa, pb = ffi.cast("const float *", a:data_ptr()), ffi.cast("const float *", b:data_ptr())
    local dd, bb = 0, 0
    for i = 0, b:numel() - 1 do
        dd, bb = dd + (pa[i] - pb[i]) ^ 2, bb + pb[i] ^ 2
    end
    return bb > 0 and math.sqrt(dd / bb) or math.sqrt(dd)
end
local function cat(k1, k2, j)
    local rows = {}
    for _, k in ipairs({ k1, k2 }) do
        local t = mbs[k][j]
        for b = 1, B do
            local row = {}
            for s = 1, S do row[s] = t:get(b, s) end
            rows[#rows + 1] = row
        end
    end
    return ds4.tensor(rows, "I64")
end
model:zero_grad()
local whole = model:forward(cat(1, 3, 1), { labels = cat(1, 3, 2) })
model:backward()
local ref = copy(model:grads({ canonical = true }))
-- the global counts, as data parallelism all-reduces them
local outs = {}
for i, k in ipairs({ 1, 3 }) do
    model:zero_grad()
    outs[i] = model:forward(mbs[k][1], { labels = mbs[k][2] })
    model:backward()
end
local N, M, Q = 0, 0, 0
for _, o in ipairs(outs) do
    N, M, Q = N + o.loss_tokens, M + o.mtp_loss_tokens, Q + o.indexer_queries
end
H.eq(N, whole.loss_tokens, "scored tokens add up over micro-batches")
H.eq(M, whole.mtp_loss_tokens, "MTP tokens add up")
H.eq(Q, whole.indexer_queries, "indexer queries add up")
H.check(outs[1].loss_tokens ~= outs[2].loss_tokens, "the micro-batches' counts differ")
local function accumulate(per_mb)
    model:zero_grad()
    for _, k in ipairs({ 1, 3 }) do
        model:forward(mbs[k][1], { labels = mbs[k][2] })
        per_mb()
    end
    return model:grads({ canonical = true })
end
local global = accumulate(function() model:backward({ ce = 1 / N, mtp = lambda / M, ikl = kappa / Q }) end)
local local_mean = accumulate(function() model:backward() end)
local parts = { ce = "layers.1.attn.wq_a.weight", mtp = "mtp.0.e_proj.weight", ikl = "layers.1.attn.indexer.wq_b.weight" }
for part, name in pairs(parts) do
    local r = rel_frob(global[name], ref[name])
    H.check(r <= 2e-5, ("%s part (%s): global normalisation vs one batch: rel %.3g"):format(part, name, r))
    if os.getenv("DS4_TEST_VERBOSE") then print(part, name, r) end
    if part ~= "ikl" then -- the query count depends on positions only: equal-length micro-batches have equal counts
        local naive = local_mean[name]:clone()
        local pn = ffi.cast("float *", naive:data_ptr())
        for i = 0, naive:numel() - 1 do pn[i] = pn[i] / 2 end
        local rn = rel_frob(naive, ref[name])
        H.check(rn > 1e-2, ("%s part: per-micro-batch means differ from the global mean (rel %.3g)"):format(part, rn))
    end
end
-- the ikl factor reaches the indexer: twice the factor, exactly twice its gradient (a power of two scales exactly)
local function ikl_grad(f)
    model:zero_grad()
    local o = model:forward(mbs[1][1], { labels = mbs[1][2] })
    model:backward({ ce = 1 / o.loss_tokens, ikl = f and f * kappa / o.indexer_queries or nil })
    return model:grads({ canonical = true })[parts.ikl]
end
local g0, g1, g2 = ikl_grad(nil), ikl_grad(1), ikl_grad(2)
local p1, p2 = ffi.cast("const float *", g1:data_ptr()), ffi.cast("const float *", g2:data_ptr())
local twice = true
for i = 0, g1:numel() - 1 do
    if p2[i] ~= 2 * p1[i] then twice = false end
end
H.eq(rel_frob(g1, g0), 0, "ikl = indexer_kl / own queries is the default, bit for bit")
H.check(twice and rel_frob(g1, g2) > 0, "ikl = 2·indexer_kl / Q doubles the indexer's gradient exactly")
-- backward(s) is backward{ce = s} with the defaults of the other parts, bit for bit
model:zero_grad()
model:forward(mbs[2][1], { labels = mbs[2][2] })
model:backward(scale)
local a1 = copy(model:grads({ canonical = true }))
model:zero_grad()
local o2 = model:forward(mbs[2][1], { labels = mbs[2][2] })
model:backward({ ce = scale, mtp = lambda * scale * o2.loss_tokens / o2.mtp_loss_tokens })
local a2 = model:grads({ canonical = true })
local eq = true
for name, g in pairs(a2) do
    if rel_frob(g, a1[name]) ~= 0 then eq = false end
end
H.check(eq, "backward{ce = s, mtp = λ·s·n/m} = backward(s)")
H.raises(function() model:backward({ mtp = 1 }) end, { "scales need ce" }, "scales without ce")
H.done("test_grad_accum.lua")
