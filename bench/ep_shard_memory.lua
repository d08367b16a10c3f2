-- ep_shard_memory.lua DIR MODE — memory of one rank under expert parallelism, replicated or with sharded experts
-- (docs/distributed.md, "Sharded experts"). bench/ep_shard_memory.sh runs it on 1, 2 and 4 ranks.
--   MODE replicated: ds4.load(DIR), expert_parallel(model)
--   MODE sharded:    ds4.load(DIR, {expert_shard = {rank, world}}), expert_parallel(model, {shard = true})
-- then one training step (forward, backward, all_reduce_grads, AdamW) on 2 rows of 64 tokens per rank, and one line
-- per rank: the routed experts' weights + gradients + Adam moments this rank holds (from the buffer sizes), its flat
-- parameter buffer, and the process's peak and current resident set (VmHWM, VmRSS: /proc/self/status).
local ds4 = require("ds4")
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local status = require("proc_status")
local dir, mode = arg[1], arg[2] or "sharded"
assert(dir and (mode == "replicated" or mode == "sharded"), "usage: ep_shard_memory.lua DIR replicated|sharded")
local r, n = ds4.dist.init()
local model
if mode == "sharded" then
    model = ds4.load(dir, { expert_shard = { rank = r, world = n } })
    ds4.dist.expert_parallel(model, { shard = true })
else
    model = ds4.load(dir)
    ds4.dist.expert_parallel(model)
end
local V = model:config().vocab_size
local ids = ds4.zeros({ 2, 64 }, "I64")
for i = 1, 128 do ids[i] = (i * 7 + r * 13) % V end
model:zero_grad()
local out = model:forward(ids, { labels = ids })
local N = ds4.dist.all_reduce(ds4.tensor({ out.loss_tokens }, "F64"))[1]
model:backward(1 / N)
ds4.dist.all_reduce_grads(model)
local opt = ds4.adamw(model, { lr = 1e-4, clip = 1.0 })
opt:step()
local experts = 0
for name, t in pairs(model:tensors()) do
    if name:match("%.experts%.%d+%.w[123]%.weight$") then experts = experts + t:numel() end
end
print(("ep_shard_memory: %s, rank %d of %d: routed experts' weights + grads + m + v %.1f MB; flat buffer %.1f MB; peak RSS %.1f MB, RSS %.1f MB")
    :format(mode, r, n, experts * 16 / 1e6, model:memory().params / 1e6, status("VmHWM") / 1e6, status("VmRSS") / 1e6))
ds4.dist.finalize()
