-- dist_rank_dies.lua [kill|error|hang] — the last rank fails after the first collective: `kill` (default) sends
-- itself SIGKILL (no cleanup, no MPI_Finalize), `error` raises a Lua error (ds4 run exits 1; the communicator's __gc
-- frees it without finalizing, so this rank does not wait for the others), `hang` sleeps DS4_TEST_HANG_S seconds (30) without
-- closing anything (then carries on, and fails at its next collective), `buckets` raises a Lua error right after a
-- backward whose gradients are being summed in small buckets (ds4.dist.overlap_backward: its communication thread
-- is in, or about to start, the buckets' collectives; the communicator's __gc must still let the process end). The
-- others keep all-reducing. They must not hang:
-- tests/test_dist_mpi.sh (mpirun ends the job) and tests/test_dist_tcp.sh / test_dist_nccl.sh (the timeout, or the
-- closed connections) run this under a bound and want an error naming the failed rank well before it.
-- DS4_TEST_DEVICE=cuda: the collective is NCCL's, on the gradients of a model on this rank's GPU. Not a ctest entry.
local ds4 = require("ds4")
local on_device = os.getenv("DS4_TEST_DEVICE") == "cuda"
local r, n = ds4.dist.init(on_device and { device = "cuda" } or nil)
local t = ds4.tensor({ 1 }, "F32")
local m
if on_device then -- the collective under test is NCCL's all-reduce of a device model's gradients
    m = ds4.load(arg[2] .. "/tiny_a"):to(ds4.dist.device(), "fp32")
    m:zero_grad()
end
local function collective()
    if on_device then ds4.dist.all_reduce_grads(m, 1) else ds4.dist.all_reduce(t) end
end
collective()
assert(on_device or t[1] == n, "first all_reduce")
local mode = arg[1] or "kill"
if mode == "buckets" then -- every rank starts a bucketed reduction; the others finish it, the last rank dies in it
    local b = ds4.load((arg[2] or "tests/fixtures") .. "/tiny_a")
    if on_device then b:to(ds4.dist.device(), "fp32") end
    local ids = ds4.tensor({ { 5, 6, 7, 8, 9, 10 } }, "I64")
    b:zero_grad()
    b:forward(ids, { labels = ids })
    ds4.dist.bucket_mb(0.01)
    ds4.dist.overlap_backward(b)
    b:backward()
    if r == n - 1 then error("dist_rank_dies: rank " .. r .. " fails on purpose, buckets in flight") end
    ds4.dist.all_reduce_grads(b)
end
if r == n - 1 then
    io.stderr:write("dist_rank_dies: rank ", r, " dies (", mode, ")\n")
    io.stderr:flush()
    if mode == "error" then error("dist_rank_dies: rank " .. r .. " fails on purpose") end
    if mode == "hang" then os.execute("sleep " .. (tonumber(os.getenv("DS4_TEST_HANG_S")) or 30)) else os.execute("kill -9 $PPID") end -- $PPID: this ds4 process
end
local t0 = os.time()
while os.time() - t0 < 120 do -- the others: collectives until the job is ended or one fails
    collective()
    ds4.dist.barrier()
end
io.stderr:write("dist_rank_dies: rank ", r, " still running after 120 s: the job was not ended\n")
os.exit(3)
