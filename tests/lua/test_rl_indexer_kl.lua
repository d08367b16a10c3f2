-- test_rl_indexer_kl.lua — the RL trainer's indexer KL loss is normalised per global query, not per micro-batch
-- (ds4.rl.trainer, config.indexer_kl; docs/distributed.md, "Loss normalisation").
--
-- tiny_a (two CSA layers) trains one GRPO step with indexer_kl = 0.5 on 4 prompts of different lengths × 4 samples,
-- every third sample cut after 2 tokens, so that the rows of a packed micro-batch have different lengths (padding)
-- and the two halves of the minibatch have different real query counts (checked: Q1 ~= Q2). The same step runs as one
-- micro-batch (the reference: one forward over every sample, its indexer KL the mean over all their real queries)
-- and as 2 and 3 micro-batches. Each micro-batch's backward takes κ / Q (Q the whole minibatch's real queries), so
-- the accumulated gradients equal the one micro-batch's up to fp32 summation order: every tensor within rel 2e-5 (as
-- tests/lua/test_grad_accum.lua; measured 5.5e-7). Normalising each part by its own count instead (the default
-- backward) weights the halves' KL by κ/Q1 and κ/Q2: rel 1.04 on the indexer's weights (measured), and counting the
-- padding (forwards without lengths, what the trainer did before) adds KL terms no sample has: rel 0.49. The logged indexer_kl metric (the step's loss over
-- its real queries) is the same in every split (rel 1e-9: double sums in another grouping) and positive.
-- Usage: ds4 run tests/lua/test_rl_indexer_kl.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local trainer = require("ds4.rl.trainer")
local rl = require("ds4.rl")
local dp = require("ds4.dp")

ds4.set_threads(2)
local FIX = H.fixtures()
local tmp = H.make_temp_dir()
local KAPPA = 0.5

local function run(micro)
    local model = ds4.load(FIX .. "/tiny_a")
    local samples = {}
    local source = { generate = function(_, prompts, opts)
        local res = model:generate(prompts, opts)
        for i, r in ipairs(res) do
            if i % 3 == 0 then r.ids, r.logprobs, r.finish_reason = { r.ids[1], r.ids[2] }, { r.logprobs[1], r.logprobs[2] }, "stop_token" end
            samples[#samples + 1] = { prompt = prompts[math.floor((i - 1) / opts.n) + 1], ids = r.ids }
        end
        return res
    end }
    local grads, row
    trainer.run({
        model = model,
        algorithm = rl.preset("grpo", { kl = rl.NIL }),
        prompts = H.prompts_of_lengths({ 6, 9, 12, 3 }),
        reward = H.parity_reward,
        decode = H.byte_text,
        rollout = { n = 4, prompts_per_step = 4, max_new_tokens = 6, temperature = 1.0, source = source },
        optim = { lr = 1e-3, clip = 0 },
        steps = 1,
        minibatches = 1,
        micro_batches = micro,
        indexer_kl = KAPPA,
        out = tmp .. "/mb" .. micro,
        seed = 11,
        progress = false,
        on_step = function(_, r)
            row = r
            grads = {}
            for k, t in pairs(model:grads({ canonical = true })) do grads[k] = t:clone() end
        end,
    })
    H.eq(model:train_options().indexer_kl, KAPPA, "config.indexer_kl is set on the model")
    return grads, row, samples, model
end

local ref, ref_row, samples, model = run(1)
H.eq(#samples, 16, "16 samples")
-- the halves of the minibatch (dp.share: 8 and 8), their real lengths and query counts
local function part_lengths(first, count)
    local len = {}
    for i = first, first + count - 1 do len[#len + 1] = #samples[i].prompt + #samples[i].ids end
    return len
end
local l1, l2 = part_lengths(1, 8), part_lengths(9, 8)
local Q1, Q2 = model:indexer_queries(l1), model:indexer_queries(l2)
H.check(Q1 ~= Q2 and Q1 > 0 and Q2 > 0, ("the halves' real query counts differ (%d, %d)"):format(Q1, Q2))
local function padded(len)
    local mx, mn = math.max(unpack(len)), math.min(unpack(len))
    return mx > mn
end
H.check(padded(l1) and padded(l2), "each half packs rows of different lengths (padding)")
H.check(type(ref_row.indexer_kl) == "number" and ref_row.indexer_kl > 0, "indexer_kl is logged and positive")

local idx_norm = 0
for name, g in pairs(ref) do
    if name:find("%.attn%.indexer%.") then idx_norm = idx_norm + select(3, H.f32_diff(g, g)) end
end
H.check(idx_norm > 0, "the indexer gets a gradient")
for _, micro in ipairs({ 2, 3 }) do
    local g, row = run(micro)
    local worst, worst_name = 0, "?"
    for name, t in pairs(ref) do
        local mx, r, bb = H.f32_diff(g[name], t)
        r = bb > 0 and r or mx
        if not (r <= worst) then worst, worst_name = r, name end
    end
    H.check(worst <= 2e-5, ("%d micro-batches vs 1: worst rel %.3g (%s)"):format(micro, worst, worst_name))
    H.near(row.indexer_kl, ref_row.indexer_kl, 1e-9 * ref_row.indexer_kl, micro .. " micro-batches: indexer_kl metric")
    print(("rl indexer KL: %d micro-batches vs 1: gradients worst rel %.3g (%s), indexer_kl %.9g vs %.9g"):format(
        micro, worst, worst_name, row.indexer_kl, ref_row.indexer_kl))
end
H.raises(function()
    trainer.run({ model = model, algorithm = rl.preset("grpo"), prompts = function() end, reward = H.parity_reward,
        decode = H.byte_text, indexer_kl = -1 })
end, { "config.indexer_kl" }, "a negative indexer_kl")
assert(dp.world() == 1)
H.done("test_rl_indexer_kl")
