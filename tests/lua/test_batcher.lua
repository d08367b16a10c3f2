-- test_batcher.lua — continuous batching from Lua (model:batcher, lua/gen_lua.c over core/generate.c).
-- Usage: ds4 run tests/lua/test_batcher.lua <fixtures_dir>
--
-- Reference: every sequence decoded alone, here in Lua: model:new_cache, model:step over the prompt, then one
-- token per step, each drawn with ds4.sample at ds4.sample_uniform(seed, sample - 1, k) (the stream of prompt 0,
-- sample s: core/generate.c), stopping at max_new_tokens, a stop id or a stop string (read off the byte-level
-- tokenizer's bytes here). The batcher runs 10 tasks (prompt lengths 1..19, n 1..3, greedy and tempered,
-- top-k / top-p, stop ids, a stop string) in 4 sequence slots with prefill pieces of 5 tokens, half submitted
-- while the others run: each task's results must equal the reference bitwise (ids, log-probabilities, finish
-- reason, the stop that matched). Also: cancel, stats, take order, errors (unknown options, freed batcher, freed
-- model, a failed step named by take).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local fixtures = H.fixtures()
local model = ds4.load(fixtures .. "/tiny_a")
local V = model:config().vocab_size
local tok = ds4.tokenizer() -- byte-level: ids 0..255 are the bytes

local function reference(prompt, o, s)
    local cache = model:new_cache(#prompt + o.max_new_tokens)
    local params = { temperature = o.temperature, top_k = o.top_k, top_p = o.top_p }
    local out = { ids = {}, logprobs = {}, finish_reason = "length" }
    local text = ""
    local logits = model:step(cache, prompt).logits
    while true do
        local u = ds4.sample_uniform(o.seed, s - 1, #out.ids)
        local id, lpm = ds4.sample(logits, params, u)
        out.ids[#out.ids + 1] = id
        out.logprobs[#out.logprobs + 1] = tonumber(ffi.new("float", lpm)) -- results hold floats
        local stopped
        for _, v in ipairs(o.stop or {}) do
            if type(v) == "number" and v == id and not stopped then stopped = "stop_token" out.stop = v end
        end
        if not stopped and id < 256 then
            text = text .. string.char(id)
            for _, v in ipairs(o.stop or {}) do
                if type(v) == "string" and not stopped and text:find(v, 1, true) then
                    stopped = "stop_string"
                    out.stop = v
                end
            end
        end
        if stopped then out.finish_reason = stopped break end
        if #out.ids >= o.max_new_tokens then break end
        logits = model:step(cache, { id }).logits
    end
    cache:free()
    return out
end

local tasks = {}
for i = 1, 10 do
    local p = {}
    for j = 1, 1 + (i * 7) % 19 do p[j] = (i * 31 + j * 17) % V end
    local o = { n = 1 + i % 3, max_new_tokens = 2 + (i * 5) % 17, seed = 50 + i, ignore_eos = true,
        temperature = ({ 0, 1, 0.7, 1.3 })[i % 4 + 1], top_k = i % 3 == 0 and 4 or nil,
        top_p = i % 5 == 0 and 0.9 or nil }
    if i % 4 == 1 then o.stop = { (i * 3) % V, (i * 11) % V } end
    tasks[i] = { prompt = p, o = o }
end
-- a stop string read off a first greedy run of task 10 (so that it matches)
do
    local t = tasks[10]
    t.o.temperature, t.o.max_new_tokens = 0, 16
    local r = reference(t.prompt, t.o, 1)
    local bytes = {}
    for k = 4, 5 do bytes[#bytes + 1] = string.char(r.ids[k] % 256) end
    t.o.stop, t.o.tokenizer = { table.concat(bytes) }, tok
end

local b = model:batcher{ max_seqs = 4, prefill_chunk = 5 }
H.check(tostring(b):find("ds4.batcher", 1, true) ~= nil, "tostring")
local by_tag, taken, steps, finishes = {}, 0, 0, {}
local function submit(i) by_tag[b:submit({ tasks[i].prompt }, tasks[i].o)] = i end
for i = 1, 5 do submit(i) end
H.eq(b:stats().queued, 5, "queued before the first step")
local next_i, compared = 6, 0
local streamed, peeks, peeked_tokens = {}, 0, 0 -- tag -> per sequence {ids, logprobs} seen through peek
while taken < #tasks and steps < 5000 do
    b:step()
    steps = steps + 1
    H.check(b:stats().seqs <= 4 or b:stats().running == 1, "at most max_seqs sequences run")
    if steps % 3 == 0 and next_i <= #tasks then submit(next_i) next_i = next_i + 1 end
    -- peek: what each unfinished task has generated so far, the tokens after those already seen
    for tg in pairs(by_tag) do
        local seen = streamed[tg] or {}
        streamed[tg] = seen
        local from = {}
        for q = 1, #seen do from[q] = #seen[q].ids end
        local counts, parts = b:peek(tg, from)
        if counts then
            for q, part in ipairs(parts) do
                seen[q] = seen[q] or { ids = {}, logprobs = {} }
                H.eq(counts[q], (from[q] or 0) + #part.ids, "peek: counts = seen + new")
                for k = 1, #part.ids do
                    seen[q].ids[#seen[q].ids + 1] = part.ids[k]
                    seen[q].logprobs[#seen[q].logprobs + 1] = part.logprobs[k]
                end
            end
            peeks = peeks + 1
        end
    end
    local tag, res = b:take()
    while tag do
        local i = by_tag[tag]
        taken = taken + 1
        local t = tasks[i]
        H.eq(#res, t.o.n, ("task %d: results"):format(i))
        for s = 1, t.o.n do
            local ref, got = reference(t.prompt, t.o, s), res[s]
            H.same(got.ids, ref.ids, ("task %d sample %d: ids"):format(i, s))
            H.same(got.logprobs, ref.logprobs, ("task %d sample %d: log-probabilities (bitwise)"):format(i, s))
            H.eq(got.finish_reason, ref.finish_reason, ("task %d sample %d: finish"):format(i, s))
            H.eq(got.stop, ref.stop, ("task %d sample %d: stop"):format(i, s))
            H.eq(got.sample_index, s, "sample_index")
            -- what peek showed while it ran: a prefix of the reference (bitwise), shorter than the whole
            local seen = (streamed[tag] or {})[s] or { ids = {}, logprobs = {} }
            H.check(#seen.ids <= #ref.ids, ("task %d sample %d: peeked no more than generated"):format(i, s))
            for k = 1, #seen.ids do
                if seen.ids[k] ~= ref.ids[k] or seen.logprobs[k] ~= ref.logprobs[k] then
                    H.check(false, ("task %d sample %d: peeked token %d differs from the reference"):format(i, s, k))
                    break
                end
            end
            peeked_tokens = peeked_tokens + #seen.ids
            finishes[got.finish_reason] = (finishes[got.finish_reason] or 0) + 1
            compared = compared + 1
        end
        tag, res = b:take()
    end
end
H.eq(taken, #tasks, "every task taken once")
H.check(peeks > 0 and peeked_tokens > 0, "peek saw tasks running and their tokens")
H.eq(b:peek((next(by_tag))), nil, "peek of a taken task")
H.check(finishes.stop_string and finishes.length, "the tasks end by a stop string and by length")
io.write(("batcher: %d tasks, %d sequences equal to the reference, in %d steps (%d model steps)\n"):format(taken,
    compared, steps, b:stats().steps))
local st = b:stats()
H.same({ st.queued, st.running, st.finished, st.seqs, st.free_seqs }, { 0, 0, 0, 0, 4 }, "stats after the run")

-- cancel: a queued task and a running one
local t1 = b:submit({ tasks[1].prompt }, { max_new_tokens = 50, ignore_eos = true })
local t2 = b:submit({ tasks[2].prompt }, { max_new_tokens = 50, ignore_eos = true, n = 4 })
b:step() -- the prompt of 8 tokens in pieces of 5: two steps to its first token
b:step()
H.eq(b:stats().queued, 1, "n = 4 waits: it does not fit beside the running sequence in 4 slots")
H.eq(b:cancel(t1), true, "cancel a running task")
H.eq(b:cancel(t2), true, "cancel a queued task")
H.eq(b:cancel(t2), false, "cancel twice")
local tag, res = b:take()
H.eq(tag, t1, "the first cancelled task is taken first")
H.eq(res[1].finish_reason, "cancelled", "cancelled finish")
H.check(#res[1].ids >= 1 and #res[1].ids < 50, "a cancelled task keeps what it generated")
tag, res = b:take()
H.eq(tag, t2, "the queued cancelled task")
H.eq(#res, 4, "its n results")
H.eq(#res[1].ids, 0, "nothing generated for a task cancelled before it ran")
H.eq(b:take(), nil, "nothing left")

-- errors
H.raises(function() b:submit({ { 1 } }, { on_token = print }) end, { "unknown option 'on_token'" }, "on_token")
H.raises(function() b:submit({ { 1 } }, { max_batch = 2 }) end, { "unknown option 'max_batch'" }, "max_batch")
H.raises(function() b:submit({ { V } }) end, { "not a token id" }, "id outside the vocabulary")
H.raises(function() b:submit({ { 1 } }, { stop = { "x" } }) end, { "need opts.tokenizer" }, "stop string without tokenizer")
H.raises(function() model:batcher{ max_seqs = 0 } end, { "max_seqs" }, "max_seqs 0")
H.raises(function() model:batcher{ slots = 2 } end, { "unknown option 'slots'" }, "unknown batcher option")
b:free()
H.raises(function() b:step() end, { "freed" }, "step after free")
local m2 = ds4.load(fixtures .. "/tiny_a")
local b2 = m2:batcher()
b2:submit({ { 1, 2 } })
m2:free()
H.raises(function() b2:step() end, { "freed" }, "step after the model was freed")
b2 = nil
collectgarbage()
collectgarbage()

-- On a GPU (ds4.cuda_devices() > 0; scripts/gpu.sh runs this there, CI has none): the same tasks through a
-- batcher of the model on CUDA, fp32 and bf16, each task's results against model:generate of that task alone on the
-- same device (batch invariance of the device's step: a sequence's tokens and log-probabilities do not depend on
-- what shares its steps).
if ds4.cuda_devices() > 0 then
    for _, dtype in ipairs({ "fp32", "bf16" }) do
        local mg = ds4.load(fixtures .. "/tiny_a", { device = "cuda", dtype = dtype })
        local bg = mg:batcher{ max_seqs = 4, prefill_chunk = 5 }
        local tags = {}
        for i = 1, #tasks do tags[bg:submit({ tasks[i].prompt }, tasks[i].o)] = i end
        local got, guard = {}, 0
        while next(tags) and guard < 5000 do
            bg:step()
            guard = guard + 1
            local tag, res = bg:take()
            while tag do
                got[tags[tag]] = res
                tags[tag] = nil
                tag, res = bg:take()
            end
        end
        for i = 1, #tasks do
            local ref = mg:generate({ tasks[i].prompt }, tasks[i].o)
            for s = 1, tasks[i].o.n do
                H.same(got[i] and got[i][s].ids, ref[s].ids, ("cuda %s task %d sample %d: ids"):format(dtype, i, s))
                H.same(got[i] and got[i][s].logprobs, ref[s].logprobs,
                    ("cuda %s task %d sample %d: log-probabilities (bitwise)"):format(dtype, i, s))
            end
        end
        bg:free()
    end
    io.write("batcher on CUDA (fp32, bf16): every task equal to its generation alone\n")
else
    io.write("batcher: no CUDA device here: the GPU part is skipped\n")
end

H.done("test_batcher")
