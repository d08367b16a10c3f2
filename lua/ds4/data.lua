--[==[ ds4.data — reading JSONL datasets, every row checked before anything trains on it.

  local data = require("ds4.data")                       -- also ds4.data
  local rows = data.read_jsonl(path, opts)               -- a file
  local rows = data.parse_jsonl(text, name, opts)        -- the same on a string (name is used in messages)

  opts.format = "prompt_answer" (default): one {"prompt": string, "answer": string | number} object per line ->
      rows[i] = {prompt = text, answer = string, line = n}; with opts.tokenizer also ids = the prompt's token ids
      (tok:encode). The prompt must be a non-empty string (and encode to at least one token); the answer a
      non-empty string or a finite number, which becomes its decimal text ("12", "0.5"; a float literal
      keeps its spelling, "100.0"). null, booleans, objects, arrays, NaN and Infinity are errors: a reward would
      otherwise compare against "json.null" or "table: 0x...".
  opts.format = "messages": one {"messages": [{"role": ..., "content": ...}, ...]} object per line ->
      rows[i] = {messages = array, line = n}. Every message is an object with a non-empty string role and, when
      present, a string content. With opts.template (a ds4.chat template or its name) and opts.tokenizer, each
      conversation is also rendered (opts.render_opts) and must train at least one token: what the template
      refuses is reported here, with the line, instead of in the middle of a run.
  Other keys of a row are allowed and ignored. Blank lines are skipped; a file without a row is an error.
  opts.max_rows: stop after this many rows.

Every error is raised as "<file>:<line>: <what is wrong>" (or "<file>: ..." for the whole file), so that the row
can be found and fixed; nothing is converted silently. tests/lua/test_data.lua; fuzzed by tests/fuzz/fuzz_dataset.c.
]==]

local json = require("ds4.chat.json")

local M = {}

-- json.decode gives objects a remembered key order (json.keys) and arrays none; null and large or integral-float
-- numbers are sentinels / boxed tables.
local function is_object(v) return type(v) == "table" and json.keys(v) ~= nil end
local function is_array(v)
    return type(v) == "table" and v ~= json.null and not json.is_boxed(v) and json.keys(v) == nil
end

local function describe(v)
    if v == nil then return "missing" end
    if v == json.null then return "null" end
    if json.is_boxed(v) then return "the number " .. tostring(v) end
    local t = type(v)
    if t == "string" then return ("the string %q"):format(#v > 40 and v:sub(1, 40) .. "..." or v) end
    if t == "table" then return is_object(v) and "an object" or "an array" end
    return ("the %s %s"):format(t, tostring(v))
end

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- The text of an answer: a non-empty string, or a finite number written as a person would.
local function answer_text(v)
    if type(v) == "string" then
        if v == "" then return nil, "is an empty string" end
        return v
    end
    if type(v) == "number" then
        if not finite(v) then return nil, "is not a finite number" end
        if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
        return json.float_repr(v)
    end
    if json.is_boxed(v) then -- a float literal with an integral value ("1e2") or an integer beyond 2^53
        if not finite(json.tonumber(v)) then return nil, "is not a finite number (" .. tostring(v) .. ")" end
        return tostring(v)
    end
    return nil, "must be a string or a finite number, got " .. describe(v)
end

local function check_prompt_answer(row, opts, at)
    local p = row.prompt
    if type(p) ~= "string" then error(at .. "\"prompt\" must be a string, got " .. describe(p), 0) end
    if not p:find("%S") then
        error(at .. "\"prompt\" is " .. (p == "" and "empty" or "only white space") .. ": nothing to generate from",
            0)
    end
    local answer, why = answer_text(row.answer)
    if not answer then error(at .. "\"answer\" " .. why, 0) end
    local out = { prompt = p, answer = answer }
    if opts.tokenizer then
        local t = opts.tokenizer:encode(p)
        local ids = {}
        for i = 1, #t do ids[i] = t[i] end
        if #ids == 0 then error(at .. "\"prompt\" encodes to no token", 0) end
        out.ids = ids
    end
    return out
end

local function check_messages(row, opts, at, template)
    local ms = row.messages
    if not is_array(ms) then error(at .. "\"messages\" must be an array of message objects, got " .. describe(ms), 0) end
    if #ms == 0 then error(at .. "\"messages\" is empty", 0) end
    for i, m in ipairs(ms) do
        if not is_object(m) then
            error(("%smessages[%d] must be an object, got %s"):format(at, i, describe(m)), 0)
        end
        if type(m.role) ~= "string" or m.role == "" then
            error(("%smessages[%d].role must be a non-empty string, got %s"):format(at, i, describe(m.role)), 0)
        end
        if m.content ~= nil and type(m.content) ~= "string" then
            error(("%smessages[%d].content must be a string, got %s"):format(at, i, describe(m.content)), 0)
        end
    end
    if template then
        local ok, r = pcall(template.render, template, opts.tokenizer, ms, opts.render_opts)
        if not ok then error(at .. tostring(r), 0) end
        local trained = 0
        for _, v in ipairs(r.mask) do trained = trained + v end
        if trained == 0 then error(at .. "the conversation has no token to train on (no assistant turn?)", 0) end
    end
    return { messages = ms }
end

local FORMATS = { prompt_answer = check_prompt_answer, messages = check_messages }

local function check_opts(opts, fname)
    opts = opts or {}
    if type(opts) ~= "table" then error(fname .. ": opts must be a table, got " .. type(opts), 3) end
    local known = { format = 1, tokenizer = 1, template = 1, render_opts = 1, max_rows = 1 }
    for k in pairs(opts) do
        if not known[k] then error(fname .. ": unknown option '" .. tostring(k) .. "'", 3) end
    end
    local fmt = opts.format or "prompt_answer"
    if not FORMATS[fmt] then
        error(fname .. ": opts.format must be \"prompt_answer\" or \"messages\", got " .. tostring(fmt), 3)
    end
    local mr = opts.max_rows
    if mr ~= nil and (type(mr) ~= "number" or mr ~= math.floor(mr) or mr < 1) then
        error(fname .. ": opts.max_rows must be an integer >= 1, got " .. tostring(mr), 3)
    end
    local template = opts.template
    if type(template) == "string" then template = require("ds4.chat").get(template) end
    if template and not opts.tokenizer then error(fname .. ": opts.template needs opts.tokenizer", 3) end
    return opts, FORMATS[fmt], template
end

function M.parse_jsonl(text, name, opts)
    if type(text) ~= "string" then error("ds4.data.parse_jsonl: text must be a string, got " .. type(text), 2) end
    name = tostring(name or "<string>")
    local o, check, template = check_opts(opts, "ds4.data.parse_jsonl")
    local rows, ln = {}, 0
    local max_rows = o.max_rows or math.huge
    for line in (text:sub(-1) == "\n" and text or text .. "\n"):gmatch("([^\n]*)\n") do
        ln = ln + 1
        if #rows >= max_rows then break end
        if line:find("[^ \t\r]") then
            local at = ("%s:%d: "):format(name, ln)
            local row, why = json.decode(line)
            if row == nil then error(at .. "not a JSON value (" .. tostring(why) .. ")", 0) end
            if not is_object(row) then error(at .. "each line must be a JSON object, got " .. describe(row), 0) end
            local r = check(row, o, at, template)
            r.line = ln
            rows[#rows + 1] = r
        end
    end
    if #rows == 0 then error(name .. ": no rows (an empty file, or only blank lines)", 0) end
    return rows
end

function M.read_jsonl(path, opts)
    if type(path) ~= "string" then error("ds4.data.read_jsonl: path must be a string, got " .. type(path), 2) end
    check_opts(opts, "ds4.data.read_jsonl")
    local f, why = io.open(path, "rb")
    if not f then error("ds4.data.read_jsonl: cannot open " .. tostring(why), 2) end
    local text, rerr = f:read("*a")
    f:close()
    if not text then error("ds4.data.read_jsonl: cannot read " .. path .. ": " .. tostring(rerr), 2) end
    return M.parse_jsonl(text, path, opts)
end

return M
