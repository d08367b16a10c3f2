-- test_trainer_async.lua — ds4.rl.trainer.run's asynchronous mode (async = {max_staleness = K}) in one process; real
-- workers are tests/test_rollout_async.sh's.
--   (a) K = 0 is the synchronous loop: the same metrics (all but the timings) and bitwise the same weights, with
--       GRPO and with DAPO's dynamic sampling (several rollout batches in a step);
--   (b) K = 1 and K = 2 with the policy as its own source: the first batch of step s is generated before step s - K
--       trains (after step s - 1 - K: the test counts the steps itself and records each generate call), so step s
--       trains on samples exactly min(s - 1, K) versions old; every sample the loss sees carries the version that
--       generated it; staleness/mean and /max say so; for s > 1 the rollout log-probabilities differ from the
--       recomputed ones (other weights), and the truncated importance weights (tis) are reported and not all 1;
--       with DAPO's dynamic sampling, batches submitted ahead that a step did not need are counted (gen_batches_unused)
--       and no sample is older than K;
--   (c) a source with :submit / :collect / :poll gets min_policy = v - K + (s - step) for each batch (and first = true
--       for a batch the step draws beyond those submitted ahead, which it collects in that step), is polled
--       during training (train_delay_s makes each micro-batch slow), and one that returns samples older than K
--       versions stops the run with a message naming the source; bad async options are refused.
-- Usage: ds4 run tests/lua/test_trainer_async.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local trainer = require("ds4.rl.trainer")
local rl = require("ds4.rl")

local FIX = H.fixtures()
ds4.set_threads(2)
local rows_of = require("ds4.plot").read_jsonl
local tmp = H.make_temp_dir()

local decode, parity = H.byte_text, H.parity_reward

local function base(model, out, o)
    return {
        model = model,
        algorithm = o.algorithm or rl.preset("grpo", { kl = rl.NIL }),
        prompts = function(k, n)
            local p = {}
            for i = 1, n do p[i] = { prompt = { 5 + (k * 3 + i) % 40, 9, 7 } } end
            return p
        end,
        reward = parity,
        decode = decode,
        rollout = { n = 4, prompts_per_step = 3, max_new_tokens = 4, temperature = 1.0, source = o.source },
        optim = { lr = 1e-2 },
        steps = o.steps or 3,
        minibatches = 1,
        micro_batches = o.micro_batches,
        out = out,
        seed = 5,
        progress = false,
        loss = o.loss,
        async = o.async,
        on_step = o.on_step,
        train_delay_s = o.train_delay_s,
    }
end

-- every metric but the wall-clock ones
local TIMING = { seconds = true, tokens_per_s = true, ["time/generate"] = true, ["time/reward"] = true,
    ["time/train"] = true, ["time/eval"] = true }
local function untimed(rows)
    local out = {}
    for i, r in ipairs(rows) do
        out[i] = {}
        for k, v in pairs(r) do if not TIMING[k] then out[i][k] = v end end
    end
    return out
end

-- The policy as its own rollout source, recording for each generated sample (by its ids table) clock() at the time:
-- the steps completed when it was generated.
local function recording_source(model, clock)
    local src = { made = {}, calls = 0 }
    function src.generate(_, prompts, opts)
        src.calls = src.calls + 1
        local res = model:generate(prompts, opts)
        for _, r in ipairs(res) do src.made[r.ids] = clock() end
        return res
    end
    return src
end

-- (a)
for _, algo in ipairs({ "grpo", "dapo" }) do
    local function spec()
        return algo == "grpo" and rl.preset("grpo", { kl = rl.NIL }) or rl.preset("dapo", {
            overlong = { soft = { max_len = 4, cache = 1, factor = 1.0 } } })
    end
    local ms, ma = ds4.load(FIX .. "/tiny_a"), ds4.load(FIX .. "/tiny_a")
    trainer.run(base(ms, tmp .. "/sync_" .. algo, { algorithm = spec() }))
    trainer.run(base(ma, tmp .. "/k0_" .. algo, { algorithm = spec(), async = { max_staleness = 0 } }))
    local rs, ra = rows_of(tmp .. "/sync_" .. algo .. "/metrics.jsonl"), rows_of(tmp .. "/k0_" .. algo .. "/metrics.jsonl")
    H.eq(#ra, 3, "(a) " .. algo .. ": three steps")
    H.same(untimed(ra), untimed(rs), "(a) " .. algo .. ": K = 0 has the synchronous run's metrics")
    H.check(H.same_bytes(ma:params(), ms:params()), "(a) " .. algo .. ": K = 0 gives the synchronous run's weights bitwise")
    if algo == "dapo" then
        local extra = 0
        for _, r in ipairs(ra) do extra = extra + r.gen_batches - 1 end
        H.check(extra > 0, "(a) dapo: dynamic sampling drew extra batches in some step (" .. extra .. ")")
    end
    for _, r in ipairs(ra) do H.eq(r["staleness/max"], 0, "(a) " .. algo .. ": K = 0 trains on the current version") end
end

-- (b)
for _, K in ipairs({ 1, 2 }) do
    local model = ds4.load(FIX .. "/tiny_a")
    local done = 0 -- steps completed, counted by on_step
    local source = recording_source(model, function() return done end)
    local made = source.made
    local seen, bad, differ = {}, {}, {}
    local step_now = 0
    local spec = rl.preset("grpo", { kl = rl.NIL })
    spec.tis = rl.tis_default
    local out = tmp .. "/k" .. K
    trainer.run(base(model, out, { async = { max_staleness = K }, source = source, steps = 4, algorithm = spec,
        on_step = function(step) done = step end,
        loss = function(mb, sp, opts)
            step_now = done + 1
            for _, s in ipairs(mb) do
                local at = made[s.ids]
                local want_version = at and 1 + at
                if not at or s.policy_version ~= want_version then
                    bad[#bad + 1] = ("step %d: a sample of version %s, generated after %s steps"):format(step_now,
                        tostring(s.policy_version), tostring(at))
                end
                seen[step_now] = seen[step_now] or {}
                seen[step_now][#seen[step_now] + 1] = step_now - (at or -99) - 1 -- its lag: versions 1 + at, 1 + done
                for t = 1, #s.ids do
                    if s.old_logp[t] ~= s.rollout_logp[t] then differ[step_now] = true end
                end
            end
            return rl.loss.compute(mb, sp, opts)
        end }))
    H.eq(#bad, 0, ("(b) K = %d: every sample carries the version that generated it%s"):format(K,
        bad[1] and (": " .. bad[1]) or ""))
    local rows = rows_of(out .. "/metrics.jsonl")
    H.eq(#rows, 4, ("(b) K = %d: four steps"):format(K))
    for s = 1, 4 do
        local want = math.min(s - 1, K)
        local lags = seen[s] or {}
        local ok = #lags > 0
        for _, l in ipairs(lags) do ok = ok and l == want end
        H.check(ok, ("(b) K = %d: step %d trains on samples %d versions old (the test's own count)"):format(K, s, want))
        H.eq(rows[s]["staleness/max"], want, ("(b) K = %d: step %d staleness/max"):format(K, s))
        H.eq(rows[s]["staleness/mean"], want, ("(b) K = %d: step %d staleness/mean"):format(K, s))
        H.eq(rows[s].policy_version, s, ("(b) K = %d: step %d trains version %d"):format(K, s, s))
        H.eq(differ[s] == true, want > 0, ("(b) K = %d: step %d: rollout log-probs %s the recomputed ones"):format(K, s,
            want > 0 and "differ from" or "equal"))
        H.check(rows[s]["tis/weight_mean"] ~= nil, ("(b) K = %d: step %d reports tis/weight_mean"):format(K, s))
        if want > 0 then
            H.check(rows[s]["logprob_mismatch/max"] > 0 and rows[s]["tis/weight_mean"] ~= 1,
                ("(b) K = %d: step %d: mismatch %.3g, mean importance weight %.6g"):format(K, s,
                rows[s]["logprob_mismatch/max"], rows[s]["tis/weight_mean"]))
        end
    end
    H.eq(source.calls, 4, ("(b) K = %d: one rollout batch per step, none beyond the last step"):format(K))
end

-- (b) with DAPO's dynamic sampling (several batches a step): a step ahead gets as many batches as the last step used,
-- more are generated when needed (lag 0), unneeded ones are dropped and counted; every batch generated is either
-- trained on or counted unused, and no sample is more than K = 1 versions old (the test's own count)
do
    local model = ds4.load(FIX .. "/tiny_a")
    local done, worst, n = 0, 0, 0
    local source = recording_source(model, function() return done end)
    local made = source.made
    local out = tmp .. "/k1_dapo"
    trainer.run(base(model, out, { async = { max_staleness = 1 }, source = source, steps = 4,
        algorithm = rl.preset("dapo", { overlong = { soft = { max_len = 4, cache = 1, factor = 1.0 } } }),
        on_step = function(step) done = step end,
        loss = function(mb, sp, opts)
            for _, s in ipairs(mb) do
                worst = math.max(worst, done - made[s.ids])
                n = n + 1
            end
            return rl.loss.compute(mb, sp, opts)
        end }))
    local rows = rows_of(out .. "/metrics.jsonl")
    local used, unused, many = 0, 0, 0
    for _, r in ipairs(rows) do
        used, unused = used + r.gen_batches, unused + r.gen_batches_unused
        if r.gen_batches > 1 then many = many + 1 end
        H.check(r["staleness/max"] <= 1, ("(b) dapo K = 1: step %d staleness/max %g"):format(r.step, r["staleness/max"]))
    end
    H.check(many > 0, "(b) dapo K = 1: some step drew several batches (" .. many .. ")")
    H.eq(used + unused, source.calls, "(b) dapo K = 1: every batch generated was trained on or counted unused")
    H.check(n > 0 and worst <= 1, ("(b) dapo K = 1: %d samples trained, at most %d version(s) old"):format(n, worst))
end

-- (b) K = 2 with dynamic sampling: a step ahead that was submitted before the last step showed how many batches a step
-- uses is topped up at the next step, not left to generate while it trains. During step 2 the trainer generates:
-- step 3's top-up (it was submitted during step 1 with one batch) to g1, the batches step 1 used; step 4's g1; and
-- the g2 - 1 that step 2 draws beyond the one it had (the policy as source generates at submission).
do
    local model = ds4.load(FIX .. "/tiny_a")
    local done, during = 0, {}
    local source = recording_source(model, function() return done end)
    local generate = source.generate
    function source.generate(...)
        during[done + 1] = (during[done + 1] or 0) + 1
        return generate(...)
    end
    local out = tmp .. "/k2_dapo"
    local cfg = base(model, out, { async = { max_staleness = 2 }, source = source, steps = 4,
        algorithm = rl.preset("dapo", { overlong = { soft = { max_len = 4, cache = 1, factor = 1.0 } } }),
        on_step = function(step) done = step end })
    -- a reward most groups give every sample alike: dynamic sampling draws several batches a step
    cfg.reward = function(text) return (#text > 0 and text:byte(1) % 8 == 0) and 1 or 0 end
    trainer.run(cfg)
    local rows = rows_of(out .. "/metrics.jsonl")
    local g1, g2 = rows[1].gen_batches, rows[2].gen_batches
    H.check(g1 >= 2, "(b) dapo K = 2: step 1 drew several batches (" .. g1 .. "), so step 3 needs a top-up")
    H.eq(during[2], (g1 - 1) + g1 + (g2 - 1), "(b) dapo K = 2: batches generated during step 2")
end

-- (c) a source with submit / collect / poll (as ds4.rollout.pool), generating at submission with the policy
do
    local model = ds4.load(FIX .. "/tiny_a")
    local K = 2
    local src = { version = 1, submits = {}, polls = 0, polls_in_train = 0, training = false }
    function src:submit(prompts, opts)
        self.submits[#self.submits + 1] = { min_policy = opts.min_policy, version = self.version, first = opts.first }
        local res = model:generate(prompts, { n = opts.n, max_new_tokens = opts.max_new_tokens, seed = opts.seed,
            temperature = opts.temperature })
        for _, r in ipairs(res) do r.policy_version = self.version end
        return { res = res }
    end
    function src:collect(h) return h.res end
    function src:poll()
        self.polls = self.polls + 1
        if self.training then self.polls_in_train = self.polls_in_train + 1 end
    end
    function src:publish() self.version = self.version + 1 end
    trainer.run(base(model, tmp .. "/src", { async = { max_staleness = K }, source = src, steps = 4,
        micro_batches = 3, train_delay_s = 0.03,
        loss = function(mb, sp, opts)
            src.training = true
            return rl.loss.compute(mb, sp, opts)
        end,
        on_step = function() src.training = false end }))
    -- step 1 submits steps 1, 2, 3 at version 1 (min 1 - 2 + 0..2, at least 1); step s > 1 submits step s + 2 (if
    -- any) at version s with min s - 2 + 2 = s
    local want = { { 1, 1 }, { 1, 1 }, { 1, 1 }, { 2, 2 } }
    H.eq(#src.submits, #want, "(c) one submit per step")
    for i, w in ipairs(want) do
        H.eq(src.submits[i].min_policy, w[1], ("(c) submit %d: min_policy"):format(i))
        H.eq(src.submits[i].version, w[2], ("(c) submit %d: at version"):format(i))
    end
    H.check(src.polls_in_train >= 4 * 3, ("(c) polled between micro-batches while training (%d times, %d in all)")
        :format(src.polls_in_train, src.polls))

    H.check(src.submits[1].first == nil, "(c) batches submitted ahead do not ask to go first")

    -- with dynamic sampling, the batches a step draws beyond those submitted ahead ask to go first (opts.first): each
    -- is collected in the step that submitted it
    local m2, step_now = ds4.load(FIX .. "/tiny_a"), 1
    local src2 = { version = 1, firsts = 0, late = 0 }
    function src2:submit(prompts, opts)
        local res = m2:generate(prompts, { n = opts.n, max_new_tokens = opts.max_new_tokens, seed = opts.seed,
            temperature = opts.temperature })
        for _, r in ipairs(res) do r.policy_version = self.version end
        if opts.first ~= nil then H.eq(opts.first, true, "(c) opts.first is true or absent") end
        if opts.first then self.firsts = self.firsts + 1 end
        return { res = res, first = opts.first, step = step_now }
    end
    function src2:collect(h)
        if h.first and h.step ~= step_now then self.late = self.late + 1 end
        return h.res
    end
    function src2:publish() self.version = self.version + 1 end
    local cfg = base(m2, tmp .. "/src_first", { async = { max_staleness = K }, source = src2, steps = 4,
        algorithm = rl.preset("dapo", { overlong = { soft = { max_len = 4, cache = 1, factor = 1.0 } } }),
        on_step = function(step) step_now = step + 1 end })
    cfg.reward = function(text) return (#text > 0 and text:byte(1) % 8 == 0) and 1 or 0 end
    trainer.run(cfg)
    H.check(src2.firsts > 0, ("(c) dynamic sampling's extra batches asked to go first (%d)"):format(src2.firsts))
    H.eq(src2.late, 0, "(c) every batch that asked to go first was collected in its own step")

    -- a source that ignores min_policy: its samples are 5 versions old
    local liar = { version = 6 }
    function liar:submit(prompts, opts)
        local res = model:generate(prompts, { n = opts.n, max_new_tokens = opts.max_new_tokens, seed = opts.seed })
        for _, r in ipairs(res) do r.policy_version = 1 end
        return res
    end
    function liar:collect(h) return h end
    H.raises(function()
        trainer.run(base(ds4.load(FIX .. "/tiny_a"), tmp .. "/liar", { async = { max_staleness = 1 }, source = liar }))
    end, { "trainer.run: step 1:", "5 versions behind", "async.max_staleness = 1", "does not honour opts.min_policy" },
        "(c) samples older than max_staleness stop the run")
    for _, a in ipairs({ { max_staleness = -1 }, { max_staleness = 1.5 }, { stale = 1 }, 3 }) do
        H.raises(function() trainer.run(base(ds4.load(FIX .. "/tiny_a"), tmp .. "/bad", { async = a })) end,
            { "trainer.run: config.async" }, "(c) bad async option refused")
    end
end

H.done("test_trainer_async")
