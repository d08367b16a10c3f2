-- test_lora_device.lua — LoRA on a CUDA GPU (docs/lora.md), against the same fixtures as test_lora.lua and the CPU.
-- Usage: ds4 run tests/lua/test_lora_device.lua <fixtures_dir>
-- Runs where ds4.cuda_devices() > 0 (a GPU machine; CI has none: there it checks nothing and says so). On cuda fp32:
--   logits and loss of tiny_hf + lora_hf against PEFT's (test_lora.lua's bounds), adapter gradients against torch
--   (1e-4 relative, as on the CPU), a LoRA AdamW step on the device leaving every frozen weight bitwise unchanged and
--   giving the CPU step's adapters within 1e-5 (the same fp32 AdamW arithmetic on gradients that differ by summation
--   order only), chunked decoding equal to the full forward bit for bit, and save_lora from the device reloading on
--   the CPU with the same adapters bit for bit. In bf16 the adapted forward is checked to run and stay within
--   5e-2 · max(1, max |ref|) of PEFT's fp32 logits (bf16 weights, fp32 adapters).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

if ds4.cuda_devices() == 0 then
    io.write("test_lora_device: no CUDA device here: nothing to check\n")
    H.done("test_lora_device")
    return
end
local fixtures = H.fixtures()
local base_dir, ad_dir = fixtures .. "/tiny_hf", fixtures .. "/lora_hf"
local io_t = ds4.load_tensors(ad_dir .. "/io.safetensors")
local ids, labels = io_t.input_ids, io_t.labels

local max_diff, bits_equal = H.max_diff, H.bits_equal

local gm = ds4.load(base_dir, { lora = ad_dir, device = "cuda", dtype = "fp32" })
local r = gm:forward(ids, { labels = labels })
local d, m = max_diff(r.logits, io_t.logits)
H.check(d <= 1e-4 * math.max(1, m), ("cuda fp32 logits vs peft: max |diff| %.3g"):format(d))
gm:zero_grad()
gm:forward(ids, { labels = labels })
gm:backward()
for key, got in pairs(gm:lora_grads()) do
    local dd, mm = max_diff(got, io_t["grad." .. key])
    H.check(dd <= 1e-4 * math.max(1e-2, mm), ("cuda grad %s: max |diff| %.3g"):format(key, dd))
end
-- one step on the device and on the CPU from the same state
local cm = ds4.load(base_dir, { lora = ad_dir })
cm:zero_grad()
cm:forward(ids, { labels = labels })
cm:backward()
local before = gm:params()
local go, co = ds4.adamw(gm, { lr = 1e-2, clip = 1.0 }), ds4.adamw(cm, { lr = 1e-2, clip = 1.0 })
go:step()
co:step()
H.check(bits_equal(gm:params(), before), "cuda: frozen weights bitwise unchanged by a LoRA step")
local ct = cm:lora_tensors()
for key, t in pairs(gm:lora_tensors()) do
    local dd = max_diff(t, ct[key])
    H.check(dd <= 1e-5, ("cuda step vs cpu step %s: max |diff| %.3g"):format(key, dd))
end
-- decoding == full forward, bitwise, on the device
local full = gm:forward(ids, { train = false }).logits
local S, V = ids:shape()[2], full:shape()[3]
local c = gm:new_cache(32)
local pos, ndiff, worst, first = 0, 0, 0, nil
for _, k in ipairs({ 3, 1, 4, 2, 1 }) do
    local chunk = {}
    for i = 1, k do chunk[i] = ids[pos + i] end
    local out = gm:step({ c }, { chunk }, { logits = "all" })
    for i = 0, k - 1 do
        for v = 1, V do
            local a, b = out.logits[i * V + v], full[(pos + i) * V + v]
            if a ~= b then
                ndiff, first = ndiff + 1, first or pos + i
                local e = math.abs(a - b)
                worst = (e ~= e or e > worst) and (e ~= e and math.huge or e) or worst
            end
        end
    end
    pos = pos + k
end
H.check(ndiff == 0, ("cuda: model:step in chunks equals the full forward bit for bit with adapters (%d of %d logits "
    .. "differ, first at position %s, max |diff| %.3g)"):format(ndiff, pos * V, tostring(first), worst))
local tmp = H.make_temp_dir() .. "/adapter"
gm:save_lora(tmp)
local back = ds4.load(base_dir, { lora = tmp })
local gt = gm:lora_tensors()
for key, t in pairs(back:lora_tensors()) do H.check(bits_equal(t, gt[key]), "save from cuda, load on cpu: " .. key) end
-- bf16
local bm = ds4.load(base_dir, { lora = ad_dir, device = "cuda", dtype = "bf16" })
local bd, bmx = max_diff(bm:forward(ids).logits, io_t.logits)
H.check(bd <= 5e-2 * math.max(1, bmx), ("cuda bf16 logits vs peft fp32: max |diff| %.3g"):format(bd))
io.write(("cuda: fp32 logits vs peft %.3g, bf16 %.3g\n"):format(d, bd))
H.done("test_lora_device")
