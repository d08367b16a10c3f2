-- test_tokenizer.lua — the tokenizer's Lua API against HF tokenizers' ids and decodes (tests/fixtures/tokenizer,
-- made by tests/gen_tokenizer_fixtures.py), its errors, and the built-in byte-level tokenizer.
-- Usage: ds4 run tests/lua/test_tokenizer.lua <fixtures_dir>
--
-- The C test (test_tokenizer.c) checks all 400 fixture strings; here a subset goes through the Lua binding. The
-- fixture lines are read by a small JSON decoder below, independent of the code under test.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()

-- ------------------------------------------------------------------------------------------------ json lines

local function utf8_char(cp)
    if cp < 0x80 then return string.char(cp) end
    if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
    if cp < 0x10000 then
        return string.char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
    end
    return string.char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
        0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

-- Decodes the subset cases.jsonl uses: objects, arrays, strings (all escapes), integers.
local function json_decode(s)
    local pos = 1
    local value
    local function ws() pos = s:find("[^ \t\r\n]", pos) or #s + 1 end
    local function str()
        pos = pos + 1 -- opening quote
        local out = {}
        while true do
            local c = s:sub(pos, pos)
            if c == '"' then
                pos = pos + 1
                return table.concat(out)
            elseif c == "\\" then
                local e = s:sub(pos + 1, pos + 1)
                local simple = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
                if simple[e] then
                    out[#out + 1] = simple[e]
                    pos = pos + 2
                else -- \uXXXX, maybe a surrogate pair
                    local cp = tonumber(s:sub(pos + 2, pos + 5), 16)
                    pos = pos + 6
                    if cp >= 0xD800 and cp < 0xDC00 and s:sub(pos, pos + 1) == "\\u" then
                        local lo = tonumber(s:sub(pos + 2, pos + 5), 16)
                        cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
                        pos = pos + 6
                    end
                    out[#out + 1] = utf8_char(cp)
                end
            else
                local stop = s:find('["\\]', pos)
                out[#out + 1] = s:sub(pos, stop - 1)
                pos = stop
            end
        end
    end
    function value()
        ws()
        local c = s:sub(pos, pos)
        if c == "{" then
            local o = {}
            pos = pos + 1
            ws()
            if s:sub(pos, pos) == "}" then pos = pos + 1 return o end
            while true do
                ws()
                local k = str()
                ws()
                pos = pos + 1 -- ':'
                o[k] = value()
                ws()
                local d = s:sub(pos, pos)
                pos = pos + 1
                if d == "}" then return o end
            end
        elseif c == "[" then
            local a = {}
            pos = pos + 1
            ws()
            if s:sub(pos, pos) == "]" then pos = pos + 1 return a end
            while true do
                a[#a + 1] = value()
                ws()
                local d = s:sub(pos, pos)
                pos = pos + 1
                if d == "]" then return a end
            end
        elseif c == '"' then
            return str()
        else
            local num = s:match("^-?%d+", pos)
            pos = pos + #num
            return tonumber(num)
        end
    end
    return value()
end

local cases = {}
for line in H.read_file(fixtures .. "/tokenizer/cases.jsonl"):gmatch("[^\n]+") do
    cases[#cases + 1] = json_decode(line)
end
H.eq(#cases, 400, "fixture cases")

-- ------------------------------------------------------------------------------------------------ fixtures

local toks = {
    deepseek = ds4.tokenizer(fixtures .. "/tokenizer/deepseek.json"),
    variant = ds4.tokenizer(fixtures .. "/tokenizer/variant.json"),
}
H.check(ds4.is_tokenizer(toks.deepseek) and not ds4.is_tokenizer({}), "is_tokenizer")
H.check(tostring(toks.deepseek):find("ds4.tokenizer", 1, true) ~= nil, "tostring")

local checked = 0
for i, c in ipairs(cases) do
    if i <= 70 or i % 9 == 0 then
        checked = checked + 1
        for name, tok in pairs(toks) do
            H.same(tok:encode(c.text), c[name], ("%s case %d ids"):format(name, i))
            H.eq(tok:decode(c[name]), c[name .. "_decoded"], ("%s case %d decode"):format(name, i))
        end
        H.eq(toks.deepseek:decode(toks.deepseek:encode(c.text)), c.text, ("deepseek case %d round trip"):format(i))
    end
end
H.check(checked >= 60, "enough cases through Lua")

do
    local tok = toks.deepseek
    -- the fixture's added tokens are ids 0..5: BOS, EOS, User, Assistant, <think>, </think>
    H.eq(tok:special("bos"), 0, "special bos")
    H.eq(tok:special("eos"), 1, "special eos")
    H.eq(tok:special("user"), 2, "special user")
    H.eq(tok:special("assistant"), 3, "special assistant")
    H.eq(tok:special("think"), 4, "special think")
    H.eq(tok:special("end_think"), 5, "special end_think")
    H.eq(tok:special("latest_reminder"), nil, "special absent from the fixture")
    H.eq(tok:special("no such name"), nil, "unknown special name")
    H.eq(tok:token_to_id("<｜User｜>"), 2, "token_to_id of an added token")
    H.eq(tok:id_to_token(2), "<｜User｜>", "id_to_token of an added token")
    H.eq(tok:token_to_id("no such token"), nil, "token_to_id of an absent token")
    H.eq(tok:id_to_token(-1), nil, "id_to_token(-1)")
    H.eq(tok:id_to_token(tok:vocab_size()), nil, "id_to_token past the end")
    H.check(tok:is_special(0) and not tok:is_special(tok:encode("a")[1]), "is_special")
    -- " " is the byte-level "Ġ" (U+0120) in the vocabulary
    local sp = tok:encode(" ")
    H.eq(#sp, 1, "one id for a space")
    H.eq(tok:id_to_token(sp[1]), "\196\160", "a space is Ġ in the vocabulary")
    H.eq(tok:token_to_id("\196\160"), sp[1], "token_to_id of Ġ")

    local plain = tok:encode("hello world")
    local with_bos = tok:encode("hello world", { bos = true })
    H.eq(with_bos[1], 0, "bos = true puts BOS first")
    H.eq(#with_bos, #plain + 1, "bos adds exactly one id")
    H.same(tok:encode("hello world", { bos = false }), plain, "bos = false")
    H.same(tok:encode(""), {}, "empty text")
    H.same(tok:encode("", { bos = true }), { 0 }, "empty text with BOS")

    local ids = tok:encode("<｜User｜>hi<｜Assistant｜><think>")
    H.eq(tok:decode(ids, { skip_special = true }), "hi", "skip_special")
    H.eq(tok:decode(ids), "<｜User｜>hi<｜Assistant｜><think>", "specials decode to their text")
    -- an integer tensor of ids decodes like the table
    H.eq(tok:decode(ds4.tensor(plain, "I64")), "hello world", "decode a tensor")
    H.eq(tok:decode(ds4.tensor({ plain }, "I32")), "hello world", "decode a 2-d tensor")
    -- invalid UTF-8 goes through by bytes
    local bad = "abc\255\254 \237\160\128 \192\175 end"
    H.eq(tok:decode(tok:encode(bad)), bad, "invalid UTF-8 round trip")
end

-- ------------------------------------------------------------------------------------------------ errors

do
    local tok = toks.deepseek
    H.raises(function() ds4.tokenizer("/nonexistent/tokenizer.json") end,
        { "ds4.tokenizer: ", "/nonexistent/tokenizer.json" }, "missing file")
    H.raises(function() ds4.tokenizer(5) end, { "ds4.tokenizer: bad argument #1" }, "non-string path")
    H.raises(function() tok:encode(5) end, { "tokenizer:encode: bad argument #1 (string expected" }, "encode a number")
    H.raises(function() tok:encode("x", 5) end, { "tokenizer:encode: bad argument #2 (options table expected, got number)" }, "encode options")
    H.raises(function() tok:encode("x", { bos = 1 }) end, { "tokenizer:encode: opts.bos must be a boolean, got 1" }, "bos not a boolean")
    H.raises(function() tok:decode({ 1, "x" }) end, { "tokenizer:decode: ids[2]" }, "decode a string id")
    H.raises(function() tok:decode({ 1, 2.5 }) end, { "tokenizer:decode: ids[2]" }, "decode a fractional id")
    H.raises(function() tok:decode({ 999999 }) end, { "ids[1] = 999999 is not a token id" }, "decode an unknown id")
    H.raises(function() tok:decode({ -1 }) end, { "ids[1] = -1 is not a token id" }, "decode a negative id")
    H.raises(function() tok:decode("abc") end, { "tokenizer:decode: bad argument #1" }, "decode a string")
    H.raises(function() tok.encode({}, "x") end, { "tokenizer:encode: self must be a ds4.tokenizer" }, "bad self")
    H.raises(function() tok:id_to_token("x") end, { "tokenizer:id_to_token: id must be an integer" }, "id_to_token")

    local dir = os.tmpname()
    local function write(text)
        local f = assert(io.open(dir, "wb"))
        f:write(text)
        f:close()
        return dir
    end
    H.raises(function() ds4.tokenizer(write("{")) end, { "ds4.tokenizer: ", dir, "tokenizer: json" }, "malformed JSON")
    H.raises(function() ds4.tokenizer(write('{"pre_tokenizer":{"type":"Metaspace"}}')) end,
        { "pre_tokenizer.type \"Metaspace\" is not supported" }, "unsupported pre-tokenizer")
    H.raises(function()
        ds4.tokenizer(write('{"pre_tokenizer":{"type":"ByteLevel"},"model":{"vocab":{"a":0},"merges":["a b"]}}'))
    end, { "model.merges[0]: token \"b\" is not in model.vocab" }, "bad merge")
    -- a tokenizer without the BOS token: bos = true is an error
    local nobos = ds4.tokenizer(write('{"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false},'
        .. '"model":{"vocab":{"a":0,"b":1}}}'))
    H.same(nobos:encode("ab"), { 0, 1 }, "a two-token tokenizer")
    H.raises(function() nobos:encode("a", { bos = true }) end, { "tokenizer:encode: ", "BOS requested" },
        "bos without a BOS token")
    os.remove(dir)
end

-- ------------------------------------------------------------------------------------------------ built-in

do
    local bl = ds4.tokenizer()
    H.eq(bl:vocab_size(), 256 + 24, "built-in vocab size")
    local all, want = {}, {}
    for b = 0, 255 do
        all[#all + 1] = string.char(b)
        want[#want + 1] = b
    end
    all = table.concat(all)
    H.same(bl:encode(all), want, "every byte is its own id")
    H.eq(bl:decode(bl:encode(all)), all, "every byte round-trips")
    local names = ds4.special_tokens()
    H.eq(names.bos, "<｜begin▁of▁sentence｜>", "special_tokens().bos")
    H.eq(bl:special("bos"), 256, "built-in bos")
    H.eq(bl:special("eos"), 257, "built-in eos")
    H.eq(bl:special("user"), 258, "built-in user")
    H.eq(bl:special("assistant"), 259, "built-in assistant")
    H.eq(bl:special("think"), 260, "built-in think")
    H.eq(bl:special("end_think"), 261, "built-in end_think")
    for name, text in pairs(names) do
        local id = bl:special(name)
        H.check(id ~= nil and id >= 256, "built-in has " .. name)
        H.same(bl:encode("a" .. text .. "b"), { 97, id, 98 }, "special " .. name .. " is one id")
        H.check(bl:is_special(id), name .. " is special")
    end
    H.same(bl:encode("x", { bos = true }), { 256, 120 }, "built-in with BOS")
    -- random byte strings round-trip
    local seed = 12345
    local function rnd(n)
        seed = (seed * 1103515245 + 12345) % 2147483648
        return seed % n
    end
    for _ = 1, 50 do
        local t = {}
        for i = 1, rnd(200) do t[i] = string.char(rnd(256)) end
        local s = table.concat(t)
        H.eq(bl:decode(bl:encode(s)), s, "built-in random bytes round trip")
    end
end

H.done("test_tokenizer.lua")
