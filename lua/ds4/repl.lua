--[[ ds4.repl — the globals and helpers of `ds4 repl` (lua/repl.c runs the prompt and calls M.setup once).

  ds4 repl [--model DIR] [--tokenizer FILE] [--threads N] [--device D] [--dtype T]

Globals:
  ds4                    the module (require("ds4"))
  model                  ds4.load(DIR) with --model DIR; otherwise a small random demo model (ds4.new_model, vocabulary
                         covering the built-in byte-level tokenizer and its chat specials): its outputs are noise
  tok                    --tokenizer FILE, else the model's (DIR/tokenizer.json), else the built-in byte-level one
  chat(text [, opts])    one user turn: the conversation so far is rendered with the chat template (deepseek_v4 for the
                         byte-level and DeepSeek tokenizers, chatml for a tokenizer with <|im_start|>; a saved model's
                         tokenizer_config.json names its own), the reply is
                         streamed to stdout as it is generated and stops at the template's end-of-turn token; both turns
                         join the history. opts: thinking (false), system (system message of a new conversation),
                         template, max_new_tokens (512), temperature (0.7), top_p (0.95), top_k, min_p, seed (default:
                         the turn number). Prints [N tokens, finish ..., tokens/s] after the reply, however
                         it ended, and returns the reply text and the result table, as generate does
                         (reply = chat("...") keeps it; chat_history() has it too).
  chat_reset()           forget the conversation;  chat_history() -> its messages
  generate{prompt = text or ids, max_new_tokens = 64, ...}
                         stream a continuation to stdout, then a line [N tokens, finish ..., tokens/s]. Any other key
                         goes to model:generate (temperature, top_k, top_p, min_p, seed, stop = {ids or strings},
                         ignore_eos, n, ...); on_token = function(i, id, logprob) runs after the token is printed
                         (return false to stop); stream = false prints nothing. A string prompt is encoded with tok.
                         -> text, r  (r: model:generate's result for the first sequence, plus r.text and r.stats; with
                         n > 1: a list of texts and the whole result)
  logprobs{text = s [, prompt = p]}   log p(token | what precedes it) of every token of text (after prompt), from
                         model:forward's logits; printed as a table token | logprob. -> {ids, tokens, logprobs, sum,
                         mean}. Without prompt the text starts after BOS when the model has one, else its first token is
                         not scored.
  top(text [, k])        the k (default 10) most probable next tokens after text, with probabilities, printed.
                         -> {{id = ..., token = ..., p = ...}, ...}
  help()                 this list

Streamed text shows control characters other than newline and tab as \xNN (a random model emits any byte).
Ctrl-C while a generation runs stops it (finish "cancelled"); what was printed stays.
]]

local ds4 = require("ds4")
local ffi = require("ffi")

local type, pairs, ipairs, tostring, error, pcall = type, pairs, ipairs, tostring, error, pcall
local exp, log, max, floor = math.exp, math.log, math.max, math.floor

local M = {}

-- The session: the conversation of chat(), and what setup found.
local S = { messages = {}, turns = 0, random = false }

-- ------------------------------------------------------------------------------------------------ helpers

local vocab_cache = setmetatable({}, { __mode = "k" })

local function current()
    local m, t = _G.model, _G.tok
    if not ds4.is_model(m) then error("no model: set the global `model` (e.g. model = ds4.load(dir))", 3) end
    if not ds4.is_tokenizer(t) then error("no tokenizer: set the global `tok` (e.g. tok = ds4.tokenizer())", 3) end
    local V = vocab_cache[m]
    if not V then
        V = m:config().vocab_size
        vocab_cache[m] = V
    end
    return m, t, V
end

-- The bytes of one token, or nil when the tokenizer does not know the id.
local function token_bytes(t, id)
    local ok, s = pcall(t.decode, t, { id })
    if ok then return s end
    return nil
end

-- Control characters (other than newline and tab) as \xNN: safe to write to a terminal.
local function sanitize(s)
    return (s:gsub("[%z\1-\8\11-\31\127]", function(c) return ("\\x%02x"):format(c:byte()) end))
end

local function valid_utf8(s)
    local i, n = 1, #s
    while i <= n do
        local c = s:byte(i)
        local more = c < 0x80 and 0 or (c >= 0xC2 and c < 0xE0) and 1 or (c >= 0xE0 and c < 0xF0) and 2
            or (c >= 0xF0 and c < 0xF5) and 3 or -1
        if more < 0 or i + more > n then return false end
        for j = i + 1, i + more do
            local d = s:byte(j)
            if d < 0x80 or d > 0xBF then return false end
        end
        i = i + more + 1
    end
    return true
end

-- A token for a table cell: quoted, every control character escaped, and every byte of a token that is not
-- UTF-8 text on its own (a piece of a multi-byte character) as \xNN.
local function show_token(t, id)
    local s = token_bytes(t, id)
    if not s then return ("<id %d>"):format(id) end
    local class = valid_utf8(s) and '[%z\1-\31\127"\\]' or '[%z\1-\31\127-\255"\\]'
    s = s:gsub(class, function(c)
        if c == "\n" then return "\\n" elseif c == "\t" then return "\\t" elseif c == "\r" then return "\\r"
        elseif c == '"' or c == "\\" then return "\\" .. c end
        return ("\\x%02x"):format(c:byte())
    end)
    return '"' .. s .. '"'
end

-- Width in characters (UTF-8 code points), for lining up table columns.
local function width(s)
    local _, cont = s:gsub("[\128-\191]", "")
    return #s - cont
end

local function pad(s, w)
    return s .. (" "):rep(w - width(s))
end

local function ids_of(t, x, what)
    if type(x) == "string" then return t:encode(x) end
    if ds4.is_tensor(x) then x = x:totable() end
    if type(x) ~= "table" then error(what .. " must be a string or an array of token ids, got " .. type(x), 3) end
    local ids = {}
    for i, v in ipairs(x) do ids[i] = v end
    return ids
end

-- BOS as context for scoring, when both the tokenizer and the model have it.
local function bos_of(t, V)
    local b = t:special("bos")
    if b and b < V then return b end
    return nil
end

local function check_ids(ids, V, what)
    for i, id in ipairs(ids) do
        if id >= V then
            error(("%s: token %d (id %d) is outside the model's vocabulary (%d ids); the tokenizer does not fit "
                .. "this model"):format(what, i, id, V), 3)
        end
    end
end

local function write(s)
    io.stdout:write(s)
    io.stdout:flush()
end

-- Log-softmax of row `row` (0-based) of F32 logits [.., V] at ffi pointer p: returns a function id -> logprob and
-- the row's logsumexp.
local function row_logsumexp(p, row, V)
    local off = row * V
    local m = -math.huge
    for j = 0, V - 1 do
        local v = p[off + j]
        if v > m then m = v end
    end
    local s = 0
    for j = 0, V - 1 do s = s + exp(p[off + j] - m) end
    return m + log(s)
end

local function logits_ptr(out)
    local lg = out.logits
    return ffi.cast("const float *", lg:data_ptr()), lg
end

-- ------------------------------------------------------------------------------------------------ generate

local OWN = { prompt = true, stream = true, on_token = true }

-- The ids at which a generation ends: the config's eos (unless ignore_eos) and the numeric stops.
local function ending_ids(m, g)
    local e = {}
    if not g.ignore_eos then
        local eos = m:config().eos_token_id
        if type(eos) == "number" then e[eos] = true
        elseif type(eos) == "table" then for _, v in ipairs(eos) do e[v] = true end end
    end
    if type(g.stop) == "table" then
        for _, v in ipairs(g.stop) do if type(v) == "number" then e[v] = true end end
    end
    return e
end

-- Run model:generate on one prompt, printing the first sequence's tokens as they come (but not the token that
-- ends it). Returns the result table.
local function run(m, t, ids, g, stream, user_cb)
    local ending = ending_ids(m, g)
    if stream or user_cb then
        g.on_token = function(i, id, lp)
            if stream and i == 1 and not ending[id] then
                local s = token_bytes(t, id)
                write(s and sanitize(s) or ("<id %d>"):format(id))
            end
            if user_cb then return user_cb(i, id, lp) end
        end
    end
    return m:generate({ ids }, g)
end

-- The text of generated ids, without a final token that ended the generation.
local function text_of(t, r)
    local ids = r.ids
    local n = #ids
    if n > 0 and (r.finish_reason == "eos" or r.finish_reason == "stop_token") then n = n - 1 end
    local parts = {}
    for i = 1, n do parts[i] = token_bytes(t, ids[i]) or "" end
    return table.concat(parts)
end

local function summary(r, stats)
    local tps = stats and stats.decode_tokens_per_s or 0
    return ("[%d tokens, finish %s%s, %.1f tokens/s]"):format(#r.ids, r.finish_reason,
        r.finish_reason == "cancelled" and " (Ctrl-C)" or "", tps)
end

function M.generate(opts)
    if type(opts) == "string" then opts = { prompt = opts } end
    if type(opts) ~= "table" then
        error("generate: bad argument #1 (table {prompt = text or ids, ...} expected, got " .. type(opts) .. ")", 2)
    end
    local m, t, V = current()
    if opts.prompt == nil then error("generate: prompt missing (a string or an array of token ids)", 2) end
    local ids = ids_of(t, opts.prompt, "generate: prompt")
    if #ids == 0 then error("generate: the prompt is empty", 2) end
    check_ids(ids, V, "generate: prompt")
    if opts.on_token ~= nil and type(opts.on_token) ~= "function" then
        error("generate: on_token must be a function(i, id, logprob), got " .. type(opts.on_token), 2)
    end
    local g = {}
    for k, v in pairs(opts) do if not OWN[k] then g[k] = v end end
    if g.max_new_tokens == nil then g.max_new_tokens = 64 end
    if type(g.stop) == "table" and g.tokenizer == nil then
        for _, v in ipairs(g.stop) do if type(v) == "string" then g.tokenizer = t break end end
    end
    local stream = opts.stream ~= false
    local res = run(m, t, ids, g, stream, opts.on_token)
    local r = res[1]
    r.stats = res.stats
    r.text = text_of(t, r)
    if stream then write("\n" .. summary(r, res.stats) .. "\n") end
    if #res > 1 then
        local texts = {}
        for i, ri in ipairs(res) do texts[i] = text_of(t, ri) end
        return texts, res
    end
    return r.text, r
end

-- ------------------------------------------------------------------------------------------------ chat

local function default_template(t)
    return require("ds4.pretrained").template_for(t) or "deepseek_v4"
end

local CHAT_OWN = { thinking = true, system = true, template = true }

function M.chat(text, opts)
    if type(text) ~= "string" then error("chat: bad argument #1 (string expected, got " .. type(text) .. ")", 2) end
    if opts ~= nil and type(opts) ~= "table" then error("chat: opts must be a table, got " .. type(opts), 2) end
    opts = opts or {}
    local m, t, V = current()
    local name = opts.template or S.template or S.model_template or default_template(t)
    local tmpl = ds4.chat.get(name)
    local thinking = opts.thinking == true
    local msgs = {}
    if opts.system and #S.messages == 0 then msgs[1] = { role = "system", content = opts.system } end
    for _, msg in ipairs(S.messages) do msgs[#msgs + 1] = msg end
    local user = { role = "user", content = text }
    msgs[#msgs + 1] = user
    local r = tmpl:render(t, msgs, { add_generation_prompt = true, thinking = thinking })
    for _, id in ipairs(r.ids) do
        if id >= V then
            error(("chat: the %s template gives token %d, outside this model's vocabulary (%d ids): the chat special "
                .. "tokens do not fit this model; use generate{prompt = ...}"):format(name, id, V), 2)
        end
    end
    S.turns = S.turns + 1
    local g = { max_new_tokens = 512, temperature = 0.7, top_p = 0.95, seed = S.turns }
    for k, v in pairs(opts) do if not CHAT_OWN[k] then g[k] = v end end
    local stop = ds4.chat.end_of_turn(t, name)
    if type(g.stop) == "table" then for _, v in ipairs(g.stop) do stop[#stop + 1] = v end end
    g.stop = stop
    for _, v in ipairs(stop) do if type(v) == "string" then g.tokenizer = t break end end
    local res = run(m, t, r.ids, g, true, nil)
    local out = res[1]
    local reply = text_of(t, out)
    write("\n" .. summary(out, res.stats) .. "\n") -- whatever ended the turn: EOS, a stop token, the length
    -- both turns join the history (a cut-short reply too: it is what was shown)
    if opts.system and #S.messages == 0 then S.messages[1] = msgs[1] end
    S.messages[#S.messages + 1] = user
    local a = { role = "assistant", content = reply }
    if thinking then
        local i, j = reply:find("</think>", 1, true)
        if i then
            a.reasoning_content, a.content = reply:sub(1, i - 1), reply:sub(j + 1)
        else
            a.reasoning_content, a.content = reply, ""
        end
    end
    S.messages[#S.messages + 1] = a
    S.template = name
    out.stats = res.stats
    return reply, out
end

function M.chat_reset()
    S.messages = {}
    S.template = nil
    S.turns = 0
end

function M.chat_history()
    return S.messages
end

-- ------------------------------------------------------------------------------------------------ scoring

function M.logprobs(opts)
    if type(opts) == "string" then opts = { text = opts } end
    if type(opts) ~= "table" or type(opts.text) ~= "string" then
        error("logprobs: bad argument #1 ({text = string [, prompt = string]} expected)", 2)
    end
    if opts.prompt ~= nil and type(opts.prompt) ~= "string" then
        error("logprobs: prompt must be a string, got " .. type(opts.prompt), 2)
    end
    local m, t, V = current()
    local ctx = {}
    local bos = bos_of(t, V)
    if bos then ctx[1] = bos end
    if opts.prompt then for _, id in ipairs(t:encode(opts.prompt)) do ctx[#ctx + 1] = id end end
    local tids = t:encode(opts.text)
    if #tids == 0 then error("logprobs: the text is empty", 2) end
    local ids = {}
    for _, id in ipairs(ctx) do ids[#ids + 1] = id end
    for _, id in ipairs(tids) do ids[#ids + 1] = id end
    check_ids(ids, V, "logprobs")
    local out = m:forward({ ids })
    local p, lg = logits_ptr(out)
    local res = { ids = {}, tokens = {}, logprobs = {}, sum = 0 }
    local first = #ctx + 1 -- position of the first text token
    local rows = {}
    for pos = math.max(first, 2), #ids do
        local row = pos - 2 -- 0-based row of the logits that predict position pos
        local lp = p[row * V + ids[pos]] - row_logsumexp(p, row, V)
        local k = #res.ids + 1
        res.ids[k], res.tokens[k], res.logprobs[k] = ids[pos], token_bytes(t, ids[pos]), lp
        res.sum = res.sum + lp
        rows[k] = { show_token(t, ids[pos]), ("%.4f"):format(lp) }
    end
    local _ = lg -- the tensor lives while p is read
    res.mean = #res.logprobs > 0 and res.sum / #res.logprobs or 0 / 0
    local w = 5
    for _, row in ipairs(rows) do w = max(w, width(row[1])) end
    local lines = { ("  %s | logprob"):format(pad("token", w)) }
    if first < 2 then
        lines[#lines + 1] = ("  %s | (no context)"):format(pad(show_token(t, ids[1]), w))
    end
    for _, row in ipairs(rows) do lines[#lines + 1] = ("  %s | %s"):format(pad(row[1], w), row[2]) end
    lines[#lines + 1] = ("  sum %.4f, mean %.4f over %d tokens"):format(res.sum, res.mean, #res.logprobs)
    write(table.concat(lines, "\n") .. "\n")
    return res
end

function M.top(text, k)
    if type(text) ~= "string" then error("top: bad argument #1 (string expected, got " .. type(text) .. ")", 2) end
    k = k == nil and 10 or k
    if type(k) ~= "number" or k < 1 or k ~= floor(k) then
        error("top: bad argument #2 (positive integer expected, got " .. tostring(k) .. ")", 2)
    end
    local m, t, V = current()
    local ids = {}
    local bos = bos_of(t, V)
    if bos then ids[1] = bos end
    for _, id in ipairs(t:encode(text)) do ids[#ids + 1] = id end
    if #ids == 0 then error("top: the text is empty and the model has no BOS token to start from", 2) end
    check_ids(ids, V, "top")
    k = math.min(k, V)
    -- the logits of the last position: model:step on a fresh cache returns only that row ([1, V]; the same values
    -- as the last row of model:forward's [1, S, V], without holding S x V floats)
    local out, row
    if m.step then
        local c = m:new_cache(#ids)
        out = m:step(c, ids)
        c:free()
        row = 0
    else
        out = m:forward({ ids })
        row = #ids - 1
    end
    local p, lg = logits_ptr(out)
    local lse = row_logsumexp(p, row, V)
    -- the k largest logits, by insertion into a sorted list (ties: the lower id first)
    local best = {}
    local off = row * V
    for j = 0, V - 1 do
        local v = p[off + j]
        local n = #best
        if n < k or v > best[n][2] then
            local i = n < k and n + 1 or n
            while i > 1 and best[i - 1][2] < v do
                best[i] = best[i - 1]
                i = i - 1
            end
            best[i] = { j, v }
        end
    end
    local _ = lg
    local res, rows, w = {}, {}, 5
    for i, b in ipairs(best) do
        local pr = exp(b[2] - lse)
        res[i] = { id = b[1], token = token_bytes(t, b[1]), p = pr }
        rows[i] = { show_token(t, b[1]), b[1], pr }
        w = max(w, width(rows[i][1]))
    end
    local lines = { ("  %s | %6s | p"):format(pad("token", w), "id") }
    for _, r in ipairs(rows) do lines[#lines + 1] = ("  %s | %6d | %.4f"):format(pad(r[1], w), r[2], r[3]) end
    write(table.concat(lines, "\n") .. "\n")
    return res
end

-- ------------------------------------------------------------------------------------------------ help

local HELP = [[
globals: ds4 (the module), model, tok (the tokenizer)
  chat("text" [, {thinking, system, max_new_tokens, temperature, top_p, top_k, seed}])  one chat turn, streamed
                                                                                        -> reply, result
  chat_reset()  chat_history()                  forget / show the conversation
  generate{prompt = "text" or ids, max_new_tokens = 64, temperature = 1, seed = 0, ...}  -> text, result
  logprobs{text = "...", prompt = "..."}          per-token log-probabilities            -> {ids, logprobs, ...}
  top("text", k)                                 the k most probable next tokens         -> {{id, token, p}, ...}
  help()                                         this list
Lines: "=expr" prints expr; an expression prints its values; unfinished chunks continue at ">>".
Tab completes names: globals, tables' fields (ds4.ch<Tab>), methods (model:<Tab>); at a line's start it indents.
Ctrl-C stops running code or a generation; Ctrl-D (at an empty prompt) exits.]]

function M.help()
    write(HELP .. "\n")
end

-- ------------------------------------------------------------------------------------------------ completion

local KEYWORDS = { "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if", "in",
    "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while" }

-- The fields a value offers without running code: a table's own keys, then (for tables and userdata) those of its
-- metatable's __index tables (methods), and the names a module loads on first use (a metatable's __lazy table, as
-- ds4's). An __index function is never called.
local function fields(v, add)
    for _ = 1, 8 do
        if type(v) == "table" then
            for k in pairs(v) do add(k) end
        end
        local mt = (type(v) == "table" or type(v) == "userdata") and getmetatable(v)
        if type(mt) ~= "table" then return end
        if type(rawget(mt, "__lazy")) == "table" then
            for k in pairs(rawget(mt, "__lazy")) do add(k) end
        end
        v = rawget(mt, "__index")
        if type(v) ~= "table" then return end
    end
end

-- The value of a.b.c from the globals, by raw lookups and __index tables only (nil when any step is missing); a
-- module named in a __lazy table is required (ds4.chat.<Tab> lists ds4.chat's functions before its first use).
local function lookup(path)
    local v = _G
    for name in path:gmatch("[^.]+") do
        local nxt
        local t = v
        for _ = 1, 8 do
            if type(t) == "table" then nxt = rawget(t, name) end
            if nxt ~= nil then break end
            local mt = (type(t) == "table" or type(t) == "userdata") and getmetatable(t)
            local lazy = type(mt) == "table" and rawget(mt, "__lazy")
            if type(lazy) == "table" and type(lazy[name]) == "string" then
                local ok, mod = pcall(require, lazy[name])
                nxt = ok and mod or nil
                break
            end
            t = type(mt) == "table" and rawget(mt, "__index") or nil
            if type(t) ~= "table" then break end
        end
        if nxt == nil then return nil end
        v = nxt
    end
    return v
end

-- Tab completion (lua/repl.c asks): the completions of `word`, the name before the cursor: a global or keyword,
-- a.b.<field> or obj:<method> (a function-valued field). Full words, sorted; {} when there is nothing to offer.
function M.complete(word)
    if type(word) ~= "string" then return {} end
    local out, seen = {}, {}
    local prefix, sep, part = word:match("^([%a_][%w_.]*)([.:])([%w_]*)$")
    if prefix and not prefix:find("%.%.") and prefix:sub(-1) ~= "." then
        local v = lookup(prefix)
        if v == nil then return out end
        fields(v, function(k)
            if type(k) == "string" and k:match("^[%a_][%w_]*$") and k:sub(1, #part) == part and not seen[k] then
                local f = sep == "." or type(lookup(prefix .. "." .. k)) == "function"
                if f then
                    seen[k] = true
                    out[#out + 1] = prefix .. sep .. k
                end
            end
        end)
    elseif word:match("^[%a_]?[%w_]*$") then
        local function add(k)
            if type(k) == "string" and k:match("^[%a_][%w_]*$") and k:sub(1, #word) == word and not seen[k] then
                seen[k] = true
                out[#out + 1] = k
            end
        end
        fields(_G, add)
        for _, k in ipairs(KEYWORDS) do add(k) end
    end
    table.sort(out)
    return out
end

-- ------------------------------------------------------------------------------------------------ setup

-- A small random model whose vocabulary covers the tokenizer (the byte-level one: bytes and chat specials).
local function demo_model(t)
    local V = t:vocab_size()
    return ds4.new_model({
        vocab_size = V, hidden_size = 64, num_hidden_layers = 2,
        num_attention_heads = 4, head_dim = 32, qk_rope_head_dim = 16, q_lora_rank = 32,
        o_groups = 2, o_lora_rank = 32, sliding_window = 16,
        layer_types = { "sliding_attention", "compressed_sparse_attention" },
        compress_rates = { compressed_sparse_attention = 4, heavily_compressed_attention = 8 },
        mlp_layer_types = { "hash_moe", "moe" },
        index_n_heads = 4, index_head_dim = 32, index_topk = 4,
        n_routed_experts = 4, num_experts_per_tok = 2, moe_intermediate_size = 64,
        hc_mult = 2, num_nextn_predict_layers = 0, initializer_range = 0.05,
        bos_token_id = t:special("bos"), eos_token_id = t:special("eos"),
    }, 1234)
end

-- opts: model (dir), tokenizer (path), threads, interactive. Sets the globals and prints the banner (stdout when
-- interactive, else stderr, so that piped output holds only what the input printed).
function M.setup(opts)
    opts = opts or {}
    if opts.threads then ds4.set_threads(opts.threads) end
    local tok_path = opts.tokenizer
    local m, model_desc, t, tok_desc
    if opts.model then
        m = ds4.load(opts.model) -- attaches DIR/tokenizer.json and the chat template of tokenizer_config.json
        model_desc = opts.model
        local attached, template = m:tokenizer()
        if attached and not tok_path then
            t, tok_desc, S.model_template = attached, opts.model .. "/tokenizer.json", template
        end
    end
    if not t then
        t = ds4.tokenizer(tok_path)
        tok_desc = tok_path or ("built-in byte-level" .. (opts.model and " (the checkpoint has no tokenizer.json)" or ""))
    end
    if not m then
        m = demo_model(t)
        model_desc = "random demo model"
        S.random = true
    end
    if not m:tokenizer() then m:set_tokenizer(t) end -- so that model:save writes the tokenizer in use
    local cfg = m:config()
    _G.ds4, _G.model, _G.tok = ds4, m, t
    for _, name in ipairs({ "chat", "chat_reset", "chat_history", "generate", "logprobs", "top", "help" }) do
        _G[name] = M[name]
    end
    local dev, dt = m:device()
    local banner = ("ds4 %s repl: model %s (%d layers, hidden %d, vocab %d, %.2fM parameters, on %s), tokenizer %s "
        .. "(vocab %d).%s help() lists the helpers, Ctrl-D exits."):format(ds4.version, model_desc,
        cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, m:n_params() / 1e6,
        dev == "cpu" and "the CPU" or (dev .. " " .. dt),
        tok_desc, t:vocab_size(),
        S.random and " Its weights are random: its outputs are noise." or "")
    local f = opts.interactive and io.stdout or io.stderr
    f:write(banner, "\n")
    f:flush()
end

return M
