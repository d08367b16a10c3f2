--[==[ ds4.runlog — everything a training run reports, in its run directory: metrics.jsonl, TensorBoard events and
a table of sampled completions.

  local log = ds4.runlog.open(dir [, {resume_step = k, tensorboard = true, quiet = false}])   -- creates dir
  log:write(row)                         -- row.step and numbers: one line of DIR/metrics.jsonl (ds4.metrics: whole,
                                         -- flushed, write errors raised; a resume drops records past step k) and
                                         -- the same numbers as TensorBoard scalars at that step
  log:table(step, name, header, rows)    -- a few rows of text (log_completions): one JSON line per row in
                                         -- DIR/<name>.jsonl ({step, header[1] = row[1], ...}) and a TensorBoard text
                                         -- table under the tag <name>
  log:close()
  log.tensorboard                        -- the event file's path, or nil (tensorboard = false, or no protobuf-c:
                                         -- said once on stderr unless quiet)
]==]

local metrics = require("ds4.metrics")
local tensorboard = require("ds4.tensorboard")

local M = {}
local R = {}
R.__index = R

function M.open(dir, opts)
    opts = opts or {}
    require("ds4.fs").mkdir_p(dir)
    local self = setmetatable({ dir = dir, tables = {} }, R)
    self.jsonl = metrics.open(dir .. "/metrics.jsonl", { resume_step = opts.resume_step })
    self.resume_step = opts.resume_step
    if opts.tensorboard ~= false then
        local ok, why = tensorboard.available()
        if ok then
            self.tb = tensorboard.open(dir)
            self.tensorboard = self.tb.path
        elseif not opts.quiet then
            io.stderr:write("ds4.runlog: " .. why .. "\n")
        end
    end
    return self
end

function R:write(row)
    self.jsonl:write(row)
    if self.tb and type(row.step) == "number" then
        local t = {}
        for k, v in pairs(row) do
            if k ~= "step" and type(v) == "number" then t[k] = v end
        end
        self.tb:scalars(row.step, t)
    end
end

function R:table(step, name, header, rows)
    local w = self.tables[name]
    if not w then
        w = metrics.open(("%s/%s.jsonl"):format(self.dir, name), { resume_step = self.resume_step })
        self.tables[name] = w
    end
    for _, r in ipairs(rows) do
        local rec = { step = step }
        for i, h in ipairs(header) do rec[h] = r[i] end
        w:write(rec)
    end
    if self.tb and #rows > 0 then
        local cells = { header }
        for _, r in ipairs(rows) do
            local line = {}
            for i = 1, #header do
                -- markdown table cells: no line breaks or pipes inside one
                line[i] = tostring(r[i] == nil and "" or r[i]):gsub("|", "\\|"):gsub("\r?\n", " ⏎ ")
            end
            cells[#cells + 1] = line
        end
        self.tb:text(step, name, cells)
    end
end

function R:close()
    self.jsonl:close()
    for _, w in pairs(self.tables) do w:close() end
    if self.tb then self.tb:close() end
end

return M
