--[[ ds4.chat — chat templates that produce token ids and a per-token loss mask.

  local chat = require("ds4.chat")            -- also ds4.chat
  local t = chat.get("deepseek_v4")          -- built-ins: "deepseek_v4", "chatml"
  local r = t:render(tok, messages, opts)    -- {ids = {...}, mask = {...}, text = "...", segments = {...}}
  local ok, why = t:check_prefix(tok, messages_before, messages_after, opts)
  chat.register(name, template)  chat.list()  chat.builder(tok)  chat.prefix_report(r_before, r_after)
  chat.end_of_turn(tok, name)                -- the ids that end an assistant turn (generation stop ids)

Messages are Lua arrays of tables {role = ..., content = ..., reasoning_content = ..., tool_calls = ...,
tool_call_id = ...}; each template's file documents the roles and options it accepts. Every template
rejects unknown roles, missing content, malformed tool calls and unknown options with a Lua error that names
the message index and field ("deepseek_v4: messages[3].tool_calls[1].name: string expected, got nil").

r.ids / r.mask: mask[i] is 1 where token i is something the model produces and is trained on (assistant
reasoning, content, tool calls, end-of-turn), 0 elsewhere (system, user, tool results, role markers,
generation prompts). r.text is the rendered string. r.segments lists the tokenised pieces:
{text = ..., trained = bool, first = index of its first id, count = number of ids}.

How masks are built: token-in/token-out, never by searching the rendered text. A template describes the
conversation as a sequence of pieces, each either text or token ids and each trained or not, through a
segment builder:

  local b = chat.builder(tok)
  b:add(text, trained)             -- text piece (trained: boolean)
  b:add_ids(ids, trained [, text]) -- ids used verbatim (e.g. what the model generated in a rollout);
                                   -- trained: boolean or a per-token array of 0/1; text defaults to decode(ids)
  b:flush()                        -- force a tokenisation boundary here
  local r = b:finish()             -- {ids, mask, text, segments}

Adjacent text pieces with the same trained flag are joined and tokenised together (one tok:encode per run):
so a segment is a maximal run of equally-masked text, and a tokenisation boundary exists only where the mask
changes (or at add_ids / flush). The ids of a run are its tokens, the mask is the run's flag: there is no
offset mapping, no find(), and an answer text that also occurs in the reasoning cannot be mistaken for it.
Where the concatenated ids can differ from tokenising r.text in one go: at a mask boundary between two plain
texts, because BPE pre-tokenisation may merge characters across it (see deepseek_v4.lua for where that can
and cannot happen in the DeepSeek-V4 format).

Your own template: register a table with either
  render = function(self, tok, messages, opts) ... return {ids = ..., mask = ..., text = ...} end
or (simpler, and the built-ins do this)
  segments = function(self, b, messages, opts) b:add(...) ... end   -- the default render wraps it
It inherits check_prefix and a render built on segments:

  chat.register("plain", { segments = function(self, b, messages, opts)
      for i, m in ipairs(messages) do
          b:add(m.role .. ": ", false)
          b:add(m.content .. "\n", m.role == "assistant")
      end
  end })

Helpers for templates: chat.check_messages(where, messages, roles), chat.check_options(where, opts, known),
chat.json (Python-compatible JSON, see ds4/chat/json.lua).
]]

local M = {}

local type, pairs, ipairs, tostring, error, setmetatable, getmetatable =
    type, pairs, ipairs, tostring, error, setmetatable, getmetatable

M.json = require("ds4.chat.json")

-- ------------------------------------------------------------------------------------------------ builder

local Builder = {}
Builder.__index = Builder

local function check_tok(tok, where)
    local t = type(tok)
    if (t ~= "table" and t ~= "userdata") or tok.encode == nil then
        error(where .. ": tokenizer expected (an object with :encode and :decode), got " .. t, 0)
    end
end

function M.builder(tok)
    check_tok(tok, "ds4.chat.builder")
    return setmetatable({ tok = tok, ids = {}, mask = {}, texts = {}, segments = {}, run = {}, run_mask = 0 },
        Builder)
end

local function push_segment(self, text, ids, mask_of)
    local first = #self.ids + 1
    local n = #ids
    for i = 1, n do
        self.ids[first + i - 1] = ids[i]
        self.mask[first + i - 1] = mask_of(i)
    end
    self.texts[#self.texts + 1] = text
    self.segments[#self.segments + 1] = { text = text, trained = mask_of(1) == 1, first = first, count = n }
end

function Builder:flush()
    if #self.run == 0 then return self end
    local text = table.concat(self.run)
    self.run = {}
    local ids = self.tok:encode(text)
    if type(ids) ~= "table" then error("ds4.chat: tok:encode returned a " .. type(ids) .. ", table expected", 2) end
    local m = self.run_mask
    push_segment(self, text, ids, function() return m end)
    return self
end

function Builder:add(text, trained)
    if type(text) ~= "string" then error("ds4.chat.builder:add: text must be a string, got " .. type(text), 2) end
    if text == "" then return self end
    local m = trained and 1 or 0
    if m ~= self.run_mask then
        self:flush()
        self.run_mask = m
    end
    self.run[#self.run + 1] = text
    return self
end

function Builder:add_ids(ids, trained, text)
    if type(ids) ~= "table" then error("ds4.chat.builder:add_ids: ids must be an array, got " .. type(ids), 2) end
    self:flush()
    if #ids == 0 then return self end
    for i = 1, #ids do
        local v = ids[i]
        if type(v) ~= "number" or v ~= math.floor(v) or v < 0 then
            error(("ds4.chat.builder:add_ids: ids[%d] is not a token id (%s)"):format(i, tostring(v)), 2)
        end
    end
    if text == nil then text = self.tok:decode(ids) end
    local mask_of
    if type(trained) == "table" then
        if #trained ~= #ids then
            error(("ds4.chat.builder:add_ids: %d mask values for %d ids"):format(#trained, #ids), 2)
        end
        mask_of = function(i) return (trained[i] == 1 or trained[i] == true) and 1 or 0 end
    else
        local m = trained and 1 or 0
        mask_of = function() return m end
    end
    push_segment(self, text, ids, mask_of)
    return self
end

function Builder:finish()
    self:flush()
    return { ids = self.ids, mask = self.mask, text = table.concat(self.texts), segments = self.segments }
end

-- ------------------------------------------------------------------------------------------------ checks

local function quote(v)
    if type(v) == "string" then return ("%q"):format(v) end
    return tostring(v)
end
M.quote = quote

-- Each message must be a table whose role is one of `roles` (a list). Raises "<where>: messages[i].role: ...".
function M.check_messages(where, messages, roles)
    if type(messages) ~= "table" then
        error(("%s: messages must be an array of message tables, got %s"):format(where, type(messages)), 0)
    end
    local known = {}
    for _, r in ipairs(roles) do known[r] = true end
    local n = 0
    for k in pairs(messages) do
        if type(k) ~= "number" then
            error(("%s: messages must be an array (found key %s)"):format(where, quote(k)), 0)
        end
        n = n + 1
    end
    for i = 1, n do
        local m = messages[i]
        if type(m) ~= "table" then
            error(("%s: messages[%d]: table expected, got %s"):format(where, i, type(m)), 0)
        end
        if type(m.role) ~= "string" then
            error(("%s: messages[%d].role: string expected, got %s"):format(where, i, type(m.role)), 0)
        end
        if not known[m.role] then
            error(("%s: messages[%d].role: unknown role %s (expected %s)"):format(where, i, quote(m.role),
                table.concat(roles, ", ")), 0)
        end
    end
    return n
end

-- opts must be nil or a table whose keys are all in `known` (a set). Returns opts or {}.
function M.check_options(where, opts, known)
    if opts == nil then return {} end
    if type(opts) ~= "table" then error(("%s: opts must be a table, got %s"):format(where, type(opts)), 0) end
    for k in pairs(opts) do
        if not known[k] then
            local names = {}
            for n in pairs(known) do names[#names + 1] = n end
            table.sort(names)
            error(("%s: unknown option %s (known: %s)"):format(where, quote(k), table.concat(names, ", ")), 0)
        end
    end
    return opts
end

-- opts[name] as a boolean, `default` when absent; an error naming the template and option otherwise.
function M.bool_option(where, opts, name, default)
    local v = opts[name]
    if v == nil then return default end
    if type(v) ~= "boolean" then error(("%s: opts.%s: boolean expected, got %s"):format(where, name, type(v)), 0) end
    return v
end

-- opts.train: which assistant turns are trained: "all" (default), "last" or "none".
function M.train_option(where, opts)
    local train = opts.train == nil and "all" or opts.train
    if train ~= "all" and train ~= "last" and train ~= "none" then
        error(("%s: opts.train: \"all\", \"last\" or \"none\" expected, got %s"):format(where, quote(train)), 0)
    end
    return train
end

-- ------------------------------------------------------------------------------------------------ prefix

-- Whether r_before (a render result) is a prefix of r_after, in ids. Returns true, or false and a report
-- {message = ..., token = first differing token index, byte = first differing byte of the texts (or nil)}.
function M.prefix_report(a, b)
    local ia, ib = a.ids, b.ids
    local n = #ia
    local at
    for i = 1, n do
        if ia[i] ~= ib[i] then
            at = i
            break
        end
    end
    if not at then return true end
    local ta, tb = a.text or "", b.text or ""
    local byte_at
    for i = 1, math.min(#ta, #tb) + 1 do
        if ta:byte(i) ~= tb:byte(i) then
            byte_at = i
            break
        end
    end
    if byte_at and byte_at > #ta then byte_at = nil end -- texts are a prefix; only tokenisation differs
    local msg
    if at > #ib then
        msg = ("not append-only: the earlier render has %d tokens, the later only %d"):format(n, #ib)
    else
        msg = ("not append-only: token %d differs (earlier %s, later %s)"):format(at, tostring(ia[at]),
            tostring(ib[at]))
    end
    if byte_at then
        local lo = math.max(1, byte_at - 24)
        msg = msg .. ("; the texts diverge at byte %d: earlier %s..., later %s..."):format(byte_at,
            quote(ta:sub(lo, byte_at + 24)), quote(tb:sub(lo, byte_at + 24)))
    elseif byte_at == nil and #ta <= #tb and tb:sub(1, #ta) == ta then
        msg = msg .. "; the texts are a prefix: the tokenisation differs at the boundary"
    end
    return false, { message = msg, token = at, byte = byte_at }
end

-- ------------------------------------------------------------------------------------------------ templates

local Template = {}
Template.__index = Template

function Template:render(tok, messages, opts)
    if type(self.segments) ~= "function" then
        error(("ds4.chat: template %s defines neither render nor segments"):format(quote(self.name)), 2)
    end
    check_tok(tok, (self.name or "template") .. ":render")
    local b = M.builder(tok)
    self:segments(b, messages, opts)
    return b:finish()
end

-- Renders both conversations (opts_after defaults to opts) and reports whether the first render's ids are
-- a prefix of the second's: true, or false and a message saying where they diverge (and the report table).
function Template:check_prefix(tok, before, after, opts, opts_after)
    local ra = self:render(tok, before, opts)
    local rb = self:render(tok, after, opts_after or opts)
    local ok, rep = M.prefix_report(ra, rb)
    if ok then return true end
    return false, rep.message, rep
end

M.Template = Template

local registry = {}
local builtin = { deepseek_v4 = "ds4.chat.deepseek_v4", chatml = "ds4.chat.chatml" }

function M.register(name, t)
    if type(name) ~= "string" or name == "" then
        error("ds4.chat.register: bad argument #1 (template name expected, got " .. type(name) .. ")", 2)
    end
    if type(t) ~= "table" then
        error("ds4.chat.register: bad argument #2 (template table expected, got " .. type(t) .. ")", 2)
    end
    if type(t.render) ~= "function" and type(t.segments) ~= "function" then
        error("ds4.chat.register: template " .. quote(name) .. " needs a render or a segments function", 2)
    end
    if getmetatable(t) == nil then setmetatable(t, Template) end
    if t.name == nil then t.name = name end
    registry[name] = t
    return t
end

function M.get(name)
    if type(name) ~= "string" then
        error("ds4.chat.get: bad argument #1 (template name expected, got " .. type(name) .. ")", 2)
    end
    local t = registry[name]
    if t then return t end
    if builtin[name] then
        t = require(builtin[name])
        if registry[name] == nil then M.register(name, t) end
        return registry[name]
    end
    error(("ds4.chat.get: unknown template %s (known: %s)"):format(quote(name), table.concat(M.list(), ", ")), 2)
end

-- The ids that end an assistant turn under template `name` (what a generation stops at): <|im_end|> for chatml,
-- the tokenizer's EOS otherwise (the DeepSeek-V4 format ends a turn with it); {} when the tokenizer lacks it.
function M.end_of_turn(tok, name)
    if name == "chatml" then
        local id = tok:token_to_id("<|im_end|>")
        return id and { id } or {}
    end
    local eos = tok:special("eos")
    return eos and { eos } or {}
end

function M.list()
    local seen, names = {}, {}
    for n in pairs(registry) do seen[n] = true end
    for n in pairs(builtin) do seen[n] = true end
    for n in pairs(seen) do names[#names + 1] = n end
    table.sort(names)
    return names
end

return M
