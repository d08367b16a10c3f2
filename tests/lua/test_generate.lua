-- test_generate.lua — generation from Lua (lua/gen_lua.c): model:generate, model:new_cache / model:step,
-- ds4.sample and ds4.sample_uniform, each against a reference computed independently here.
-- Usage: ds4 run tests/lua/test_generate.lua <fixtures_dir>
--
-- References and bounds:
--   (a) teacher forcing: every generated token's log-probability is recomputed from ONE model:forward over
--       prompt..generated (log-softmax in double, here in Lua, of the logits row before the token), and the
--       sampled distribution (temperature, top-k, top-p, min-p in HF's order) is rebuilt from that row to check
--       that the token is in its support and that sample_logprobs is its renormalised log-probability.
--       Bound 1e-5: both sides are fp32 logits from the same kernels (ds4_gen.h promises that any chunking of a
--       sequence gives the full forward's rows), the log-softmax is taken in double on both sides, and the
--       result stores the log-probability as a float (rounding ~1e-7 for |lp| < 10).
--   (b) model:step in irregular chunks, one and two caches per step, against the full forward's logits rows;
--       bound 1e-5 for the same reason (the maximum difference is printed: 0 is expected).
--   (c) n samples and seeds: same seed -> same ids, another seed -> other ids, max_batch = 1 and prefill_chunk
--       give the batched result, samples of a prompt differ, result order is prompt-major.
--   (d) finish reasons: length, stop_token, stop_string (byte-level tokenizer; the stop string is read off a
--       first greedy run), eos (found by sampling with ignore_eos, then generated again without it: the
--       counter-based sampler draws the same tokens, so the run must end at the first eos), cancelled by
--       on_token returning false, errors raised inside on_token re-raised unchanged.
--   (e) argument errors, with the message checked.
--   (f) record_experts: the checkpoint's own tid2eid table is the reference for hash-routed layers; every
--       expert id is in [0, E) and distinct within a token; record_index: shape and the causal bound on the
--       number of compressed entries. Both equal what model:step records for the same tokens.
--   ds4.sample: on a grid of N uniform draws the counts of each id equal N times the reference probability
--   (within 1: inverse-CDF sampling), lp_model / lp_sample against Lua's log-softmax.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local fixtures = H.fixtures()
local FIXTURES = { "tiny_a", "tiny_b", "tiny_hf" }
local TOL = 1e-5

-- ------------------------------------------------------------------------------------------------ helpers

local lcg, random_ids = H.lcg, H.random_ids -- Park–Miller draws; token ids without 0 (bos) and 1 (eos)

local function concat(a, b)
    local t = {}
    for i = 1, #a do t[#t + 1] = a[i] end
    for i = 1, #b do t[#t + 1] = b[i] end
    return t
end

local slice = H.slice

local function f32(t) return ffi.cast("const float *", t:data_ptr()) end
local function i32(t) return ffi.cast("const int32_t *", t:data_ptr()) end

-- Log-softmax (double) of the V floats at p[off .. off + V - 1]: 0-based table id -> log p.
local function log_softmax(p, off, V)
    local mx = -math.huge
    for i = 0, V - 1 do
        if p[off + i] > mx then mx = p[off + i] end
    end
    local z = 0
    for i = 0, V - 1 do z = z + math.exp(p[off + i] - mx) end
    local lse = mx + math.log(z)
    local lp = {}
    for i = 0, V - 1 do lp[i] = p[off + i] - lse end
    return lp
end

-- The distribution sampled from, rebuilt from logits p[off ..] (HF warper order: temperature, top-k, top-p,
-- min-p): 0-based table id -> probability (absent: filtered out). Greedy (temperature 0): {argmax = 1}.
local function sampled_dist(p, off, V, s)
    local T = s.temperature or 1
    local mx, arg = -math.huge, 0
    for i = 0, V - 1 do
        if p[off + i] > mx then mx, arg = p[off + i], i end
    end
    if T == 0 then return { [arg] = 1 } end
    local ent = {}
    for i = 0, V - 1 do ent[i + 1] = { w = math.exp((p[off + i] - mx) / T), id = i } end
    table.sort(ent, function(a, b)
        if a.w ~= b.w then return a.w > b.w end
        return a.id < b.id
    end)
    local n = #ent
    local k = s.top_k or 0
    if k > 0 and k < n then n = k end
    local top_p = s.top_p or 1
    if top_p < 1 then
        local tot = 0
        for i = 1, n do tot = tot + ent[i].w end
        local cum, keep = 0, n
        for i = 1, n do
            cum = cum + ent[i].w
            if cum / tot >= top_p then keep = i break end
        end
        n = keep
    end
    local min_p = s.min_p or 0
    local dist, tot = {}, 0
    for i = 1, n do
        if ent[i].w >= min_p * ent[1].w then
            dist[ent[i].id] = ent[i].w
            tot = tot + ent[i].w
        end
    end
    for id, w in pairs(dist) do dist[id] = w / tot end
    return dist
end

local function load(name) return ds4.load(fixtures .. "/" .. name) end

local function first_diff(a, b)
    for i = 1, math.max(#a, #b) do
        if a[i] ~= b[i] then return i end
    end
    return nil
end

-- Results of two generate calls hold the same ids (exactly) and log-probabilities (within TOL).
local function same_results(r1, r2, what)
    if not H.eq(#r1, #r2, what .. ": result count") then return false end
    local ok, lpd = true, 0
    for i = 1, #r1 do
        ok = H.same(r1[i].ids, r2[i].ids, ("%s: res[%d].ids"):format(what, i)) and ok
        ok = H.eq(r1[i].finish_reason, r2[i].finish_reason, ("%s: res[%d].finish_reason"):format(what, i)) and ok
        for j = 1, math.min(#r1[i].logprobs, #r2[i].logprobs) do
            lpd = math.max(lpd, math.abs(r1[i].logprobs[j] - r2[i].logprobs[j]))
        end
    end
    return H.check(lpd <= TOL, ("%s: logprobs differ by %.3g"):format(what, lpd)) and ok
end

-- ------------------------------------------------------------------------------------------------ (a) teacher forcing
local SAMPLINGS = {
    { temperature = 1 },
    { temperature = 0.7, top_k = 20 },
    { temperature = 1.3, top_p = 0.9 },
    { temperature = 1, top_k = 50, min_p = 0.05 },
    { temperature = 0 },
}

local function teacher_forcing(name)
    local model = load(name)
    local V = model:config().vocab_size
    local rnd = lcg(#name * 7919 + 17)
    local prompts = { random_ids(rnd, 1, V), random_ids(rnd, 6, V), random_ids(rnd, 17, V) }
    local worst_lp, worst_slp, checked = 0, 0, 0
    for si, s in ipairs(SAMPLINGS) do
        local opts = { max_new_tokens = 16, n = 2, seed = 100 + si, ignore_eos = true }
        for k, v in pairs(s) do opts[k] = v end
        local res = model:generate(prompts, opts)
        H.eq(#res, 6, name .. ": #res = #prompts * n")
        for i, r in ipairs(res) do
            local what = ("%s sampling %d res[%d]"):format(name, si, i)
            H.eq(r.prompt_index, math.floor((i - 1) / 2) + 1, what .. ".prompt_index")
            H.eq(r.sample_index, (i - 1) % 2 + 1, what .. ".sample_index")
            local prompt = prompts[r.prompt_index]
            H.eq(r.prompt_len, #prompt, what .. ".prompt_len")
            H.eq(#r.ids, 16, what .. ": max_new_tokens ids (ignore_eos)")
            H.eq(r.finish_reason, "length", what .. ".finish_reason")
            H.eq(#r.logprobs, #r.ids, what .. ": #logprobs")
            H.eq(#r.sample_logprobs, #r.ids, what .. ": #sample_logprobs")
            local full = concat(prompt, r.ids)
            local logits = model:forward({ full }).logits
            local p = f32(logits)
            for j, id in ipairs(r.ids) do
                local off = (#prompt + j - 2) * V -- the row of the token just before ids[j]
                local lp = log_softmax(p, off, V)
                local d = math.abs(lp[id] - r.logprobs[j])
                worst_lp = math.max(worst_lp, d)
                if d > TOL then
                    H.check(false, ("%s: logprobs[%d] = %.9g, teacher forcing %.9g"):format(what, j, r.logprobs[j], lp[id]))
                end
                local dist = sampled_dist(p, off, V, s)
                if not H.check(dist[id] ~= nil, ("%s: ids[%d] = %d is outside the sampled support"):format(what, j, id)) then
                    break
                end
                local want = s.temperature == 0 and 0 or math.log(dist[id])
                d = math.abs(want - r.sample_logprobs[j])
                worst_slp = math.max(worst_slp, d)
                if d > TOL then
                    H.check(false, ("%s: sample_logprobs[%d] = %.9g, reference %.9g"):format(what, j,
                        r.sample_logprobs[j], want))
                end
                -- the whole draw again: ds4.sample on the teacher-forced row with generation's uniform (stream =
                -- prompt << 32 | sample, step = tokens generated before: core/generate.c)
                local row = {}
                for v = 0, V - 1 do row[v + 1] = p[off + v] end
                local u = ds4.sample_uniform(opts.seed, (r.prompt_index - 1) * 2 ^ 32 + (r.sample_index - 1), j - 1)
                local rid = ds4.sample(row, s, u)
                if rid ~= id then
                    H.check(false, ("%s: ids[%d] = %d, ds4.sample on the teacher-forced row draws %d"):format(what, j, id, rid))
                end
                checked = checked + 1
            end
            -- (a use of logits after the last read through p: the tensor stays alive while p is read)
            H.same(logits:shape(), { 1, #full, V }, what .. ": forward logits shape")
        end
        H.check(type(res.stats) == "table", name .. ": res.stats")
    end
    io.write(("(a) %s: %d generated tokens teacher-forced: max |logprob diff| %.3g, max |sample_logprob diff| %.3g "
        .. "(bound %g)\n"):format(name, checked, worst_lp, worst_slp, TOL))
    model:free()
end

-- ------------------------------------------------------------------------------------------------ (b) step
-- Feed seq through cache in chunks; rows of logits = "all" against the rows of ref (a [1, S, V] logits tensor).
local function step_chunked(name)
    local model = load(name)
    local V = model:config().vocab_size
    local rnd = lcg(4242 + #name)
    local seq_a, seq_b = random_ids(rnd, 40, V), random_ids(rnd, 33, V)
    local keep = { model:forward({ seq_a }).logits, model:forward({ seq_b }).logits } -- anchors the data
    local ref_a, ref_b = f32(keep[1]), f32(keep[2])

    local function cmp_rows(got, gr0, ref, r0, n, worst)
        local g = f32(got)
        for r = 0, n - 1 do
            for v = 0, V - 1 do
                local d = math.abs(g[(gr0 + r) * V + v] - ref[(r0 + r) * V + v])
                if d ~= d then d = math.huge end
                if d > worst then worst = d end
            end
        end
        return worst
    end

    -- one cache, irregular chunks
    local c = model:new_cache(64)
    H.eq(c:len(), 0, name .. ": new cache is empty")
    H.eq(c:capacity(), 64, name .. ": capacity")
    H.check(c:bytes() > 0, name .. ": cache bytes")
    H.check(tostring(c):find("ds4.cache (0 of 64 positions", 1, true) ~= nil, "tostring(cache): " .. tostring(c))
    local chunks = { 3, 2, 1, 5, 7, 1, 4, 8, 2, 7 }
    local worst, pos = 0, 0
    for _, n in ipairs(chunks) do
        local out = model:step({ c }, { slice(seq_a, pos + 1, pos + n) }, { logits = "all" })
        H.same(out.logits:shape(), { n, V }, name .. ": logits = \"all\" shape")
        worst = cmp_rows(out.logits, 0, ref_a, pos, n, worst)
        pos = pos + n
        H.eq(c:len(), pos, name .. ": cache length after a step")
    end
    H.check(worst <= TOL, ("%s: chunked step vs full forward: max |diff| %.3g"):format(name, worst))
    io.write(("(b) %s: one cache, chunks %s: max |logit diff| vs forward %.3g (bound %g)\n"):format(name,
        table.concat(chunks, ","), worst, TOL))

    -- two caches in one step, different chunkings; logits = "last" (the default) and "all"
    local ca, cb = model:new_cache(40), model:new_cache(50)
    local chunks_a = { 5, 1, 1, 6, 3, 8, 2, 2, 9, 3 }
    local chunks_b = { 1, 7, 2, 2, 4, 1, 9, 7 }
    local pa, pb, worst2, worst_last = 0, 0, 0, 0
    for k = 1, math.max(#chunks_a, #chunks_b) do
        local caches, ids, what = {}, {}, {}
        if chunks_a[k] then
            caches[#caches + 1], ids[#ids + 1] = ca, slice(seq_a, pa + 1, pa + chunks_a[k])
            what[#what + 1] = { ref_a, pa, chunks_a[k] }
            pa = pa + chunks_a[k]
        end
        if chunks_b[k] then
            caches[#caches + 1], ids[#ids + 1] = cb, slice(seq_b, pb + 1, pb + chunks_b[k])
            what[#what + 1] = { ref_b, pb, chunks_b[k] }
            pb = pb + chunks_b[k]
        end
        local all = (k % 2 == 1)
        local out = model:step(caches, ids, all and { logits = "all" } or nil)
        local r = 0
        for s, w in ipairs(what) do
            if all then
                worst2 = cmp_rows(out.logits, r, w[1], w[2], w[3], worst2)
                r = r + w[3]
            else
                worst_last = cmp_rows(out.logits, s - 1, w[1], w[2] + w[3] - 1, 1, worst_last)
            end
        end
        if not all then H.same(out.logits:shape(), { #caches, V }, name .. ": logits = \"last\" shape") end
    end
    H.eq(ca:len(), 40, name .. ": cache a length")
    H.eq(cb:len(), 33, name .. ": cache b length")
    H.check(worst2 <= TOL and worst_last <= TOL, ("%s: two caches per step: max |diff| %.3g (all), %.3g (last)")
        :format(name, worst2, worst_last))
    io.write(("(b) %s: two caches per step: max |logit diff| %.3g (all rows), %.3g (last rows)\n"):format(name,
        worst2, worst_last))

    -- copy_from: a copy continues exactly like the original; reset empties
    local c2 = model:new_cache(64)
    local c3 = model:new_cache(64)
    model:step({ c2 }, { slice(seq_a, 1, 21) })
    c3:copy_from(c2)
    H.eq(c3:len(), 21, name .. ": copy_from copies the length")
    local o2 = model:step({ c2 }, { slice(seq_a, 22, 30) }, { logits = "all" })
    local o3 = model:step({ c3 }, { slice(seq_a, 22, 30) }, { logits = "all" })
    H.check(cmp_rows(o3.logits, 0, f32(o2.logits), 0, 9, 0) == 0, name .. ": a copied cache continues identically")
    H.same(o2.logits:shape(), { 9, V }, name .. ": logits of the original") -- o2 stays alive past the read
    H.check(cmp_rows(o3.logits, 0, ref_a, 21, 9, 0) <= TOL, name .. ": the copy continues like the full forward")
    c3:reset()
    H.eq(c3:len(), 0, name .. ": reset")
    local o4 = model:step(c3, slice(seq_a, 1, 4), { logits = "all" }) -- a single cache with a single id array
    H.check(cmp_rows(o4.logits, 0, ref_a, 0, 4, 0) <= TOL, name .. ": after reset, a cache starts over")
    -- keep: the reference logits stay alive until here, past the last read through ref_a / ref_b
    H.same(keep[1]:shape(), { 1, 40, V }, name .. ": reference logits a")
    H.same(keep[2]:shape(), { 1, 33, V }, name .. ": reference logits b")
    model:free()
end

-- Routing and indexer records of model:step do not depend on chunking either.
local function step_records()
    local model = load("tiny_a")
    local cfg = model:config()
    local V = cfg.vocab_size
    local seq = random_ids(lcg(99), 30, V)
    local c1, c2 = model:new_cache(30), model:new_cache(30)
    local one = model:step(c1, seq, { experts = true, index = true, logits = "none" })
    H.eq(one.logits, nil, "logits = \"none\" returns no logits")
    H.same(one.experts:shape(), { 30, cfg.num_hidden_layers, cfg.num_experts_per_tok }, "step experts shape")
    local n_csa = 0
    for _, t in ipairs(cfg.layer_types) do
        if t == "compressed_sparse_attention" then n_csa = n_csa + 1 end
    end
    H.same(one.index_picks:shape(), { 30, n_csa, cfg.index_topk }, "step index_picks shape")
    local ex, ix = one.experts:totable(), one.index_picks:totable()
    local pos, mismatch = 0, 0
    for _, n in ipairs({ 1, 4, 3, 9, 2, 11 }) do
        local o = model:step(c2, slice(seq, pos + 1, pos + n), { experts = true, index = true })
        local e, x = o.experts:totable(), o.index_picks:totable()
        for r = 1, n do
            if not H.same(e[r], ex[pos + r], ("experts of token %d, chunked vs one step"):format(pos + r)) then
                mismatch = mismatch + 1
            end
            H.same(x[r], ix[pos + r], ("index picks of token %d, chunked vs one step"):format(pos + r))
        end
        pos = pos + n
    end
    model:free()
end

-- The cache keeps its model alive; model:free() makes it unusable but collectable.
local function cache_lifetime()
    local c
    do
        local model = load("tiny_a")
        c = model:new_cache(16)
        model:step(c, { 5, 6, 7 })
    end
    collectgarbage()
    collectgarbage()
    H.eq(c:len(), 3, "cache after its model object went out of scope")
    H.check(c:bytes() > 0, "cache bytes after its model object went out of scope (the model is kept alive)")
    local model = load("tiny_a")
    local c2 = model:new_cache(8)
    model:free()
    H.raises(function() return c2:len() end, { "ds4.cache:len", "model has been freed" }, "cache after model:free()")
    H.check(tostring(c2):find("model freed", 1, true) ~= nil, "tostring of a cache of a freed model")
    c2:free()
    H.raises(function() return c2:len() end, { "has been freed" }, "cache after c:free()")
    c2:free() -- twice is harmless
    H.check(ds4.is_cache(c) and not ds4.is_cache({}), "ds4.is_cache")
end

local function step_errors()
    local model = load("tiny_a")
    local other = load("tiny_hf")
    local V = model:config().vocab_size
    local c, c2 = model:new_cache(4), model:new_cache(8)
    local co = other:new_cache(4)
    H.raises(function() return model:step({ c }, { { V } }) end, { "ds4.model:step", "ids[1][1] = 256", "vocabulary size 256" },
        "step: id out of range")
    H.raises(function() return model:step({ c }, { { -1 } }) end, { "not a token id" }, "step: negative id")
    H.raises(function() return model:step({ c }, { {} }) end, { "ids[1] is empty" }, "step: empty ids")
    H.raises(function() return model:step({ c, c }, { { 1 }, { 2 } }) end, { "are the same cache" }, "step: same cache twice")
    H.raises(function() return model:step({ c, c2 }, { { 1 } }) end, { "2 caches but 1 id sequences" }, "step: count mismatch")
    H.raises(function() return model:step({ c }, { 1, 2 }) end, { "1 caches but 2 id sequences", "one per cache" },
        "step: flat ids for an array of caches")
    H.raises(function() return model:step({ co }, { { 1 } }) end, { "belongs to another model" }, "step: foreign cache")
    H.raises(function() return model:step({ c }, { { 1, 2, 3, 4, 5 } }) end, { "5 new tokens do not fit", "0 of 4" },
        "step: over capacity")
    H.eq(c:len(), 0, "a failed step appends nothing")
    H.raises(function() return model:step({ c }, { { 1 } }, { logits = "some" }) end, { "opts.logits must be" },
        "step: bad logits mode")
    H.raises(function() return model:step({ c }, { { 1 } }, { expert = true }) end, { "unknown option 'expert'" },
        "step: unknown option")
    H.raises(function() return model:step({}, {}) end, { "empty array" }, "step: no caches")
    H.raises(function() return model:step({ {} }, { { 1 } }) end, { "caches[1] must be a ds4.cache" }, "step: not a cache")
    H.raises(function() return model:new_cache(0) end, { "max_len", "positive integer" }, "new_cache(0)")
    H.raises(function() return model:new_cache(2.5) end, { "positive integer" }, "new_cache(2.5)")
    H.raises(function() return c:copy_from(co) end, { "different models" }, "copy_from another model's cache")
    model:step(c2, { 1, 2, 3, 4, 5 })
    H.raises(function() return c:copy_from(c2) end, { "capacity" }, "copy_from a longer cache")
    -- an integer tensor is accepted for the ids, as a Lua array is
    local a = model:step(c, ds4.tensor({ 7, 8 }, "I64"), { logits = "all" })
    c:reset()
    local b = model:step(c, { 7, 8 }, { logits = "all" })
    H.same(a.logits:totable(), b.logits:totable(), "step: tensor ids = table ids")
    model:free()
    other:free()
end

-- ------------------------------------------------------------------------------------------------ (c) samples, seeds
local function seeds_and_batching()
    local model = load("tiny_a")
    local V = model:config().vocab_size
    local rnd = lcg(777)
    local prompts = { random_ids(rnd, 3, V), random_ids(rnd, 11, V), random_ids(rnd, 20, V) }
    local base = { max_new_tokens = 24, temperature = 1, n = 3, seed = 11, ignore_eos = true }
    local function with(extra)
        local o = {}
        for k, v in pairs(base) do o[k] = v end
        for k, v in pairs(extra or {}) do o[k] = v end
        return o
    end
    local r1 = model:generate(prompts, with())
    local r2 = model:generate(prompts, with())
    same_results(r1, r2, "same seed")
    local r3 = model:generate(prompts, with({ seed = 12 }))
    local differ = 0
    for i = 1, #r1 do
        if first_diff(r1[i].ids, r3[i].ids) then differ = differ + 1 end
    end
    H.eq(differ, #r1, "another seed changes every sequence (24 tokens at temperature 1)")
    local within = 0
    for p = 0, 2 do
        for s = 2, 3 do
            if first_diff(r1[p * 3 + 1].ids, r1[p * 3 + s].ids) then within = within + 1 end
        end
    end
    H.eq(within, 6, "the n samples of a prompt differ")
    same_results(model:generate(prompts, with({ max_batch = 1 })), r1, "max_batch = 1 vs batched")
    same_results(model:generate(prompts, with({ max_batch = 2, prefill_chunk = 3 })), r1, "max_batch = 2, prefill_chunk = 3")
    -- a sequence depends on its own prompt, the seed and its (prompt, sample) indices only, not on the others
    local other = model:generate({ random_ids(rnd, 7, V), prompts[2] }, with())
    same_results({ other[4], other[5], other[6] }, { r1[4], r1[5], r1[6] }, "prompt 2 next to another prompt 1")
    -- a share of the batch (data parallelism: a rank's prompts) with prompt_base draws what the whole batch drew
    local share = model:generate({ prompts[2], prompts[3] }, with({ prompt_base = 1 }))
    same_results({ share[1], share[2], share[3], share[4], share[5], share[6] }, { r1[4], r1[5], r1[6], r1[7], r1[8], r1[9] },
        "prompts 2..3 with prompt_base = 1")
    H.check(first_diff(model:generate({ prompts[2] }, with())[1].ids, r1[4].ids) ~= nil,
        "without prompt_base, prompt 2 alone draws another stream")
    -- prompts as 1-D tensors, and as one 2-D tensor of equal-length prompts
    same_results(model:generate({ ds4.tensor(prompts[1], "I64"), ds4.tensor(prompts[2], "I32"), prompts[3] }, with()), r1,
        "tensor prompts")
    local eq2 = { random_ids(rnd, 5, V), random_ids(rnd, 5, V) }
    same_results(model:generate(ds4.tensor(eq2, "I64"), with({ n = 1 })), model:generate(eq2, with({ n = 1 })),
        "a [B, S] tensor of prompts")
    -- stats
    local st = r1.stats
    H.check(type(st) == "table", "res.stats")
    for _, k in ipairs({ "prefill_tokens", "decode_tokens", "prefill_seconds", "decode_seconds", "prefill_tokens_per_s",
        "decode_tokens_per_s" }) do
        H.check(type(st[k]) == "number" and st[k] >= 0, "res.stats." .. k .. " = " .. tostring(st[k]))
    end
    H.check(st.prefill_tokens >= 3 + 11 + 20, ("res.stats.prefill_tokens %s covers the prompts"):format(st.prefill_tokens))
    H.check(st.decode_tokens > 0, "res.stats.decode_tokens")
    io.write(("(c) stats: prefill %d tokens %.1f tok/s, decode %d tokens %.1f tok/s\n"):format(st.prefill_tokens,
        st.prefill_tokens_per_s, st.decode_tokens, st.decode_tokens_per_s))
    model:free()
end

-- ------------------------------------------------------------------------------------------------ (d) finish reasons
local function finish_reasons()
    local model = load("tiny_a")
    local cfg = model:config()
    local V, eos = cfg.vocab_size, cfg.eos_token_id
    local prompt = { 72, 101, 108, 108, 111 }
    local greedy = { temperature = 0, max_new_tokens = 24, ignore_eos = true }
    local g = model:generate({ prompt }, greedy)[1].ids
    H.eq(#g, 24, "greedy run length")

    -- length
    local r = model:generate({ prompt }, { temperature = 0, max_new_tokens = 5, ignore_eos = true })[1]
    H.eq(r.finish_reason, "length", "max_new_tokens -> length")
    H.same(r.ids, slice(g, 1, 5), "length: the greedy prefix")
    H.eq(r.stop, nil, "length: no stop value")

    -- stop token: the first j >= 2 whose token did not occur before
    local j
    for k = 2, #g do
        local seen = false
        for i = 1, k - 1 do seen = seen or g[i] == g[k] end
        if not seen then j = k break end
    end
    if H.check(j ~= nil, "greedy output has a token that does not repeat an earlier one") then
        r = model:generate({ prompt }, { temperature = 0, max_new_tokens = 24, ignore_eos = true, stop = { g[j] } })[1]
        H.eq(r.finish_reason, "stop_token", "stop id -> stop_token")
        H.same(r.ids, slice(g, 1, j), "stop_token: ids end with the stop id")
        H.eq(r.stop, g[j], "stop_token: res.stop is the id")
    end

    -- stop string (built-in byte-level tokenizer: ids 0..255 are the bytes)
    local tok = ds4.tokenizer()
    local text = tok:decode(g)
    local bytes = {}
    for i = 1, #g do bytes[i] = string.char(g[i]) end
    H.eq(text, table.concat(bytes), "byte-level decode of the greedy run")
    local js, s
    for k = 2, #g do
        local cand = string.char(g[k - 1], g[k])
        if g[k - 1] ~= 0 and g[k] ~= 0 and not table.concat(bytes, "", 1, k - 1):find(cand, 1, true) then
            js, s = k, cand
            break
        end
    end
    if H.check(js ~= nil, "a two-byte stop string read off the greedy run") then
        r = model:generate({ prompt }, { temperature = 0, max_new_tokens = 24, ignore_eos = true, tokenizer = tok,
            stop = { V - 1 == g[js] and 0 or V - 1, "\255\254never", s } })[1]
        H.eq(r.finish_reason, "stop_string", "stop string -> stop_string")
        H.same(r.ids, slice(g, 1, js), "stop_string: ids up to the token completing the string")
        H.eq(r.stop, s, "stop_string: res.stop is the string")
    end

    -- eos: sample with ignore_eos until a sequence contains eos, then again without ignore_eos
    local found
    for seed = 1, 40 do
        local opts = { temperature = 1, n = 8, max_new_tokens = 48, seed = seed, ignore_eos = true }
        local res = model:generate({ prompt }, opts)
        for i, q in ipairs(res) do
            for k, id in ipairs(q.ids) do
                if id == eos then found = { seed = seed, i = i, k = k, ids = q.ids } break end
            end
            if found then break end
        end
        if found then break end
    end
    if H.check(found ~= nil, "eos sampled within 40 seeds x 8 samples x 48 tokens") then
        local res = model:generate({ prompt }, { temperature = 1, n = 8, max_new_tokens = 48, seed = found.seed })
        r = res[found.i]
        H.eq(r.finish_reason, "eos", "sampling eos -> eos")
        H.same(r.ids, slice(found.ids, 1, found.k), "eos: the same draws up to and including eos")
        for _, q in ipairs(res) do
            if q.finish_reason == "eos" then H.eq(q.ids[#q.ids], eos, "eos is the last id") end
            for k = 1, #q.ids - 1 do
                if q.ids[k] == eos then H.check(false, "eos before the end of a sequence that did not ignore it") end
            end
        end
        -- ignore_eos with eos as a stop id: stop_token
        r = model:generate({ prompt }, { temperature = 1, n = 8, max_new_tokens = 48, seed = found.seed, ignore_eos = true,
            stop = { eos } })[found.i]
        H.eq(r.finish_reason, "stop_token", "ignore_eos + stop = {eos} -> stop_token")
        H.same(r.ids, slice(found.ids, 1, found.k), "ignore_eos + stop = {eos}: same ids")
        io.write(("(d) eos sampled with seed %d, sample %d, at token %d\n"):format(found.seed, found.i, found.k))
    end

    -- on_token: sees every token as it is sampled, in the result's numbering
    local prompts = { prompt, { 3, 4 } }
    local seen = {}
    local res = model:generate(prompts, { temperature = 1, n = 2, seed = 5, max_new_tokens = 9, ignore_eos = true,
        on_token = function(i, id, lp)
            seen[i] = seen[i] or { ids = {}, lps = {} }
            table.insert(seen[i].ids, id)
            table.insert(seen[i].lps, lp)
        end })
    for i = 1, 4 do
        local s_i = seen[i] or { ids = {}, lps = {} }
        H.same(s_i.ids, res[i].ids, ("on_token ids of res[%d]"):format(i))
        for k = 1, #s_i.lps do
            H.near(s_i.lps[k], res[i].logprobs[k], 1e-6, ("on_token logprob %d of res[%d]"):format(k, i))
        end
    end

    -- on_token returning false cancels everything
    local calls = 0
    res = model:generate(prompts, { temperature = 1, n = 2, seed = 5, max_new_tokens = 9, ignore_eos = true,
        on_token = function()
            calls = calls + 1
            if calls == 5 then return false end
            return true -- anything but false continues
        end })
    local total = 0
    for i, q in ipairs(res) do
        H.eq(q.finish_reason, "cancelled", ("res[%d] cancelled by on_token"):format(i))
        H.check(#q.ids < 9, ("res[%d]: cancelled early (%d ids)"):format(i, #q.ids))
        total = total + #q.ids
    end
    H.check(total >= 5 and total <= 8, ("cancelled after the 5th token: %d tokens kept in all"):format(total))

    -- an error inside on_token: the generation is cancelled and the error re-raised unchanged
    H.raises(function()
        return model:generate(prompts, { max_new_tokens = 9, on_token = function(i) if i == 2 then error("boom in on_token") end end })
    end, { "boom in on_token" }, "error in on_token")
    local obj = { "an error object" }
    local ok, e = pcall(model.generate, model, prompts, { on_token = function() error(obj) end })
    H.check(not ok and e == obj, "a non-string error value from on_token is re-raised as is")
    -- the model is not left busy
    r = model:generate({ prompt }, greedy)[1]
    H.same(r.ids, g, "generate after an on_token error")

    -- re-entering the model from on_token raises there (and the outer generation carries on)
    local errs = {}
    local cache = model:new_cache(8)
    r = model:generate({ prompt }, { temperature = 0, max_new_tokens = 3, ignore_eos = true, on_token = function()
        for _, f in ipairs({
            function() return model:forward({ { 1, 2 } }) end,
            function() return model:generate({ { 1 } }) end,
            function() return model:step(cache, { 1 }) end,
            function() return model:free() end,
        }) do
            local ok2, e2 = pcall(f)
            errs[#errs + 1] = not ok2 and tostring(e2) or "no error"
        end
    end })[1]
    H.same(r.ids, slice(g, 1, 3), "generation with re-entrant calls in on_token")
    H.eq(#errs, 12, "re-entrant calls: 4 per token")
    for i, m in ipairs(errs) do
        H.check(m:find("the model is generating", 1, true) ~= nil, ("re-entrant call %d: %s"):format(i, m))
    end
    H.eq(model:step(cache, { 1, 2 }).logits:shape()[1], 1, "the model works after the generation")

    -- on_token may collect garbage and change the prompt / option tables: generate works on its own copies
    local mprompts = { { 72, 101, 108 }, { 108, 111 } }
    local mopts = { temperature = 1, n = 2, seed = 8, max_new_tokens = 6, ignore_eos = true, stop = { 300 % V } }
    local want = model:generate({ { 72, 101, 108 }, { 108, 111 } }, { temperature = 1, n = 2, seed = 8,
        max_new_tokens = 6, ignore_eos = true, stop = { 300 % V } })
    mopts.on_token = function()
        mprompts[1], mprompts[2] = nil, nil
        mopts.stop, mopts.tokenizer = nil, nil
        collectgarbage()
    end
    same_results(model:generate(mprompts, mopts), want, "on_token clearing the prompts and collecting garbage")
    -- a generation with another model inside on_token
    local other = load("tiny_hf")
    local inner = {}
    r = model:generate({ prompt }, { temperature = 0, max_new_tokens = 3, ignore_eos = true, on_token = function()
        inner[#inner + 1] = other:generate({ { 5, 6 } }, { temperature = 0, max_new_tokens = 2, ignore_eos = true })[1].ids
    end })[1]
    H.same(r.ids, slice(g, 1, 3), "generation with a nested generation of another model")
    H.eq(#inner, 3, "nested generations")
    H.same(inner[3], inner[1], "nested greedy generations agree")
    other:free()
    -- yielding from on_token cannot cross ds4_generate: an error, re-raised by generate inside the coroutine
    local co = coroutine.create(function()
        return model:generate({ prompt }, { max_new_tokens = 3, on_token = function() coroutine.yield(1) end })
    end)
    local ok3, e3 = coroutine.resume(co)
    H.check(not ok3 and tostring(e3):find("yield", 1, true) ~= nil, "yield in on_token: " .. tostring(e3))

    -- the host's interrupt flag (lua/main.c stores it under "ds4.interrupt" when it has one)
    local flag = debug.getregistry()["ds4.interrupt"]
    if type(flag) == "userdata" then
        local p = ffi.cast("volatile int *", flag)
        local before = p[0]
        local n_tok = 0
        r = model:generate({ prompt }, { temperature = 0, max_new_tokens = 20, ignore_eos = true, on_token = function()
            n_tok = n_tok + 1
            if n_tok == 3 then p[0] = 1 end
        end })[1]
        p[0] = before
        H.eq(r.finish_reason, "cancelled", "the interrupt flag cancels the generation")
        H.check(#r.ids < 20, "the interrupt flag stops early")
        -- already set when generate starts: nothing runs; the records are empty
        p[0] = 1
        local ok4, res4 = pcall(model.generate, model, { prompt, { 9 } }, { max_new_tokens = 4, n = 2,
            record_experts = true, record_index = true })
        p[0] = before
        if H.check(ok4, "generate with the interrupt flag set: " .. tostring(res4)) then
            H.eq(#res4, 4, "interrupted before the start: every sequence is returned")
            for i, q in ipairs(res4) do
                H.eq(q.finish_reason, "cancelled", ("interrupted before the start: res[%d]"):format(i))
                H.eq(#q.ids, 0, ("interrupted before the start: res[%d] has no ids"):format(i))
                H.eq(q.experts:shape()[1], 0, ("interrupted before the start: res[%d] has no expert rows"):format(i))
            end
        end
    else
        io.write("(d) no ds4.interrupt flag in the registry: interrupt test skipped\n")
    end
    model:free()
end

-- ------------------------------------------------------------------------------------------------ (e) argument errors
local function argument_errors()
    local model = load("tiny_a")
    local G = "ds4.model:generate"
    local function gen(p, o) return function() return model:generate(p, o) end end
    H.raises(gen(nil), { G, "array of prompts expected" }, "nil prompts")
    H.raises(gen({ 1, 2, 3 }), { G, "flat array of numbers", "{ids}" }, "flat prompt")
    H.raises(gen({}), { G, "empty array" }, "no prompts")
    H.raises(gen({ {} }), { G, "prompts[1] is empty" }, "empty prompt")
    H.raises(gen({ { 1, 2 }, "x" }), { G, "prompts[2] must be an array of token ids" }, "string prompt")
    H.raises(gen({ { 1, "x" } }), { G, "prompts[1][2] must be a token id" }, "string id")
    H.raises(gen({ { 1, 2.5 } }), { G, "prompts[1][2] = 2.5 is not a token id" }, "fractional id")
    H.raises(gen({ { 3 }, { 1, 256 } }), { G, "prompts[2][2] = 256 is not a token id", "vocabulary size 256" },
        "id = vocab size")
    H.raises(gen({ { -1 } }), { G, "prompts[1][1] = -1" }, "negative id")
    H.raises(gen({ ds4.tensor({ { 1, 2 } }, "I64") }), { G, "prompts[1] must be a 1-D tensor" }, "2-D tensor prompt")
    H.raises(gen({ { 1 } }, 5), { G, "options table expected" }, "non-table options")
    H.raises(gen({ { 1 } }, { max_tokens = 3 }), { G, "unknown option 'max_tokens'" }, "unknown option")
    H.raises(gen({ { 1 } }, { [1] = true }), { G, "unknown option 1" }, "non-string option key")
    H.raises(gen({ { 1 } }, { stop = { "ab" } }), { G, "opts.stop[1]", "stop strings need opts.tokenizer" },
        "stop string without tokenizer")
    local bad = {
        { { temperature = -1 }, "opts.temperature must be a finite number >= 0" },
        { { temperature = 0 / 0 }, "opts.temperature" },
        { { temperature = math.huge }, "opts.temperature must be finite" },
        { { temperature = "1" }, "opts.temperature" },
        { { top_k = -1 }, "opts.top_k must be an integer >= 0" },
        { { top_k = 1.5 }, "opts.top_k" },
        { { top_p = 0 }, "opts.top_p must be a number in (0, 1]" },
        { { top_p = 1.5 }, "opts.top_p" },
        { { min_p = -0.1 }, "opts.min_p must be a number in [0, 1]" },
        { { n = 0 }, "opts.n must be a positive integer" },
        { { max_new_tokens = 0 }, "opts.max_new_tokens must be a positive integer" },
        { { seed = -1 }, "opts.seed must be a non-negative integer" },
        { { seed = "x" }, "opts.seed" },
        { { ignore_eos = 1 }, "opts.ignore_eos must be a boolean" },
        { { record_experts = "yes" }, "opts.record_experts must be a boolean" },
        { { max_batch = -1 }, "opts.max_batch must be an integer >= 0" },
        { { prefill_chunk = 0.5 }, "opts.prefill_chunk" },
        { { on_token = 5 }, "opts.on_token must be a function" },
        { { tokenizer = {} }, "opts.tokenizer must be a ds4.tokenizer" },
        { { stop = 5 }, "opts.stop must be an array" },
        { { stop = { true } }, "opts.stop[1] must be a token id or a non-empty string" },
        { { stop = { 3, "" }, tokenizer = ds4.tokenizer() }, "opts.stop[2] is an empty string" },
        { { stop = { 256 } }, "opts.stop[1] must be a token id in [0, 256)" },
        { { stop = { "a\0b" }, tokenizer = ds4.tokenizer() }, "NUL" },
    }
    for _, b in ipairs(bad) do
        local k = next(b[1])
        H.raises(gen({ { 1 } }, b[1]), { G, b[2] }, "bad option " .. k)
    end
    -- the errors leave nothing behind: a call afterwards works
    H.eq(#model:generate({ { 1 } }, { max_new_tokens = 2, ignore_eos = true })[1].ids, 2, "generate after the errors")
    model:free()
    H.raises(gen({ { 1 } }), { G, "model has been freed" }, "generate after model:free()")
end

-- ------------------------------------------------------------------------------------------------ (f) records
local function records(name)
    local model = load(name)
    local cfg = model:config()
    local V, L, K, E = cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.n_routed_experts
    -- the independent reference: the checkpoint's tid2eid tables, by layer
    local tid2eid = {}
    for tname, t in pairs(ds4.load_tensors(fixtures .. "/" .. name)) do
        local li = tname:match("layers%.(%d+)%.[%w_]+%.gate%.tid2eid$")
        if li and not tname:match("^mtp") then tid2eid[tonumber(li) + 1] = t:totable() end
    end
    local n_hash = 0
    for li = 1, L do
        if cfg.mlp_layer_types[li] == "hash_moe" then
            n_hash = n_hash + 1
            H.check(tid2eid[li] ~= nil, ("%s: tid2eid of hash layer %d in the checkpoint"):format(name, li - 1))
        end
    end
    local csa_rate = cfg.compress_rates.compressed_sparse_attention
    local n_csa = 0
    for _, t in ipairs(cfg.layer_types) do
        if t == "compressed_sparse_attention" then n_csa = n_csa + 1 end
    end
    local topk = cfg.index_topk

    local rnd = lcg(31337 + #name)
    local prompts = { random_ids(rnd, 2, V), random_ids(rnd, 13, V) }
    local res = model:generate(prompts, { temperature = 1, seed = 9, n = 2, max_new_tokens = 12, ignore_eos = true,
        record_experts = true, record_index = true })
    local hash_checked = 0
    for i, r in ipairs(res) do
        local full = concat(prompts[r.prompt_index], r.ids)
        local rows = r.prompt_len + #r.ids - 1
        local what = ("%s res[%d]"):format(name, i)
        if H.check(r.experts ~= nil, what .. ".experts") then
            H.eq(r.experts:dtype(), "I32", what .. ".experts dtype")
            H.same(r.experts:shape(), { rows, L, K }, what .. ".experts shape [prompt_len + #ids - 1, L, K]")
            local ex = r.experts:totable()
            local bad_range, bad_dup, bad_hash = 0, 0, 0
            for t = 1, rows do
                for li = 1, L do
                    local set = {}
                    for k = 1, K do
                        local e = ex[t][li][k]
                        if not (e >= 0 and e < E) then bad_range = bad_range + 1 end
                        if set[e] then bad_dup = bad_dup + 1 end
                        set[e] = true
                    end
                    if tid2eid[li] and cfg.mlp_layer_types[li] == "hash_moe" then
                        local want = tid2eid[li][full[t] + 1]
                        for k = 1, K do
                            if ex[t][li][k] ~= want[k] then bad_hash = bad_hash + 1 end
                        end
                        hash_checked = hash_checked + 1
                    end
                end
            end
            H.eq(bad_range, 0, what .. ": expert ids outside [0, E)")
            H.eq(bad_dup, 0, what .. ": repeated expert ids within a token's top-k")
            H.eq(bad_hash, 0, what .. ": hash-layer experts differ from the checkpoint's tid2eid")
            -- the same tokens through model:step give the same records
            local c = model:new_cache(rows)
            local o = model:step(c, slice(full, 1, rows), { experts = true, index = true, logits = "none" })
            H.same(r.experts:totable(), o.experts:totable(), what .. ": experts = model:step's")
            if r.index_picks then H.same(r.index_picks:totable(), o.index_picks:totable(), what .. ": index_picks = model:step's") end
        end
        if H.check(r.index_picks ~= nil, what .. ".index_picks") then
            H.same(r.index_picks:shape(), { rows, n_csa, topk }, what .. ".index_picks shape [rows, n_csa, index_topk]")
            local ix = r.index_picks:totable()
            local bad = 0
            for t = 1, rows do
                local entries = math.floor(t / csa_rate) -- windows complete at position t - 1 (0-based)
                for l = 1, n_csa do
                    local set, npos = {}, 0
                    for k = 1, topk do
                        local v = ix[t][l][k]
                        if v >= 0 then
                            npos = npos + 1
                            if v >= entries or set[v] then bad = bad + 1 end
                            set[v] = true
                        elseif v ~= -1 then
                            bad = bad + 1
                        end
                    end
                    if npos ~= math.min(entries, topk) then bad = bad + 1 end
                end
            end
            H.eq(bad, 0, what .. ": index picks outside [-1, entries), repeated, or padding where entries exist")
        end
    end
    io.write(("(f) %s: %d hash-layer rows checked against tid2eid (%d hash layers)\n"):format(name, hash_checked, n_hash))
    -- nothing recorded unless asked
    local r = model:generate({ { 5 } }, { max_new_tokens = 2 })[1]
    H.check(r.experts == nil and r.index_picks == nil, name .. ": no records unless asked")
    model:free()
end

-- ------------------------------------------------------------------------------------------------ ds4.sample
local function sampling()
    local logits = { 1.5, -0.25, 3, 0.5, 3, -2, 0.75 }
    local V = #logits
    local p = ffi.new("float[?]", V, logits)
    local lp = log_softmax(p, 0, V)
    -- greedy: the argmax, ties to the lowest id; lp_sample 0; u may be omitted
    local id, lpm, lps = ds4.sample(logits, { temperature = 0 })
    H.eq(id, 2, "greedy: lowest id among equal maxima")
    H.near(lpm, lp[2], 1e-12, "greedy: lp_model")
    H.eq(lps, 0, "greedy: lp_sample")
    -- inverse CDF on a grid of N uniform draws: counts = N * p within 1
    local N = 2000
    for _, s in ipairs({ {}, { temperature = 0.5, top_k = 3 }, { temperature = 1.2, top_p = 0.7 }, { min_p = 0.3 },
        { top_k = 2, top_p = 0.5 }, { top_k = 1 } }) do
        local dist = sampled_dist(p, 0, V, s)
        local counts, worst_lp = {}, 0
        for k = 0, N - 1 do
            local u = (k + 0.5) / N
            local i, m, q = ds4.sample(logits, s, u)
            counts[i] = (counts[i] or 0) + 1
            worst_lp = math.max(worst_lp, math.abs(m - lp[i]))
            if dist[i] then worst_lp = math.max(worst_lp, math.abs(q - math.log(dist[i]))) end
        end
        local label = ("sample %s"):format(require("ds4.chat.json").encode(s))
        for i = 0, V - 1 do
            local want = (dist[i] or 0) * N
            H.check(math.abs((counts[i] or 0) - want) <= 1 + 1e-9,
                ("%s: id %d drawn %d times of %d, expected %.2f"):format(label, i, counts[i] or 0, N, want))
        end
        H.check(worst_lp <= 1e-6, ("%s: lp_model / lp_sample max diff %.3g"):format(label, worst_lp))
    end
    -- forms of the logits argument: table, F32 tensor [V] or [1, V], another dtype
    local a = { ds4.sample(logits, nil, 0.3) }
    H.same({ ds4.sample(ds4.tensor(logits), nil, 0.3) }, a, "sample: tensor [V] = table")
    H.same({ ds4.sample(ds4.tensor({ logits }), nil, 0.3) }, a, "sample: tensor [1, V] = table")
    H.eq(ds4.sample(ds4.tensor(logits, "F64"), nil, 0.3), a[1], "sample: F64 tensor")
    -- errors
    H.raises(function() return ds4.sample(logits, nil, 1) end, { "ds4.sample", "u in [0, 1)" }, "u = 1")
    H.raises(function() return ds4.sample(logits, {}) end, { "ds4.sample", "u in [0, 1)" }, "u missing")
    H.raises(function() return ds4.sample({ 1, 0 / 0 }, nil, 0.5) end, { "ds4.sample", "NaN" }, "NaN logit")
    H.raises(function() return ds4.sample({}, nil, 0.5) end, { "empty" }, "empty logits")
    H.raises(function() return ds4.sample(logits, { temp = 1 }, 0.5) end, { "unknown option 'temp'" }, "unknown key")
    H.raises(function() return ds4.sample(logits, { top_p = 0 }, 0.5) end, { "opts.top_p" }, "top_p = 0")
    H.raises(function() return ds4.sample(logits, { temperature = -1 }, 0.5) end, { "opts.temperature" }, "negative T")
    -- the counter-based uniform
    local u1 = ds4.sample_uniform(1, 2, 3)
    H.check(u1 >= 0 and u1 < 1, "sample_uniform in [0, 1)")
    H.eq(ds4.sample_uniform(1, 2, 3), u1, "sample_uniform is a function of its arguments")
    H.check(ds4.sample_uniform(1, 2, 4) ~= u1 and ds4.sample_uniform(1, 3, 3) ~= u1 and ds4.sample_uniform(2, 2, 3) ~= u1,
        "sample_uniform changes with each argument")
    local sum, n = 0, 4000
    for k = 0, n - 1 do sum = sum + ds4.sample_uniform(7, 0, k) end
    H.near(sum / n, 0.5, 0.03, "sample_uniform mean over 4000 steps")
    H.raises(function() return ds4.sample_uniform(-1, 0, 0) end, { "ds4.sample_uniform", "seed" }, "negative seed")
    H.raises(function() return ds4.sample_uniform(0, 0.5, 0) end, { "stream" }, "fractional stream")
end

-- ------------------------------------------------------------------------------------------------ run
local sections = {
    { "sampling", sampling },
    { "step", function() for _, n in ipairs(FIXTURES) do step_chunked(n) end end },
    { "step_records", step_records },
    { "cache_lifetime", cache_lifetime },
    { "step_errors", step_errors },
    { "teacher_forcing", function() for _, n in ipairs(FIXTURES) do teacher_forcing(n) end end },
    { "seeds", seeds_and_batching },
    { "finish", finish_reasons },
    { "errors", argument_errors },
    { "records", function() for _, n in ipairs(FIXTURES) do records(n) end end },
}
local only = os.getenv("TEST_GENERATE_ONLY") -- comma-separated section names, for debugging
for _, s in ipairs(sections) do
    if not only or ("," .. only .. ","):find("," .. s[1] .. ",", 1, true) then s[2]() end
end
H.done("test_generate")
