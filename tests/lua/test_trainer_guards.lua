-- test_trainer_guards.lua — the RL loop (ds4.rl.trainer) stops, naming the step and the metric, instead of training
-- on a broken step or finishing with exit status 0 (issue 18, items 2, 3 and 9):
--   (a) most rollout groups failed (finish_reason "failed", as ds4.rollout.pool returns a task that ran out of
--       attempts): an error before anything trains on the rest, the failures counted in groups/failed and the
--       step's metrics line written first; a few failures are counted and the run goes on without them;
--   (b) divergence: kl above guard.max_kl, grad_norm above guard.max_grad_norm, a NaN loss (non-finite weights);
--   (c) guard.max_idle_steps steps in a row that trained on nothing (every group's rewards equal);
--   (d) a metrics file that cannot be written (/dev/full) stops the run.
-- The rollouts are the fixture model's own generations, through a wrapper that fails chosen prompts.
-- Usage: ds4 run tests/lua/test_trainer_guards.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")
local trainer = require("ds4.rl.trainer")
local rl = require("ds4.rl")
local json = require("ds4.chat.json")

local FIX = H.fixtures()
ds4.set_threads(2)

local PROMPTS = { { 5, 6, 7 }, { 8, 9 }, { 10, 11, 12 }, { 13, 14 } }

-- A rollout source: the model's own generate, with the results of prompts in `fail` replaced by what the pool
-- returns for a failed task.
local function source(model, fail)
    return { generate = function(_, prompts, opts)
        local res = model:generate(prompts, opts)
        for i, r in ipairs(res) do
            local p = math.floor((i - 1) / opts.n) + 1
            if fail and fail[p] then
                res[i] = { ids = {}, logprobs = {}, sample_logprobs = {}, finish_reason = "failed", prompt_index = p,
                    error = "worker w1: internal: generation failed" }
            end
        end
        return res
    end }
end

-- The parity of the first generated token decides the reward: groups are mixed (informative) on random weights.
local reward, decode = H.parity_reward, H.byte_text

local function run(o)
    local model = o.model or ds4.load(FIX .. "/tiny_a")
    local dir = H.make_temp_dir()
    local cfg = {
        model = model,
        algorithm = o.algorithm or rl.preset("grpo", { kl = rl.NIL }),
        prompts = function(_, n)
            local out = {}
            for i = 1, n do out[i] = { prompt = PROMPTS[(i - 1) % #PROMPTS + 1] } end
            return out
        end,
        reward = o.reward or reward,
        decode = decode,
        rollout = { n = 4, prompts_per_step = 4, max_new_tokens = 4, temperature = 1.0,
            source = source(o.source_model or model, o.fail) },
        optim = { lr = o.lr or 1e-3 },
        steps = o.steps or 2,
        minibatches = o.minibatches or 2,
        guard = o.guard,
        out = o.out or dir,
        progress = false,
        seed = 3,
    }
    local ok, res = pcall(trainer.run, cfg)
    local rows = {}
    local f = io.open(dir .. "/metrics.jsonl")
    if f then
        for line in f:lines() do rows[#rows + 1] = json.decode(line) end
        f:close()
    end
    os.execute("rm -rf " .. H.shell_quote(dir))
    return ok, res, rows
end

-- ------------------------------------------------------------------------------------------------ (a)
do
    local ok, err, rows = run({ fail = { true, true, true } })
    H.check(not ok, "(a) 3 of 4 groups failed: the run stops")
    err = tostring(err)
    H.check(err:find("trainer.run: step 1: 3 of 4 rollout groups failed", 1, true) ~= nil, "(a) message: " .. err)
    H.eq(#rows, 1, "(a) the step's metrics line was written first")
    H.eq(rows[1] and rows[1]["groups/failed"], 3, "(a) groups/failed")
    H.eq(rows[1] and rows[1].loss, nil, "(a) nothing was trained")
    local ok2, res2, rows2 = run({ fail = { false, true } })
    H.check(ok2, "(a) 1 of 4 groups failed: the run goes on: " .. tostring(not ok2 and res2))
    H.eq(#rows2, 2, "(a) both steps ran")
    H.eq(rows2[2] and rows2[2]["groups/failed"], 1, "(a) and counted the failure")
    H.eq(ok2 and res2.failed_groups, 2, "(a) failed groups over the run")
    H.check(rows2[1] and rows2[1]["groups/kept"] <= 3, "(a) the failed group is not trained on")
end

-- ------------------------------------------------------------------------------------------------ (b)
do
    local ok, err, rows = run({ guard = { max_kl = 1e-30 } })
    H.check(not ok and tostring(err):find("trainer.run: step 1: kl = ", 1, true) ~= nil
        and tostring(err):find("guard.max_kl", 1, true) ~= nil, "(b) kl above guard.max_kl: " .. tostring(err))
    H.eq(#rows, 1, "(b) the step's metrics line was written first")
    ok, err = run({ guard = { max_grad_norm = 1e-30 } })
    H.check(not ok and tostring(err):find("step 1: grad_norm = ", 1, true) ~= nil, "(b) grad_norm: " .. tostring(err))
    -- NaN weights in the trained model (the rollouts come from a healthy copy): the loss is NaN, backward refuses
    -- it, the trainer names the step
    local m = ds4.load(FIX .. "/tiny_a")
    local p = m:params()
    local q = ffi.cast("float *", p:data_ptr())
    for i = 0, p:numel() - 1, 97 do q[i] = 0 / 0 end
    m:set_params(p)
    ok, err = run({ model = m, source_model = ds4.load(FIX .. "/tiny_a"), guard = false })
    H.check(not ok and tostring(err):find("trainer.run: step 1:", 1, true) ~= nil
        and tostring(err):find("nan", 1, true) ~= nil, "(b) NaN weights: " .. tostring(err))
    -- defaults: an ordinary run trips nothing
    local ok3, res3 = run({ steps = 3 })
    H.check(ok3, "(b) an ordinary run passes the default guards: " .. tostring(not ok3 and res3))
    H.raises(function() trainer.run({ model = m, algorithm = rl.preset("grpo", { kl = rl.NIL }), prompts = function() end,
        reward = reward, decode = decode, guard = { max_kll = 1 } }) end, { "config.guard", "max_kll" },
        "(b) an unknown guard key")
end

-- ------------------------------------------------------------------------------------------------ (c)
do
    local ok, err, rows = run({ algorithm = rl.preset("dapo"), reward = function() return 0 end, steps = 5,
        guard = { max_idle_steps = 3 } })
    H.check(not ok and tostring(err):find("step 3: 3 steps in a row trained on nothing", 1, true) ~= nil,
        "(c) idle steps: " .. tostring(err))
    H.eq(#rows, 3, "(c) three metrics lines")
end

-- ------------------------------------------------------------------------------------------------ (d)
do
    local f = io.open("/dev/full", "w")
    if f then
        f:close()
        local dir = H.make_temp_dir()
        os.execute(("ln -s /dev/full %s/metrics.jsonl"):format(H.shell_quote(dir)))
        local ok, err = run({ out = dir })
        H.check(not ok and tostring(err):find("ds4.metrics: write", 1, true) ~= nil
            and tostring(err):find("No space left", 1, true) ~= nil, "(d) a full disk stops the run: " .. tostring(err))
        os.execute("rm -rf " .. H.shell_quote(dir))
    else
        print("(d) skipped: no /dev/full")
    end
end

H.done("test_trainer_guards")
