-- dist_rank_dies.lua [kill|error] — the last rank dies after the first collective: `kill` (default) sends itself
-- SIGKILL (no cleanup, no MPI_Finalize), `error` raises a Lua error (ds4 run exits 1; the communicator's __gc
-- frees it without finalizing, so this rank does not wait for the others). The others keep all-reducing. They must not hang: tests/test_dist_mpi.sh runs this under a timeout
-- and wants mpirun to end the job with an error naming the dead rank well before it. Not a ctest entry itself.
local ds4 = require("ds4")
local r, n = ds4.dist.init()
local t = ds4.tensor({ 1 }, "F32")
ds4.dist.all_reduce(t)
assert(t[1] == n, "first all_reduce")
local mode = arg[1] or "kill"
if r == n - 1 then
    io.stderr:write("dist_rank_dies: rank ", r, " dies (", mode, ")\n")
    io.stderr:flush()
    if mode == "error" then error("dist_rank_dies: rank " .. r .. " fails on purpose") end
    os.execute("kill -9 $PPID") -- the shell's parent is this ds4 process
end
local t0 = os.time()
while os.time() - t0 < 120 do -- the others: collectives until the job is ended (or an MPI error is raised)
    ds4.dist.all_reduce(t)
    ds4.dist.barrier()
end
io.stderr:write("dist_rank_dies: rank ", r, " still running after 120 s: the job was not ended\n")
os.exit(3)
