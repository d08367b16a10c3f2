-- test_chat.lua — chat templates (ds4.chat): DeepSeek-V4 rendering against hand-written expected text,
-- token-exact loss masks, the failure modes of other frameworks' mask builders (docs/rl.md, "Chat masks"),
-- append-only checks, ChatML, user templates, errors, and the Python-compatible JSON they render.
--
-- The expected strings below are written out by hand from the rules of DeepSeek-V4's official encoder
-- (encoding_dsv4.py, as vendored by SGLang): they are an independent reference, not output of the code
-- under test.
local H = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/harness.lua")
local ds4 = require("ds4")
local chat = require("ds4.chat")
local json = require("ds4.chat.json")

local BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
local U, A = "<｜User｜>", "<｜Assistant｜>"

-- ------------------------------------------------------------------------------------------------ tokenizers

-- Both real tokenizers: the built-in byte-level one (every byte an id, the DeepSeek chat special tokens as
-- single ids, including <｜latest_reminder｜> and ｜DSML｜) and an HF byte-level BPE fixture with DeepSeek
-- special tokens (BOS, EOS, User, Assistant, <think>, </think> and the V3 tool tokens; no DSML token, so the
-- tool-call blocks are BPE-encoded text there).
local toks = {
    { name = "built-in byte-level", tok = ds4.tokenizer() },
    { name = "deepseek.json", tok = ds4.tokenizer(H.fixtures() .. "/tokenizer/deepseek.json") },
}
local TNAME = "?" -- the tokenizer under test, for messages

-- ------------------------------------------------------------------------------------------------ helpers

local ds = chat.get("deepseek_v4")
local cm = chat.get("chatml")

-- Maximal runs of trained tokens: {{text = decoded, first = i, last = j}, ...}
local function trained_runs(tok, r)
    local runs, i, n = {}, 1, #r.ids
    while i <= n do
        if r.mask[i] == 1 then
            local j = i
            while j < n and r.mask[j + 1] == 1 do j = j + 1 end
            local ids = {}
            for k = i, j do ids[#ids + 1] = r.ids[k] end
            runs[#runs + 1] = { text = tok:decode(ids), first = i, last = j }
            i = j + 1
        else
            i = i + 1
        end
    end
    return runs
end

local function run_texts(tok, r)
    local out = {}
    for i, run in ipairs(trained_runs(tok, r)) do out[i] = run.text end
    return out
end

-- The invariants every render must satisfy, whatever the tokenizer.
local function check_render(tok, r, what, whole)
    H.eq(#r.mask, #r.ids, what .. ": one mask value per id")
    local ok = true
    for i = 1, #r.mask do
        if r.mask[i] ~= 0 and r.mask[i] ~= 1 then ok = false end
    end
    H.check(ok, what .. ": mask values are 0/1")
    H.eq(tok:decode(r.ids), r.text, what .. ": decode(ids) == text")
    if whole ~= false then
        H.same(r.ids, tok:encode(r.text), what .. " [" .. TNAME .. "]: segment ids == encode(whole text)")
    end
    -- the segments tile the ids
    local next_first = 1
    for _, s in ipairs(r.segments) do
        if s.first ~= next_first then ok = false end
        next_first = s.first + s.count
    end
    H.check(ok and next_first == #r.ids + 1, what .. ": segments tile the ids")
end

local function render(tok, tmpl, messages, opts, what, whole)
    local r = tmpl:render(tok, messages, opts)
    check_render(tok, r, what, whole)
    return r
end

-- ------------------------------------------------------------------------------------------------ fixtures

local SYS = "You are a helpful assistant."

-- The "## Tools" block of the official encoder (TOOLS_TEMPLATE with the DSML token and the thinking tokens
-- filled in), followed by one schema; written out by hand.
local TOOLS_BLOCK = [[## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Get the weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
]]

local WEATHER_TOOL = '{"type": "function", "function": {"name": "get_weather", "description": '
    .. '"Get the weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": '
    .. '"string"}, "days": {"type": "integer"}}, "required": ["city"]}}}'

local CALL_BLOCK = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    .. "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    .. "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n"
    .. "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"

local function weather_conversation()
    return {
        { role = "system", content = SYS },
        { role = "user", content = "Weather in Paris?" },
        { role = "assistant", reasoning_content = "I need the tool.", tool_calls = {
            { id = "call_1", type = "function", ["function"] = { name = "get_weather",
                arguments = '{"city": "Paris", "days": 2}' } } } },
        { role = "tool", tool_call_id = "call_1", content = "Sunny, 21C" },
        { role = "assistant", reasoning_content = "Got it.", content = "Sunny, 21C in Paris." },
    }
end

-- ------------------------------------------------------------------------------------------------ tests

for _, entry in ipairs(toks) do
    local tok = entry.tok
    TNAME = entry.name
    io.write("test_chat: tokenizer ", TNAME, "\n")

    -- 1. The answer also occurs in the reasoning (docs/rl.md, "Chat masks", failure 1): the mask must cover the
    -- real answer and EOS, at the end, not the "4" inside the reasoning.
    do
        local msgs = { { role = "system", content = SYS }, { role = "user", content = "What is 2+2?" },
            { role = "assistant", reasoning_content = "2+2 = 4, answer 4", content = "4" } }
        local r = render(tok, ds, msgs, nil, "answer-in-reasoning")
        H.eq(r.text, BOS .. SYS .. U .. "What is 2+2?" .. A .. "<think>2+2 = 4, answer 4</think>4" .. EOS,
            "answer-in-reasoning text")
        H.same(run_texts(tok, r), { "2+2 = 4, answer 4</think>4" .. EOS }, "reasoning + </think> + answer + EOS trained")
        local r2 = render(tok, ds, msgs, { train_reasoning = false }, "answer-in-reasoning, no reasoning")
        local runs = trained_runs(tok, r2)
        H.eq(#runs, 1, "one trained run")
        H.eq(runs[1] and runs[1].text, "4" .. EOS, "only the answer and EOS trained")
        H.eq(runs[1] and runs[1].last, #r2.ids, "the trained answer is the final one, not the 4 in the reasoning")
        H.eq(r2.ids[#r2.ids], tok:encode(EOS)[1], "EOS is the last token")
        H.eq(r2.mask[#r2.mask], 1, "EOS trained")
        -- prompt-side markers are never trained
        local think_id = tok:encode("<think>")[1]
        local asst_id = tok:encode(A)[1]
        for i, id in ipairs(r.ids) do
            if id == think_id or id == asst_id then H.eq(r.mask[i], 0, "prompt-side marker untrained") end
        end
    end

    -- 2. Chat mode.
    do
        local msgs = { { role = "system", content = SYS }, { role = "user", content = "What is 2+2?" },
            { role = "assistant", reasoning_content = "ignored in chat mode", content = "4" } }
        local r = render(tok, ds, msgs, { thinking = false }, "chat mode")
        H.eq(r.text, BOS .. SYS .. U .. "What is 2+2?" .. A .. "</think>4" .. EOS, "chat mode text")
        H.same(run_texts(tok, r), { "4" .. EOS }, "chat mode: content + EOS trained, prompt </think> not")
    end

    -- 3. Multi-turn with dropped thinking (default) and kept thinking.
    do
        local msgs = {
            { role = "user", content = "Hi" },
            { role = "assistant", reasoning_content = "Greet back.", content = "Hello!" },
            { role = "user", content = "Bye" },
            { role = "assistant", reasoning_content = "Say farewell.", content = "Goodbye!" },
        }
        local r = render(tok, ds, msgs, nil, "multi-turn dropped")
        H.eq(r.text, BOS .. U .. "Hi" .. A .. "</think>Hello!" .. EOS .. U .. "Bye" .. A
            .. "<think>Say farewell.</think>Goodbye!" .. EOS, "multi-turn, earlier reasoning dropped")
        H.same(run_texts(tok, r), { "Hello!" .. EOS, "Say farewell.</think>Goodbye!" .. EOS },
            "dropped turn: content + EOS trained")
        local rl = render(tok, ds, msgs, { train = "last" }, "multi-turn last")
        H.same(run_texts(tok, rl), { "Say farewell.</think>Goodbye!" .. EOS }, "train = last")
        H.same(rl.ids, r.ids, "train option changes the mask only")
        local rn = render(tok, ds, msgs, { train = "none" }, "multi-turn none")
        H.same(run_texts(tok, rn), {}, "train = none")
        local rk = render(tok, ds, msgs, { drop_thinking = false }, "multi-turn kept")
        H.eq(rk.text, BOS .. U .. "Hi" .. A .. "<think>Greet back.</think>Hello!" .. EOS .. U .. "Bye" .. A
            .. "<think>Say farewell.</think>Goodbye!" .. EOS, "multi-turn, reasoning kept")
        H.same(run_texts(tok, rk), { "Greet back.</think>Hello!" .. EOS, "Say farewell.</think>Goodbye!" .. EOS },
            "kept reasoning trained in every turn")
        -- per-message override
        local m2 = { msgs[1], { role = "assistant", reasoning_content = "Greet back.", content = "Hello!", train = false },
            msgs[3], msgs[4] }
        H.same(run_texts(tok, render(tok, ds, m2, nil, "train override")), { "Say farewell.</think>Goodbye!" .. EOS },
            "assistant.train = false")
        -- chat mode multi-turn
        local rc = render(tok, ds, msgs, { thinking = false }, "multi-turn chat")
        H.eq(rc.text, BOS .. U .. "Hi" .. A .. "</think>Hello!" .. EOS .. U .. "Bye" .. A .. "</think>Goodbye!" .. EOS,
            "multi-turn chat mode")
    end

    -- 4. Generation prompt.
    do
        local msgs = { { role = "user", content = "Hi" } }
        H.eq(render(tok, ds, msgs, nil, "no gen prompt").text, BOS .. U .. "Hi", "no generation prompt")
        local r = render(tok, ds, msgs, { add_generation_prompt = true }, "gen prompt")
        H.eq(r.text, BOS .. U .. "Hi" .. A .. "<think>", "generation prompt, thinking")
        H.same(run_texts(tok, r), {}, "prompt untrained")
        H.eq(render(tok, ds, msgs, { add_generation_prompt = true, thinking = false }, "gen prompt chat").text,
            BOS .. U .. "Hi" .. A .. "</think>", "generation prompt, chat")
        H.eq(render(tok, ds, msgs, { add_generation_prompt = true, bos = false }, "no bos").text,
            U .. "Hi" .. A .. "<think>", "bos = false")
        -- a later turn's generation prompt after dropped thinking
        local m3 = { { role = "user", content = "Hi" }, { role = "assistant", reasoning_content = "r", content = "c" },
            { role = "user", content = "Again" } }
        H.eq(render(tok, ds, m3, { add_generation_prompt = true }, "gen prompt 2").text,
            BOS .. U .. "Hi" .. A .. "</think>c" .. EOS .. U .. "Again" .. A .. "<think>", "second-turn prompt")
    end

    -- 5. Tools: the "## Tools" block, a tool-call-only assistant turn (docs/rl.md, "Chat masks", failure 2), tool
    -- result folding, and drop_thinking switched off by the tools.
    do
        local msgs = weather_conversation()
        local want = BOS .. SYS .. "\n\n" .. TOOLS_BLOCK .. U .. "Weather in Paris?" .. A .. "<think>I need the tool.</think>"
            .. CALL_BLOCK .. EOS .. U .. "<tool_result>Sunny, 21C</tool_result>" .. A
            .. "<think>Got it.</think>Sunny, 21C in Paris." .. EOS
        local r = render(tok, ds, msgs, { tools = { WEATHER_TOOL } }, "tools")
        H.eq(r.text, want, "tools conversation text")
        H.same(run_texts(tok, r), { "I need the tool.</think>" .. CALL_BLOCK .. EOS,
            "Got it.</think>Sunny, 21C in Paris." .. EOS }, "tool-call turn: reasoning + DSML block + EOS trained")
        -- tools given on the system message: same text
        local m2 = weather_conversation()
        m2[1].tools = { WEATHER_TOOL }
        H.eq(render(tok, ds, m2, nil, "tools on system").text, want, "tools on the system message")
        -- no system message: an empty one is put first
        local m3 = weather_conversation()
        table.remove(m3, 1)
        H.eq(render(tok, ds, m3, { tools = { WEATHER_TOOL } }, "tools no system").text,
            BOS .. "\n\n" .. TOOLS_BLOCK .. want:sub(#BOS + #SYS + 2 + #TOOLS_BLOCK + 1), "tools without a system message")
        -- without tool schemas the official encoder keeps drop_thinking: the tool-call turn loses its reasoning
        local r4 = render(tok, ds, weather_conversation(), nil, "tool calls, dropped")
        H.eq(r4.text, BOS .. SYS .. U .. "Weather in Paris?" .. A .. "</think>" .. CALL_BLOCK .. EOS .. U
            .. "<tool_result>Sunny, 21C</tool_result>" .. A .. "<think>Got it.</think>Sunny, 21C in Paris." .. EOS,
            "tool calls without tools: dropped thinking")
        H.same(run_texts(tok, r4), { CALL_BLOCK .. EOS, "Got it.</think>Sunny, 21C in Paris." .. EOS },
            "tool-call-only turn trained: DSML block + EOS")
        -- agentic prompt: ends with the tool result, generation prompt
        local m5 = weather_conversation()
        m5[5] = nil
        local r5 = render(tok, ds, m5, { tools = { WEATHER_TOOL }, add_generation_prompt = true }, "tool gen prompt")
        H.eq(r5.text, want:sub(1, #want - #"Got it.</think>Sunny, 21C in Paris." - #EOS), "prompt after a tool result")
    end

    -- 6. Several tool results: sorted by call order, merged with a following user message; argument forms.
    do
        local msgs = {
            { role = "user", content = "Do both." },
            { role = "assistant", content = "Calling.", tool_calls = {
                { id = "a", name = "first", arguments = { x = 1 } },
                { id = "b", type = "function", ["function"] = { name = "second", arguments = "{}" } },
            } },
            { role = "tool", tool_call_id = "b", content = "B" },
            { role = "tool", tool_call_id = "a", content = { { type = "text", text = "A1" }, { type = "text", text = "A2" } } },
            { role = "user", content = "Thanks." },
        }
        local r = render(tok, ds, msgs, { drop_thinking = false, add_generation_prompt = true }, "two tools")
        H.eq(r.text, BOS .. U .. "Do both." .. A .. "<think></think>Calling.\n\n<｜DSML｜tool_calls>\n"
            .. "<｜DSML｜invoke name=\"first\">\n<｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>\n"
            .. "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"second\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" .. EOS
            .. U .. "<tool_result>A1\n\nA2</tool_result>\n\n<tool_result>B</tool_result>\n\nThanks." .. A .. "<think>",
            "tool results sorted by call order and merged with the user turn")

        local args = '{"q": "say \\"hi\\"\\n", "n": 1.0, "flag": true, "list": [1, "two", null], '
            .. '"obj": {"z": 1, "a": [2.5, -0.0]}, "big": 12345678901234567890, "f": 0.1, "e": 1e-7, "u": "\\u00e9\\ud83d\\ude00"}'
        local m2 = { { role = "user", content = "x" }, { role = "assistant", content = "", tool_calls = {
            { name = "f", arguments = args }, { name = "g", arguments = "not json" } } } }
        local r2 = render(tok, ds, m2, { thinking = false }, "argument forms")
        local P = function(k, s, v) return ('<｜DSML｜parameter name="%s" string="%s">%s</｜DSML｜parameter>'):format(k, s, v) end
        H.eq(r2.text, BOS .. U .. "x" .. A .. "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
            .. table.concat({ P("q", "true", 'say "hi"\n'), P("n", "false", "1.0"), P("flag", "false", "true"),
                P("list", "false", '[1, "two", null]'), P("obj", "false", '{"z": 1, "a": [2.5, -0.0]}'),
                P("big", "false", "12345678901234567890"), P("f", "false", "0.1"), P("e", "false", "1e-07"),
                P("u", "true", "é😀") }, "\n")
            .. "\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\n" .. P("arguments", "true", "not json")
            .. "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" .. EOS, "tool-call arguments rendered as the official encoder does")
    end

    -- 7. reasoning_effort, response_format, developer and latest_reminder.
    do
        local msgs = { { role = "system", content = SYS, response_format = '{"type": "json_object"}' },
            { role = "user", content = "Q" } }
        local r = render(tok, ds, msgs, { reasoning_effort = "max", add_generation_prompt = true }, "effort")
        H.eq(r.text, BOS .. "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
            .. "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
            .. "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
            .. SYS .. "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
            .. '{"type": "json_object"}' .. U .. "Q" .. A .. "<think>", "reasoning_effort max + response_format")
        H.eq(render(tok, ds, msgs, { reasoning_effort = "max", thinking = false }, "effort chat").text,
            BOS .. SYS .. "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
            .. '{"type": "json_object"}' .. U .. "Q", "reasoning_effort only in thinking mode")
        local m2 = { { role = "developer", content = "Be brief." }, { role = "user", content = "Q" },
            { role = "latest_reminder", content = "today" }, { role = "assistant", reasoning_content = "r", content = "A." } }
        -- thinking mode drops developer messages before the last user turn (_drop_thinking_messages) ...
        -- (whole = false: the reminder text runs straight into the trained reasoning, a mask cut between two
        -- plain texts, where one-shot BPE may merge "today" and "r"; see deepseek_v4.lua)
        local r2 = render(tok, ds, m2, nil, "developer/reminder", false)
        H.eq(r2.text, BOS .. U .. "Q" .. A .. "<think><｜latest_reminder｜>today" .. "r</think>A." .. EOS,
            "developer dropped, latest_reminder after the generation prompt")
        -- ... and keeps them with drop_thinking = false: a developer turn renders as a user turn
        local r3 = render(tok, ds, m2, { drop_thinking = false }, "developer kept", false)
        H.eq(r3.text, BOS .. U .. "Be brief." .. U .. "Q" .. A .. "<think><｜latest_reminder｜>today" .. "r</think>A." .. EOS,
            "developer kept")
    end

    -- 8. Token-in/token-out: assistant ids used verbatim.
    do
        local gen = tok:encode("Let me think.</think>Done." .. EOS)
        local msgs = { { role = "user", content = "Go" }, { role = "assistant", ids = gen } }
        local r = render(tok, ds, msgs, nil, "ids verbatim", false)
        H.eq(r.text, BOS .. U .. "Go" .. A .. "<think>Let me think.</think>Done." .. EOS, "ids text")
        local tail = {}
        for i = #r.ids - #gen + 1, #r.ids do tail[#tail + 1] = r.ids[i] end
        H.same(tail, gen, "generated ids kept verbatim")
        H.same(run_texts(tok, r), { "Let me think.</think>Done." .. EOS }, "generated ids trained")
        local r2 = render(tok, ds, msgs, { train_reasoning = false }, "ids no reasoning", false)
        H.same(run_texts(tok, r2), { "Done." .. EOS }, "train_reasoning = false splits the ids at </think>")
        H.raises(function() ds:render(tok, { msgs[1], msgs[2], { role = "user", content = "more" } }) end,
            { "messages[2].ids", "drop_thinking" }, "ids on a dropped turn")
    end

    -- 9. Append-only continuation checks.
    do
        local before = { { role = "user", content = "Hi" }, { role = "assistant", reasoning_content = "r1", content = "c1" } }
        local after = { before[1], before[2], { role = "user", content = "More" },
            { role = "assistant", reasoning_content = "r2", content = "c2" } }
        local ok, why = ds:check_prefix(tok, before, after, { drop_thinking = false })
        H.check(ok, "drop_thinking = false renders are append-only: " .. tostring(why))
        ok, why = ds:check_prefix(tok, before, after)
        H.check(not ok, "default drop_thinking is not append-only after a reasoning turn")
        H.check(type(why) == "string" and why:find("not append-only", 1, true) ~= nil, "the report says so: " .. tostring(why))
        H.check(why and why:find("<think>r1", 1, true) ~= nil, "the report shows where the texts diverge: " .. tostring(why))
        -- a rollout prompt (generation prompt) continued by the sampled turn
        ok, why = ds:check_prefix(tok, { before[1] }, before, { add_generation_prompt = true }, {})
        H.check(ok, "generation prompt + turn is append-only: " .. tostring(why))
        ok, why = ds:check_prefix(tok, { before[1] }, before, { add_generation_prompt = true, thinking = false },
            { thinking = false })
        H.check(ok, "chat mode generation prompt + turn is append-only: " .. tostring(why))
        -- an agentic continuation with tools (drop_thinking off automatically)
        local w = weather_conversation()
        local w4 = { w[1], w[2], w[3], w[4] }
        ok, why = ds:check_prefix(tok, w4, w, { tools = { WEATHER_TOOL }, add_generation_prompt = true },
            { tools = { WEATHER_TOOL } })
        H.check(ok, "tool-result prompt + final turn is append-only: " .. tostring(why))
        -- the same without tool schemas is not: the tool-call turn's reasoning is dropped once a user turn follows
        ok = ds:check_prefix(tok, { w[1], w[2], w[3] }, w)
        H.check(not ok, "without tools, the tool-call turn is re-rendered without reasoning")
    end

    -- 10. ChatML.
    do
        local msgs = { { role = "system", content = "S" }, { role = "user", content = "Q" },
            { role = "assistant", reasoning_content = "think", content = "A", tool_calls = {
                { name = "f", arguments = '{"b": 1, "a": "x"}' } } },
            { role = "tool", content = "R" }, { role = "assistant", content = "Done" } }
        -- deepseek.json has no <|im_start|>/<|im_end|> added tokens, so the cut between "<|im_end|>" (trained) and
        -- "\n" (not) is between plain texts, where one-shot BPE may merge (chatml.lua): not asserted there.
        local whole = TNAME ~= "deepseek.json"
        local r = render(tok, cm, msgs, { add_generation_prompt = true }, "chatml", whole)
        H.eq(r.text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
            .. 'A\n<tool_call>\n{"name": "f", "arguments": {"b": 1, "a": "x"}}\n</tool_call><|im_end|>\n'
            .. "<|im_start|>tool\nR<|im_end|>\n<|im_start|>assistant\nDone<|im_end|>\n<|im_start|>assistant\n",
            "chatml text")
        H.same(run_texts(tok, r), { 'A\n<tool_call>\n{"name": "f", "arguments": {"b": 1, "a": "x"}}\n</tool_call><|im_end|>',
            "Done<|im_end|>" }, "chatml masks")
        local r2 = render(tok, cm, msgs, { thinking = true, drop_thinking = false, train = "last" }, "chatml think", whole)
        H.check(r2.text:find("<|im_start|>assistant\n<think>\nthink\n</think>\n\nA\n<tool_call>", 1, true) ~= nil,
            "chatml think block")
        H.same(run_texts(tok, r2), { "Done<|im_end|>" }, "chatml train = last")
        local r3 = render(tok, cm, msgs, { thinking = true, drop_thinking = false, train_reasoning = false }, "chatml tr", whole)
        H.eq(run_texts(tok, r3)[1]:sub(1, 2), "A\n", "chatml train_reasoning = false")
        local ok = cm:check_prefix(tok, { msgs[1], msgs[2] }, { msgs[1], msgs[2], msgs[3] }, { add_generation_prompt = true }, {})
        H.check(ok, "chatml generation prompt is append-only")
    end

    -- 11. Errors name the message index and field.
    do
        H.raises(function() ds:render(tok, { { role = "user", content = "a" }, { role = "robot", content = "b" } }) end,
            { "deepseek_v4", "messages[2].role", "robot" }, "unknown role")
        H.raises(function() ds:render(tok, { { role = "user" } }) end, { "messages[1].content", "string expected" },
            "missing content")
        H.raises(function() ds:render(tok, { { role = "user", content = "a" }, { role = "assistant" } }) end,
            { "messages[2].content" }, "assistant without content or tool calls")
        H.raises(function()
            ds:render(tok, { { role = "user", content = "a" }, { role = "assistant", tool_calls = { { arguments = "{}" } } } })
        end, { "messages[2].tool_calls[1].name" }, "tool call without a name")
        H.raises(function()
            ds:render(tok, { { role = "user", content = "a" },
                { role = "assistant", tool_calls = { { type = "function", ["function"] = { name = "f", arguments = 3 } } } } })
        end, { "messages[2].tool_calls[1].function.arguments" }, "tool call with bad arguments")
        H.raises(function()
            ds:render(tok, { { role = "user", content = "a" }, { role = "assistant", tool_calls = { { name = "f", arguments = "[1]" } } } })
        end, { "messages[2].tool_calls[1].arguments" }, "tool call arguments not an object")
        H.raises(function() ds:render(tok, { { role = "user", content = "a" }, { role = "tool" } }) end,
            { "messages[2].content" }, "tool without content")
        H.raises(function() ds:render(tok, { { role = "user", content = "a" } }, { add_generation_promt = true }) end,
            { "unknown option", "add_generation_promt" }, "misspelt option")
        H.raises(function() ds:render(tok, { { role = "user", content = "a" } }, { train = "some" }) end,
            { "opts.train" }, "bad train")
        H.raises(function() ds:render(tok, { { role = "user", content = "a" } }, { tools = { { description = "x" } } }) end,
            { "opts.tools[1].name" }, "tool schema without a name")
        H.raises(function() ds:render(tok, { "hello" }) end, { "messages[1]", "table expected" }, "message not a table")
        H.raises(function() cm:render(tok, { { role = "user", content = 5 } }) end, { "chatml", "messages[1].content" },
            "chatml content")
    end
end

-- ------------------------------------------------------------------------------------------------ registry

do
    local names = chat.list()
    H.check(table.concat(names, ","):find("chatml", 1, true) and table.concat(names, ","):find("deepseek_v4", 1, true),
        "list has the built-ins")
    H.raises(function() chat.get("nope") end, { "unknown template", "deepseek_v4" }, "unknown template")
    H.check(chat.get("deepseek_v4") == ds, "get returns the same template")

    local tok = toks[1].tok
    local plain = chat.register("plain", { segments = function(self, b, messages)
        for _, m in ipairs(messages) do
            b:add(m.role .. ": ", false)
            b:add(m.content .. "\n", m.role == "assistant")
        end
    end })
    local r = plain:render(tok, { { role = "user", content = "hi" }, { role = "assistant", content = "yo" } })
    H.eq(r.text, "user: hi\nassistant: yo\n", "user template text")
    H.same(run_texts(tok, r), { "yo\n" }, "user template mask")
    H.check(plain:check_prefix(tok, { { role = "user", content = "hi" } },
        { { role = "user", content = "hi" }, { role = "assistant", content = "yo" } }), "user template check_prefix")
    H.check(chat.get("plain") == plain, "registered template is found")

    chat.register("raw", { render = function(self, tk, messages)
        local b = chat.builder(tk)
        b:add_ids(tk:encode("x"), true)
        b:add("y", false)
        return b:finish()
    end })
    local rr = chat.get("raw"):render(tok, {})
    H.eq(rr.text, "xy", "render-style template")
    H.same(rr.mask, { 1, 0 }, "render-style template mask")
    H.raises(function() chat.register("bad", {}) end, { "render or a segments" }, "template without functions")
    H.check(ds4.chat == chat, "ds4.chat is the module")
end

-- ------------------------------------------------------------------------------------------------ builder

do
    -- In deepseek.json, "and" is one token but "a" + "nd" are three: the builder joins equally-masked text
    -- before tokenising (so it matches one-shot tokenisation), and only a mask change cuts the text (where,
    -- between plain texts, the ids legitimately differ from one-shot tokenisation).
    local tok = toks[2].tok
    local whole = tok:encode("and")
    H.eq(#whole, 1, "fixture: 'and' is one token")
    local b = chat.builder(tok)
    b:add("a", true)
    b:add("nd", true)
    local r = b:finish()
    H.same(r.ids, whole, "same-mask pieces are tokenised together")
    H.same(r.mask, { 1 }, "their mask")
    b = chat.builder(tok)
    b:add("a", false)
    b:add("nd", true)
    r = b:finish()
    local want = tok:encode("a")
    for _, id in ipairs(tok:encode("nd")) do want[#want + 1] = id end
    H.same(r.ids, want, "a mask change cuts the text: ids of the pieces")
    H.check(#r.ids ~= #whole, "... which differ from one-shot tokenisation here (the documented case)")
    H.eq(r.mask[1], 0, "first piece untrained")
    H.eq(r.mask[#r.mask], 1, "second piece trained")
    H.eq(#r.segments, 2, "two segments")
    H.eq(r.text, "and", "text")
    b = chat.builder(tok)
    b:add("a", true)
    b:flush()
    b:add("nd", true)
    H.eq(#b:finish().ids, #want, "flush forces a cut")
    b = chat.builder(tok)
    b:add_ids({ 10, 11, 12 }, { 0, 1, 1 })
    r = b:finish()
    H.same(r.mask, { 0, 1, 1 }, "add_ids with a per-token mask")
    H.eq(r.text, tok:decode({ 10, 11, 12 }), "add_ids text defaults to decode")
    H.raises(function() chat.builder(tok):add_ids({ 1, -2 }, true) end, { "ids[2]" }, "bad id")
    H.raises(function() chat.builder(tok):add(5, true) end, { "string" }, "bad text")
    H.raises(function() chat.builder(42) end, { "tokenizer expected" }, "bad tokenizer")
end

-- ------------------------------------------------------------------------------------------------ json

do
    local cases = { { 0.5, "0.5" }, { 1e-5, "1e-05" }, { 1e16, "1e+16" }, { 1.5e16, "1.5e+16" }, { 123.456, "123.456" },
        { 0.1 + 0.2, "0.30000000000000004" }, { 1e-4, "0.0001" }, { 2.0 ^ 60 + 0.0, "1.152921504606847e+18" },
        { -2.5e-300, "-2.5e-300" }, { 1 / 3, "0.3333333333333333" }, { 1e300 * 10, "1e+301" } }
    for _, c in ipairs(cases) do H.eq(json.float_repr(c[1]), c[2], "float_repr " .. c[2]) end
    H.eq(json.float_repr(3.0), "3.0", "float_repr integral")
    H.eq(json.encode(3), "3", "integral Lua number as int")
    H.eq(json.encode({ b = 1, a = { true, false, json.null }, c = "é\t\1" }),
        '{"a": [true, false, null], "b": 1, "c": "é\\t\\u0001"}', "sorted keys, escapes")
    local src = '{"z": 1, "a": {"y": [1.0, 2, 1e400], "x": {}}, "m": []}'
    local v = assert(json.decode(src))
    H.eq(json.encode(v), '{"z": 1, "a": {"y": [1.0, 2, Infinity], "x": {}}, "m": []}', "decode keeps order and floats")
    H.eq(json.encode(json.object { "k2", 1, "k1", 2 }), '{"k2": 1, "k1": 2}', "json.object order")
    H.eq(json.encode(json.array({})), "[]", "json.array")
    local bad, err = json.decode('{"a": }')
    H.check(bad == nil and err:find("byte 7", 1, true), "decode error position: " .. tostring(err))
    H.check(json.decode('"a\tb"') == nil, "raw control character rejected (as Python)")
    H.eq(json.decode('"\\ud83d\\ude00"'), "😀", "surrogate pair")
end

H.done("test_chat")
