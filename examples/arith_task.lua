--[[ examples/arith_task.lua — the verifiable task shared by examples/dapo.lua, grpo.lua and gspo.lua.

Problems "a+b=" (a up to three digits, b one digit): the answer goes in \boxed{...}. A dataset is JSONL with one
{"prompt": "...", "answer": "..."} per line (the same format a user's own dataset uses). Prompts are encoded
as raw text (no chat template) with the given tokenizer; the SFT warm-up teaches the "\boxed{answer}<eos>"
format to partial accuracy; correctness is ds4.reward.math_reward (boxed extraction + exact-rational equality).

  local task = dofile(ds4.script_dir() .. "/arith_task.lua")
]]

local ds4 = require("ds4")
local json = require("ds4.chat.json")

local T = {}

-- The "minimal standard" generator (Park & Miller: s <- 16807 s mod 2^31 - 1): the data depend only on the seed.
-- Lua numbers are doubles, so the product must stay below 2^53 to be exact (16807 · 2^31 < 2^46); the classic
-- 1103515245 multiplier would round and fall into short cycles. The draw uses the high part (s / m · n), not
-- s % n.
-- Returns the draw function and its state ({s = ...}: saved in RL checkpoints, so that a resumed run draws on).
function T.rng(seed)
    local m = 2147483647
    local st = { s = seed % m }
    if st.s == 0 then st.s = 1 end
    return function(n)
        st.s = st.s * 16807 % m
        return math.floor(st.s / m * n)
    end, st
end

-- The problem kinds, each a function r -> {prompt, answer} (r: the generator above).
--   add: "a+b=", a in [0, 1000), b in [0, 10): 10,000 problems, so the RL steps rarely repeat one and held-out
--        accuracy measures generalisation, not recall. The units digit and its carry chain are what the 0.6 M model
--        of the CPU example learns within a couple of hundred SFT steps; two two-digit operands need far more
--        (measured: 6% after 300 steps).
--   mul: "a*b=", a in [0, 10000), b in [2, 10): 80,000 problems, answers of up to five digits; each answer digit
--        needs a product from the multiplication table plus a carry of up to 8 from the digits to its right, and the
--        model writes the most significant digit first, so it must resolve the whole carry chain before its first
--        digit. The GPU demonstration's task, for a model of ~200 M parameters. (Two two-digit operands, 8,100
--        problems, were tried first: the 220 M model memorised the training problems, held-out accuracy stalled at
--        ~24%.)
T.kinds = {
    add = function(r)
        local a, b = r(1000), r(10)
        return { prompt = ("%d+%d="):format(a, b), answer = tostring(a + b) }
    end,
    mul = function(r)
        local a, b = r(10000), 2 + r(8)
        return { prompt = ("%d*%d="):format(a, b), answer = tostring(a * b) }
    end,
}

-- One problem of the given kind (default "add"); an unknown kind is an error naming the kinds.
function T.problem(r, kind)
    local f = T.kinds[kind or "add"]
    if not f then
        local names = {}
        for k in pairs(T.kinds) do names[#names + 1] = k end
        table.sort(names)
        error(("arith_task: unknown task '%s' (%s)"):format(tostring(kind), table.concat(names, ", ")), 2)
    end
    return f(r)
end

-- n problems of `kind` drawn with r, none of whose prompts is in `exclude` (a set of prompt strings), as JSONL;
-- returns the set of prompts written. Problems may repeat within the file (mul has only 8,100).
function T.write_jsonl(path, n, r, exclude, kind)
    local f = assert(io.open(path, "w"))
    local seen, k = {}, 0
    while k < n do
        local p = T.problem(r, kind)
        if not (exclude and exclude[p.prompt]) then
            f:write(json.encode(p), "\n")
            seen[p.prompt] = true
            k = k + 1
        end
    end
    f:close()
    return seen
end

-- Samples {prompt = ids, text = prompt string, answer = string} from a JSONL file of {prompt, answer}. ds4.data
-- checks every row (a non-empty prompt, an answer that is a string or a finite number) and names file:line. opts:
-- ds4.data's template, thinking and columns: a conversational prompt is rendered with the template (generation
-- prompt appended), and text is the rendering.
function T.read_jsonl(path, tok, opts)
    opts = opts or {}
    local out = {}
    for i, row in ipairs(ds4.data.read_jsonl(path, { tokenizer = tok, template = opts.template,
        thinking = opts.thinking, columns = opts.columns })) do
        out[i] = { prompt = row.ids, text = row.prompt, answer = row.answer }
    end
    return out
end

function T.encode(tok, s)
    local t = tok:encode(s)
    local o = {}
    for i = 1, #t do o[i] = t[i] end
    return o
end

-- The model configs of the examples: "small" (examples/small_model.lua, ~0.6 M parameters, the CPU example),
-- "gpu" (examples/gpu_model.lua, ~220 M, the GPU demonstration), or the path of a Lua file that returns a
-- function tok -> config table.
local HERE = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "." -- this file's directory
function T.model_config(tok, arch)
    arch = arch or "small"
    local file = (arch == "small" or arch == "gpu") and (HERE .. "/" .. arch .. "_model.lua") or arch
    local ok, f = pcall(dofile, file)
    if not ok then error(("arith_task: model config '%s': %s"):format(arch, tostring(f)), 2) end
    if type(f) ~= "function" then
        error(("arith_task: model config %s must return a function tok -> config table"):format(file), 2)
    end
    return f(tok)
end

-- Reward: 1 for a correct boxed (or last-number) answer, 0 otherwise.
function T.reward(text, sample)
    return ds4.reward.math_reward(text, sample)
end

function T.correct(text, sample)
    local r = ds4.reward.math_reward(text, sample)
    return r.score > 0
end

-- Supervised warm-up on "\boxed{answer}<eos>" (loss on the response only), `steps` AdamW updates of `batch`
-- samples drawn in order from `samples`.
function T.sft(model, tok, samples, o)
    if #samples == 0 then error("arith_task.sft: no training samples", 2) end
    local eos = model:config().eos_token_id
    local opt = ds4.adamw(model, { lr = o.lr, betas = { 0.9, 0.95 }, weight_decay = 0.0, clip = 1.0,
        schedule = "constant", warmup = math.max(1, math.floor(o.steps / 15)), total = o.steps })
    local k, loss, t0 = 0, nil, ds4.metrics.clock()
    for step = 1, o.steps do
        local ids, labels, S = {}, {}, 0
        for i = 1, o.batch do
            k = k % #samples + 1
            local s = samples[k]
            local resp = T.encode(tok, "\\boxed{" .. s.answer .. "}")
            resp[#resp + 1] = eos
            local x, l = {}, {}
            for _, v in ipairs(s.prompt) do x[#x + 1] = v; l[#l + 1] = -100 end
            for _, v in ipairs(resp) do x[#x + 1] = v; l[#l + 1] = v end
            ids[i], labels[i] = x, l
            if #x > S then S = #x end
        end
        for i = 1, o.batch do
            for t = #ids[i] + 1, S do ids[i][t], labels[i][t] = eos, -100 end
        end
        model:zero_grad()
        loss = model:forward(ids, { labels = labels }).loss
        model:backward()
        opt:step()
        if o.progress and (step % 25 == 0 or step == o.steps) then
            print(("sft step %d/%d loss %.4f (%.0f s)"):format(step, o.steps, loss, ds4.metrics.clock() - t0))
        end
    end
    return loss
end

return T
