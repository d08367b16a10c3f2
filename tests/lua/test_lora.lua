-- test_lora.lua — LoRA adapters (lua/lora_lua.c, core/lora*.c; docs/lora.md).
-- Usage: ds4 run tests/lua/test_lora.lua <fixtures_dir>
--
-- Reference: tests/fixtures/lora_hf, a PEFT adapter on tiny_hf (every site ds4 adapts, random non-zero A and B) with
-- the logits, loss and adapter gradients torch + peft computed (tests/gen_lora_fixtures.py). Checks:
--  (a) ds4.load(tiny_hf, {lora = lora_hf}): logits and loss against PEFT's (the forward test's bounds: both sides fp32
--      with different summation orders, ~1e-6 relative);
--  (b) the adapter gradients of the mean cross-entropy against torch autograd: max |diff| <= 1e-4 · max(1e-2, max |ref|)
--      per tensor (fp32 backward on both sides; the gradients are ~1e-2..1, differences ~1e-7); the indexer adapters
--      get exactly zero (its picks are discrete; only its KL loss reaches it), as in torch;
--  (c) central finite differences of the loss on the largest-gradient element of every adapter tensor (a smooth model:
--      see there): step 1e-3 on values ~0.2; fp32 rounding of a loss ~4 contributes ~5e-7 / 2e-3 = 2.5e-4 absolute and
--      the O(h²) truncation ~1e-6 relative; bound 1e-3 + 1% of |grad|;
--  (d) a LoRA AdamW step leaves every frozen weight bitwise unchanged, changes the adapters, and allocates no gradient
--      for the frozen weights (model:grads() refuses);
--  (e) decoding with model:step in chunks gives the full forward's logits bit for bit with adapters on;
--  (f) save_lora → load_lora gives the same adapters bit for bit and the same logits; the saved keys are the fixture's;
--  (g) merge_lora: the merged model's logits equal the adapted model's within 1e-5 · max(1, max |logit|);
--  (h) a fresh model:lora leaves the outputs bit for bit unchanged (B = 0), and bad options are refused.
--  (i) the layout and the flat buffer (lora_layout, lora_layout_numel, lora_from_layout, lora_params,
--      set_lora_params): another model rebuilt from them holds the PEFT adapter tensor by tensor; bad layouts refused.
-- With DS4_KEEP_SAVED=1 a trained adapter and its logits are kept for tests/check_lora_peft.py (path printed).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()
local base_dir, ad_dir = fixtures .. "/tiny_hf", fixtures .. "/lora_hf"
local io_t = ds4.load_tensors(ad_dir .. "/io.safetensors")
local ids, labels = io_t.input_ids, io_t.labels

local max_diff, bits_equal = H.max_diff, H.bits_equal


-- (a) forward against PEFT
local model = ds4.load(base_dir, { lora = ad_dir })
local info = model:lora_info()
H.eq(info.rank, 4, "rank from adapter_config.json")
H.near(info.scale, 2.0, 0, "scale alpha / r")
local r = model:forward(ids, { labels = labels })
local d, m = max_diff(r.logits, io_t.logits)
H.check(d <= 1e-4 * math.max(1, m), ("(a) logits vs peft: max |diff| %.3g"):format(d))
H.check(math.abs(r.loss - io_t.loss:item()) <= 1e-5 * io_t.loss:item(), ("(a) loss %.8f vs %.8f"):format(r.loss,
    io_t.loss:item()))
io.write(("(a) logits vs peft: max |diff| %.3g (max |ref| %.3g)\n"):format(d, m))

-- (b) gradients against torch autograd
model:zero_grad()
local loss = model:forward(ids, { labels = labels }).loss
model:backward()
local g = model:lora_grads()
local n, worst = 0, 0
for key, got in pairs(g) do
    n = n + 1
    local ref = io_t["grad." .. key]
    if H.check(ref ~= nil, "(b) no reference gradient for " .. key) then
        local dd, mm = max_diff(got, ref)
        local rel = dd / math.max(1e-2, mm)
        if rel > worst then worst = rel end
        H.check(rel <= 1e-4, ("(b) %s: max |diff| %.3g (max |ref| %.3g)"):format(key, dd, mm))
        if key:find("indexer", 1, true) then H.eq(mm, 0, "(b) torch gives the indexer adapters no gradient") end
    end
end
H.eq(n, 44, "(b) adapter tensors")
io.write(("(b) %d adapter gradients vs torch: worst max |diff| / max(1e-2, max |ref|) = %.3g\n"):format(n, worst))
H.raises(function() model:grads() end, { "not enabled" }, "(d) no gradient buffer for the frozen weights")

-- (c) finite differences on the largest-gradient element of every adapter tensor, on tiny_hf's shape with random
-- weights and swiglu_limit 50: the fixture's limit of 1 clamps many activations, and a clamp's kink inside the
-- finite-difference step breaks the comparison (the torch comparison (b) covers the clamped model)
local json = require("ds4.chat.json")
local cfg = json.decode(H.read_file(base_dir .. "/config.json"))
cfg.swiglu_limit = 50
local fm = ds4.new_model(cfg, 5)
fm:lora({ rank = 4, alpha = 8, targets = { "all" } })
local fvals = {}
for key, t in pairs(ds4.load_tensors(ad_dir .. "/adapter_model.safetensors")) do fvals[key] = t end
fm:set_lora(fvals)
fm:zero_grad()
fm:forward(ids, { labels = labels })
fm:backward()
local fg = fm:lora_grads()
local h, fd_worst = 1e-3, 0
local function loss_now() return fm:forward(ids, { labels = labels, train = false }).loss end
for key, gt in pairs(fg) do
    if not key:find("indexer", 1, true) then
        local best, bi = -1, 1
        for i = 1, gt:numel() do
            if math.abs(gt[i]) > best then best, bi = math.abs(gt[i]), i end
        end
        local t = fvals[key]
        local v0 = t[bi]
        t[bi] = v0 + h
        fm:set_lora(fvals)
        local lp = loss_now()
        t[bi] = v0 - h
        fm:set_lora(fvals)
        local lm = loss_now()
        t[bi] = v0
        local fd = (lp - lm) / (2 * h)
        local e, bound = math.abs(fd - gt[bi]), 1e-3 + 0.01 * math.abs(gt[bi])
        fd_worst = math.max(fd_worst, e / bound)
        H.check(e <= bound, ("(c) %s[%d]: fd %.6g vs grad %.6g"):format(key, bi, fd, gt[bi]))
    end
end
io.write(("(c) finite differences: worst error / bound = %.3g\n"):format(fd_worst))

-- (d) a LoRA step: frozen weights bitwise unchanged, adapters moved
local before = model:params()
local a_before = model:lora_tensors()
model:zero_grad()
model:forward(ids, { labels = labels })
model:backward()
local opt = ds4.adamw(model, { lr = 1e-2, weight_decay = 0.1, clip = 1.0 })
local st = opt:step()
H.check(st.grad_norm > 0, "(d) gradient norm")
H.check(bits_equal(model:params(), before), "(d) every frozen weight bitwise unchanged after the step")
local moved = 0
for key, t in pairs(model:lora_tensors()) do
    if not bits_equal(t, a_before[key]) then moved = moved + 1 end
end
H.eq(moved, 44 - 4, "(d) every trainable adapter tensor changed (the 4 indexer tensors are not trainable)")
H.eq(opt:state().m:numel(), info.numel, "(d) optimizer moments cover the adapters only")

-- (e) decoding in chunks == full forward, bit for bit, with adapters
local full = model:forward(ids, { train = false }).logits
local S, V = ids:shape()[2], full:shape()[3]
local seq = {}
for s = 1, S do seq[s] = ids[s] end
local c = model:new_cache(32)
local pos, same = 0, true
for _, k in ipairs({ 3, 1, 4, 2, 1 }) do
    local chunk = {}
    for i = 1, k do chunk[i] = seq[pos + i] end
    local out = model:step({ c }, { chunk }, { logits = "all" })
    for i = 0, k - 1 do
        for v = 1, V do
            if out.logits[i * V + v] ~= full[(pos + i) * V + v] then same = false end
        end
    end
    pos = pos + k
end
H.check(same, "(e) model:step in chunks equals the full forward bit for bit with adapters")

-- (f) save and load
local tmp = os.getenv("DS4_KEEP_SAVED") and "saved_lora_hf" or H.make_temp_dir() .. "/adapter"
model:save_lora(tmp, { overwrite = true, base = "tiny_hf" })
local saved = ds4.load_tensors(tmp .. "/adapter_model.safetensors")
local ref_keys = ds4.load_tensors(ad_dir .. "/adapter_model.safetensors")
local nk = 0
for key in pairs(ref_keys) do
    nk = nk + 1
    H.check(saved[key] ~= nil, "(f) saved adapter has " .. key)
end
for key in pairs(saved) do H.check(ref_keys[key] ~= nil, "(f) saved key known to peft: " .. key) end
local m2 = ds4.load(base_dir, { lora = tmp })
local mine = model:lora_tensors()
local all_same = true
for key, t in pairs(m2:lora_tensors()) do all_same = all_same and bits_equal(t, mine[key]) end
H.check(all_same, "(f) reloaded adapters bit for bit")
H.check(bits_equal(m2:forward(ids).logits, full), "(f) reloaded model's logits bit for bit")
if os.getenv("DS4_KEEP_SAVED") then
    ds4.save_tensors(tmp .. "/ds4_logits.safetensors", { input_ids = ids, logits = full })
    io.write("kept the trained adapter for tests/check_lora_peft.py: " .. tmp .. "\n")
end

-- (g) merge
m2:merge_lora()
H.eq(m2:lora_info(), nil, "(g) merged: no adapters left")
local dm, mm = max_diff(m2:forward(ids).logits, full)
H.check(dm <= 1e-5 * math.max(1, mm), ("(g) merged vs adapted logits: max |diff| %.3g"):format(dm))
io.write(("(g) merged vs adapted: max |diff| %.3g\n"):format(dm))

-- (h) fresh adapters change nothing; options are checked
local m3 = ds4.load(base_dir)
local plain = m3:forward(ids).logits
m3:lora({ rank = 8, alpha = 16, targets = { "attention", "shared", "experts", "indexer" }, seed = 3 })
H.check(bits_equal(m3:forward(ids).logits, plain), "(h) B = 0: outputs bit for bit unchanged")
H.raises(function() m3:lora({ rank = 4, dropout = 0.1 }) end, { "dropout" }, "(h) dropout refused")
H.raises(function() m3:lora({ rank = 4, targets = { "lm_head" } }) end, { "targets[1]" }, "(h) unknown target")
H.raises(function() m3:lora({ rank = 0 }) end, { "rank" }, "(h) rank 0")
model:lora({ rank = 2 })
H.raises(function() opt:step() end, { "LoRA" }, "(h) an optimizer of replaced adapters refuses to step")
m3:drop_lora()
H.check(bits_equal(m3:forward(ids).logits, plain), "(h) dropped")

-- (i) the flat buffer and the layout (what a rollout worker rebuilds the trainer's adapters from): a model given
-- the PEFT adapter's layout and flat values holds the same adapters as PEFT's, tensor by tensor
local src = ds4.load(base_dir, { lora = ad_dir })
local lay = src:lora_layout()
H.eq(lay.rank, src:lora_info().rank, "(i) layout rank")
local dst = ds4.load(base_dir)
H.eq(dst:lora_layout(), nil, "(i) no adapters, no layout")
H.eq(dst:lora_layout_numel(lay), src:lora_info().numel, "(i) the layout's element count without attaching it")
dst:lora_from_layout(lay)
H.eq(dst:lora_info().numel, src:lora_info().numel, "(i) same element count")
H.eq(dst:lora_info().scale, src:lora_info().scale, "(i) same scale")
dst:set_lora_params(src:lora_params())
local same_all, theirs = true, src:lora_tensors()
for key, t in pairs(dst:lora_tensors()) do same_all = same_all and theirs[key] ~= nil and bits_equal(t, theirs[key]) end
H.check(same_all, "(i) flat copy: every PEFT tensor bit for bit")
H.check(bits_equal(dst:forward(ids).logits, src:forward(ids).logits), "(i) and the same logits")
local bad = { rank = lay.rank, alpha = lay.alpha, masks = {} }
for i, m in ipairs(lay.masks) do bad.masks[i] = m end
local plain_layer -- a layer without an indexer (tiny_hf: layer 2, HCA)
for i, t in ipairs(dst:config().layer_types) do
    if t ~= "compressed_sparse_attention" then plain_layer = plain_layer or i end
end
bad.masks[plain_layer] = 0xfff -- every site, the indexer's included
H.raises(function() dst:lora_from_layout(bad) end, { "names weights the layer does not have" },
    "(i) a mask naming the indexer on a layer without one")
table.remove(bad.masks)
H.raises(function() dst:lora_layout_numel(bad) end, { "layer masks for a model of" }, "(i) a mask per layer")
H.raises(function() dst:set_lora_params(ds4.zeros({ 3 })) end, { "3 values given" }, "(i) wrong size refused")

H.done("test_lora")
