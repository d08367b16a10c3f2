-- test_kv_qat.lua — the FP8 KV quantisation-aware option (model:set_kv_qat, docs/architecture.md "FP8 KV
-- quantisation-aware training") on the fixtures whose indexer width is a power of two:
--   (a) it is applied: the logits move (a re-run with it on moves them by exactly 0) but by less than their own
--       largest magnitude (e4m3 keeps 3 mantissa bits, at most 2^-4 relative error per key channel, but FP4 on the
--       indexer can change which entries a CSA query picks, a discrete change, so no tighter bound holds on these
--       tiny random models); turned off again, the logits are the original ones bit for bit;
--   (b) decoding equals the full forward bit for bit with it on: irregular chunks through one cache and two caches
--       stepping together (the rounding is applied where a window key or an entry is made, the same in both);
--   (c) rollout and training agree exactly: every generated token's log-probability (model:generate, cached
--       batched decoding) equals the one model:logprobs computes from one training forward over prompt + completion;
--   (d) training runs through it: loss, LM-loss gradients and, with the indexer KL loss, the indexer's gradients
--       are finite, and the indexer's gradients differ from the option-off ones (the rotation and the FP4 rounding
--       are in the path);
--   (e) errors: a non-boolean is refused; the flag reads back;
--   (f) where ds4.cuda_devices() > 0 (scripts/gpu.sh; CI has none): the option turned on for a model loaded onto the
--       GPU, fp32 and bf16, and (b), (c), (d) there: decoding == full forward and rollout == training bit for bit on
--       the device (tests/test_cuda_kv_qat.c compares the device with the CPU).
-- Straight-through gradients have no finite-difference reference (the rounding is piecewise constant); (d) checks
-- that they exist and are finite, not their values.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local fixtures = H.fixtures()
local lcg, random_ids, slice = H.lcg, H.random_ids, H.slice

local function f32(t) return ffi.cast("const float *", t:data_ptr()) end

-- max |a - b| over n floats (NaN counts as infinite)
local function maxdiff(a, ao, b, bo, n)
    local w = 0
    for i = 0, n - 1 do
        local d = math.abs(a[ao + i] - b[bo + i])
        if d ~= d then d = math.huge end
        if d > w then w = d end
    end
    return w
end

local function is_pow2(n) return n >= 1 and math.floor(math.log(n) / math.log(2) + 0.5) == math.log(n) / math.log(2) end

-- (b) decoding == full forward, bitwise, on the model's device (the option on); ref: its full-forward logits of seq
local function decoding(model, name, seq, ref, rnd, V)
    local c = model:new_cache(64)
    local worst, pos = 0, 0
    for _, k in ipairs({ 3, 2, 1, 5, 7, 1, 4, 8, 2, 4 }) do
        local out = model:step({ c }, { slice(seq, pos + 1, pos + k) }, { logits = "all" })
        worst = math.max(worst, maxdiff(f32(out.logits), 0, ref, pos * V, k * V))
        pos = pos + k
    end
    H.eq(worst, 0, name .. ": chunked decoding vs one full forward, option on (max |diff|)")
    local seq_b = random_ids(rnd, 29, V)
    local ref_b = model:forward({ seq_b }).logits
    local ca, cb = model:new_cache(40), model:new_cache(40)
    local pa, pb, worst2 = 0, 0, 0
    local ch_a, ch_b = { 5, 1, 6, 3, 8, 2, 9, 3 }, { 1, 7, 2, 4, 1, 9, 5 }
    for k = 1, 8 do
        local caches, ids, what = {}, {}, {}
        if ch_a[k] then
            caches[#caches + 1], ids[#ids + 1] = ca, slice(seq, pa + 1, pa + ch_a[k])
            what[#what + 1] = { ref, pa, ch_a[k] }
            pa = pa + ch_a[k]
        end
        if ch_b[k] then
            caches[#caches + 1], ids[#ids + 1] = cb, slice(seq_b, pb + 1, pb + ch_b[k])
            what[#what + 1] = { f32(ref_b), pb, ch_b[k] }
            pb = pb + ch_b[k]
        end
        local out = model:step(caches, ids, { logits = "all" })
        local r = 0
        for _, w in ipairs(what) do
            worst2 = math.max(worst2, maxdiff(f32(out.logits), r * V, w[1], w[2] * V, w[3] * V))
            r = r + w[3]
        end
    end
    H.eq(worst2, 0, name .. ": two caches stepping together vs full forwards, option on (max |diff|)")
    io.write(("%s: decoding vs full forward, option on: max |diff| %g and %g\n"):format(name, worst, worst2))
end

-- (c) rollout log-probabilities == training log-probabilities, exactly, on the model's device (the option on)
local function rollout(model, name, rnd, V)
    local prompts = { random_ids(rnd, 3, V), random_ids(rnd, 11, V), random_ids(rnd, 20, V) }
    local res = model:generate(prompts, { n = 2, max_new_tokens = 9, temperature = 1.0, seed = 5, ignore_eos = true })
    local ids, labels, S = {}, {}, 0
    for i, r in ipairs(res) do
        local p = prompts[r.prompt_index]
        local x, l = {}, {}
        for _, v in ipairs(p) do x[#x + 1] = v; l[#l + 1] = -100 end
        for _, v in ipairs(r.ids) do x[#x + 1] = v; l[#l + 1] = v end
        ids[i], labels[i] = x, l
        S = math.max(S, #x)
    end
    for i = 1, #ids do
        for t = #ids[i] + 1, S do ids[i][t], labels[i][t] = 1, -100 end
    end
    model:forward(ids, { labels = labels, train = true })
    local lp = f32(model:logprobs())
    local mism, count = 0, 0
    for i, r in ipairs(res) do
        local p = #prompts[r.prompt_index]
        for j = 1, #r.ids do
            -- logp[b][s] scores labels[b][s + 1]: generated token j (1-based) sits at position p + j
            local d = math.abs(lp[(i - 1) * S + p + j - 2] - r.logprobs[j])
            if d ~= d then d = math.huge end
            mism = math.max(mism, d)
            count = count + 1
        end
    end
    H.eq(mism, 0, ("%s: %d rollout log-probabilities vs the training forward's, option on (max |diff|)"):format(
        name, count))
    io.write(("%s: rollout vs training log-probabilities over %d tokens: max |diff| %g\n"):format(name, count, mism))
end

-- (d) training through it, with the indexer KL loss; leaves the option off
local function training(model, name, seq)
    local function grads_with(on)
        model:set_kv_qat(on)
        model:set_train_options({ indexer_kl = 1.0 })
        model:zero_grad()
        local out = model:forward({ seq }, { labels = seq })
        model:backward()
        local g = model:grads({ canonical = true })
        model:set_train_options({})
        return out, g
    end
    local out_q, g_q = grads_with(true)
    local _, g_p = grads_with(false)
    H.check(out_q.loss == out_q.loss and math.abs(out_q.loss) < math.huge, name .. ": finite loss, option on")
    local nonfinite, idx_moved, n_idx = 0, 0, 0
    for k, t in pairs(g_q) do
        local a, b = f32(t), f32(g_p[k])
        local m = t:numel()
        for i = 0, m - 1 do
            if a[i] ~= a[i] or math.abs(a[i]) == math.huge then nonfinite = nonfinite + 1 end
        end
        if k:find("indexer", 1, true) then
            n_idx = n_idx + 1
            if maxdiff(a, 0, b, 0, m) > 0 then idx_moved = idx_moved + 1 end
        end
    end
    H.eq(nonfinite, 0, name .. ": every gradient finite, option on")
    H.check(n_idx > 0 and idx_moved > 0, ("%s: %d of %d indexer gradient tensors moved with the option"):format(
        name, idx_moved, n_idx))
    io.write(("%s: loss %.6f with the option; %d of %d indexer gradient tensors differ from the option off\n")
        :format(name, out_q.loss, idx_moved, n_idx))
end

for _, name in ipairs({ "tiny_a", "tiny_b", "tiny_hf" }) do
    local model = ds4.load(fixtures .. "/" .. name)
    local cfg = model:config()
    if not is_pow2(cfg.index_head_dim) then
        io.write(("%s: index_head_dim %d is not a power of two: skipped\n"):format(name, cfg.index_head_dim))
        goto continue
    end
    do
        local V = cfg.vocab_size
        local rnd = lcg(777 + #name)
        local seq = random_ids(rnd, 37, V)
        local n = #seq * V

        -- (a) applied, close, and reversible
        local plain = model:forward({ seq }).logits
        H.eq(model:kv_qat(), false, name .. ": off by default")
        model:set_kv_qat(true)
        H.eq(model:kv_qat(), true, name .. ": reads back")
        local q1 = model:forward({ seq }).logits
        local q2 = model:forward({ seq }).logits
        local moved = maxdiff(f32(plain), 0, f32(q1), 0, n)
        local top = 0
        for i = 0, n - 1 do top = math.max(top, math.abs(f32(plain)[i])) end
        H.eq(maxdiff(f32(q1), 0, f32(q2), 0, n), 0, name .. ": two forwards with the option on give the same bits")
        H.check(moved > 0 and moved < top, ("%s: the option moves the logits by %.3g (want > 0 and < %.3g, their "
            .. "largest magnitude)"):format(name, moved, top))
        model:set_kv_qat(false)
        local back = model:forward({ seq }).logits
        H.eq(maxdiff(f32(plain), 0, f32(back), 0, n), 0, name .. ": off again gives the original logits bit for bit")
        model:set_kv_qat(true)
        io.write(("%s: option on moves the logits by %.3g (largest |logit| %.3g)\n"):format(name, moved, top))

        decoding(model, name, seq, f32(q1), rnd, V)
        rollout(model, name, rnd, V)
        training(model, name, seq)

        -- (e) errors
        H.raises(function() model:set_kv_qat(1) end, { "ds4.model:set_kv_qat" }, name .. ": a number is refused")

        -- (f) on a GPU, fp32 and bf16: the option set on a model already there, (b)-(d) on the device
        for _, dtype in ipairs(ds4.cuda_devices() > 0 and { "fp32", "bf16" } or {}) do
            local label = ("%s cuda %s"):format(name, dtype)
            local dm = ds4.load(fixtures .. "/" .. name, { device = "cuda", dtype = dtype })
            local dplain = dm:forward({ seq }).logits
            dm:set_kv_qat(true)
            H.eq(dm:kv_qat(), true, label .. ": reads back")
            local dq = dm:forward({ seq }).logits
            H.check(maxdiff(f32(dplain), 0, f32(dq), 0, n) > 0, label .. ": the option moves the logits")
            decoding(dm, label, seq, f32(dq), lcg(31 + #name), V)
            rollout(dm, label, lcg(37 + #name), V)
            training(dm, label, seq)
            dm:free()
        end
    end
    ::continue::
end

H.done()
