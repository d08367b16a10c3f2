-- test_fp4_experts.lua — ds4.load(dir, {fp4_experts = true}) from Lua (docs/checkpoints.md, "FP4-resident experts"),
-- on tests/fixtures/quant_fp4, against the same checkpoint loaded the ordinary way (experts dequantised to fp32;
-- tests/test_fp4_resident.c has the kernel-level checks and the guard against ignored scales):
--   (a) logits of a full forward, chunked decoding and generation equal the dequantised model's bit for bit;
--   (b) a LoRA step: the same loss and adapter gradients, the packed experts' bytes unchanged (model:tensors());
--   (c) refusals: a non-boolean option, a float checkpoint, merging adapters into packed experts;
--   (d) where ds4.cuda_devices() > 0 (scripts/gpu.sh; CI has none): the packed model on CUDA, in bf16 and in fp32,
--       against the dequantised model on CUDA in the same dtype, bit for bit (the kernels decode every FP4 value to
--       exactly the value the dequantised weight holds in that dtype, and sum as over it: cuda/cuda_fp4.cuh):
--       logits of a batch small enough for the skinny GEMMs and of one large enough for the tiled ones, chunked
--       decoding, generation, a full fine-tuning pass (loss, every gradient the packed model has; the experts have
--       none: they are frozen, as on the CPU) and a LoRA step (adapter gradients, the logits after AdamW); the device
--       holds the packed bytes, not an expansion (model:memory()).
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
-- Random adapters on every target (the same on every model: B too, which PEFT's init would leave 0), then a training
-- pass and an AdamW step: the loss and the adapter gradients.
local function lora_step(m)
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
    local loss = m:forward({ seq }, { labels = { seq } }).loss
    m:backward()
    local grads = m:lora_grads()
    ds4.adamw(m, { lr = 1e-2 }):step()
    return loss, grads
end

-- How many of b's tensors a has too, and how many of those differ in a bit.
local function compare(a, b)
    local n, differ = 0, 0
    for key, t in pairs(b) do
        if a[key] then
            n = n + 1
            if not H.same_bytes(a[key], t) then differ = differ + 1 end
        end
    end
    return n, differ
end

local losses, grads = {}, {}
for i, m in ipairs({ packed, ref }) do losses[i], grads[i] = lora_step(m) end
H.eq(losses[1], losses[2], "(b) LoRA loss")
local n, differ = compare(grads[1], grads[2])
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
H.raises(function() packed:merge_lora() end, { "FP4-resident" }, "(c) merging adapters into packed experts")

-- (d)
if ds4.cuda_devices() == 0 then
    print("test_fp4_experts: no CUDA device here: the CUDA part is skipped")
    H.done("test_fp4_experts")
    return
end
local big = {} -- 4 x 300 tokens: 300 rows per expert on average, past the skinny GEMMs' 256
for b = 1, 4 do big[b] = H.random_ids(rnd, 300, V) end
for _, dtype in ipairs({ "bf16", "fp32" }) do
    local what = "(d) cuda " .. dtype
    local p = ds4.load(dir, { fp4_experts = true, device = "cuda", dtype = dtype })
    local r = ds4.load(dir, { device = "cuda", dtype = dtype })
    local mp, mr = p:memory(), r:memory()
    -- quant_fp4's expert kinds are blocks of 8 x (512 + 32) bytes, multiples of 16: no alignment between them
    H.eq(mp.device_fp4_experts, mp.fp4_experts, what .. ": packed expert bytes on the device")
    local esize = dtype == "bf16" and 2 or 4
    local expanded = mr.device - (mp.device - mp.device_fp4_experts) -- what the dequantised experts take there
    H.check(math.abs(expanded - n_packed * 32 * 32 * esize) <= 16 * 8,
        ("%s: the dequantised model's experts take %d device bytes, want about %d"):format(what, expanded,
            n_packed * 32 * 32 * esize))
    H.check(H.same_bytes(p:forward({ seq }).logits, r:forward({ seq }).logits), what .. ": logits (skinny GEMMs)")
    H.check(H.same_bytes(p:forward(big).logits, r:forward(big).logits), what .. ": logits of 1200 tokens (tiles)")
    local cp2, cr2, at, eq = p:new_cache(32), r:new_cache(32), 0, true
    for _, k in ipairs({ 1, 4, 2, 7, 1, 8 }) do
        local ids = H.slice(seq, at + 1, at + k)
        eq = eq and H.same_bytes(p:step({ cp2 }, { ids }, { logits = "all" }).logits,
            r:step({ cr2 }, { ids }, { logits = "all" }).logits)
        at = at + k
    end
    H.check(eq, what .. ": chunked decoding logits")
    local g1, g2 = p:generate({ H.slice(seq, 1, 5) }, opts), r:generate({ H.slice(seq, 1, 5) }, opts)
    for i = 1, #g2 do
        H.same(g1[i].ids, g2[i].ids, what .. ": generated ids " .. i)
        H.same(g1[i].logprobs, g2[i].logprobs, what .. ": generated log-probabilities " .. i)
    end
    -- full fine-tuning: the packed experts are no parameters, so they have no gradient; every other one is equal
    local lp, lr = {}, {}
    for i, m in ipairs({ p, r }) do
        m:zero_grad()
        lp[i] = m:forward(big, { labels = big }).loss
        m:backward()
        lr[i] = m:grads()
    end
    H.eq(lp[1], lp[2], what .. ": training loss")
    local ng, nd = compare(lr[1], lr[2])
    local n_ref = 0
    for _ in pairs(lr[2]) do n_ref = n_ref + 1 end
    H.check(ng > 0 and nd == 0 and ng + n_packed == n_ref,
        ("%s: %d of %d gradients differ (%d in the dequantised model, %d packed experts)"):format(what, nd, ng, n_ref,
            n_packed))
    p:free()
    r:free()
    -- LoRA, the experts' adapters included, on fresh models
    p = ds4.load(dir, { fp4_experts = true, device = "cuda", dtype = dtype })
    r = ds4.load(dir, { device = "cuda", dtype = dtype })
    local la, ga = lora_step(p)
    local lb, gb = lora_step(r)
    H.eq(la, lb, what .. ": LoRA loss")
    local nl, dl = compare(ga, gb)
    H.check(nl > 0 and dl == 0, ("%s: %d of %d adapter gradients differ"):format(what, dl, nl))
    H.check(H.same_bytes(p:forward({ seq }).logits, r:forward({ seq }).logits), what .. ": logits after a LoRA step")
    print(("%s: packed experts %d bytes on the device (dequantised there: %d); logits, decoding, generation, %d "
        .. "gradients and %d adapter gradients equal the dequantised model's bit for bit"):format(what,
            mp.device_fp4_experts, expanded, ng, nl))
    p:free()
    r:free()
end
H.done("test_fp4_experts")
