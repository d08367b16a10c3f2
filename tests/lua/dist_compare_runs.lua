-- dist_compare_runs.lua A B [bound] — compare two runs of an example (sft.lua, dapo.lua) that should have trained the
-- same model: their saved weights (A/model or A/final, B/...) and their metrics.jsonl, records matched by step.
-- Not a ctest entry itself: tests/test_dist_examples.sh runs it.
--
-- Without a bound: every weight and every metric must be the same bits (the timings — tokens_per_s, seconds,
-- time/* — excepted: wall clock). With a bound: weights within max |Δ| <= bound, and every metric within a relative
-- 1e-4 of A's (the caller states why in its comment). NaN never passes. Prints the largest differences found.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")
local json = require("ds4.chat.json")

local A, B, bound = arg[1], arg[2], tonumber(arg[3] or "")
local function weights(dir)
    for _, f in ipairs({ "/model/model.safetensors", "/final/model.safetensors" }) do
        if ds4.fs.exists(dir .. f) then return ds4.load_tensors(dir .. f) end
    end
    error("no saved model under " .. dir)
end
local wa, wb = weights(A), weights(B)
local worst, names = 0, 0
for name, ta in pairs(wa) do
    local tb = wb[name]
    if H.check(tb ~= nil and tb:numel() == ta:numel(), "tensor " .. name .. " in both") and ta:dtype() == "F32" then
        local pa, pb = ffi.cast("const float *", ta:data_ptr()), ffi.cast("const float *", tb:data_ptr())
        for i = 0, ta:numel() - 1 do
            local d = math.abs(pa[i] - pb[i])
            if d ~= d then d = math.huge end
            if d > worst then worst = d end
        end
        names = names + 1
    end
end
H.check(names > 0, "weights compared")
if bound then
    H.check(worst <= bound, ("weights max |Δ| %.3g within %.3g"):format(worst, bound))
else
    H.eq(worst, 0, "weights max |Δ| (want the same bits)")
end

local TIMING = { tokens_per_s = true, seconds = true }
local function records(dir)
    local out = {}
    for line in io.lines(dir .. "/metrics.jsonl") do
        local r = assert(json.decode(line))
        out[#out + 1] = r
    end
    return out
end
local ra, rb = records(A), records(B)
H.eq(#rb, #ra, "metrics records")
local mrel, mkey = 0, "-"
for i = 1, math.min(#ra, #rb) do
    for k, va in pairs(ra[i]) do
        if not TIMING[k] and not k:match("^time/") and type(va) == "number" then
            local vb = rb[i][k]
            if bound then
                local rel = type(vb) == "number" and math.abs(va - vb) / math.max(math.abs(va), 1e-30) or math.huge
                if rel ~= rel then rel = math.huge end
                if rel > mrel then mrel, mkey = rel, ("%s at step %s"):format(k, tostring(ra[i].step)) end
            elseif vb ~= va then
                H.eq(vb, va, ("metric %s at step %s"):format(k, tostring(ra[i].step)))
            end
        end
    end
end
if bound then H.check(mrel <= 1e-4, ("metrics within 1e-4 relative (worst %.3g: %s)"):format(mrel, mkey)) end
print(("dist_compare_runs: weights max |Δ| %.3g, metrics worst rel %.3g (%s)"):format(worst, mrel, mkey))
H.done("dist_compare_runs")
