-- dist_collectives.lua — the collectives of ds4.dist on N ranks against closed forms. Run by tests/test_dist_mpi.sh
-- under `mpirun -np N` (and once without mpirun: a world of one); not a ctest entry itself (no test_ prefix).
-- Every rank checks its own results; a failure exits 1 and mpirun ends the job.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local r, n = ds4.dist.init()
H.eq(ds4.dist.rank(), r, "rank()")
H.eq(ds4.dist.world_size(), n, "world_size()")
local want_n = tonumber(os.getenv("DS4_TEST_WORLD") or "1")
H.eq(n, want_n, "world size as launched")
H.check(r >= 0 and r < n, "rank in [0, n)")
H.eq(ds4.dist.backend(), os.getenv("DS4_TEST_BACKEND") or (os.getenv("OMPI_COMM_WORLD_RANK") and "mpi" or "single"),
    "backend")
H.check(ds4.dist.local_rank() >= 0 and ds4.dist.local_rank() < n, "local_rank in [0, n)")
ds4.dist.barrier()

-- all_reduce sum, F32: element i of rank r holds (r + 1) * (i + 1); the sum is (i + 1) * n (n + 1) / 2, exact in
-- fp32 for these magnitudes (integers below 2^24), so any summation order gives it.
local m = 1000
local vals = {}
for i = 1, m do vals[i] = (r + 1) * i end
local t = ds4.tensor(vals, "F32")
H.check(ds4.dist.all_reduce(t, "sum") == t, "all_reduce returns its tensor (in place)")
local bad = 0
for i = 1, m do
    if t[i] ~= i * n * (n + 1) / 2 then bad = bad + 1 end
end
H.eq(bad, 0, "F32 all_reduce: elements off the closed form i * n(n+1)/2")

-- The sum's order is rank order, one fp32 addition at a time: rank 0 holds 1, every other rank 2^-24 (half an ulp
-- of 1). ((1 + h) + h) + h rounds to 1 at every step (ties to even); any other grouping adds h + h = 2^-23 first and
-- gives 1 + 2^-23 (4 ranks: (1 + h) + (h + h), the recursive-doubling order). Each element of a buffer longer than
-- the world (shards of uneven size: 1003 elements) must come out so.
local hh = {}
for i = 1, 1003 do hh[i] = r == 0 and 1 or 2 ^ -24 end
local ro = ds4.dist.all_reduce(ds4.tensor(hh, "F32"))
bad = 0
for i = 1, 1003 do
    if ro[i] ~= 1 then bad = bad + 1 end
end
H.eq(bad, 0, "F32 all_reduce sums in rank order (elements off 1)")

-- F64 with values that need double precision: 1 + r * 2^-40 sums to n + 2^-40 n(n-1)/2 exactly in fp64, and
-- -r * 2^600 (beyond fp32's range; a power of two times a small integer, so every partial sum is exact).
local d = ds4.tensor({ 1 + r * 2 ^ -40, -r * 2 ^ 600 }, "F64")
ds4.dist.all_reduce(d)
H.eq(d[1], n + 2 ^ -40 * n * (n - 1) / 2, "F64 all_reduce keeps 2^-40")
H.eq(d[2], -2 ^ 600 * n * (n - 1) / 2, "F64 all_reduce of large values")

-- all_gather: each rank contributes a 2 x 3 I32 block of (rank, position); the result is [n, 2, 3] in rank order.
local blk = ds4.tensor({ { r, r * 10 + 1, r * 10 + 2 }, { r * 10 + 3, r * 10 + 4, -r } }, "I32")
local g = ds4.dist.all_gather(blk)
H.same(g:shape(), { n, 2, 3 }, "all_gather shape")
bad = 0
for k = 0, n - 1 do
    local want = { k, k * 10 + 1, k * 10 + 2, k * 10 + 3, k * 10 + 4, -k }
    for j = 1, 6 do
        if g[k * 6 + j] ~= want[j] then bad = bad + 1 end
    end
end
H.eq(bad, 0, "all_gather: elements off rank order")

-- all_to_all_v: rank s sends (s + q) % 3 rows to rank q, row i of that block = (s, 100 q + i) as I32; rank r receives
-- (s + r) % 3 rows from rank s, in rank order (some blocks empty).
local rows_to, send_rows, recv_rows = {}, {}, {}
for q = 0, n - 1 do
    send_rows[q + 1], recv_rows[q + 1] = (r + q) % 3, (q + r) % 3
    for i = 0, (r + q) % 3 - 1 do rows_to[#rows_to + 1] = { r, 100 * q + i } end
end
local sent = #rows_to > 0 and ds4.tensor(rows_to, "I32") or ds4.zeros({ 0, 2 }, "I32")
local got = ds4.dist.all_to_all_v(sent, send_rows, recv_rows)
local want = {}
for s = 0, n - 1 do
    for i = 0, (s + r) % 3 - 1 do want[#want + 1] = { s, 100 * r + i } end
end
H.same(got:totable(), #want > 0 and want or {}, "all_to_all_v: blocks from every rank in rank order")
H.raises(function() return ds4.dist.all_to_all_v(sent, { 1 }, recv_rows) end,
    n > 1 and { "send_rows has 1 entries" } or { "sends 1 rows" }, "all_to_all_v with a wrong count")

-- broadcast from the last rank, BF16 (any dtype: bytes are copied): every rank ends with the root's values.
local root = n - 1
local b = ds4.tensor({ r + 0.5, -r, 3 }, "BF16")
H.check(ds4.dist.broadcast(b, root) == b, "broadcast returns its tensor")
H.same(b:totable(), { root + 0.5, -root, 3 }, "broadcast from rank " .. root)

-- errors name the function and the problem
H.raises(function() return ds4.dist.all_reduce(blk) end, { "ds4.dist.all_reduce", "I32", "F32 or F64 only" },
    "all_reduce of I32")
H.raises(function() return ds4.dist.all_reduce(t, "max") end, { "ds4.dist.all_reduce", "\"max\"", "sum" },
    "all_reduce op max")
H.raises(function() return ds4.dist.broadcast(b, n) end, { "ds4.dist.broadcast", "root " .. n, "outside ranks" },
    "broadcast root out of range")

ds4.dist.barrier()
ds4.dist.finalize()
H.check(not ds4.dist.is_initialized(), "finalize ends the communicator")
H.raises(function() return ds4.dist.rank() end, { "ds4.dist.rank", "not initialized", "ds4.dist.init()" },
    "rank after finalize")
H.done("dist_collectives rank " .. r .. " of " .. n)
