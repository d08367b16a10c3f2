-- test_trainer_run.lua — what ds4.rl.trainer.run gives a user (issue 17):
--   (a) it creates its output directory (a nested one that does not exist: it used to stop with "No such file");
--   (b) rewards see each sample's response_ids / response_len / finish_reason: ds4.reward.overlong_reward works
--       inside the loop (it failed on every sample), combined with another reward through ds4.reward.combine;
--   (c) the step metrics, recomputed here from the generations and rewards the test saw through its own wrappers:
--       reward/mean, /std, /min, /max, each component (rewards/NAME), response_len/mean, /min, /max,
--       /clipped_ratio; the time split time/generate, time/reward, time/train; TensorBoard events beside them;
--   (d) log_completions: every Nth step, N sampled completions in completions.jsonl;
--   (e) a reward that always fails stops the run at step 1, naming the guard and the first error (it used to run
--       to the end, training on nothing, with exit status 0);
--   (f) config.loss: a user loss that returns rl.loss.compute's result gives bitwise the built-in run; one whose
--       gradients are zero leaves the parameters as they were; a malformed result is an error naming config.loss;
--   (g) old log-probabilities with several minibatches: the first minibatch's come from its own training forward
--       (no second forward), the later ones' from a forward before the step's first update; every sample's equal
--       bit for bit a forward of that sample alone by a fresh model holding the step's starting weights, and the
--       first minibatch's PPO ratio is exactly 1.
-- Usage: ds4 run tests/lua/test_trainer_run.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local trainer = require("ds4.rl.trainer")
local rl = require("ds4.rl")
local reward = require("ds4.reward")

local FIX = H.fixtures()
ds4.set_threads(2)
local same_bytes = H.same_bytes

local decode, parity = H.byte_text, H.parity_reward

local function base(model, out, o)
    o = o or {}
    return {
        model = model,
        algorithm = o.algorithm or rl.preset("grpo", { kl = rl.NIL }),
        prompts = function(k, n)
            local p = {}
            for i = 1, n do p[i] = { prompt = { 5 + (k * 3 + i) % 40, 9, 7 }, answer = "x" } end
            return p
        end,
        reward = o.reward or parity,
        decode = decode,
        rollout = { n = 4, prompts_per_step = 3, max_new_tokens = o.max_new_tokens or 4, temperature = 1.0,
            source = o.source },
        optim = { lr = 1e-3 },
        steps = o.steps or 2,
        minibatches = o.minibatches or 1,
        out = out,
        seed = 5,
        progress = false,
        loss = o.loss,
        log_completions = o.log_completions,
    }
end

local rows_of = require("ds4.plot").read_jsonl

local tmp = H.make_temp_dir()

-- (a), (b), (c), (d)
do
    local model = ds4.load(FIX .. "/tiny_a")
    local seen_gen, seen = {}, {}
    -- the model's own generate, recorded; every third sample ends after 2 tokens, as if at a stop token, so that
    -- lengths and finish reasons vary
    local source = { generate = function(_, prompts, opts)
        local res = model:generate(prompts, opts)
        for i, r in ipairs(res) do
            if i % 3 == 0 then
                r.ids, r.logprobs, r.finish_reason = { r.ids[1], r.ids[2] }, { r.logprobs[1], r.logprobs[2] },
                    "stop_token"
            end
            seen_gen[#seen_gen + 1] = r
        end
        return res
    end }
    local overlong = reward.overlong_reward({ max_len = 4, cache_len = 2 })
    local combined = reward.combine({ { parity, 1.0, "parity" }, { overlong, 0.5, "overlong" } })
    local function watched(text, sample)
        local ok = type(sample.response_ids) == "table" and sample.response_len == #sample.response_ids
            and type(sample.finish_reason) == "string" and sample.answer == "x"
        local r = combined(text, sample)
        seen[#seen + 1] = { ok = ok, score = r.score, parity = r.info.parity.score, overlong = r.info.overlong.score,
            len = sample.response_len, finish = sample.finish_reason }
        return r
    end
    local out = tmp .. "/not/yet/there"
    local res = trainer.run(base(model, out, { reward = watched, source = source, steps = 2,
        log_completions = { every = 2, n = 3 } }))
    H.check(io.open(out .. "/metrics.jsonl") ~= nil, "(a) trainer.run created its output directory")
    H.eq(#seen, #seen_gen, "(b) one reward per generated sample")
    local all_ok = true
    for _, s in ipairs(seen) do all_ok = all_ok and s.ok end
    H.check(all_ok, "(b) every sample has response_ids, response_len, finish_reason and its prompt's fields")
    for _, s in ipairs(seen) do
        local want = s.len <= 2 and 0 or (s.len <= 4 and (2 - s.len) / 2 or -1)
        if s.overlong ~= want then H.eq(s.overlong, want, "(b) overlong_reward of a length-" .. s.len .. " sample") end
    end
    H.check(true, "(b) overlong_reward ran inside trainer.run")
    -- (c) step 1's metrics from what the test saw: samples of the first rollout batch (no dynamic sampling: one)
    local rows = rows_of(out .. "/metrics.jsonl")
    H.eq(#rows, 2, "(c) two metrics records")
    local r1 = rows[1]
    local n = 12
    local sum, sq, mn, mx, par, ov, ln, lmin, lmax, clipped = 0, 0, math.huge, -math.huge, 0, 0, 0, math.huge, 0, 0
    for i = 1, n do
        local s = seen[i]
        sum, sq = sum + s.score, sq + s.score * s.score
        mn, mx = math.min(mn, s.score), math.max(mx, s.score)
        par, ov = par + s.parity, ov + s.overlong
        ln, lmin, lmax = ln + s.len, math.min(lmin, s.len), math.max(lmax, s.len)
        if s.finish == "length" then clipped = clipped + 1 end
    end
    local mean = sum / n
    H.near(r1["reward/mean"], mean, 1e-12, "(c) reward/mean")
    H.near(r1["reward/std"], math.sqrt(sq / n - mean * mean), 1e-9, "(c) reward/std")
    H.eq(r1["reward/min"], mn, "(c) reward/min")
    H.eq(r1["reward/max"], mx, "(c) reward/max")
    H.near(r1["rewards/parity"], par / n, 1e-12, "(c) rewards/parity")
    H.near(r1["rewards/overlong"], ov / n, 1e-12, "(c) rewards/overlong")
    H.near(r1["response_len/mean"], ln / n, 1e-12, "(c) response_len/mean")
    H.eq(r1["response_len/min"], lmin, "(c) response_len/min")
    H.eq(r1["response_len/max"], lmax, "(c) response_len/max")
    H.near(r1["response_len/clipped_ratio"], clipped / n, 1e-12, "(c) response_len/clipped_ratio")
    H.check(clipped > 0 and clipped < n, "(c) both finish reasons occur")
    for _, k in ipairs({ "time/generate", "time/reward", "time/train", "time/eval", "seconds" }) do
        H.check(type(r1[k]) == "number" and r1[k] >= 0, "(c) " .. k)
    end
    H.check(r1["time/generate"] + r1["time/reward"] + r1["time/train"] <= r1.seconds + 1e-6,
        "(c) the time split fits in the step")
    if ds4.tensorboard.available() then
        local p = io.popen("ls " .. H.shell_quote(out))
        local names = p:read("*a")
        p:close()
        H.check(names:find("events%.out%.tfevents%."), "(c) TensorBoard events beside metrics.jsonl")
    end
    -- (d)
    local comp = rows_of(out .. "/completions.jsonl")
    H.eq(#comp, 3, "(d) 3 completions, logged at step 2 only")
    H.eq(comp[1].step, 2, "(d) at step 2")
    H.check(type(comp[1].prompt) == "string" and type(comp[1].completion) == "string" and comp[1].reward
        and comp[1].finish_reason, "(d) prompt, completion, reward, finish_reason")
    H.eq(#res.history, 2, "history")
end

-- (e)
do
    local model = ds4.load(FIX .. "/tiny_a")
    local out = tmp .. "/broken"
    H.raises(function()
        trainer.run(base(model, out, { reward = function() error("no such field: answer_key") end, steps = 5 }))
    end, { "trainer.run: step 1:", "12 of 12 rewards failed", "guard.max_reward_error_frac", "no such field: answer_key" },
        "(e) a broken reward stops the run at step 1")
    H.eq(#rows_of(out .. "/metrics.jsonl"), 1, "(e) after writing that step's metrics")
    -- a few errors among good rewards do not stop it
    local k = 0
    local res = trainer.run(base(ds4.load(FIX .. "/tiny_a"), tmp .. "/some", { reward = function(text)
        k = k + 1
        if k % 6 == 0 then error("flaky") end
        return parity(text)
    end }))
    H.eq(#res.history, 2, "(e) a few reward errors are counted, not fatal")
end

-- (f)
do
    local ma = ds4.load(FIX .. "/tiny_a")
    trainer.run(base(ma, tmp .. "/builtin"))
    local mb = ds4.load(FIX .. "/tiny_a")
    local calls = 0
    trainer.run(base(mb, tmp .. "/user", { loss = function(mb_, spec, opts)
        calls = calls + 1
        for _, s in ipairs(mb_) do
            assert(#s.logp == #s.ids and #s.old_logp == #s.ids and #s.rollout_logp == #s.ids, "per-token arrays")
            assert(s.adv ~= nil and type(s.reward) == "number", "advantage and reward")
        end
        assert(opts.denom > 0 and opts.num_seqs == #mb_ and opts.step_seqs >= #mb_, "normalisers")
        return rl.loss.compute(mb_, spec, opts)
    end }))
    H.check(calls > 0, "(f) the user loss was called")
    H.check(same_bytes(mb:params(), ma:params()), "(f) rl.loss.compute as a user loss gives the built-in run bitwise")
    local mz = ds4.load(FIX .. "/tiny_a")
    local p0 = mz:params()
    trainer.run(base(mz, tmp .. "/zero", { loss = function(mb_)
        local g = {}
        for i, s in ipairs(mb_) do
            g[i] = {}
            for t = 1, #s.ids do g[i][t] = 0 end
        end
        return { loss = 0, grads = g }
    end }))
    H.check(same_bytes(mz:params(), p0), "(f) zero gradients leave the parameters as they were")
    H.raises(function()
        trainer.run(base(ds4.load(FIX .. "/tiny_a"), tmp .. "/bad", { loss = function() return { loss = 1 } end }))
    end, { "trainer.run: step 1:", "config.loss", "result.grads" }, "(f) a malformed user loss result")
    H.raises(function() trainer.run(base(ds4.load(FIX .. "/tiny_a"), tmp .. "/bad2", { loss = 5 })) end,
        { "trainer.run: config.loss must be a function" }, "(f) a user loss that is not a function")
end

-- (g)
do
    local m = ds4.load(FIX .. "/tiny_a")
    local calls, snap = {}, nil
    local function copy(a)
        local o = {}
        for i, v in ipairs(a) do o[i] = v end
        return o
    end
    trainer.run(base(m, tmp .. "/old", { minibatches = 2, steps = 2, loss = function(mb_, spec, opts)
        -- the step's first loss call comes before its first update: the weights the step starts from
        if #calls % 2 == 0 then snap = m:params() end
        local rec = { params = snap, samples = {} }
        for i, s in ipairs(mb_) do
            rec.samples[i] = { prompt = copy(s.prompt), ids = copy(s.ids), old = copy(s.old_logp), logp = copy(s.logp) }
        end
        calls[#calls + 1] = rec
        return rl.loss.compute(mb_, spec, opts)
    end }))
    H.eq(#calls, 4, "(g) two minibatches in each of two steps")
    local ref = ds4.load(FIX .. "/tiny_a")
    local differ, ratio_not_1, n = 0, 0, 0
    for c, rec in ipairs(calls) do
        ref:set_params(rec.params)
        for _, s in ipairs(rec.samples) do
            local ids, labels = {}, {}
            for _, v in ipairs(s.prompt) do ids[#ids + 1] = v; labels[#labels + 1] = -100 end
            for _, v in ipairs(s.ids) do ids[#ids + 1] = v; labels[#labels + 1] = v end
            ref:forward({ ids }, { labels = { labels }, train = true })
            local lp = ref:logprobs()
            for j = 1, #s.ids do
                n = n + 1
                -- numbers from F32 values: equal doubles are equal bits (a NaN equals nothing)
                if lp[#s.prompt - 1 + j] ~= s.old[j] then differ = differ + 1 end
                if c % 2 == 1 and s.logp[j] ~= s.old[j] then ratio_not_1 = ratio_not_1 + 1 end
            end
        end
    end
    H.check(n > 0, "(g) old log-probabilities were seen")
    H.eq(differ, 0, "(g) old log-probabilities that differ from a lone forward at the step's starting weights")
    H.eq(ratio_not_1, 0, "(g) first-minibatch tokens whose log-probability differs from its old one")
end

os.execute("rm -rf " .. H.shell_quote(tmp))
H.done("test_trainer_run")
