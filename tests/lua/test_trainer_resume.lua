-- test_trainer_resume.lua — RL checkpoints and resume (issue 17): ds4.rl.trainer with checkpoint = {every = 2},
-- stopped after step 2 (on_step returns false) and resumed in a fresh model, gives bitwise the run that never
-- stopped: the final policy parameters, the optimizer's moments, and every metric but the timings. The checkpoint
-- holds the reference model of a KL term (the resumed run's reference starts perturbed and must come back), the
-- loop's counters (which batch of prompts comes next, so prompts(k, n) sees the same k) and the caller's own state
-- (config.state); its name counts completed optimizer updates (2 minibatches per step: step 2 = step_000004).
-- The same with LoRA adapters: the adapters, their moments and the metrics bitwise, the frozen weights unmoved.
-- Usage: ds4 run tests/lua/test_trainer_resume.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local trainer = require("ds4.rl.trainer")
local rl = require("ds4.rl")

local FIX = H.fixtures()
ds4.set_threads(2)

local same_bytes = H.same_bytes

-- prompts as a function of k only; the caller's state counts the calls
local function config(model, reference, out, o)
    local calls = { n = 0 }
    local cfg = {
        model = model,
        reference = reference,
        algorithm = rl.preset("grpo", { kl = { coef = 0.05, estimator = "k3", where = "loss" } }),
        prompts = function(k, n)
            calls.n = calls.n + 1
            local p = {}
            for i = 1, n do p[i] = { prompt = { 5 + (k * 7 + i) % 40, 6 + (k + i) % 30, 7 } } end
            return p
        end,
        reward = H.parity_reward,
        decode = H.byte_text,
        rollout = { n = 4, prompts_per_step = 4, max_new_tokens = 5, temperature = 1.0 },
        optim = { lr = 3e-3 },
        steps = 4,
        minibatches = 2,
        out = out,
        seed = 11,
        progress = false,
        checkpoint = { every = 2, resume = o.resume },
        state = { save = function() return { calls = calls.n } end, load = function(t) calls.n = t.calls end },
        on_step = o.on_step,
    }
    return cfg, calls
end

local rows_of = require("ds4.plot").read_jsonl

local TIMING = { seconds = true, tokens_per_s = true, ["time/generate"] = true, ["time/reward"] = true,
    ["time/train"] = true, ["time/eval"] = true }

local tmp = H.make_temp_dir()
-- A: four steps without stopping
local ma = ds4.load(FIX .. "/tiny_a")
local cfg_a, calls_a = config(ma, ds4.load(FIX .. "/tiny_a"), tmp .. "/a", {})
local ra = trainer.run(cfg_a)
H.eq(ra.updates, 8, "4 steps x 2 minibatches = 8 updates")
-- B: the same run, stopped after step 2
local mb = ds4.load(FIX .. "/tiny_a")
local rb = trainer.run((config(mb, ds4.load(FIX .. "/tiny_a"), tmp .. "/b", {
    on_step = function(step) return step < 2 end })))
H.eq(rb.stopped_at, 2, "on_step returning false stops the run after step 2")
H.check(io.open(tmp .. "/b/ckpt/step_000004/COMPLETE") ~= nil, "the checkpoint of step 2 is named by its 4 updates")
local _, tstate = ds4.checkpoints.read_state(tmp .. "/b/ckpt/step_000004", "trainer")
H.eq(tstate.step, 2, "the trainer state records the RL step")
H.eq(tstate.user.calls, 2, "and the caller's state (config.state.save)")
-- C: resumed in a fresh model, with a perturbed reference that the checkpoint must restore
local mc = ds4.load(FIX .. "/tiny_a")
local refc = ds4.load(FIX .. "/tiny_a")
local ref_params = refc:params()
local scaled = refc:params()
for i = 1, scaled:numel() do scaled[i] = scaled[i] * 0.5 end
refc:set_params(scaled)
local cfg_c, calls_c = config(mc, refc, tmp .. "/b", { resume = true })
local rc = trainer.run(cfg_c)
H.eq(rc.resumed_from, tmp .. "/b/ckpt/step_000004", "resumed from the newest checkpoint")
H.eq(rc.updates, 8, "the optimizer's update count continues")
H.check(same_bytes(mc:params(), ma:params()), "the resumed run's final parameters equal the uninterrupted run's, bit for bit")
H.check(same_bytes(refc:params(), ref_params), "the reference model is the checkpoint's, not the perturbed one")
H.eq(calls_c.n, calls_a.n, "the caller's state continued from the checkpoint")
local sa = ds4.checkpoints.read_state(tmp .. "/a/ckpt/step_000008", "optimizer")
local sc = ds4.checkpoints.read_state(tmp .. "/b/ckpt/step_000008", "optimizer")
H.check(same_bytes(sa.m, sc.m) and same_bytes(sa.v, sc.v), "the final AdamW moments are bit-identical")
local a_rows, c_rows = rows_of(tmp .. "/a/metrics.jsonl"), rows_of(tmp .. "/b/metrics.jsonl")
H.eq(#c_rows, #a_rows, "the resumed run's metrics file has every step once")
for i, ra_row in ipairs(a_rows) do
    local rc_row = c_rows[i] or {}
    H.eq(rc_row.step, ra_row.step, "step of record " .. i)
    for k, v in pairs(ra_row) do
        if not TIMING[k] then H.eq(rc_row[k], v, ("step %d: %s"):format(ra_row.step, k)) end
    end
end
H.eq(#rc.history, 4, "the returned history covers the steps before the resume too")

-- a model whose hash-routing tables differ from the checkpoint's is refused, naming why
local other = ds4.load(FIX .. "/tiny_b")
H.raises(function() trainer.run((config(other, ds4.load(FIX .. "/tiny_b"), tmp .. "/b", { resume = true }))) end,
    { "trainer.run: resume:", "hash-routing tables" }, "a model of other tables")

-- LoRA: the same run training adapters only (rank 2 on the attention, shared and routed experts). The checkpoint
-- holds the adapters beside the frozen weights and the optimizer's moments are the adapters'; the resumed policy
-- gets fresh adapters of another seed, which the checkpoint's must replace.
local function same_tensors(a, b)
    for k, t in pairs(a) do
        if not b[k] or not same_bytes(t, b[k]) then return false, k end
    end
    for k in pairs(b) do
        if not a[k] then return false, k end
    end
    return true
end
local function lora_model(seed)
    local m = ds4.load(FIX .. "/tiny_a")
    m:lora{ rank = 2, alpha = 4, seed = seed }
    return m
end
local la = lora_model(5)
local base = la:params()
local lra = trainer.run((config(la, ds4.load(FIX .. "/tiny_a"), tmp .. "/la", {})))
H.eq(lra.updates, 8, "LoRA: 8 updates")
H.check(same_bytes(la:params(), base), "LoRA: the frozen weights did not move")
H.check(io.open(tmp .. "/la/ckpt/step_000004/adapter_model.safetensors") ~= nil and
    io.open(tmp .. "/la/ckpt/step_000004/adapter_config.json") ~= nil, "LoRA: the checkpoint holds the adapters")
local lb = lora_model(5)
trainer.run((config(lb, ds4.load(FIX .. "/tiny_a"), tmp .. "/lb", { on_step = function(step) return step < 2 end })))
local lc = lora_model(99)
local cfg_lc, calls_lc = config(lc, ds4.load(FIX .. "/tiny_a"), tmp .. "/lb", { resume = true })
local rlc = trainer.run(cfg_lc)
H.eq(rlc.resumed_from, tmp .. "/lb/ckpt/step_000004", "LoRA: resumed from the checkpoint of step 2")
H.eq(calls_lc.n, 4, "LoRA: the caller's state continued")
local ok, key = same_tensors(lc:lora_tensors(), la:lora_tensors())
H.check(ok, "LoRA: the resumed run's adapters equal the uninterrupted run's, bit for bit (first difference: "
    .. tostring(key) .. ")")
H.check(same_bytes(lc:params(), base), "LoRA: the resumed run's frozen weights are the checkpoint's")
local lsa = ds4.checkpoints.read_state(tmp .. "/la/ckpt/step_000008", "optimizer")
local lsc = ds4.checkpoints.read_state(tmp .. "/lb/ckpt/step_000008", "optimizer")
H.eq(lsa.m:numel(), la:lora_info().numel, "LoRA: the optimizer's moments cover the adapters only")
H.check(same_bytes(lsa.m, lsc.m) and same_bytes(lsa.v, lsc.v) and same_bytes(lsa.tensor_steps, lsc.tensor_steps),
    "LoRA: the final AdamW moments and step counts are bit-identical")
local la_rows, lc_rows = rows_of(tmp .. "/la/metrics.jsonl"), rows_of(tmp .. "/lb/metrics.jsonl")
H.eq(#lc_rows, #la_rows, "LoRA: every step once in the resumed run's metrics")
for i, r in ipairs(la_rows) do
    for k, v in pairs(r) do
        if not TIMING[k] then H.eq((lc_rows[i] or {})[k], v, ("LoRA step %d: %s"):format(r.step, k)) end
    end
end
-- a LoRA checkpoint needs a policy with the same adapters; a full one, a policy without adapters
H.raises(function() trainer.run((config(ds4.load(FIX .. "/tiny_a"), ds4.load(FIX .. "/tiny_a"), tmp .. "/lb",
    { resume = true }))) end, { "trainer.run: resume:", "holds LoRA adapters", "model:lora" }, "a policy without adapters")
local r4 = ds4.load(FIX .. "/tiny_a")
r4:lora{ rank = 4 }
H.raises(function() trainer.run((config(r4, ds4.load(FIX .. "/tiny_a"), tmp .. "/lb", { resume = true }))) end,
    { "trainer.run: resume:", "rank 4", "rank 2" }, "adapters of another rank")
H.raises(function() trainer.run((config(lora_model(1), ds4.load(FIX .. "/tiny_a"), tmp .. "/b", { resume = true })))
end, { "trainer.run: resume:", "holds none" }, "a LoRA policy and a checkpoint of a full run")

os.execute("rm -rf " .. H.shell_quote(tmp))
H.done("test_trainer_resume")
