-- test_fp4_experts.lua — ds4.load(dir, {fp4_experts = true}) from Lua (docs/checkpoints.md, "FP4-resident experts"),
-- on tests/fixtures/quant_fp4, against the same checkpoint loaded the ordinary way (experts dequantised to fp32;
-- tests/test_fp4_resident.c has the kernel-level checks and the guard against ignored scales):
--   (a) logits of a full forward, chunked decoding and generation equal the dequantised model's bit for bit;
--   (b) a LoRA step: the same loss and adapter gradients, the packed experts' bytes unchanged (model:tensors());
--   (c) refusals: a non-boolean option, a float checkpoint, a CUDA device, merging adapters into packed experts.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()
local dir = fixtures .. "/quant_fp4"
local packed = ds4.load(dir, { fp4_experts = true })
local ref = ds4.load(dir)
local V = packed:config().vocab_size
local rnd = H.lcg(14)
local seq = H.random_ids(rnd, 23, V)

-- (a)
H.check(H.same_bytes(packed:forward({ seq }).logits, ref:forward({ seq }).logits), "(a) full forward logits")
local cp, cr, pos, same = packed:new_cache(32), ref:new_cache(32), 0, true
for _, k in ipairs({ 1, 4, 2, 7, 1, 8 }) do
    local ids = H.slice(seq, pos + 1, pos + k)
    local a = packed:step({ cp }, { ids }, { logits = "all" }).logits
    local b = ref:step({ cr }, { ids }, { logits = "all" }).logits
    same = same and H.same_bytes(a, b)
    pos = pos + k
end
H.check(same, "(a) chunked decoding logits")
local opts = { n = 2, max_new_tokens = 8, temperature = 1.0, seed = 3, ignore_eos = true }
local ga, gb = packed:generate({ H.slice(seq, 1, 5) }, opts), ref:generate({ H.slice(seq, 1, 5) }, opts)
for i = 1, #gb do
    H.same(ga[i].ids, gb[i].ids, "(a) generated ids " .. i)
    H.same(ga[i].logprobs, gb[i].logprobs, "(a) generated log-probabilities " .. i)
end
io.write("(a) forward, chunked decoding and generation: FP4-resident == dequantised, bit for bit\n")

-- (b)
local function experts_bytes(m)
    local out = {}
    for name, t in pairs(m:tensors()) do
        if name:find("ffn.experts.", 1, true) then out[name] = t end
    end
    return out
end
local before = experts_bytes(packed)
local n_packed = 0
for _, t in pairs(before) do
    H.eq(t:dtype(), "U8", "(b) a packed expert's view holds its bytes")
    n_packed = n_packed + 1
end
H.eq(n_packed, 48, "(b) FP4-resident experts")
local losses, grads = {}, {}
for i, m in ipairs({ packed, ref }) do
    m:lora({ rank = 4, alpha = 8, targets = { "all" }, seed = 2 })
    local vals = m:lora_tensors()
    local r2 = H.lcg(5)
    local keys = {}
    for key in pairs(vals) do keys[#keys + 1] = key end
    table.sort(keys)
    for _, key in ipairs(keys) do
        local t = vals[key]
        for j = 1, t:numel() do t[j] = r2(0, 1000) / 2500 - 0.2 end
    end
    m:set_lora(vals)
    m:zero_grad()
    losses[i] = m:forward({ seq }, { labels = { seq } }).loss
    m:backward()
    grads[i] = m:lora_grads()
    ds4.adamw(m, { lr = 1e-2 }):step()
end
H.eq(losses[1], losses[2], "(b) LoRA loss")
local n, differ = 0, 0
for key, g in pairs(grads[2]) do
    n = n + 1
    if not H.same_bytes(grads[1][key], g) then differ = differ + 1 end
end
H.check(n > 0 and differ == 0, ("(b) %d of %d adapter gradients differ"):format(differ, n))
local after = experts_bytes(packed)
local changed = 0
for name, t in pairs(before) do
    if not H.same_bytes(t, after[name]) then changed = changed + 1 end
end
H.eq(changed, 0, "(b) packed experts changed by a LoRA step")
io.write(("(b) LoRA step: loss %.6f and %d adapter gradients equal; the %d packed experts unchanged\n")
    :format(losses[1], n, n_packed))

-- (c)
H.raises(function() ds4.load(dir, { fp4_experts = 1 }) end, { "fp4_experts must be a boolean" }, "(c) option type")
H.raises(function() ds4.load(fixtures .. "/tiny_hf", { fp4_experts = true }) end, { "no routed expert" },
    "(c) a float checkpoint")
H.raises(function() ds4.load(dir, { fp4_experts = true, device = "cuda" }) end, { "FP4-resident" }, "(c) CUDA")
H.raises(function() packed:merge_lora() end, { "FP4-resident" }, "(c) merging adapters into packed experts")
H.done("test_fp4_experts")
