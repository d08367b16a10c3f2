-- test_metrics.lua — ds4.metrics: each record one whole line on disk as soon as write returns (no buffer for a
-- kill -9 to lose), write errors raised, and a resume that drops a torn last line and the records it will redo
-- (issue 18, item 3). The kill -9 itself: tests/chaos/test_kill_resume.sh.
-- Usage: ds4 run tests/lua/test_metrics.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local metrics = require("ds4.metrics")
local json = require("ds4.chat.json")

local dir = H.make_temp_dir()
local path = dir .. "/metrics.jsonl"

local function lines(p)
    local out = {}
    local f = io.open(p, "rb")
    if not f then return out end
    local text = f:read("*a")
    f:close()
    for l in text:gmatch("([^\n]*)\n") do out[#out + 1] = l end
    H.check(text == "" or text:sub(-1) == "\n", "the file ends with a newline")
    return out
end

local function steps(p)
    local out = {}
    for i, l in ipairs(lines(p)) do
        local r = json.decode(l)
        out[i] = type(r) ~= "table" and "bad" or r.step or "no step"
    end
    return out
end

-- records are on disk as soon as write returns (read back through another handle, before close)
local w = metrics.open(path)
w:write({ step = 1, loss = 0.5 })
w:write({ step = 2, loss = 0.25, ["eval/accuracy"] = 0.5 })
H.same(steps(path), { 1, 2 }, "two records on disk before close")
H.eq(lines(path)[2], json.encode({ step = 2, loss = 0.25, ["eval/accuracy"] = 0.5 }), "one record per line")
w:close()
H.raises(function() w:write({ step = 3 }) end, { "ds4.metrics: write", "closed" }, "write after close")
H.raises(function() metrics.open(path):write("text") end, { "a table expected" }, "a record must be a table")

-- a resume after a crash: a torn last line, a line that is not JSON, records the resumed run will redo
local f = assert(io.open(path, "wb"))
f:write('{"step": 1}\n{"step": 2}\ngarbage\n{"step": 3}\n{"step": 4}\n{"eval/accuracy": 0.5}\n{"step": 5, "lo')
f:close()
w = metrics.open(path, { resume_step = 3 })
H.eq(w.dropped, 3, "dropped: the torn line (step 5), the garbage line and step 4")
H.same(steps(path), { 1, 2, 3, "no step" }, "kept records up to the resume step (and records without a step)")
w:write({ step = 4 })
w:close()
H.same(steps(path), { 1, 2, 3, "no step", 4 }, "the resumed run appends whole lines")
for _, l in ipairs(lines(path)) do H.check(json.decode(l) ~= nil, "every line parses: " .. l) end
-- a resume with nothing to drop leaves the file alone; a resume without a file creates it
w = metrics.open(path, { resume_step = 10 })
H.eq(w.dropped, 0, "nothing to drop")
w:close()
w = metrics.open(dir .. "/new.jsonl", { resume_step = 0 })
w:write({ step = 1 })
w:close()
H.same(steps(dir .. "/new.jsonl"), { 1 }, "a resume from scratch starts the file")
H.raises(function() metrics.open(path, { resume = 3 }) end, { "ds4.metrics.open", "unknown option 'resume'" },
    "unknown option")

-- a full disk: the write raises instead of losing the record
local full = io.open("/dev/full", "w")
if full then
    full:close()
    local wf = metrics.open("/dev/full")
    H.raises(function() wf:write({ step = 1 }) end, { "ds4.metrics: write /dev/full", "No space left" },
        "a write to a full device raises")
else
    print("skipped: no /dev/full")
end
H.raises(function() metrics.open(dir .. "/no/such/dir/m.jsonl") end, { "ds4.metrics.open" }, "an unwritable path")

os.execute("rm -rf " .. H.shell_quote(dir))
H.done("test_metrics")
