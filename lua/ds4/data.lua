--[==[ ds4.data — reading JSONL datasets, every row checked before anything trains on it.

  local data = require("ds4.data")                       -- also ds4.data
  local rows = data.read_jsonl(path, opts)               -- a file
  local rows = data.parse_jsonl(text, name, opts)        -- the same on a string (name is used in messages)

Formats (opts.format; "auto" looks at the first row: "messages" -> messages, "completion" -> prompt_completion,
else prompt_answer; the other rows must then have the same shape; rows.format says which it was):
  "prompt_answer" (the default; RL prompts with a reference answer): one {"prompt": ..., "answer": ...} object per
      line -> rows[i] = {prompt = text, answer = string, line = n}. The prompt is a non-empty string, or a chat
      conversation (TRL's conversational format: an array of {"role", "content"} messages) -> also
      rows[i].messages; a conversation is rendered with opts.template and opts.tokenizer, the generation prompt
      appended and the thinking mode opts.thinking (default false), and prompt becomes the rendered text. The answer
      is a non-empty string or a finite number, which becomes its decimal text ("12", "0.5"; a float literal keeps
      its spelling, "100.0"). null, booleans, objects, arrays, NaN and Infinity are errors: a reward would otherwise
      compare against "json.null" or "table: 0x...". With opts.tokenizer also ids = the prompt's token ids (at
      least one).
  "messages" (SFT on conversations, the shape HF chat datasets use): {"messages": [{"role": ..., "content": ...},
      ...]} -> rows[i] = {messages = array, line = n}. Every message is an object with a non-empty string role;
      content is a string, null (an assistant turn with tool_calls) or an array of parts, and the template says
      what it accepts (system / user / assistant / tool turns, tool calls). With opts.template (a ds4.chat
      template or its name) and opts.tokenizer, each conversation is rendered (opts.render_opts) and must train at
      least one token; rows[i].ids / labels are then its token ids and the labels SFT trains on (the token where
      the template's mask trains it, -100 elsewhere).
  "prompt_completion" (SFT on prompt / completion pairs, TRL's format): {"prompt": ..., "completion": ...} -> rows[i]
      = {prompt, completion, line}. Both non-empty strings (plain text: with opts.tokenizer, ids = prompt tokens,
      completion tokens, then EOS — opts.eos, else the tokenizer's — and labels only on the completion and EOS), or
      both conversations (rendered as prompt .. completion with the template; only the completion's turns train).
Column mapping: opts.columns = {prompt = "question", answer = "reward_model.ground_truth", ...} reads a field from
another key of the row, a dotted path going into nested objects; opts.columns = "verl" is {answer =
"reward_model.ground_truth"} (verl's layout: "prompt" a conversation, the reference in reward_model.ground_truth).
Errors then name the path the value was read from.
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

-- A row's field through opts.columns: the value, and its name for messages ("\"prompt\"", or
-- "\"reward_model.ground_truth\" (answer)").
local function field(row, key, cols)
    local path = cols and cols[key]
    if not path then return row[key], '"' .. key .. '"' end
    local v = row
    for part in path:gmatch("[^.]+") do
        if not is_object(v) then
            v = nil
            break
        end
        v = v[part]
    end
    return v, ('"%s" (%s)'):format(path, key)
end

local function tokens(t)
    local ids = {}
    for i = 1, #t do ids[i] = t[i] end
    return ids
end

-- A conversation (an array of message objects) checked for its shape; null content becomes absent (an assistant
-- turn with tool calls). `what` names it in errors ("messages", "\"prompt\"").
local function check_conversation(ms, at, what)
    if #ms == 0 then error(at .. what .. " is empty", 0) end
    for i, m in ipairs(ms) do
        if not is_object(m) then
            error(("%s%s[%d] must be an object, got %s"):format(at, what, i, describe(m)), 0)
        end
        if type(m.role) ~= "string" or m.role == "" then
            error(("%s%s[%d].role must be a non-empty string, got %s"):format(at, what, i, describe(m.role)), 0)
        end
        if m.content == json.null then m.content = nil end
        if m.content ~= nil and type(m.content) ~= "string" and not is_array(m.content) then
            error(("%s%s[%d].content must be a string, null or an array of parts, got %s"):format(at, what, i,
                describe(m.content)), 0)
        end
    end
    return ms
end

local function render(template, opts, ms, ropts, at)
    local ok, r = pcall(template.render, template, opts.tokenizer, ms, ropts)
    if not ok then error(at .. tostring(r), 0) end
    return r
end

-- ids and SFT labels (-100 where the mask does not train) of a rendering; at least one trained token.
local function labelled(r, at)
    local labels, trained = {}, 0
    for i, id in ipairs(r.ids) do
        if r.mask[i] == 1 then
            labels[i], trained = id, trained + 1
        else
            labels[i] = -100
        end
    end
    if trained == 0 then error(at .. "the conversation has no token to train on (no assistant turn?)", 0) end
    return r.ids, labels
end

local function needs_template(template, at, what)
    if not template then
        error(at .. what .. " is a conversation: rendering it needs a chat template (opts.template, "
            .. "--chat-template)", 0)
    end
end

-- An RL prompt: its text, its conversation (or nil) and its ids (nil without a tokenizer).
local function prompt_of(row, opts, at, template, cols)
    local p, pname = field(row, "prompt", cols)
    if is_array(p) then
        needs_template(template, at, pname)
        local ms = check_conversation(p, at, pname)
        local r = render(template, opts, ms, { add_generation_prompt = true, thinking = opts.thinking == true }, at)
        return r.text, ms, r.ids
    end
    if type(p) ~= "string" then
        error(at .. pname .. " must be a string or a conversation (an array of messages), got " .. describe(p), 0)
    end
    if not p:find("%S") then
        error(at .. pname .. " is " .. (p == "" and "empty" or "only white space") .. ": nothing to generate from", 0)
    end
    return p, nil, opts.tokenizer and tokens(opts.tokenizer:encode(p)) or nil
end

local function check_prompt_answer(row, opts, at, template, cols)
    local text, ms, ids = prompt_of(row, opts, at, template, cols)
    local a, aname = field(row, "answer", cols)
    local answer, why = answer_text(a)
    if not answer then error(at .. aname .. " " .. why, 0) end
    local out = { prompt = text, messages = ms, answer = answer }
    if opts.tokenizer then
        if #ids == 0 then error(at .. '"prompt" encodes to no token', 0) end
        out.ids = ids
    end
    return out
end

local function check_messages(row, opts, at, template, cols)
    local ms, name = field(row, "messages", cols)
    if not is_array(ms) then error(at .. name .. " must be an array of message objects, got " .. describe(ms), 0) end
    check_conversation(ms, at, cols and cols.messages and name or "messages")
    local out = { messages = ms }
    if template then out.ids, out.labels = labelled(render(template, opts, ms, opts.render_opts, at), at) end
    return out
end

local function check_prompt_completion(row, opts, at, template, cols)
    local p, pname = field(row, "prompt", cols)
    local c, cname = field(row, "completion", cols)
    local out = { prompt = p, completion = c }
    if is_array(p) or is_array(c) then
        if not (is_array(p) and is_array(c)) then
            error(("%s%s and %s must both be strings or both be conversations, got %s and %s"):format(at, pname,
                cname, describe(p), describe(c)), 0)
        end
        check_conversation(p, at, pname)
        check_conversation(c, at, cname)
        if not template then
            if opts.tokenizer then needs_template(template, at, pname) end
            return out
        end
        -- only the completion trains: the prompt's own assistant turns are context (train = false)
        local ms = {}
        for _, m in ipairs(p) do
            local x = {}
            for k, v in pairs(m) do x[k] = v end
            if x.role == "assistant" then x.train = false end
            ms[#ms + 1] = x
        end
        for _, m in ipairs(c) do ms[#ms + 1] = m end
        out.ids, out.labels = labelled(render(template, opts, ms, opts.render_opts, at), at)
        return out
    end
    for _, f in ipairs({ { p, pname }, { c, cname } }) do
        if type(f[1]) ~= "string" then
            error(at .. f[2] .. " must be a string or a conversation, got " .. describe(f[1]), 0)
        end
        if f[1] == "" then error(at .. f[2] .. " is empty", 0) end
    end
    if opts.tokenizer then
        local eos = opts.eos or opts.tokenizer:special("eos")
        if not eos then
            error(at .. "plain-text completions end with EOS, and this tokenizer has none: give opts.eos (the "
                .. "model's eos_token_id)", 0)
        end
        local ids, labels = tokens(opts.tokenizer:encode(p)), {}
        for i = 1, #ids do labels[i] = -100 end
        for _, id in ipairs(tokens(opts.tokenizer:encode(c))) do
            ids[#ids + 1], labels[#labels + 1] = id, id
        end
        ids[#ids + 1], labels[#labels + 1] = eos, eos
        out.ids, out.labels = ids, labels
    end
    return out
end

local FORMATS = { prompt_answer = check_prompt_answer, messages = check_messages,
    prompt_completion = check_prompt_completion }
local COLUMN_PRESETS = { verl = { answer = "reward_model.ground_truth" } }
local COLUMN_FIELDS = { prompt = true, answer = true, messages = true, completion = true }

-- The format of a row, for format = "auto".
local function detect(row, cols)
    if field(row, "messages", cols) ~= nil then return "messages" end
    if field(row, "completion", cols) ~= nil then return "prompt_completion" end
    return "prompt_answer"
end

local function check_columns(cols, fname)
    if type(cols) == "string" then
        return COLUMN_PRESETS[cols] or error(fname .. ": opts.columns: unknown layout '" .. cols .. "' (verl, or a "
            .. "table {field = \"path\"})", 4)
    end
    if cols == nil then return nil end
    if type(cols) ~= "table" then error(fname .. ": opts.columns must be a table or \"verl\", got " .. type(cols), 4) end
    for k, v in pairs(cols) do
        if not COLUMN_FIELDS[k] then
            error(fname .. ": opts.columns: unknown field '" .. tostring(k) .. "' (prompt, answer, messages, "
                .. "completion)", 4)
        end
        if type(v) ~= "string" or v == "" or v:find("^%.") or v:find("%.$") or v:find("%.%.") then
            error(("%s: opts.columns.%s must be a key or a dotted path (\"reward_model.ground_truth\"), got %s")
                :format(fname, k, tostring(v)), 4)
        end
    end
    return cols
end

local function check_opts(opts, fname)
    opts = opts or {}
    if type(opts) ~= "table" then error(fname .. ": opts must be a table, got " .. type(opts), 3) end
    local known = { format = 1, tokenizer = 1, template = 1, render_opts = 1, max_rows = 1, columns = 1, thinking = 1,
        eos = 1 }
    for k in pairs(opts) do
        if not known[k] then error(fname .. ": unknown option '" .. tostring(k) .. "'", 3) end
    end
    local fmt = opts.format or "prompt_answer"
    if fmt ~= "auto" and not FORMATS[fmt] then
        error(fname .. ": opts.format must be \"auto\", \"prompt_answer\", \"messages\" or \"prompt_completion\", "
            .. "got " .. tostring(fmt), 3)
    end
    local mr = opts.max_rows
    if mr ~= nil and (type(mr) ~= "number" or mr ~= math.floor(mr) or mr < 1) then
        error(fname .. ": opts.max_rows must be an integer >= 1, got " .. tostring(mr), 3)
    end
    local cols = check_columns(opts.columns, fname)
    local template = opts.template
    if type(template) == "string" then template = require("ds4.chat").get(template) end
    if template and not opts.tokenizer then error(fname .. ": opts.template needs opts.tokenizer", 3) end
    return opts, fmt, template, cols
end

function M.parse_jsonl(text, name, opts)
    if type(text) ~= "string" then error("ds4.data.parse_jsonl: text must be a string, got " .. type(text), 2) end
    name = tostring(name or "<string>")
    local o, fmt, template, cols = check_opts(opts, "ds4.data.parse_jsonl")
    local auto = fmt == "auto"
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
            if auto then
                local kind = detect(row, cols)
                if fmt == "auto" then
                    fmt = kind
                elseif kind ~= fmt then
                    error(("%sa %s row in a %s file (the first row decides the format)"):format(at, kind, fmt), 0)
                end
            end
            local r = FORMATS[fmt](row, o, at, template, cols)
            r.line = ln
            rows[#rows + 1] = r
        end
    end
    if #rows == 0 then error(name .. ": no rows (an empty file, or only blank lines)", 0) end
    rows.format = fmt
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
