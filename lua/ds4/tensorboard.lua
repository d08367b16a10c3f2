--[==[ ds4.tensorboard — TensorBoard event files, written live as a run goes (`tensorboard --logdir runs`).

  local tensorboard = require("ds4.tensorboard")
  tensorboard.available() -> true | false, why  (the records come from protobuf-c: lua/tb_lua.c)
  local w = tensorboard.open(dir)                DIR/events.out.tfevents.<seconds>.<host>.<pid>.ds4, a new file per
                                                 process (TensorBoard reads every event file of a directory)
  w:scalars(step, {tag = number, ...})           one Event of scalars; tags with a "/" group into sections
  w:text(step, tag, text | rows)                 markdown text, or a table: rows = {{"h1", "h2"}, {"a", "b"}, ...}
  w:close()                                      w.path

Each record (TFRecord framing around an Event protobuf) is written whole by one unbuffered write (ds4.metrics'
writer), so a crash loses at most the record being written; a failed write raises "ds4.metrics: write PATH: ...".
The first record of a file is the file_version event TensorBoard's readers expect. Non-finite numbers are written
as they are (TensorBoard shows NaN and Inf). tests/lua/test_tensorboard.lua checks the bytes against a record
TensorBoard's own writer produced, and tests/test_tensorboard.sh loads a run's files with TensorBoard's reader.
]==]

local metrics = require("ds4.metrics")
local fs = require("ds4.fs")

local M = {}
local W = {}
W.__index = W

local function tb()
    local core = require("ds4.core")
    return core.tb
end

function M.available()
    if tb() then return true end
    return false, "this ds4 was built without protobuf-c (scripts/install-deps.sh installs libprotobuf-c-dev and "
        .. "protobuf-c-compiler): no TensorBoard event files"
end

function M.open(dir)
    if type(dir) ~= "string" then error("ds4.tensorboard.open: dir must be a string, got " .. type(dir), 2) end
    local ok, why = M.available()
    if not ok then error("ds4.tensorboard.open: " .. why, 2) end
    local now = metrics.wall()
    local path = ("%s/events.out.tfevents.%d.%s.%d.ds4"):format(dir, math.floor(now), fs.hostname(), fs.pid())
    local okf, out = pcall(metrics.open, path) -- unbuffered, whole records, write errors raised
    if not okf then error("ds4.tensorboard.open: " .. tostring(out), 2) end
    local self = setmetatable({ path = path, out = out }, W)
    out:write_bytes(tb().file_version(now))
    return self
end

function W:scalars(step, values)
    local t = {}
    for k, v in pairs(values) do
        if type(k) == "string" and type(v) == "number" then t[k] = v end
    end
    if next(t) then self.out:write_bytes(tb().scalars(metrics.wall(), step, t)) end
end

function W:text(step, tag, content)
    self.out:write_bytes(tb().text(metrics.wall(), step, tag, content))
end

function W:close() self.out:close() end

return M
