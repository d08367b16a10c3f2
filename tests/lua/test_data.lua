-- test_data.lua — ds4.data: every row of a JSONL dataset is checked before anything trains on it (issue 18, items
-- 5 and 6), errors name file:line, and nothing is converted silently; examples/arith_task.lua reads through it.
-- Usage: ds4 run tests/lua/test_data.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local data = require("ds4.data")

local function parse(text, opts) return data.parse_jsonl(text, "d.jsonl", opts) end

-- ------------------------------------------------------------------------------------------------ prompt/answer
do
    local rows = parse('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "x", "answer": 12, "id": 7}\n'
        .. '{"prompt": "y", "answer": 0.5}\n{"prompt": "z", "answer": 1e2}\n{"prompt": "w", "answer": -3}\n'
        .. '{"prompt": "v", "answer": 123456789012345678901234567890}\n  \n{"prompt": "u", "answer": "\\\\frac{1}{2}"}')
    H.eq(#rows, 7, "rows (blank lines skipped, a last line without a newline kept)")
    H.same({ rows[1].prompt, rows[1].answer, rows[1].line }, { "1+1=", "2", 1 }, "a string answer")
    H.same({ rows[2].answer, rows[2].line }, { "12", 3 }, "an integer answer, extra keys ignored, line numbers count blank lines")
    H.eq(rows[3].answer, "0.5", "a fractional answer")
    H.eq(rows[4].answer, "100.0", "a float literal keeps its spelling")
    H.eq(rows[5].answer, "-3", "a negative integer")
    H.eq(rows[6].answer, "123456789012345678901234567890", "a big integer keeps every digit")
    H.eq(rows[7].answer, "\\frac{1}{2}", "escapes decoded")
    H.eq(rows[1].ids, nil, "no tokenizer: no ids")
    local tok = ds4.tokenizer()
    local r = parse('{"prompt": "ab", "answer": "c"}', { tokenizer = tok })
    H.same(r[1].ids, { 97, 98 }, "with a tokenizer: the prompt's ids")

    local function bad(line, needles, what, opts)
        H.raises(function() parse('{"prompt": "ok", "answer": "1"}\n' .. line, opts) end, needles, what)
    end
    bad('{"prompt": "1+1=", "answer": null}', { "d.jsonl:2:", '"answer"', "got null" }, "null answer")
    bad('{"prompt": "1+1=", "answer": {"a": 1}}', { "d.jsonl:2:", "got an object" }, "object answer")
    bad('{"prompt": "1+1=", "answer": [2]}', { "d.jsonl:2:", "got an array" }, "array answer")
    bad('{"prompt": "1+1=", "answer": true}', { "d.jsonl:2:", "got the boolean true" }, "boolean answer")
    bad('{"prompt": "1+1=", "answer": 1e999}', { "d.jsonl:2:", "not a finite number" }, "1e999 (Infinity)")
    bad('{"prompt": "1+1=", "answer": NaN}', { "d.jsonl:2:", "not a finite number" }, "NaN answer")
    bad('{"prompt": "1+1=", "answer": -Infinity}', { "d.jsonl:2:", "not a finite number" }, "-Infinity answer")
    bad('{"prompt": "1+1=", "answer": 3e11031333333333333333333}', { "d.jsonl:2:", "not a finite number" },
        "an exponent of many digits overflows to infinity (fuzz_dataset found it raising inside the decoder)")
    H.eq(parse('{"prompt": "x", "answer": -3e-11031333333333333333333}')[1].answer, "-0.0",
        "an exponent of many digits underflows to zero")
    bad('{"prompt": "1+1=", "answer": ""}', { "d.jsonl:2:", "empty string" }, "empty answer")
    bad('{"prompt": "1+1="}', { "d.jsonl:2:", '"answer"', "missing" }, "no answer")
    bad('{"prompt": "", "answer": "2"}', { "d.jsonl:2:", '"prompt" is empty' }, "empty prompt")
    bad('{"prompt": " \\t\\n", "answer": "2"}', { "d.jsonl:2:", "only white space" }, "white-space prompt")
    bad('{"prompt": 5, "answer": "2"}', { "d.jsonl:2:", '"prompt" must be a string', "the number 5" }, "number prompt")
    bad('{"answer": "2"}', { "d.jsonl:2:", '"prompt" must be a string', "missing" }, "no prompt")
    bad('{"prompt": "1+1=", "answer": "2"', { "d.jsonl:2:", "not a JSON value" }, "truncated JSON")
    bad('[1, 2]', { "d.jsonl:2:", "must be a JSON object", "an array" }, "an array line")
    bad('"text"', { "d.jsonl:2:", "must be a JSON object" }, "a string line")
    bad('null', { "d.jsonl:2:", "got null" }, "a null line")
    H.raises(function() parse("\n  \n") end, { "d.jsonl: no rows" }, "no rows")
    H.raises(function() parse("x", { format = "csv" }) end, { "ds4.data.parse_jsonl", "opts.format" }, "bad format")
    H.raises(function() parse("x", { tokenzier = tok }) end, { "unknown option 'tokenzier'" }, "unknown option")
    H.eq(#parse('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n{"prompt": "', { max_rows = 2 }), 2,
        "max_rows stops before later lines")
    H.raises(function() parse("x", { max_rows = "2" }) end, { "opts.max_rows must be an integer" }, "bad max_rows")
end

-- ------------------------------------------------------------------------------------------------ messages
do
    local tok = ds4.tokenizer()
    local o = { format = "messages", tokenizer = tok, template = "deepseek_v4", render_opts = { thinking = false } }
    local rows = parse('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
        o)
    H.eq(rows[1].messages[2].content, "yo", "a conversation")
    local function bad(line, needles, what, opts)
        H.raises(function() parse(line, opts or o) end, needles, what)
    end
    bad('{"messages": {"role": "user"}}', { "d.jsonl:1:", '"messages" must be an array', "an object" }, "object")
    bad('{"messages": []}', { "d.jsonl:1:", "is empty" }, "no messages")
    bad('{"messages": [5]}', { "d.jsonl:1:", "messages[1] must be an object" }, "a number message")
    bad('{"messages": [{"content": "x"}]}', { "d.jsonl:1:", "messages[1].role" }, "no role")
    bad('{"messages": [{"role": "user", "content": 7}]}', { "d.jsonl:1:", "messages[1].content must be a string" },
        "number content")
    bad('{"messages": [{"role": "wizard", "content": "x"}]}', { "d.jsonl:1:", "unknown role" }, "the template's check")
    bad('{"messages": [{"role": "user", "content": "x"}]}', { "d.jsonl:1:", "no token to train on" },
        "nothing trained")
    H.raises(function() parse("{}", { format = "messages", template = "deepseek_v4" }) end,
        { "opts.template needs opts.tokenizer" }, "a template without a tokenizer")
    H.eq(#parse('{"messages": [{"role": "user", "content": "x"}]}', { format = "messages" }), 1,
        "without a template only the structure is checked")
end

-- ------------------------------------------------------------------------------------------------ issue 17
-- SFT on user datasets: messages rows with tool turns, prompt/completion rows (plain text and conversations), the
-- format detected from the first row; RL prompts as conversations (TRL) and verl's layout through a column mapping.
do
    local tok = ds4.tokenizer()
    local chat = require("ds4.chat")
    local tmpl = chat.get("deepseek_v4")
    local EOS = tok:special("eos")
    local function labels_of(r)
        local l = {}
        for i, id in ipairs(r.ids) do l[i] = r.mask[i] == 1 and id or -100 end
        return l
    end
    -- messages with system / user / assistant-with-tool-calls (content null) / tool turns: ids and labels are the
    -- template's rendering and mask
    local conv = '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}, '
        .. '{"role": "assistant", "content": null, "tool_calls": [{"name": "get", "arguments": {"city": "Oslo"}}]}, '
        .. '{"role": "tool", "content": "rain"}, {"role": "assistant", "content": "It rains."}]}'
    local rows = parse(conv, { format = "auto", tokenizer = tok, template = "deepseek_v4",
        render_opts = { thinking = false } })
    H.eq(rows.format, "messages", "auto: a messages row")
    H.eq(rows[1].messages[3].content, nil, "null content becomes absent")
    local want = tmpl:render(tok, rows[1].messages, { thinking = false })
    H.same(rows[1].ids, want.ids, "messages: ids are the rendering's")
    H.same(rows[1].labels, labels_of(want), "messages: labels where the mask trains")
    -- plain prompt / completion: prompt bytes (not trained), completion bytes and EOS (trained)
    rows = parse('{"prompt": "ab", "completion": "cd"}\n{"prompt": "x", "completion": " y"}',
        { format = "auto", tokenizer = tok })
    H.eq(rows.format, "prompt_completion", "auto: a prompt/completion row")
    H.same(rows[1].ids, { 97, 98, 99, 100, EOS }, "prompt/completion ids")
    H.same(rows[1].labels, { -100, -100, 99, 100, EOS }, "prompt/completion labels")
    H.same(parse('{"prompt": "a", "completion": "b"}', { format = "auto", tokenizer = tok, eos = 7 })[1].ids,
        { 97, 98, 7 }, "opts.eos ends plain completions")
    -- conversational prompt / completion: only the completion's turns train, not an assistant turn of the prompt
    local pc = '{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, '
        .. '{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}'
    rows = parse(pc, { format = "auto", tokenizer = tok, template = tmpl, render_opts = { thinking = false } })
    local msgs = {
        { role = "user", content = "hi" }, { role = "assistant", content = "hello", train = false },
        { role = "user", content = "2+2?" }, { role = "assistant", content = "4" } }
    want = tmpl:render(tok, msgs, { thinking = false })
    H.same(rows[1].ids, want.ids, "conversational prompt/completion: ids")
    H.same(rows[1].labels, labels_of(want), "conversational prompt/completion: the prompt's assistant turn untrained")
    local trained = {}
    for _, l in ipairs(rows[1].labels) do if l ~= -100 then trained[#trained + 1] = l end end
    H.eq(tok:decode(trained), "4" .. tok:decode({ EOS }), "only the completion and its end of turn train")
    -- RL prompts: a conversation rendered with the generation prompt and the thinking mode chosen
    local rl_rows = parse('{"prompt": [{"role": "user", "content": "1+1?"}], "answer": 2}',
        { tokenizer = tok, template = "deepseek_v4", thinking = true })
    local gen = tmpl:render(tok, { { role = "user", content = "1+1?" } }, { add_generation_prompt = true,
        thinking = true })
    H.same(rl_rows[1].ids, gen.ids, "a conversational RL prompt: rendered ids with the generation prompt")
    H.eq(rl_rows[1].prompt, gen.text, "and its rendered text")
    H.eq(rl_rows[1].answer, "2", "its answer")
    local nothink = parse('{"prompt": [{"role": "user", "content": "1+1?"}], "answer": 2}',
        { tokenizer = tok, template = "deepseek_v4" })
    H.check(#nothink[1].ids ~= #rl_rows[1].ids or nothink[1].prompt ~= rl_rows[1].prompt,
        "thinking mode changes the generation prompt")
    -- verl's layout: the reference answer in reward_model.ground_truth
    local verl = '{"data_source": "gsm8k", "prompt": [{"role": "user", "content": "3*3?"}], "ability": "math", '
        .. '"reward_model": {"style": "rule", "ground_truth": "9"}, "extra_info": {"index": 0}}'
    rows = parse(verl, { tokenizer = tok, template = "deepseek_v4", columns = "verl" })
    H.eq(rows[1].answer, "9", "verl: columns = \"verl\" reads reward_model.ground_truth")
    rows = parse('{"q": "hi", "meta": {"gold": 5}}', { columns = { prompt = "q", answer = "meta.gold" } })
    H.same({ rows[1].prompt, rows[1].answer }, { "hi", "5" }, "a custom column mapping with a dotted path")
    local function bad(line, opts, needles, what) H.raises(function() parse(line, opts) end, needles, what) end
    bad('{"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": null}}',
        { tokenizer = tok, template = "deepseek_v4", columns = "verl" },
        { "d.jsonl:1:", '"reward_model.ground_truth" (answer)', "got null" }, "verl: the mapped field is named")
    bad('{"prompt": [{"role": "user", "content": "x"}], "answer": 1}', { tokenizer = tok },
        { "d.jsonl:1:", '"prompt" is a conversation', "chat template" }, "a conversation without a template")
    bad('{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}', { format = "auto" },
        { "d.jsonl:1:", "must both be strings or both be conversations" }, "mixed prompt/completion")
    bad('{"prompt": "a", "completion": ""}', { format = "auto", tokenizer = tok }, { "d.jsonl:1:",
        '"completion" is empty' }, "an empty completion")
    bad('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "x"}]}', { format = "auto" },
        { "d.jsonl:2:", "a messages row in a prompt_completion file" }, "auto: rows of another shape")
    bad('{"prompt": "a", "answer": 1}', { columns = { answr = "x" } }, { "unknown field 'answr'" }, "column typo")
    bad('{"prompt": "a", "answer": 1}', { columns = { answer = "a..b" } }, { "opts.columns.answer" }, "bad path")
    bad('{"prompt": "a", "answer": 1}', { columns = "trl" }, { "unknown layout 'trl'" }, "unknown layout")
end

-- ------------------------------------------------------------------------------------------------ arith_task
do
    local task = dofile(H.fixtures() .. "/../../examples/arith_task.lua")
    local dir = H.make_temp_dir()
    local function write(name, text)
        local f = assert(io.open(dir .. "/" .. name, "w"))
        f:write(text)
        f:close()
        return dir .. "/" .. name
    end
    local tok = ds4.tokenizer()
    local s = task.read_jsonl(write("ok.jsonl", '{"prompt": "1+1=", "answer": 2}\n'), tok)
    H.same({ s[1].prompt, s[1].text, s[1].answer }, { { 49, 43, 49, 61 }, "1+1=", "2" }, "arith_task.read_jsonl")
    H.raises(function() task.read_jsonl(write("null.jsonl", '{"prompt": "1+1=", "answer": null}\n'), tok) end,
        { "null.jsonl:1:", "got null" }, "arith_task: a null answer is an error, not \"json.null\"")
    H.raises(function() task.read_jsonl(write("obj.jsonl", '{"prompt": "1+1=", "answer": {}}\n'), tok) end,
        { "obj.jsonl:1:", "an object" }, "arith_task: an object answer is an error, not \"table: 0x...\"")
    H.raises(function() task.read_jsonl(write("inf.jsonl", '{"prompt": "1+1=", "answer": 1e999}\n'), tok) end,
        { "inf.jsonl:1:", "not a finite number" }, "arith_task: 1e999 is an error, not \"Infinity\"")
    H.raises(function() task.read_jsonl(write("empty.jsonl", '{"prompt": "", "answer": 2}\n'), tok) end,
        { "empty.jsonl:1:", '"prompt" is empty' }, "arith_task: an empty prompt is refused at load")
    H.raises(function() data.read_jsonl(dir .. "/missing.jsonl") end, { "ds4.data.read_jsonl", "missing.jsonl" },
        "a missing file")
    os.execute("rm -rf " .. H.shell_quote(dir))
end

H.done("test_data")
