--[[ ds4.chat.deepseek_v4 — the DeepSeek-V4 chat format with token-exact loss masks.

  local t = require("ds4.chat").get("deepseek_v4")
  local r = t:render(tok, messages, opts)     -- {ids, mask, text, segments}

Renders what DeepSeek-V4's official encoder renders (encoding_dsv4.py of the V4 release, as vendored by SGLang
in python/sglang/srt/entrypoints/openai/encoding_dsv4.py: encode_messages, render_message,
merge_tool_messages, sort_tool_results_by_call_order, _drop_thinking_messages). Written from its rules;
every string the model was trained on is restated below exactly, with its name in that file.

  <｜begin▁of▁sentence｜>                                           once, unless opts.bos == false
  {system content}[\n\n## Tools ...][\n\n## Response Format ...]  system: no role marker
  <｜User｜>{content}                                              user; tool results fold in here
  <｜Assistant｜><think>  or  <｜Assistant｜></think>                after a user turn that an assistant turn
                                                                 follows (or that ends the prompt, with
                                                                 opts.add_generation_prompt)
  {reasoning}</think>{content}{tool calls}<｜end▁of▁sentence｜>    assistant, thinking mode
  {content}{tool calls}<｜end▁of▁sentence｜>                       chat mode, and earlier turns whose thinking
                                                                 is dropped

Messages (a Lua array):
  {role = "system", content = s [, tools = {...}] [, response_format = table or JSON string]}
  {role = "user", content = s}
  {role = "assistant", content = s, reasoning_content = s, tool_calls = {...}, wo_eos = bool, train = bool,
   ids = {...}}
  {role = "tool", content = s or {{type = "text", text = s}, ...}, tool_call_id = s}
  {role = "developer", content = s [, tools, response_format]}   rendered as a user turn (<｜User｜>...)
  {role = "latest_reminder", content = s}                       <｜latest_reminder｜>{content}
  tool_calls entries: {name = s, arguments = {k = v} or JSON string [, id = s]}, or OpenAI style
  {id = s, type = "function", ["function"] = {name = s, arguments = JSON string}}.
  tools entries: {type = "function", ["function"] = schema}, a bare schema {name, description, parameters},
  or the schema's JSON text (which keeps its key order; Lua tables are written with sorted keys, see
  ds4/chat/json.lua).
  assistant.ids: the token ids the model generated for this turn (from reasoning through EOS, exactly as
  sampled); used verbatim instead of rendering reasoning/content/tool_calls (token-in/token-out for rollouts).
  assistant.train: overrides opts.train for this turn. assistant.wo_eos: no EOS (an unfinished turn).

Options (all optional):
  thinking = true             thinking mode (false: chat mode)
  add_generation_prompt = false   after a final user/tool turn, append <｜Assistant｜><think> (or </think>)
  drop_thinking = true        drop the reasoning of assistant turns before the last user turn; switched off
                              automatically when any message (or opts.tools) carries tools, as the official
                              encoder does. Only drop_thinking = false renders are append-only across turns.
  train_reasoning = true      train reasoning and its </think> (false: only content, tool calls, EOS)
  train = "all"               which assistant turns are trained: "all", "last" or "none"
  tools = {...}               tool schemas for the "## Tools" block: attached to the first system message,
                              or to an empty system message put first (as SGLang's server does)
  reasoning_effort = nil      "max" prepends the official maximum-effort instruction (thinking mode only);
                              "high" renders the same as nil, as in the official encoder
  bos = true                  begin with <｜begin▁of▁sentence｜>

Tool results: consecutive tool and user messages merge into one user turn whose parts are joined by "\n\n",
each tool result as <tool_result>{content}</tool_result>, tool results reordered to follow the order of the
tool calls (by tool_call_id) of the latest assistant turn that made calls.

Masks: 1 on reasoning and </think> (when train_reasoning), content, the tool-call block and EOS of trained
assistant turns; 0 on everything else, including the prompt-side <｜Assistant｜> and <think>/</think> that
follow a user turn (the model does not produce them: they are the generation prompt).

Segment ids versus one-shot tokenisation. The builder tokenises each maximal run of equally-masked text on
its own (ds4/chat/init.lua), so the rendered text is cut only where the mask changes. In ordinary
conversations every such cut sits next to a special token: a prompt run ends with <｜Assistant｜>, <think> or
</think>, a trained run ends with <｜end▁of▁sentence｜>, and with train_reasoning = false the trained run
starts right after </think>. When the tokenizer has these as added tokens (the DeepSeek tokenizers and ds4's
built-in one do), its added-token split already cuts the text there, so the concatenated ids equal
tok:encode(r.text) (tests/lua/test_chat.lua checks this with both real tokenizers). Where they may differ:
  - a cut between two plain texts, which the format itself produces in two places: a latest_reminder turn
    ("<｜latest_reminder｜>today") runs straight into the next assistant's reasoning ("today" + "Let me..."),
    and an assistant turn right after a system message (no user turn) starts right after the system text.
    One-shot BPE would pre-tokenise "todayLet" as one word; the segments keep "today" and "Let" apart, which
    is what a rollout produces anyway (the prompt is tokenised, then the model's tokens are appended).
  - a tokenizer lacking one of the markers as an added token: BPE then merges across the cut, e.g. under
    DeepSeek's split regex "</think>" + "Hello" pre-tokenises as "</think" + ">Hello" ([punct][A-Za-z]+).
    (Same-mask neighbours never cause this: content "Done." and the "\n\n<｜DSML｜tool_calls>" block after it
    are one run, so ".\n\n" stays one pre-token as in the one-shot encoding.)
  - ids supplied verbatim (assistant.ids), which are what the model sampled and need not be the canonical
    tokenisation of their text (that is the point of passing them).
]]

local chat = require("ds4.chat")
local json = chat.json

local type, ipairs, pairs, tostring, error = type, ipairs, pairs, tostring, error
local quote = chat.quote

local T = { name = "deepseek_v4" }

-- ------------------------------------------------------------------------------------------------ strings
-- All from encoding_dsv4.py (names there in parentheses).

local BOS = "<｜begin▁of▁sentence｜>" -- bos_token
local EOS = "<｜end▁of▁sentence｜>" -- eos_token
local THINK = "<think>" -- thinking_start_token
local END_THINK = "</think>" -- thinking_end_token
local DSML = "｜DSML｜" -- dsml_token
local USER = "<｜User｜>" -- USER_SP_TOKEN
local ASSISTANT = "<｜Assistant｜>" -- ASSISTANT_SP_TOKEN
local LATEST_REMINDER = "<｜latest_reminder｜>" -- LATEST_REMINDER_SP_TOKEN

-- REASONING_EFFORT_MAX
local REASONING_EFFORT_MAX = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    .. "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    .. "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    .. "adversarial scenarios.\n"
    .. "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    .. "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
    .. "\n\n"

-- TOOLS_TEMPLATE with dsml_token, thinking_start_token and thinking_end_token filled in; the schemas (one
-- JSON object per line) go between TOOLS_HEAD and TOOLS_TAIL.
local TOOLS_HEAD = "## Tools\n\n"
    .. "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    .. '"<' .. DSML .. 'tool_calls>" block like the following:\n\n'
    .. "<" .. DSML .. "tool_calls>\n"
    .. "<" .. DSML .. 'invoke name="$TOOL_NAME">\n'
    .. "<" .. DSML .. 'parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</' .. DSML
    .. "parameter>\n"
    .. "...\n"
    .. "</" .. DSML .. "invoke>\n"
    .. "<" .. DSML .. 'invoke name="$TOOL_NAME2">\n'
    .. "...\n"
    .. "</" .. DSML .. "invoke>\n"
    .. "</" .. DSML .. "tool_calls>\n\n"
    .. 'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    .. 'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    .. "If thinking_mode is enabled (triggered by " .. THINK .. "), you MUST output your complete reasoning "
    .. "inside " .. THINK .. "..." .. END_THINK .. " BEFORE any tool calls or final response.\n\n"
    .. "Otherwise, output directly after " .. END_THINK .. " with tool calls or final response.\n\n"
    .. "### Available Tool Schemas\n\n"
local TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    .. "calls.\n"

-- response_format_template
local RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

T.strings = {
    bos = BOS, eos = EOS, think = THINK, end_think = END_THINK, dsml = DSML, user = USER, assistant = ASSISTANT,
    latest_reminder = LATEST_REMINDER, reasoning_effort_max = REASONING_EFFORT_MAX,
}

local WHERE = "deepseek_v4"
local ROLES = { "system", "user", "assistant", "tool", "developer", "latest_reminder" }
local OPTIONS = { thinking = true, add_generation_prompt = true, drop_thinking = true, train_reasoning = true,
    train = true, tools = true, reasoning_effort = true, bos = true }

local function fail(i, field, msg)
    error(("%s: messages[%d]%s: %s"):format(WHERE, i, field and ("." .. field) or "", msg), 0)
end

local function fail_opt(field, msg) error(("%s: opts.%s: %s"):format(WHERE, field, msg), 0) end

-- ------------------------------------------------------------------------------------------------ rendering

-- A tool schema in its rendered form (JSON text). `tool` is OpenAI style, a bare schema or JSON text.
-- fail_at(subfield, message) raises; subfield is relative to the list ("[2]", "[2].name").
local function render_tool(tool, j, fail_at)
    local at = ("[%d]"):format(j)
    if type(tool) == "string" then
        local v, err = json.decode(tool)
        if v == nil then fail_at(at, "not valid JSON (" .. err .. ")") end
        tool = v
    end
    if type(tool) ~= "table" then fail_at(at, "tool schema (table or JSON string) expected, got " .. type(tool)) end
    if tool.type == "function" and type(tool["function"]) == "table" then
        tool = tool["function"]
        at = at .. ".function"
    end
    if type(tool.name) ~= "string" then fail_at(at .. ".name", "string expected, got " .. type(tool.name)) end
    return json.encode(tool)
end

local function render_tools(tools, fail_at)
    local parts = {}
    for j, tool in ipairs(tools) do parts[j] = render_tool(tool, j, fail_at) end
    return TOOLS_HEAD .. table.concat(parts, "\n") .. TOOLS_TAIL
end

local function render_response_format(rf, fail_at)
    if type(rf) == "string" then
        local v, err = json.decode(rf)
        if v == nil then fail_at("not valid JSON (" .. err .. ")") end
        rf = v
    end
    if type(rf) ~= "table" then fail_at("table or JSON string expected, got " .. type(rf)) end
    return RESPONSE_FORMAT_HEAD .. json.encode(rf)
end

-- Arguments of one tool call as an (ordered where known) Lua table, following encode_arguments_to_dsml:
-- a JSON string is decoded; text that does not parse becomes {arguments = text}, as the official encoder does.
local function call_arguments(args, fail_at)
    if args == nil then return {} end
    if type(args) == "string" then
        local v = json.decode(args)
        if v == nil then return json.object { "arguments", args } end
        args = v
    end
    if type(args) ~= "table" or args == json.null or json.is_boxed(args) then
        fail_at("table or JSON object text expected, got " .. (args == json.null and "null" or type(args)))
    end
    if json.keys(args) == nil then
        for k in pairs(args) do
            if type(k) ~= "string" then fail_at("an object with string keys expected, got key " .. quote(k)) end
        end
    end
    return args
end

-- The DSML block for a list of normalised tool calls ({name, args}): tool_calls_template around
-- tool_call_template around the parameters of encode_arguments_to_dsml, preceded by "\n\n".
local function render_tool_calls(calls)
    local invokes = {}
    for j, c in ipairs(calls) do
        local params = {}
        local keys = json.keys(c.args)
        if keys == nil then
            keys = {}
            for k in pairs(c.args) do keys[#keys + 1] = k end
            table.sort(keys)
        end
        for _, k in ipairs(keys) do
            local v = c.args[k]
            if v ~= nil then
                local is_str = type(v) == "string"
                params[#params + 1] = ("<%sparameter name=\"%s\" string=\"%s\">%s</%sparameter>"):format(DSML, k,
                    is_str and "true" or "false", is_str and v or json.encode(v), DSML)
            end
        end
        invokes[j] = ("<%sinvoke name=\"%s\">\n%s\n</%sinvoke>"):format(DSML, c.name, table.concat(params, "\n"),
            DSML)
    end
    return ("\n\n<%stool_calls>\n%s\n</%stool_calls>"):format(DSML, table.concat(invokes, "\n"), DSML)
end

-- ------------------------------------------------------------------------------------------------ messages

local function check_string(i, m, field, optional)
    local v = m[field]
    if v == nil and optional then return nil end
    if type(v) ~= "string" then fail(i, field, "string expected, got " .. type(v)) end
    return v
end

local function normalise_calls(i, list)
    if type(list) ~= "table" then fail(i, "tool_calls", "array expected, got " .. type(list)) end
    local calls = {}
    for j, tc in ipairs(list) do
        local field = ("tool_calls[%d]"):format(j)
        local function fail_at(msg) fail(i, field, msg) end
        if type(tc) ~= "table" then fail_at("table expected, got " .. type(tc)) end
        local name, args, id = tc.name, tc.arguments, tc.id
        local f = tc["function"]
        if f ~= nil then
            if type(f) ~= "table" then fail(i, field .. ".function", "table expected, got " .. type(f)) end
            name, args, id = f.name, f.arguments, id or f.id
            field = field .. ".function"
        end
        if type(name) ~= "string" or name == "" then
            fail(i, field .. ".name", "non-empty string expected, got " .. (name == "" and "\"\"" or type(name)))
        end
        if id ~= nil and type(id) ~= "string" then fail(i, field .. ".id", "string expected, got " .. type(id)) end
        calls[j] = { name = name, args = call_arguments(args, function(msg) fail(i, field .. ".arguments", msg) end),
            id = id }
    end
    for k in pairs(list) do
        if type(k) ~= "number" or k > #calls then fail(i, "tool_calls", "array expected (found key " .. quote(k) .. ")") end
    end
    return calls
end

-- Validated copies of the messages: {role, content, reasoning, calls, tools (rendered block), rf, ids, ...,
-- index = position in the caller's array}.
local function normalise(messages)
    local n = chat.check_messages(WHERE, messages, ROLES)
    local out = {}
    for i = 1, n do
        local m = messages[i]
        local role = m.role
        local x = { role = role, index = i }
        if m.task ~= nil then fail(i, "task", "internal classification tasks are not supported") end
        if m.tools ~= nil and role ~= "system" and role ~= "developer" then
            fail(i, "tools", "tools belong on a system or developer message")
        end
        if role == "system" or role == "developer" then
            local has_extra = m.tools ~= nil or m.response_format ~= nil
            x.content = check_string(i, m, "content", role == "system" and has_extra) or ""
            if role == "developer" and x.content == "" then fail(i, "content", "must not be empty") end
            if m.tools ~= nil then
                if type(m.tools) ~= "table" then fail(i, "tools", "array expected, got " .. type(m.tools)) end
                x.has_tools = #m.tools > 0
                if x.has_tools then
                    x.tools = render_tools(m.tools, function(sub, msg) fail(i, "tools" .. sub, msg) end)
                end
            end
            if m.response_format ~= nil then
                x.response_format = render_response_format(m.response_format,
                    function(msg) fail(i, "response_format", msg) end)
            end
        elseif role == "user" or role == "latest_reminder" then
            x.content = check_string(i, m, "content")
        elseif role == "tool" then
            local c = m.content
            if type(c) == "table" then
                local parts = {}
                for j, b in ipairs(c) do
                    if type(b) ~= "table" then fail(i, ("content[%d]"):format(j), "table expected, got " .. type(b)) end
                    if b.type == "text" then
                        if type(b.text) ~= "string" then
                            fail(i, ("content[%d].text"):format(j), "string expected, got " .. type(b.text))
                        end
                        parts[j] = b.text
                    else
                        parts[j] = "[Unsupported " .. tostring(b.type == nil and "None" or b.type) .. "]"
                    end
                end
                c = table.concat(parts, "\n\n")
            elseif type(c) ~= "string" then
                fail(i, "content", "string or array of content parts expected, got " .. type(c))
            end
            x.content = c
            if m.tool_call_id ~= nil and type(m.tool_call_id) ~= "string" then
                fail(i, "tool_call_id", "string expected, got " .. type(m.tool_call_id))
            end
            x.tool_call_id = m.tool_call_id
        else -- assistant
            if m.tool_calls ~= nil then x.calls = normalise_calls(i, m.tool_calls) end
            if x.calls and #x.calls == 0 then x.calls = nil end
            if m.ids ~= nil then
                if type(m.ids) ~= "table" then fail(i, "ids", "array of token ids expected, got " .. type(m.ids)) end
                for j, v in ipairs(m.ids) do
                    if type(v) ~= "number" or v ~= math.floor(v) or v < 0 then
                        fail(i, ("ids[%d]"):format(j), "token id expected, got " .. tostring(v))
                    end
                end
                x.ids = m.ids
            end
            x.content = check_string(i, m, "content", x.calls ~= nil or x.ids ~= nil) or ""
            x.reasoning = check_string(i, m, "reasoning_content", true)
            if m.wo_eos ~= nil and type(m.wo_eos) ~= "boolean" then fail(i, "wo_eos", "boolean expected") end
            x.wo_eos = m.wo_eos == true
            if m.train ~= nil and type(m.train) ~= "boolean" then fail(i, "train", "boolean expected") end
            x.train = m.train
        end
        out[i] = x
    end
    return out
end

-- merge_tool_messages: every run of tool/user messages becomes one user message with parts.
local function merge_tool_messages(list)
    local merged = {}
    for _, m in ipairs(list) do
        local last = merged[#merged]
        if m.role == "tool" or m.role == "user" then
            local part = m.role == "tool"
                and { tool = true, id = m.tool_call_id or "", text = "<tool_result>" .. m.content .. "</tool_result>" }
                or { text = m.content }
            if last and last.role == "user" then
                last.parts[#last.parts + 1] = part
            else
                merged[#merged + 1] = { role = "user", parts = { part }, index = m.index }
            end
        else
            merged[#merged + 1] = m
        end
    end
    return merged
end

-- sort_tool_results_by_call_order: within a user turn, tool results take the order of the latest assistant
-- turn's tool calls (matched by id; unknown ids sort as position 0, stably); other parts stay in place.
local function sort_tool_results(list)
    local order = {}
    for _, m in ipairs(list) do
        if m.role == "assistant" and m.calls then
            order = {}
            for j, c in ipairs(m.calls) do
                if c.id and c.id ~= "" then order[c.id] = j - 1 end
            end
        elseif m.role == "user" then
            local slots, tools = {}, {}
            for j, p in ipairs(m.parts) do
                if p.tool then
                    slots[#slots + 1] = j
                    tools[#tools + 1] = { part = p, key = order[p.id] or 0, seq = #tools + 1 }
                end
            end
            if #tools > 1 and next(order) ~= nil then
                table.sort(tools, function(a, b)
                    if a.key ~= b.key then return a.key < b.key end
                    return a.seq < b.seq
                end)
                for k, j in ipairs(slots) do m.parts[j] = tools[k].part end
            end
        end
    end
end

local function last_user_index(list)
    for i = #list, 1, -1 do
        if list[i].role == "user" or list[i].role == "developer" then return i end
    end
    return 0
end

-- _drop_thinking_messages: before the last user turn, assistant turns lose their reasoning and developer
-- messages are dropped.
local function drop_thinking_messages(list)
    local last = last_user_index(list)
    local out = {}
    for i, m in ipairs(list) do
        if i >= last or m.role == "user" or m.role == "system" or m.role == "latest_reminder" then
            out[#out + 1] = m
        elseif m.role == "assistant" then
            local c = {}
            for k, v in pairs(m) do c[k] = v end
            c.reasoning = nil
            c.dropped = true
            out[#out + 1] = c
        end
    end
    return out
end

-- ------------------------------------------------------------------------------------------------ template

function T:segments(b, messages, opts)
    opts = chat.check_options(WHERE, opts, OPTIONS)
    local function bool_opt(name, default) return chat.bool_option(WHERE, opts, name, default) end
    local thinking = bool_opt("thinking", true)
    local gen_prompt = bool_opt("add_generation_prompt", false)
    local drop = bool_opt("drop_thinking", true)
    local train_reasoning = bool_opt("train_reasoning", true)
    local bos = bool_opt("bos", true)
    local train = chat.train_option(WHERE, opts)
    local effort = opts.reasoning_effort
    if effort ~= nil and effort ~= "max" and effort ~= "high" then
        fail_opt("reasoning_effort", "\"max\", \"high\" or nil expected, got " .. quote(effort))
    end

    local list = normalise(messages)
    if opts.tools ~= nil then
        if type(opts.tools) ~= "table" then fail_opt("tools", "array expected, got " .. type(opts.tools)) end
        if #opts.tools > 0 then
            local block = render_tools(opts.tools, function(sub, msg) fail_opt("tools" .. sub, msg) end)
            local sys
            for _, m in ipairs(list) do
                if m.role == "system" then
                    sys = m
                    break
                end
            end
            if sys and sys.tools then fail_opt("tools", "the system message already has tools") end
            if not sys then
                sys = { role = "system", content = "", index = 0 }
                table.insert(list, 1, sys)
            end
            sys.tools, sys.has_tools = block, true
        end
    end

    list = merge_tool_messages(list)
    sort_tool_results(list)
    for _, m in ipairs(list) do
        if m.has_tools then drop = false end
    end
    if thinking and drop then list = drop_thinking_messages(list) end
    local last_user = last_user_index(list)

    local last_assistant = 0
    for i, m in ipairs(list) do
        if m.role == "assistant" then last_assistant = i end
    end

    local end_think_id
    if bos then b:add(BOS, false) end
    for i, m in ipairs(list) do
        if i == 1 and thinking and effort == "max" then b:add(REASONING_EFFORT_MAX, false) end
        local role = m.role
        if role == "system" then
            b:add(m.content, false)
            if m.tools then b:add("\n\n" .. m.tools, false) end
            if m.response_format then b:add("\n\n" .. m.response_format, false) end
        elseif role == "developer" then
            b:add(USER .. m.content, false)
            if m.tools then b:add("\n\n" .. m.tools, false) end
            if m.response_format then b:add("\n\n" .. m.response_format, false) end
        elseif role == "user" then
            local texts = {}
            for j, p in ipairs(m.parts) do texts[j] = p.text end
            b:add(USER .. table.concat(texts, "\n\n"), false)
        elseif role == "latest_reminder" then
            b:add(LATEST_REMINDER .. m.content, false)
        else -- assistant
            local trained
            if m.train ~= nil then
                trained = m.train
            else
                trained = train == "all" or (train == "last" and i == last_assistant)
            end
            local with_thinking = thinking and (not drop or i > last_user)
            if m.ids then
                if thinking and not with_thinking then
                    fail(m.index, "ids",
                        "given for a turn whose reasoning is dropped (render with drop_thinking = false)")
                end
                local mask = trained
                if trained and with_thinking and not train_reasoning then
                    -- Token-level: everything up to and including the </think> token is reasoning.
                    if end_think_id == nil then
                        local e = b.tok:encode(END_THINK)
                        end_think_id = #e == 1 and e[1] or false
                    end
                    if not end_think_id then
                        fail(m.index, "ids", "train_reasoning = false needs a tokenizer with a </think> token")
                    end
                    mask = {}
                    local seen = false
                    for j, id in ipairs(m.ids) do
                        mask[j] = seen and 1 or 0
                        if id == end_think_id then seen = true end
                    end
                end
                b:add_ids(m.ids, mask)
            else
                if with_thinking then
                    local tr = trained and train_reasoning
                    b:add(m.reasoning or "", tr)
                    b:add(END_THINK, tr)
                end
                b:add(m.content, trained)
                if m.calls then b:add(render_tool_calls(m.calls), trained) end
                if not m.wo_eos then b:add(EOS, trained) end
            end
        end

        -- The transition after a user/developer turn: when an assistant (or latest_reminder) turn follows,
        -- or, at the end, when a generation prompt is asked for.
        local nxt = list[i + 1]
        local transition
        if nxt then
            transition = nxt.role == "assistant" or nxt.role == "latest_reminder"
        else
            transition = gen_prompt
        end
        if transition and (role == "user" or role == "developer") then
            b:add(ASSISTANT, false)
            if thinking and (not drop or i >= last_user) then
                b:add(THINK, false)
            else
                b:add(END_THINK, false)
            end
        end
    end
end

return T
