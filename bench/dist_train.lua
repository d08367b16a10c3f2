--[[ bench/dist_train.lua — data-parallel training throughput (weak scaling): every rank trains the same number of
rows per step (its micro-batch of the global batch), so N ranks take N times the tokens; the gradients are summed
over the ranks (ds4.dist.all_reduce_grads: NCCL for GPU ranks) and every rank takes the same AdamW step. Prints the
global tokens/s and what share of N times one rank's tokens/s that is. bench/dist_bench.sh runs it on 1, 2 (and 4)
ranks, launched torchrun-style; alone it is one rank.

  ds4 run bench/dist_train.lua [--config bench/config_599m.json] [--batch 8] [--seq 1024] [--steps 5]
                               [--device cuda] [--dtype bf16] [--bucket_mb 25] [--threads 0] [--ep 0] [--zero 0]

--bucket_mb: the gradients are summed in buckets of this many MiB while the backward runs
(ds4.dist.overlap_backward); 0: one all-reduce after the backward. --threads: each rank's CPU threads (0: all
cores; CPU ranks sharing a machine want cores / ranks, leaving the communication thread room). --ep 1: expert
parallelism on top (DP×EP; with more than one rank): rank r computes routed experts [r·E/P, (r+1)·E/P) for every
rank's tokens, the rows exchanged with all-to-all (NCCL send / recv between GPUs), E a multiple of the ranks; each
rank still holds every expert's weights. --ep 2: the same with sharded experts (ds4.dist.expert_parallel(model, {shard =
true}), docs/distributed.md "Sharded experts"): each rank keeps only its experts' weights, gradients, fp32 master and
moments (cut down on the host before the model moves to its GPU). The gradients are then summed after the backward
(--bucket_mb 0: expert parallelism has no overlapped buckets). --zero 1: ZeRO-1 (the AdamW
moments sharded over the ranks: ds4.dist.shard_optimizer; the gradients all-reduced as without it), --zero 2: ZeRO-1
with the reduce-scatter (each rank sums only its region of the gradients). Each rank's training state on the device
(weights, gradients, fp32 master, moments: model:memory()) is printed for rank 0, and every rank's as "dist
state_mib_rank R MIB" lines. --ep_self 1: --ep on one rank too (expert parallelism over a world of one: every
exchange a device copy of the rank's own rows), the exchanges' fixed costs (plans, synchronisations, reorderings, the
backward's recomputed expert inputs) without transfers between GPUs; bench/dist_bench.sh's one-rank baseline leaves
it off.

Random tokens, a random model (ds4.random_model, seed 1), no MTP. Best of --steps steps after two warm-up steps; a
step is timed from before the forward until the optimizer step has returned (which reads the step's per-piece sums
back, so the device has finished). Prints "dist KEY VALUE" lines for scripts; it measures, never passes or fails. ]]
local ds4 = require("ds4")
local dp = require("ds4.dp")
local metrics = require("ds4.metrics")

local o = { config = "bench/config_599m.json", batch = 8, seq = 1024, steps = 5, device = "cuda", dtype = "bf16",
    bucket_mb = 25, threads = 0, ep = 0, zero = 0, ep_self = 0 }
local i = 1
while i <= #arg do
    local k = arg[i]:match("^%-%-([%w_]+)$")
    if not k or o[k] == nil or arg[i + 1] == nil then
        error(("bench/dist_train.lua: unknown or incomplete option %s (--config --batch --seq --steps --device --dtype --bucket_mb --threads --ep --zero --ep_self)")
            :format(arg[i]))
    end
    o[k] = type(o[k]) == "number" and assert(tonumber(arg[i + 1]), "a number after --" .. k) or arg[i + 1]
    i = i + 2
end
assert(o.ep == 0 or o.ep == 1 or o.ep == 2, "bench/dist_train.lua: --ep 0, 1 or 2 (sharded experts)")
assert(o.zero == 0 or o.zero == 1 or o.zero == 2, "bench/dist_train.lua: --zero 0, 1 or 2")

local rank, world = dp.init(o.device)
local ep = o.ep > 0 and (world > 1 or o.ep_self == 1)
if ep and world == 1 and not ds4.dist.is_initialized() then -- --ep_self: a world of one, NCCL on this GPU
    ds4.dist.init(o.device:match("^cuda") and { device = "cuda" } or nil)
end
local shard = ep and o.ep == 2 and { shard = true } or nil
-- no overlapped buckets with expert parallelism: one all-reduce after the backward. Overlapped, the buckets' sums
-- take the links from the expert exchanges that the backward waits for (2 H200s, even with the buckets on an NCCL
-- communicator of their own: 134.5 ms a step against 131.5; bench/RESULTS.md)
if ep then o.bucket_mb = 0 end
if world > 1 then ds4.dist.bucket_mb(o.bucket_mb) end
if o.threads > 0 then ds4.set_threads(o.threads) end
local model = ds4.random_model(o.config, { seed = 1 })
if shard then ds4.dist.expert_parallel(model, shard) end -- cut down on the host: the GPU never holds every expert
model:to(dp.device() or o.device, o.dtype)
-- (again after the move: the exchange works on the memory the model computes in; the shard stays as it is)
if ep then ds4.dist.expert_parallel(model, shard) end -- the backward's 1 / n below is the global normalisation EP needs
model:set_train_options({ mtp_lambda = 0 })
local opt = ds4.adamw(model, { lr = 1e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 })
local zero = o.zero > 0 and world > 1
if zero then ds4.dist.shard_optimizer(opt, { reduce_scatter = o.zero == 2 }) end

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

local best, loss, wait = math.huge, nil, math.huge
for step = 1, o.steps + 2 do
    dp.barrier()
    local t0 = metrics.clock()
    model:zero_grad()
    local out = model:forward(ids, { labels = ids, logits = false })
    local n = dp.sum({ out.loss_tokens })[1]
    if world > 1 then ds4.dist.overlap_backward(model) end -- a no-op with --bucket_mb 0
    model:backward(1 / n)
    local t1 = metrics.clock()
    if world > 1 then ds4.dist.all_reduce_grads(model) end -- the summing not hidden behind the backward
    local tw = metrics.clock() - t1
    opt:step()
    local mx = dp.max({ metrics.clock() - t0, tw }) -- the slowest rank's step is the step
    local dt, w = mx[1], mx[2]
    if step > 2 and dt < best then best, wait = dt, w end
    loss = dp.sum({ out.loss * out.loss_tokens })[1] / n
end
local tokens = world * o.batch * o.seq
local mem = model:memory() -- each rank's training state on its device (none on the CPU)
local state_mib = dp.gather_numbers({ (mem.device + mem.device_grads + mem.device_master + mem.device_moments) / 2 ^ 20 })
if dp.is_root() then
    print(("# %d rank%s (%s, buckets of %g MiB%s), %s %s, %d x %d rows per rank, best of %d steps: %.1f ms per step "
        .. "(%.1f in all_reduce_grads), loss %.4f"):format(world, world > 1 and "s" or "",
        world > 1 and ds4.dist.backend() or "no communicator", world > 1 and o.bucket_mb or 0,
        (ep and (shard and ", expert parallel, sharded experts" or ", expert parallel") or "") .. (zero and (o.zero == 2 and ", ZeRO-1 reduce-scatter" or ", ZeRO-1") or ""),
        model:device(), o.config, o.batch, o.seq, o.steps, 1e3 * best, 1e3 * wait,
        loss))
    print(("dist ranks %d"):format(world))
    print(("dist expert_parallel %d"):format(ep and o.ep or 0))
    print(("dist zero %d"):format(zero and o.zero or 0))
    if state_mib[1][1] > 0 then
        print(("dist state_mib %.1f"):format(state_mib[1][1]))
        for q = 1, #state_mib do print(("dist state_mib_rank %d %.1f"):format(q - 1, state_mib[q][1])) end
    end
    print(("dist tokens_per_s %.1f"):format(tokens / best))
    print(("dist ms_per_step %.2f"):format(1e3 * best))
    print(("dist reduce_ms %.2f"):format(1e3 * wait))
end
dp.finalize()
