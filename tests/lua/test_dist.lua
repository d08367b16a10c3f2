-- test_dist.lua — ds4.dist in a process that no launcher started: a world of one (rank 0, size 1), collectives
-- that are the identity, and the errors of misuse. The multi-rank runs are tests/test_dist_mpi.sh (mpirun).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

H.check(not ds4.dist.is_initialized(), "not initialized before init()")
H.raises(function() return ds4.dist.world_size() end, { "ds4.dist.world_size", "not initialized" },
    "world_size before init")
H.raises(function() return ds4.dist.barrier() end, { "ds4.dist.barrier", "not initialized" }, "barrier before init")
local r, n = ds4.dist.init()
H.eq(r, 0, "rank of a world of one")
H.eq(n, 1, "size of a world of one")
local r2, n2 = ds4.dist.init()
H.check(r2 == 0 and n2 == 1, "init() again returns the same communicator")
H.eq(ds4.dist.backend(), "single", "backend without a launcher")
H.eq(type(ds4.dist.have_mpi), "boolean", "have_mpi says whether this build has MPI")
ds4.dist.barrier()
local t = ds4.tensor({ 1.5, -2, 1e-30 }, "F32")
ds4.dist.all_reduce(t)
H.same(t:totable(), ds4.tensor({ 1.5, -2, 1e-30 }, "F32"):totable(), "all_reduce of one rank is the identity")
local g = ds4.dist.all_gather(ds4.tensor({ { 1, 2 }, { 3, 4 } }, "I64"))
H.same(g:shape(), { 1, 2, 2 }, "all_gather adds a leading rank dimension")
H.same(g:totable(), { { { 1, 2 }, { 3, 4 } } }, "all_gather of one rank copies")
H.raises(function() return ds4.dist.broadcast(t, 1) end, { "ds4.dist.broadcast", "root 1 outside ranks [0, 1)" },
    "broadcast root 1 of 1")
H.raises(function() return ds4.dist.all_reduce({}) end, { "ds4.dist.all_reduce", "ds4.tensor expected" },
    "all_reduce of a table")
H.raises(function() return ds4.dist.all_gather(ds4.zeros({ 1, 1, 1, 1, 1, 1, 1, 1 })) end,
    { "ds4.dist.all_gather", "8 dims", "at most 8" }, "all_gather of an 8-d tensor")

-- all_reduce_grads on a world of one: the sum is the identity, the scale applies
local m = ds4.load(H.fixtures() .. "/tiny_a")
H.raises(function() return ds4.dist.all_reduce_grads(m) end, { "ds4.dist.all_reduce_grads", "not enabled" },
    "all_reduce_grads before zero_grad")
local io_t = ds4.load_tensors(H.fixtures() .. "/tiny_a/io.safetensors")
m:zero_grad()
m:forward(io_t.input_ids, { labels = io_t.labels })
m:backward()
local before = m:grads({ canonical = true })
ds4.dist.all_reduce_grads(m, 0.5)
local after = m:grads({ canonical = true })
local bad, seen = 0, 0
for name, gt in pairs(before) do
    local at = after[name]
    for i = 1, gt:numel() do
        seen = seen + 1
        if at[i] ~= gt[i] * 0.5 then bad = bad + 1 end -- halving is exact in binary floating point
    end
end
H.check(seen > 0, "the model has gradients")
H.eq(bad, 0, "all_reduce_grads(m, 0.5) on one rank halves every gradient exactly")

-- the overlapped reduction's settings (its equalities: dist_buckets.lua): 25 MiB by default, whole elements of 4
-- bytes, 0 turns it off; a world of one has nothing to overlap, so overlap_backward leaves all_reduce_grads as it was
H.eq(ds4.dist.bucket_mb(), 25, "bucket_mb defaults to 25 MiB")
H.eq(ds4.dist.bucket_mb(1e-9), 4 / 1048576, "a bucket holds at least one element")
H.raises(function() ds4.dist.bucket_mb(-1) end, { "ds4.dist.bucket_mb", "-1 MiB" }, "a negative bucket size")
H.eq(ds4.dist.bucket_mb(0), 0, "bucket_mb 0: one reduction after the backward")
ds4.dist.bucket_mb(25)
H.raises(function() ds4.dist.overlap_backward("m") end, { "ds4.dist.overlap_backward", "ds4.model expected" },
    "overlap_backward of a non-model")
m:zero_grad()
m:forward(io_t.input_ids, { labels = io_t.labels })
ds4.dist.overlap_backward(m)
m:backward()
ds4.dist.all_reduce_grads(m, 0.5) -- nothing overlapped on one rank: the scale applies as without it
local halved = m:grads({ canonical = true })
bad = 0
for name, gt in pairs(before) do
    local at = halved[name]
    for i = 1, gt:numel() do
        if at[i] ~= gt[i] * 0.5 then bad = bad + 1 end
    end
end
H.eq(bad, 0, "overlap_backward on one rank: the same gradients, scaled")
H.raises(function() ds4.dist.shard_optimizer(ds4.adamw(m, { lr = 1e-3 }), { reduce = true }) end,
    { "ds4.dist.shard_optimizer", "unknown option 'reduce'" }, "shard_optimizer's options are checked")

-- expert parallelism on a world of one: the refusals (its equalities: dist_expert_parallel.lua)
H.raises(function() ds4.dist.expert_parallel("m") end, { "ds4.dist.expert_parallel", "ds4.model expected" }, "not a model")
H.raises(function() ds4.dist.expert_parallel(m, 1) end, { "boolean expected" }, "on must be a boolean")
ds4.dist.expert_parallel(m)
H.raises(function() ds4.dist.all_reduce_grads(m, 0.5) end, { "scale 0.5 with expert parallelism on" },
    "all_reduce_grads scales nothing under expert parallelism")
H.raises(function() m:lora({ rank = 2, targets = { "experts" } }) end,
    { "routed experts are not supported with expert parallelism" }, "LoRA on the routed experts with expert parallelism")
m:lora({ rank = 2, targets = { "shared" } }) -- other adapters are fine
ds4.dist.expert_parallel(m, false)
m:lora({ rank = 2, targets = { "experts" } })
H.raises(function() ds4.dist.expert_parallel(m) end, { "LoRA adapters on its routed experts" },
    "expert parallelism on a model with routed-expert adapters")
local q4 = ds4.load(H.fixtures() .. "/quant_fp4", { fp4_experts = true })
H.raises(function() ds4.dist.expert_parallel(q4) end, { "FP4-resident routed experts", "not support" },
    "expert parallelism on FP4-resident experts")
ds4.dist.expert_parallel(ds4.load(H.fixtures() .. "/quant_fp4")) -- the same experts expanded to fp32: fine

-- context parallelism on a world of one: the refusals (its equalities: dist_context_parallel.lua)
H.raises(function() ds4.dist.context_parallel("m") end, { "ds4.dist.context_parallel", "ds4.model expected" }, "not a model")
m = ds4.load(H.fixtures() .. "/tiny_a")
ds4.dist.expert_parallel(m)
H.raises(function() ds4.dist.context_parallel(m) end, { "context parallel", "expert parallelism is on" },
    "context parallelism with expert parallelism on")
ds4.dist.expert_parallel(m, false)
m:lora({ rank = 2, targets = { "shared" } })
H.raises(function() ds4.dist.context_parallel(m) end, { "context parallel", "LoRA adapters" },
    "context parallelism on a model with adapters")
m:drop_lora()
H.raises(function() ds4.dist.context_parallel(m, { shard = true }) end,
    { "ds4.dist.context_parallel", "unknown option 'shard'" }, "context parallelism's options are checked")
H.raises(function() ds4.dist.context_parallel(m, 1) end,
    { "ds4.dist.context_parallel", "boolean expected, or {whole_attention = boolean}" }, "a number for on")
ds4.dist.context_parallel(m, { whole_attention = true })
ds4.dist.context_parallel(m)
H.raises(function() ds4.dist.expert_parallel(m) end, { "expert parallel", "context parallelism is on" },
    "expert parallelism with context parallelism on")
H.raises(function() m:lora({ rank = 2, targets = { "shared" } }) end, { "not supported with context parallelism" },
    "adapters with context parallelism on")
m:set_train_options({ indexer_kl = 0.1 })
H.raises(function() m:forward(ds4.tensor({ { 5, 6, 7, 8 } }, "I64"), { labels = ds4.tensor({ { 5, 6, 7, 8 } }, "I64"),
    logits = false, train = true }) end, { "context parallel", "indexer KL" }, "the indexer KL loss")
m:set_train_options({ recompute = true })
H.raises(function() m:forward(ds4.tensor({ { 5, 6, 7, 8 } }, "I64"), { labels = ds4.tensor({ { 5, 6, 7, 8 } }, "I64"),
    logits = false, train = true }) end, { "context parallel", "recomputation" }, "per-block recomputation")
m:set_train_options({})
H.raises(function() m:forward(ds4.tensor({ { 5, 6, 7, 8 } }, "I64"), { hidden = true, logits = false }) end,
    { "context parallel", "hidden" }, "hidden streams as an output")
ds4.dist.context_parallel(m, false)

ds4.dist.finalize()
H.check(not ds4.dist.is_initialized(), "finalize")
ds4.dist.finalize() -- a second finalize does nothing
local r3 = ds4.dist.init() -- a world of one needs no MPI, so it can start again
H.eq(r3, 0, "init after finalize (world of one)")
ds4.dist.finalize()
H.done("test_dist")
