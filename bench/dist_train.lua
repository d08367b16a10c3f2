--[[ bench/dist_train.lua — data-parallel training throughput (weak scaling): every rank trains the same number of
rows per step (its micro-batch of the global batch), so N ranks take N times the tokens; the gradients are summed
over the ranks (ds4.dist.all_reduce_grads: NCCL for GPU ranks) and every rank takes the same AdamW step. Prints the
global tokens/s and what share of N times one rank's tokens/s that is. bench/dist_bench.sh runs it on 1, 2 (and 4)
ranks, launched torchrun-style; alone it is one rank.

  ds4 run bench/dist_train.lua [--config bench/config_599m.json] [--batch 8] [--seq 1024] [--steps 5]
                               [--device cuda] [--dtype bf16]

Random tokens, a random model (ds4.random_model, seed 1), no MTP. Best of --steps steps after two warm-up steps; a
step is timed from before the forward until the optimizer step has returned (which reads the step's per-piece sums
back, so the device has finished). Prints "dist KEY VALUE" lines for scripts; it measures, never passes or fails. ]]
local ds4 = require("ds4")
local dp = require("ds4.dp")
local metrics = require("ds4.metrics")

local o = { config = "bench/config_599m.json", batch = 8, seq = 1024, steps = 5, device = "cuda", dtype = "bf16" }
local i = 1
while i <= #arg do
    local k = arg[i]:match("^%-%-([%w_]+)$")
    if not k or o[k] == nil or arg[i + 1] == nil then
        error(("bench/dist_train.lua: unknown or incomplete option %s (--config --batch --seq --steps --device --dtype)")
            :format(arg[i]))
    end
    o[k] = type(o[k]) == "number" and assert(tonumber(arg[i + 1]), "a number after --" .. k) or arg[i + 1]
    i = i + 2
end

local rank, world = dp.init(o.device)
local model = ds4.random_model(o.config, { seed = 1 })
model:to(dp.device() or o.device, o.dtype)
model:set_train_options({ mtp_lambda = 0 })
local opt = ds4.adamw(model, { lr = 1e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 })

-- this rank's rows: a fixed LCG, different on every rank (the rows of a global batch)
local V, s = model:config().vocab_size, 12345 + 7919 * rank
local ids = {}
for b = 1, o.batch do
    ids[b] = {}
    for t = 1, o.seq do
        s = (s * 16807) % 2147483647
        ids[b][t] = s % V
    end
end

local best, loss = math.huge, nil
for step = 1, o.steps + 2 do
    dp.barrier()
    local t0 = metrics.clock()
    model:zero_grad()
    local out = model:forward(ids, { labels = ids, logits = false })
    local n = dp.sum({ out.loss_tokens })[1]
    model:backward(1 / n)
    if world > 1 then ds4.dist.all_reduce_grads(model) end
    opt:step()
    local dt = dp.max({ metrics.clock() - t0 })[1] -- the slowest rank's step is the step
    if step > 2 then best = math.min(best, dt) end
    loss = dp.sum({ out.loss * out.loss_tokens })[1] / n
end
local tokens = world * o.batch * o.seq
if dp.is_root() then
    print(("# %d rank%s (%s), %s %s, %d x %d rows per rank, best of %d steps: %.1f ms per step, loss %.4f"):format(
        world, world > 1 and "s" or "", world > 1 and ds4.dist.backend() or "no communicator", model:device(),
        o.config, o.batch, o.seq, o.steps, 1e3 * best, loss))
    print(("dist ranks %d"):format(world))
    print(("dist tokens_per_s %.1f"):format(tokens / best))
    print(("dist ms_per_step %.2f"):format(1e3 * best))
end
dp.finalize()
