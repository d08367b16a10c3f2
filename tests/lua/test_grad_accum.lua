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
H.done("test_grad_accum.lua")
