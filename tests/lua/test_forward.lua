-- test_forward.lua — model:forward against the reference outputs stored with each fixture.
-- Usage: ds4 run tests/lua/test_forward.lua <fixtures_dir>
--
-- io.safetensors of every fixture holds input_ids, labels and what transformers (fp32, CPU) computed for
-- them: logits, loss, hidden.<l> (the residual streams after layer l) and, for tiny_a, the MTP block's
-- mtp_logits / mtp_loss.
--
-- Tolerances: both sides are fp32 with a different summation order (blocked matmuls, threaded reductions),
-- which moves results by ~1e-6 relative; the bounds below are the acceptance bounds of the issue:
-- max |logit - ref| <= 1e-4 * max(1, max |ref|) and |loss - ref| <= 1e-5 * |ref|. Hidden streams use the
-- logit rule (they feed the logits, so they cannot be looser than that in practice).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()

local max_diff = H.max_diff

local function check_close(got, ref, what)
    if not H.check(got ~= nil, what .. ": missing") then return end
    if not H.same(got:shape(), ref:shape(), what .. " shape") then return end
    H.eq(got:dtype(), "F32", what .. " dtype")
    local d, m = max_diff(got, ref)
    local tol = 1e-4 * math.max(1, m)
    H.check(d <= tol, ("%s: max |diff| %.3g > %.3g (max |ref| %.3g)"):format(what, d, tol, m))
    return d
end

local function check_loss(got, ref, what)
    if not H.check(type(got) == "number", what .. ": expected a number, got " .. tostring(got)) then return end
    local tol = 1e-5 * math.abs(ref)
    H.check(math.abs(got - ref) <= tol, ("%s: %.9g vs reference %.9g (|diff| %.3g > %.3g)"):format(
        what, got, ref, math.abs(got - ref), tol))
end

-- Rows of a [B, S] tensor as a Lua table of tables.
local function rows_of(t)
    return t:totable()
end

-- Number of labels scored by the HF convention: position t is scored against labels[t+1] unless it is -100.
local function scored(labels, shift)
    local n = 0
    local sh = labels:shape()
    for b = 1, sh[1] do
        for s = 1 + shift, sh[2] do
            if labels:get(b, s) ~= -100 then n = n + 1 end
        end
    end
    return n
end

for _, name in ipairs({ "tiny_a", "tiny_b", "tiny_hf" }) do
    local dir = fixtures .. "/" .. name
    local io_t = ds4.load_tensors(dir .. "/io.safetensors")
    local model = ds4.load(dir)
    local cfg = model:config()
    local ref_loss = io_t.loss:item()

    local r = model:forward(io_t.input_ids, { labels = io_t.labels, hidden = true })
    local d = check_close(r.logits, io_t.logits, name .. " logits")
    check_loss(r.loss, ref_loss, name .. " loss")
    H.eq(r.loss_tokens, scored(io_t.labels, 1), name .. " loss_tokens")
    H.eq(r.mtp_logits, nil, name .. ": no mtp_logits unless asked")

    -- hidden [L, B, S, n, D] against hidden.<l> [B, S, n, D]
    local L = cfg.num_hidden_layers
    local sh = io_t.input_ids:shape()
    H.same(r.hidden and r.hidden:shape(), { L, sh[1], sh[2], cfg.hc_mult, cfg.hidden_size }, name .. " hidden shape")
    if r.hidden then
        local per = sh[1] * sh[2] * cfg.hc_mult * cfg.hidden_size
        local all = r.hidden:reshape({ L, per })
        for l = 0, L - 1 do
            local ref = io_t["hidden." .. l]
            if H.check(ref ~= nil, name .. " fixture has hidden." .. l) then
                local got = ds4.zeros({ per })
                for i = 1, per do got[i] = all:get(l + 1, i) end
                check_close(got:reshape(ref:shape()), ref, ("%s hidden.%d"):format(name, l))
            end
        end
    end

    -- ids / labels as Lua tables of rows give the same result; so do I32 ids.
    local rt = model:forward(rows_of(io_t.input_ids), { labels = rows_of(io_t.labels) })
    local dt = max_diff(rt.logits, r.logits)
    H.eq(dt, 0, name .. ": table ids give the same logits as tensor ids")
    H.eq(rt.loss, r.loss, name .. ": table ids give the same loss")
    local r32 = model:forward(io_t.input_ids:to("I32"), { labels = io_t.labels:to("I32") })
    H.eq(max_diff(r32.logits, r.logits), 0, name .. ": I32 ids give the same logits")
    H.eq(rt.hidden, nil, name .. ": no hidden unless asked")

    -- Without labels: same logits, no loss.
    local rn = model:forward(io_t.input_ids)
    H.eq(max_diff(rn.logits, r.logits), 0, name .. ": logits do not depend on labels")
    H.eq(rn.loss, nil, name .. ": loss is nil without labels")
    H.eq(rn.loss_tokens, 0, name .. ": loss_tokens is 0 without labels")

    -- One row alone: row 2 of the batch must match row 2 of the batched logits (rows are independent).
    local row2 = rows_of(io_t.input_ids)[2]
    local r1 = model:forward({ row2 })
    local V = cfg.vocab_size
    local worst = 0
    for s = 1, sh[2] do
        for v = 1, V do
            local e = math.abs(r1.logits:get(1, s, v) - r.logits:get(2, s, v))
            if e > worst then worst = e end
        end
    end
    local _, maxabs = max_diff(r.logits, r.logits)
    H.check(worst <= 1e-4 * math.max(1, maxabs), name .. ": a row alone matches its batched logits, max diff " .. worst)

    if name == "tiny_a" then
        H.check(model:has_mtp(), "tiny_a has MTP weights")
        local rm = model:forward(io_t.input_ids, { labels = io_t.labels, mtp = true })
        check_close(rm.mtp_logits, io_t.mtp_logits, "tiny_a mtp_logits")
        check_loss(rm.mtp_loss, io_t.mtp_loss:item(), "tiny_a mtp_loss")
        H.eq(rm.mtp_loss_tokens, scored(io_t.labels, 2), "tiny_a mtp_loss_tokens")
        check_close(rm.logits, io_t.logits, "tiny_a logits with mtp")
    else
        H.raises(function() return model:forward(io_t.input_ids, { mtp = true }) end,
            { "ds4.model:forward", "no MTP weights" }, name .. ": mtp without MTP weights")
    end

    -- Argument errors.
    H.raises(function() return model:forward({ { 1, 2, 3 }, { 4, 5 } }) end,
        { "ds4.model:forward", "rows differ in length: row 2 has 2 elements, row 1 has 3" }, name .. ": ragged ids")
    H.raises(function() return model:forward({ { 1, 2.5 } }) end, { "ids[1][2]", "expected an integer token id" },
        name .. ": fractional id")
    H.raises(function() return model:forward(io_t.input_ids, { labels = { { 1, 2 } } }) end,
        { "opts.labels has shape [1, 2], ids have [" }, name .. ": labels shape mismatch")
    H.raises(function() return model:forward(io_t.logits) end, { "ids must be a [batch, seq] tensor, got shape [" },
        name .. ": 3-D ids")
    H.raises(function() return model:forward("abc") end, { "ids must be an integer tensor" }, name .. ": string ids")
    H.raises(function() return model:forward(io_t.input_ids, { mtp = 1 }) end, { "opts.mtp must be a boolean" },
        name .. ": non-boolean flag")
    H.raises(function() return model:forward(io_t.input_ids, { label = io_t.labels }) end,
        { "unknown option 'label'" }, name .. ": misspelt option")
    H.raises(function() return model:forward({ { V } }) end, { "ds4.model:forward" }, name .. ": id out of vocabulary")

    H.check(model:n_params() > 0, name .. ": n_params")
    if d then io.write(("%s: max |dlogit| %.3g, loss %.9g (ref %.9g)\n"):format(name, d, r.loss or 0 / 0, ref_loss)) end

    model:free()
    H.raises(function() return model:forward(io_t.input_ids) end, { "model has been freed" }, name .. ": after free")
    H.raises(function() return model:config() end, { "model has been freed" }, name .. ": config after free")
    model:free() -- twice is harmless
end

-- Config / model-level API on tiny_a.
do
    local cfg = ds4.config(fixtures .. "/tiny_a")
    H.eq(cfg.vocab_size, 256, "config vocab_size")
    H.eq(cfg.hidden_size, 64, "config hidden_size")
    H.eq(cfg.num_hidden_layers, 4, "config num_hidden_layers")
    H.same(cfg.layer_types, { "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention" }, "config layer_types")
    H.same(cfg.mlp_layer_types, { "hash_moe", "hash_moe", "moe", "moe" }, "config mlp_layer_types")
    H.eq(cfg.rope_parameters.main.rope_type, "default", "rope main type")
    H.eq(cfg.rope_parameters.main.rope_theta, 10000, "rope main theta")
    H.eq(cfg.rope_parameters.compress.rope_type, "yarn", "rope compress type")
    H.eq(cfg.rope_parameters.compress.factor, 16, "rope compress factor")
    H.eq(cfg.rope_parameters.compress.rope_theta, 160000, "rope compress theta")
    H.eq(cfg.compress_rates.compressed_sparse_attention, 4, "compress rate csa")
    H.eq(cfg.compress_rates.heavily_compressed_attention, 8, "compress rate hca")
    H.eq(cfg.scoring_func, "sqrtsoftplus", "scoring_func")
    H.eq(cfg.hc_mult, 4, "hc_mult")
    H.eq(cfg.swiglu_limit, 0.25, "swiglu_limit")
    H.eq(cfg.tie_word_embeddings, false, "tie_word_embeddings")
    H.eq(cfg.num_nextn_predict_layers, 1, "num_nextn_predict_layers")
    H.raises(function() return ds4.config("/nonexistent/cfg") end, { "ds4.config:", "/nonexistent/cfg" },
        "config of a missing path")

    local m = ds4.load(fixtures .. "/tiny_a")
    H.same(m:config(), cfg, "model:config() equals ds4.config()")
    -- Parameter count by hand from the fixture's tensor list is the sum of all numels; check against the
    -- weight file read independently of the model.
    local w = ds4.load_tensors(fixtures .. "/tiny_a/model.safetensors")
    local total, tensors = 0, m:tensors()
    for _, t in pairs(w) do
        if t:dtype() == "F32" then total = total + t:numel() end
    end
    H.eq(m:n_params(), total, "n_params = sum of the F32 tensors of the checkpoint")
    local names = 0
    for k, t in pairs(tensors) do
        names = names + 1
        H.check(ds4.is_tensor(t), "model:tensors() value " .. k)
    end
    H.check(names > 0, "model:tensors() is not empty")
    H.check(tensors["embed.weight"] ~= nil, "model:tensors() uses official names (embed.weight)")
    if tensors["embed.weight"] then
        H.eq(max_diff(tensors["embed.weight"], w["model.embed_tokens.weight"]), 0, "embed.weight values")
    end
    H.check(tostring(m):find("ds4.model", 1, true) == 1, "tostring(model)")
    H.check(ds4.is_model(m) and not ds4.is_model(w), "is_model")
    m:free()
    H.eq(tostring(m), "ds4.model (freed)", "tostring of a freed model")
end

-- An unreachable model does not block set_threads (it is collected first).
do
    local tmp = ds4.load(fixtures .. "/tiny_hf")
    H.check(tmp:n_params() > 0, "temporary model loaded")
end

H.raises(function() return ds4.load("/nonexistent/checkpoint") end, { "ds4.load:", "/nonexistent/checkpoint" },
    "load of a missing directory")
H.raises(function() return ds4.load() end, { "ds4.load: bad argument #1" }, "load without a path")
H.eq(type(ds4.threads()), "number", "threads()")
H.check(ds4.threads() >= 1, "threads() >= 1")
ds4.set_threads(2)
H.eq(ds4.threads(), 2, "set_threads(2) takes effect")
local held = ds4.load(fixtures .. "/tiny_hf")
H.raises(function() ds4.set_threads(1) end, { "ds4.set_threads", "in use by 1 loaded model" }, "set_threads in use")
held:free()
ds4.set_threads(1)
H.eq(ds4.threads(), 1, "set_threads after freeing the model")

collectgarbage()
H.done("test_forward")
