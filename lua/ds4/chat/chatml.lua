--[[ ds4.chat.chatml — ChatML (<|im_start|>role\n...<|im_end|>\n), a second template on the same segment
builder as deepseek_v4, to show that the mechanism is not tied to one format.

  local t = require("ds4.chat").get("chatml")
  local r = t:render(tok, messages, opts)     -- {ids, mask, text, segments}

  <|im_start|>system\n{content}<|im_end|>\n
  <|im_start|>user\n{content}<|im_end|>\n
  <|im_start|>assistant\n[<think>\n{reasoning}\n</think>\n\n]{content}[\n<tool_call>\n{json}\n</tool_call>...]<|im_end|>\n
  <|im_start|>tool\n{content}<|im_end|>\n
  <|im_start|>assistant\n                     the generation prompt (opts.add_generation_prompt)

Messages: {role = "system"|"user"|"assistant"|"tool", content = s}; assistant turns may carry
reasoning_content, tool_calls ({name, arguments} or OpenAI style; written as Hermes/Qwen-style
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks), train = bool, ids = {...} (verbatim
generated tokens through <|im_end|>, used verbatim as in deepseek_v4).

Options: add_generation_prompt = false; thinking = false (true: assistant reasoning_content is rendered as a
<think>\n...\n</think>\n\n block); drop_thinking = true (with thinking: no block for assistant turns before the
last user turn); train_reasoning = true; train = "all" | "last" | "none".

Masks: 1 on what the assistant writes after "<|im_start|>assistant\n": the think block (when
train_reasoning), content, tool calls and <|im_end|>; 0 on the role headers, the "\n" after <|im_end|>, and
every non-assistant turn. The segment-vs-one-shot caveat of ds4/chat/init.lua applies: with a tokenizer that
has <|im_start|>/<|im_end|> as added tokens every mask change sits next to one; with one that does not
(e.g. a DeepSeek tokenizer), BPE may merge "<|im_end|>" with the "\n" after it when the whole text is
tokenised at once, while the builder keeps them apart (they are masked differently).
]]

local chat = require("ds4.chat")
local json = chat.json

local type, ipairs, error = type, ipairs, error

local T = { name = "chatml" }

local IM_START, IM_END = "<|im_start|>", "<|im_end|>"
T.strings = { im_start = IM_START, im_end = IM_END }

local WHERE = "chatml"
local ROLES = { "system", "user", "assistant", "tool" }
local OPTIONS = { add_generation_prompt = true, thinking = true, drop_thinking = true, train_reasoning = true,
    train = true }

local function fail(i, field, msg)
    error(("%s: messages[%d]%s: %s"):format(WHERE, i, field and ("." .. field) or "", msg), 0)
end

local function tool_call_json(i, j, tc)
    local field = ("tool_calls[%d]"):format(j)
    if type(tc) ~= "table" then fail(i, field, "table expected, got " .. type(tc)) end
    local name, args = tc.name, tc.arguments
    if tc["function"] ~= nil then
        if type(tc["function"]) ~= "table" then fail(i, field .. ".function", "table expected") end
        name, args = tc["function"].name, tc["function"].arguments
        field = field .. ".function"
    end
    if type(name) ~= "string" or name == "" then fail(i, field .. ".name", "non-empty string expected") end
    if type(args) == "string" then
        local v, err = json.decode(args)
        if v == nil then fail(i, field .. ".arguments", "not valid JSON (" .. err .. ")") end
        args = v
    elseif args == nil then
        args = {}
    end
    if type(args) ~= "table" or args == json.null or json.is_boxed(args) then
        fail(i, field .. ".arguments", "table or JSON object text expected, got " .. type(args))
    end
    return json.encode(json.object { "name", name, "arguments", args })
end

function T:segments(b, messages, opts)
    opts = chat.check_options(WHERE, opts, OPTIONS)
    local function bool_opt(name, default) return chat.bool_option(WHERE, opts, name, default) end
    local gen_prompt = bool_opt("add_generation_prompt", false)
    local thinking = bool_opt("thinking", false)
    local drop = bool_opt("drop_thinking", true)
    local train_reasoning = bool_opt("train_reasoning", true)
    local train = chat.train_option(WHERE, opts)

    local n = chat.check_messages(WHERE, messages, ROLES)
    local last_user, last_assistant = 0, 0
    for i = 1, n do
        if messages[i].role == "user" then last_user = i end
        if messages[i].role == "assistant" then last_assistant = i end
    end

    for i = 1, n do
        local m = messages[i]
        local role = m.role
        b:add(IM_START .. role .. "\n", false)
        if role ~= "assistant" then
            if type(m.content) ~= "string" then fail(i, "content", "string expected, got " .. type(m.content)) end
            b:add(m.content .. IM_END .. "\n", false)
        else
            local trained = m.train
            if trained == nil then
                trained = train == "all" or (train == "last" and i == last_assistant)
            elseif type(trained) ~= "boolean" then
                fail(i, "train", "boolean expected")
            end
            if m.ids ~= nil then
                if type(m.ids) ~= "table" then fail(i, "ids", "array of token ids expected") end
                b:add_ids(m.ids, trained) -- what the model sampled, through its <|im_end|>
            else
                local calls = m.tool_calls
                if calls ~= nil and type(calls) ~= "table" then fail(i, "tool_calls", "array expected") end
                local content = m.content
                if content == nil and calls and #calls > 0 then content = "" end
                if type(content) ~= "string" then fail(i, "content", "string expected, got " .. type(content)) end
                local r = m.reasoning_content
                if r ~= nil and type(r) ~= "string" then
                    fail(i, "reasoning_content", "string expected, got " .. type(r))
                end
                if thinking and r and (not drop or i > last_user) then
                    b:add("<think>\n" .. r .. "\n</think>\n\n", trained and train_reasoning)
                end
                b:add(content, trained)
                for j, tc in ipairs(calls or {}) do
                    b:add("\n<tool_call>\n" .. tool_call_json(i, j, tc) .. "\n</tool_call>", trained)
                end
                b:add(IM_END, trained)
            end
            b:add("\n", false)
        end
    end
    if gen_prompt then b:add(IM_START .. "assistant\n", false) end
end

return T
