--[==[ ds4.metrics — a JSONL metrics file that survives kill -9, a full disk and a resume.

  local w = ds4.metrics.open(path [, {resume_step = k}])
  w:write(record)      -- one JSON object (a table), as one line
  w:write_bytes(s)     -- s as it is (binary records), by the same single write
  w:close()
  ds4.metrics.clock()  -- seconds of a monotonic clock (durations; os.clock would add up every thread's CPU time)
  ds4.metrics.wall()   -- seconds since the epoch, with fractions (timestamps: TensorBoard's wall_time)

Each record is encoded first and then written as one whole line by one unbuffered write, so the file holds every
record written before a crash (a kill -9 loses at most the record being written, never earlier ones, and a
buffered stdio stream would have lost everything since its last flush) and never a line glued to the next one.
A failed write (a full disk, an I/O error, a closed file) raises "ds4.metrics: write PATH: reason": a run whose
metrics cannot be kept stops instead of finishing with exit status 0 and a cut file.

open() appends to an existing file. With opts.resume_step = k (a run resuming after k completed steps) it first
rewrites the file without what the resumed run will write again or cannot use: a last line without its newline
(torn by a crash), lines that are not JSON objects, and records whose "step" is above k. The rewrite goes to a
temporary file renamed over the old one, so a crash during it leaves either file whole. w.dropped counts the
lines dropped. tests/lua/test_metrics.lua, tests/chaos/test_kill_resume.sh.
]==]

local json = require("ds4.chat.json")
local ffi = require("ffi")

local M = {}

pcall(ffi.cdef, "typedef struct ds4_timespec { long tv_sec; long tv_nsec; } ds4_timespec;")
pcall(ffi.cdef, "int clock_gettime(int clk, ds4_timespec *tp);")
local ts = ffi.new("ds4_timespec")
local function clock_s(id)
    ffi.C.clock_gettime(id, ts)
    return tonumber(ts.tv_sec) + 1e-9 * tonumber(ts.tv_nsec)
end
function M.clock() return clock_s(1) end -- CLOCK_MONOTONIC
function M.wall() return clock_s(0) end  -- CLOCK_REALTIME
local W = {}
W.__index = W

local function fail(msg) error("ds4.metrics: " .. msg, 3) end

-- The lines of `path` worth keeping after a crash at or after step k; nil when the file does not exist.
local function kept_lines(path, k)
    local f = io.open(path, "rb")
    if not f then return nil end
    local text, rerr = f:read("*a")
    f:close()
    if not text then fail(("read %s: %s"):format(path, tostring(rerr))) end
    local keep, dropped = {}, 0
    local complete = text:match("^(.*\n)") or "" -- everything up to the last newline; the rest is torn
    if #complete < #text then dropped = dropped + 1 end
    for line in complete:gmatch("([^\n]*)\n") do
        local rec = line:find("%S") and json.decode(line)
        if type(rec) == "table" and json.keys(rec) ~= nil and not (type(rec.step) == "number" and rec.step > k) then
            keep[#keep + 1] = line
        elseif line:find("%S") then
            dropped = dropped + 1
        end
    end
    return keep, dropped
end

local function write_all(f, s, path)
    local ok, err = f:write(s)
    if not ok then fail(("write %s: %s"):format(path, tostring(err))) end
end

function M.open(path, opts)
    if type(path) ~= "string" then error("ds4.metrics.open: path must be a string, got " .. type(path), 2) end
    opts = opts or {}
    for key in pairs(opts) do
        if key ~= "resume_step" then error("ds4.metrics.open: unknown option '" .. tostring(key) .. "'", 2) end
    end
    local k = opts.resume_step
    if k ~= nil and (type(k) ~= "number" or k ~= k) then
        error("ds4.metrics.open: opts.resume_step must be a number, got " .. tostring(k), 2)
    end
    local dropped = 0
    if k then
        local keep, d = kept_lines(path, k)
        if keep and d > 0 then
            local tmp = path .. ".tmp"
            local t, err = io.open(tmp, "wb")
            if not t then error(("ds4.metrics.open: create %s: %s"):format(tmp, tostring(err)), 2) end
            for _, line in ipairs(keep) do write_all(t, line .. "\n", tmp) end
            local ok, cerr = t:close()
            if not ok then error(("ds4.metrics.open: write %s: %s"):format(tmp, tostring(cerr)), 2) end
            local rok, rerr = os.rename(tmp, path)
            if not rok then error(("ds4.metrics.open: rename %s: %s"):format(tmp, tostring(rerr)), 2) end
        end
        dropped = d or 0
    end
    local f, err = io.open(path, "ab")
    if not f then error(("ds4.metrics.open: %s"):format(tostring(err)), 2) end
    f:setvbuf("no") -- one write(2) per record: nothing waits in a buffer for a crash to lose
    return setmetatable({ path = path, f = f, dropped = dropped, written = 0 }, W)
end

function W:write(record)
    if not self.f then fail("write " .. self.path .. ": the file is closed") end
    if type(record) ~= "table" then fail(("write %s: a table expected, got %s"):format(self.path, type(record))) end
    write_all(self.f, json.encode(record) .. "\n", self.path)
    self.written = self.written + 1
end

-- bytes written as they are, by the same single unbuffered write (ds4.tensorboard's records)
function W:write_bytes(s)
    if not self.f then fail("write " .. self.path .. ": the file is closed") end
    write_all(self.f, s, self.path)
    self.written = self.written + 1
end

function W:close()
    if not self.f then return end
    local f = self.f
    self.f = nil
    local ok, err = f:close()
    if not ok then fail(("close %s: %s"):format(self.path, tostring(err))) end
end

return M
