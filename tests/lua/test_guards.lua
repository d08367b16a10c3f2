-- test_guards.lua — what the engine refuses instead of failing silently (issue 18, items 7, 8 and 10).
-- Usage: ds4 run tests/lua/test_guards.lua <fixtures_dir>
--
--   (7) opt:step() whose update would make parameters non-finite (lr = 1e38) raises and leaves parameters,
--       moments, gradients and the step count exactly as they were; a model with a non-finite weight is never
--       saved (model:save, ds4.checkpoints.save: nothing is committed, no directory is left);
--   (8) a scored loss that is NaN is a NaN number, never nil (nil stays "nothing scored"), and backward /
--       backward_logprobs of such a forward raise instead of filling the gradients with NaN;
--  (10) model:set_params and opt:step from inside an on_token callback raise, as forward and backward do.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local FIX = H.fixtures()
local io_t = ds4.load_tensors(FIX .. "/tiny_a/io.safetensors")
local ids, labels = io_t.input_ids, io_t.labels

local function same_bytes(a, b)
    return a:nbytes() == b:nbytes() and ffi.C.memcmp(a:data_ptr(), b:data_ptr(), a:nbytes()) == 0
end
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

local function all_finite(t)
    local p = ffi.cast("const float *", t:data_ptr())
    for i = 0, t:numel() - 1 do
        local x = p[i]
        if x ~= x or x == math.huge or x == -math.huge then return false end
    end
    return true
end

local function flat_grads(model)
    local out = {}
    for k, v in pairs(model:grads({ canonical = true })) do out[k] = v end
    return out
end

local function same_grads(a, b)
    for k, v in pairs(a) do
        if not b[k] or not same_bytes(v, b[k]) then return false end
    end
    return true
end

-- ------------------------------------------------------------------------------------------------ (7)
do
    local model = ds4.load(FIX .. "/tiny_a")
    model:zero_grad()
    model:forward(ids, { labels = labels })
    model:backward()
    local p0, g0 = model:params(), flat_grads(model)
    local opt = ds4.adamw(model, { lr = 1e38 })
    H.raises(function() return opt:step() end, { "ds4.adamw:step", "non-finite", "unchanged" },
        "(7) an update to non-finite parameters is refused")
    H.check(same_bytes(model:params(), p0), "(7) the parameters are exactly as before")
    H.check(same_grads(flat_grads(model), g0), "(7) the gradients are exactly as before (not clipped in place)")
    H.eq(opt:steps(), 0, "(7) the step count did not move")
    local st = opt:state()
    local zero = ds4.zeros({ st.m:numel() })
    H.check(same_bytes(st.m, zero) and same_bytes(st.v, zero), "(7) the moments are still zero")
    H.eq(st.tensor_steps:totable()[1], 0, "(7) per-tensor step counts unchanged")
    -- the same gradients with a sane learning rate: accepted, and equal to a fresh optimizer's first step
    local ok = ds4.adamw(model, { lr = 1e-3 })
    local r = ok:step()
    H.eq(r.step, 1, "(7) a sane step after the refused one")
    H.check(all_finite(model:params()), "(7) finite parameters after it")
    local ref = ds4.load(FIX .. "/tiny_a")
    ref:zero_grad()
    ref:forward(ids, { labels = labels })
    ref:backward()
    ds4.adamw(ref, { lr = 1e-3 }):step()
    H.check(same_bytes(model:params(), ref:params()), "(7) the refused step left no trace in the next one")

    -- a diverged model is never saved
    local bad = p0:clone()
    ffi.cast("float *", bad:data_ptr())[17] = 0 / 0
    model:set_params(bad)
    local root = H.make_temp_dir()
    H.raises(function() return ds4.checkpoints.save(root, 5, model) end,
        { "ds4.checkpoints.save", "non-finite", "diverged" }, "(7) checkpoints.save of NaN weights")
    H.eq(ds4.checkpoints.latest(root), nil, "(7) no checkpoint was committed")
    H.eq(#ds4.checkpoints.scan(root), 0, "(7) and no temporary directory was left behind")
    H.raises(function() return model:save(root .. "/model") end, { "non-finite" }, "(7) model:save of NaN weights")
    H.check(not io.open(root .. "/model/config.json"), "(7) model:save wrote nothing")
    ffi.cast("float *", bad:data_ptr())[17] = 1 / 0
    model:set_params(bad)
    H.raises(function() return model:save(root .. "/model") end, { "non-finite", "inf" }, "(7) an infinite weight")
    os.execute("rm -rf " .. H.shell_quote(root))
end

-- ------------------------------------------------------------------------------------------------ (8)
do
    local model = ds4.load(FIX .. "/tiny_a")
    local out = model:forward(ids, { labels = labels })
    H.check(type(out.loss) == "number" and out.loss == out.loss, "(8) a finite loss")
    local none = {}
    for i = 1, labels:size(1) do
        none[i] = {}
        for j = 1, labels:size(2) do none[i][j] = -100 end
    end
    H.eq(model:forward(ids, { labels = none }).loss, nil, "(8) nothing scored: loss nil")
    -- NaN weights: the loss is a NaN number
    local p = model:params()
    local ptr = ffi.cast("float *", p:data_ptr())
    for i = 0, p:numel() - 1 do ptr[i] = 0 / 0 end
    model:set_params(p)
    local o = model:forward(ids, { labels = labels })
    H.check(type(o.loss) == "number" and o.loss ~= o.loss, "(8) a NaN loss is a NaN number, got " .. tostring(o.loss))
    H.check(o.loss_tokens > 0, "(8) with its scored tokens")
    model:zero_grad()
    o = model:forward(ids, { labels = labels })
    H.check(o.loss ~= o.loss, "(8) the training forward's NaN loss too")
    H.raises(function() model:backward() end, { "ds4.model:backward", "loss is nan" }, "(8) backward refuses it")
    model:forward(ids, { labels = labels })
    H.raises(function() model:backward_logprobs(ds4.zeros({ ids:size(1), ids:size(2) })) end,
        { "ds4.model:backward_logprobs", "loss is nan" }, "(8) backward_logprobs refuses it")
    local gsum = 0
    for _, v in pairs(model:grads({ canonical = true })) do
        local q = ffi.cast("const float *", v:data_ptr())
        for i = 0, v:numel() - 1 do gsum = gsum + math.abs(q[i]) end
    end
    H.eq(gsum, 0, "(8) the gradients were left at zero")
end

-- ------------------------------------------------------------------------------------------------ (10)
do
    local model = ds4.load(FIX .. "/tiny_a")
    local p = model:params()
    H.raises(function()
        model:generate({ { 5, 6, 7 } }, { max_new_tokens = 3, on_token = function() model:set_params(p) end })
    end, { "set_params", "generating" }, "(10) set_params from on_token")
    model:zero_grad()
    model:forward(ids, { labels = labels })
    model:backward()
    local opt = ds4.adamw(model, { lr = 1e-3 })
    H.raises(function()
        model:generate({ { 5, 6, 7 } }, { max_new_tokens = 3, on_token = function() opt:step() end })
    end, { "ds4.adamw:step", "generating" }, "(10) opt:step from on_token")
    H.eq(opt:steps(), 0, "(10) no update happened")
    H.check(same_bytes(model:params(), p), "(10) the weights are unchanged")
    -- outside a generation both work
    model:set_params(p)
    H.eq(opt:step().step, 1, "(10) opt:step after the generation")
    -- another model may change while this one generates
    local other = ds4.load(FIX .. "/tiny_a")
    local res = model:generate({ { 5, 6, 7 } }, { max_new_tokens = 2, on_token = function() other:set_params(p) end })
    H.eq(#res[1].ids, 2, "(10) a different model's set_params from on_token is fine")
end

H.done("test_guards")
