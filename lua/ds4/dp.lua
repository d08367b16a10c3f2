--[==[ ds4.dp — data parallelism for training scripts: which share of a global batch this rank takes, and the
reductions its metrics and counts need (docs/distributed.md, "Data parallelism in the examples").

  local dp = require("ds4.dp")
  local rank, world = dp.init([device])     -- ds4.dist.init() when a launcher started this process with more than
                                            -- one rank (mpirun, srun, torchrun-style variables); else a world of one
                                            -- without any communicator (nothing to finalize). device "cuda...": with
                                            -- NCCL on the local rank's GPU; dp.device() then names it (put the model
                                            -- there)
  dp.rank(), dp.world(), dp.is_root()       -- rank 0 writes files, checkpoints and prints
  local first, count = dp.share(n, parts, k) -- part k (0-based) of n items split in `parts` contiguous parts:
                                            -- n // parts each, the first n % parts one more (ds4_shard_range)
  local s = dp.sum({a, b, ...})             -- every rank's numbers summed (F64, rank order: the same sum whatever
                                            -- the launcher); a table of the same length on every rank
  local m = dp.max({a, ...}), dp.min({...}) -- the same for max / min
  local all = dp.gather_strings(s)          -- every rank's string, in rank order
  local nums = dp.gather_numbers({...})     -- every rank's array of numbers (any lengths), in rank order
  dp.broadcast_string(s [, root])           -- rank root's string on every rank
  dp.barrier(), dp.finalize()               -- finalize only ends a communicator that dp.init made

Every function works in a world of one (it returns its input), so a script written with ds4.dp runs unchanged
without a launcher. The share of each rank is contiguous and in rank order, so the global batch, read in rank
order, is the batch one process would have taken: with the rank-order sum of the gradients (ds4.dist.all_reduce
and the backward's single addition per element, docs/distributed.md) training on N ranks gives the same bits as one
process accumulating the same micro-batches.
]==]
local ds4 = require("ds4")
local ffi = require("ffi")

local M = {}
local started = false -- this module called ds4.dist.init (and so finalizes)

-- Launched with more than one rank? (the variables mpirun, srun and torchrun set; ds4's dist/launch.c reads the
-- same ones and says more about malformed values when init runs)
local function launched_world()
    for _, v in ipairs({ "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "WORLD_SIZE" }) do
        local n = tonumber(os.getenv(v) or "")
        if n and n > 1 then return n end
    end
    return 1
end

-- device: where the script's model will compute ("cuda", "cuda:N", "cpu"; nil or "": ds4 run --device's). A CUDA
-- model's gradients are summed on the GPUs, through NCCL on the local rank's GPU: the script then puts its model on
-- ds4.dist.device() (M.device() says where).
function M.init(device)
    if not ds4.dist.is_initialized() and launched_world() > 1 then
        local dev = (device and device ~= "") and device or ds4.device():match("^%S+")
        ds4.dist.init(dev:match("^cuda") and { device = "cuda" } or nil)
        started = true
    end
    return M.rank(), M.world()
end

local function on() return ds4.dist.is_initialized() and ds4.dist.world_size() > 1 end

-- The device a data-parallel rank's model belongs on: the NCCL communicator's GPU, or nil (no NCCL: keep yours).
function M.device()
    if on() and ds4.dist.device() ~= "cpu" then return ds4.dist.device() end
end

function M.rank() return on() and ds4.dist.rank() or 0 end
-- The bucket size (MiB) of the overlapped gradient sum when a script leaves it to the default (-1 or nil): 25 on CPU
-- and GPU ranks. And whether ZeRO-1 reduce-scatters by default: on CPU ranks; not on GPU ranks, where its NCCL
-- reductions (ncclReduce per region) pass the tests but were not timed against the all-reduce (docs/distributed.md).
function M.bucket_mb(mb) if mb == nil or mb < 0 then return 25 end return mb end
function M.reduce_scatter() return not M.device() end
function M.world() return on() and ds4.dist.world_size() or 1 end
function M.is_root() return M.rank() == 0 end
function M.barrier() if on() then ds4.dist.barrier() end end

function M.finalize()
    if started and ds4.dist.is_initialized() then ds4.dist.finalize() end
    started = false
end

function M.share(n, parts, k)
    local q, r = math.floor(n / parts), n % parts
    local count = q + (k < r and 1 or 0)
    return k * q + math.min(k, r) + 1, count
end

function M.sum(t)
    if not on() or #t == 0 then return t end
    local x = ds4.tensor(t, "F64")
    ds4.dist.all_reduce(x)
    local out = {}
    for i = 1, #t do out[i] = x[i] end
    return out
end

local function fold(t, pick)
    if not on() or #t == 0 then return t end
    local g = ds4.dist.all_gather(ds4.tensor(t, "F64")) -- [world, #t]
    local out = {}
    for i = 1, #t do
        local v = g[i]
        for r = 1, M.world() - 1 do v = pick(v, g[r * #t + i]) end
        out[i] = v
    end
    return out
end

function M.max(t) return fold(t, math.max) end
function M.min(t) return fold(t, math.min) end

-- Every rank's variable-length payload of n elements: each rank fills a buffer of the longest rank's size (at least
-- 1) through fill(ptr), the buffers are gathered, and read(base, rank, n_of_rank, stride) is called per rank.
local function gather_padded(n, dtype, ctype, fill, read)
    local W = M.world()
    local lens = ds4.dist.all_gather(ds4.tensor({ n }, "F64"))
    local most = 1
    for r = 1, W do most = math.max(most, lens[r]) end
    local buf = ds4.zeros({ most }, dtype)
    fill(ffi.cast(ctype, buf:data_ptr()))
    local all = ds4.dist.all_gather(buf) -- [world, most]
    local base = ffi.cast(ctype, all:data_ptr())
    local out = {}
    for r = 0, W - 1 do out[r + 1] = read(base + r * most, lens[r + 1]) end
    return out
end

function M.gather_strings(s)
    if not on() then return { s } end
    return gather_padded(#s, "U8", "char *", function(p) ffi.copy(p, s, #s) end, ffi.string)
end

-- every rank's array of numbers (any lengths), in rank order, exact (F64)
function M.gather_numbers(t)
    if not on() then return { t } end
    return gather_padded(#t, "F64", "double *", function(p)
        for i = 1, #t do p[i - 1] = t[i] end
    end, function(q, n)
        local a = {}
        for i = 1, n do a[i] = q[i - 1] end
        return a
    end)
end

function M.broadcast_string(s, root)
    if not on() then return s end
    return M.gather_strings(s)[(root or 0) + 1]
end

return M
