-- dist_zero_alone.lua FIXTURES WHAT [DIR] — a read-back of a sharded fp32 master on one rank alone must fail, not
-- hang. Run by tests/test_dist_nccl.sh on 2 GPUs (not a ctest entry: a CPU model's master is never sharded, so its
-- read-backs are not collectives).
--
-- ZeRO-1 on a GPU keeps each rank's region of the fp32 master on its device only, so reading the weights back to the
-- host gathers the regions from their owners: a collective that every rank must call. Here both ranks take one
-- sharded step, then rank 0 alone reads back (WHAT: `params` model:params(), `state` opt:state(), `save` a checkpoint
-- into DIR) while rank 1 does something else (it sleeps DS4_TEST_HANG_S seconds, longer than DS4_DIST_TIMEOUT, then
-- tries a barrier and exits). Rank 0's read-back must fail within the communicator's timeout with an error that names
-- the read-back; rank 0 prints one line saying how long it took and what it said, then raises it (ds4 run exits
-- non-zero). A read-back that returns instead is a failure (the line says "returned").
local ds4 = require("ds4")
local FIX, WHAT, DIR = arg[1], arg[2], arg[3]
assert(WHAT == "params" or WHAT == "state" or (WHAT == "save" and DIR), "usage: dist_zero_alone.lua FIXTURES "
    .. "params|state|save [DIR]")
local r, n = ds4.dist.init({ device = "cuda" })
assert(n == 2, "2 ranks")
local dtype = os.getenv("DS4_TEST_DTYPE") or "fp32"
local model = ds4.load(FIX .. "/tiny_a"):to(ds4.dist.device(), dtype)
local opt = ds4.adamw(model, { lr = 2e-3, weight_decay = 0.1 })
local off, len = ds4.dist.shard_optimizer(opt)
local ids = ds4.tensor({ { 5 + r, 6, 7, 8, 9, 10, 11, 12 } }, "I64")
model:zero_grad()
model:forward(ids, { labels = ids })
model:backward()
ds4.dist.all_reduce_grads(model)
opt:step() -- every rank: the master's regions updated on their owners, the host weights now stale
assert(model:memory().device_master == len * 4, "this rank's device master is its region's only")

if r == 0 then
    local t0 = os.time()
    local ok, e = pcall(function()
        if WHAT == "params" then return model:params() end
        if WHAT == "state" then return opt:state() end
        return ds4.checkpoints.save(DIR, 1, model)
    end)
    io.stderr:write(("dist_zero_alone: rank 0's %s alone (shard %d + %d) %s after %d s: %s\n"):format(WHAT, off, len,
        ok and "returned" or "failed", os.time() - t0, ok and "(no error)" or tostring(e)))
    io.stderr:flush()
    if ok then os.exit(2) end
    error(e, 0)
end
os.execute("sleep " .. (tonumber(os.getenv("DS4_TEST_HANG_S")) or 30)) -- never joins the read-back
local ok, e = pcall(ds4.dist.barrier)
io.stderr:write("dist_zero_alone: rank 1 woke; its barrier: ", ok and "passed" or tostring(e), "\n")
os.exit(ok and 0 or 1)
