--[[ ds4.chat.json — the JSON that chat templates render, byte-compatible with Python's
  json.dumps(value, ensure_ascii=False) (what DeepSeek's official encoder and HF chat templates use):
  separators ", " and ": ", non-ASCII kept as is, only '"', '\' and control characters escaped, floats
  written as Python's repr (shortest round-trip: 0.5, 1.0, 1e-05, 1e+16), NaN/Infinity allowed.

  local json = require("ds4.chat.json")
  json.encode(value)        -> string
  json.decode(text)         -> value, or nil, message (never raises on bad input)
  json.object{k1, v1, k2, v2, ...}   an object whose keys keep this order
  json.array(t)             mark t as a JSON array (so that an empty table encodes as [] rather than {})
  json.keys(t)              the remembered key order of an object from decode/object, or nil
  json.null                 the null sentinel (decode gives it for null; encode writes null)

  Key order. Python dicts keep insertion order and the rendered text depends on it (tool schemas, tool-call
  arguments). Lua tables have no order, so: objects produced by json.decode or json.object remember their
  key order (keys added later come after, sorted); any other table's keys are written sorted. To render a
  schema exactly as its source wrote it, pass the JSON text (templates accept JSON strings) or decode it.

  Numbers. A Lua number that is an integer (|x| < 2^63) is written as an integer ("3"), any other as Python's
  float repr. json.decode keeps Python's distinction: "1.0" and "1e2" are floats (written back as "1.0" and
  "100.0"), integer literals beyond 2^53 keep their digits; such values are returned as small boxed numbers
  (tables with a .text field, and tonumber-able through json.tonumber) so that they render exactly.
]]

local J = {}

local type, pairs, ipairs, tostring, tonumber, error = type, pairs, ipairs, tostring, tonumber, error
local fmt, byte, char, sub, concat = string.format, string.byte, string.char, string.sub, table.concat

J.null = setmetatable({}, { __tostring = function() return "json.null" end })

local key_order = setmetatable({}, { __mode = "k" })   -- object -> {keys in order}
local is_array_t = setmetatable({}, { __mode = "k" })  -- tables marked as arrays
local boxed_mt = { __tostring = function(b) return b.text end }

function J.object(kv)
    local t, keys = {}, {}
    for i = 1, #kv, 2 do
        local k = kv[i]
        if type(k) ~= "string" then error("json.object: keys must be strings", 2) end
        if t[k] == nil then keys[#keys + 1] = k end
        local v = kv[i + 1]
        if v == nil then v = J.null end
        t[k] = v
    end
    key_order[t] = keys
    return t
end

function J.array(t)
    is_array_t[t] = true
    return t
end

function J.keys(t) return key_order[t] end
function J.is_boxed(v) return type(v) == "table" and getmetatable(v) == boxed_mt end
function J.tonumber(v)
    if J.is_boxed(v) then return v.value end
    return tonumber(v)
end

local function boxed(text, value) return setmetatable({ text = text, value = value }, boxed_mt) end

-- ------------------------------------------------------------------------------------------------ encode

-- Python's repr of a float: the shortest decimal that reads back to x, fixed notation for exponents
-- -4 <= e < 16 (with ".0" when integral), otherwise d[.ddd]e+XX.
function J.float_repr(x)
    if x ~= x then return "NaN" end
    if x == math.huge then return "Infinity" end
    if x == -math.huge then return "-Infinity" end
    if x == 0 then return (1 / x < 0) and "-0.0" or "0.0" end
    local s
    for p = 0, 16 do
        s = fmt("%." .. p .. "e", x)
        if tonumber(s) == x then break end
    end
    local sign, m, e = s:match("^(%-?)(%d[%.%d]*)e([-+]%d+)$")
    e = tonumber(e)
    local digits = m:gsub("%.", ""):gsub("0+$", "")
    if digits == "" then digits = "0" end
    local n = #digits
    if e >= -4 and e < 16 then
        if e >= 0 then
            if n <= e + 1 then
                return sign .. digits .. string.rep("0", e + 1 - n) .. ".0"
            end
            return sign .. sub(digits, 1, e + 1) .. "." .. sub(digits, e + 2)
        end
        return sign .. "0." .. string.rep("0", -e - 1) .. digits
    end
    local mant = n > 1 and (sub(digits, 1, 1) .. "." .. sub(digits, 2)) or digits
    return sign .. mant .. "e" .. (e < 0 and "-" or "+") .. fmt("%02d", math.abs(e))
end

local function number_text(x)
    if x == math.floor(x) and x > -2 ^ 63 and x < 2 ^ 63 then
        if x == 0 then return "0" end
        return fmt("%.0f", x)
    end
    return J.float_repr(x)
end

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
    ["\b"] = "\\b", ["\f"] = "\\f" }

local function string_text(s)
    return '"' .. s:gsub('[%c"\\]', function(c)
        local e = escapes[c]
        if e then return e end
        local b = byte(c)
        if b < 32 then return fmt("\\u%04x", b) end
        return c -- DEL (0x7f) is a %c character Python leaves alone
    end) .. '"'
end
J.string = string_text

local function is_sequence(t)
    local n = 0
    for k in pairs(t) do
        if type(k) ~= "number" or k < 1 or k ~= math.floor(k) then return false end
        n = n + 1
    end
    for i = 1, n do
        if t[i] == nil then return false end
    end
    return n > 0, n
end

local function ordered_keys(t)
    local keys, seen = {}, {}
    local order = key_order[t]
    if order then
        for _, k in ipairs(order) do
            if t[k] ~= nil and not seen[k] then
                keys[#keys + 1] = k
                seen[k] = true
            end
        end
    end
    local rest = {}
    for k in pairs(t) do
        if not seen[k] then rest[#rest + 1] = k end
    end
    table.sort(rest, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(rest) do keys[#keys + 1] = k end
    return keys
end

local function encode(v, out, depth)
    local tv = type(v)
    if tv == "string" then
        out[#out + 1] = string_text(v)
    elseif tv == "number" then
        out[#out + 1] = number_text(v)
    elseif tv == "boolean" then
        out[#out + 1] = v and "true" or "false"
    elseif v == nil or v == J.null then
        out[#out + 1] = "null"
    elseif tv == "table" then
        if getmetatable(v) == boxed_mt then
            out[#out + 1] = v.text
            return
        end
        if depth > 200 then error("json.encode: nesting too deep (a cycle?)", 0) end
        local seq, n = is_sequence(v)
        if seq or is_array_t[v] then
            n = n or #v
            out[#out + 1] = "["
            for i = 1, n do
                if i > 1 then out[#out + 1] = ", " end
                encode(v[i], out, depth + 1)
            end
            out[#out + 1] = "]"
        else
            out[#out + 1] = "{"
            for i, k in ipairs(ordered_keys(v)) do
                if i > 1 then out[#out + 1] = ", " end
                local tk = type(k)
                if tk == "number" then
                    k = number_text(k)
                elseif tk == "boolean" then
                    k = tostring(k)
                elseif tk ~= "string" then
                    error("json.encode: object key of type " .. tk, 0)
                end
                out[#out + 1] = string_text(k)
                out[#out + 1] = ": "
                encode(v[k], out, depth + 1)
            end
            out[#out + 1] = "}"
        end
    else
        error("json.encode: cannot encode a " .. tv, 0)
    end
end

function J.encode(v)
    local out = {}
    encode(v, out, 0)
    return concat(out)
end

-- ------------------------------------------------------------------------------------------------ decode

local function utf8_char(cp)
    if cp < 0x80 then return char(cp) end
    if cp < 0x800 then return char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
    if cp < 0x10000 then
        return char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
    end
    return char(0xF0 + math.floor(cp / 262144), 0x80 + math.floor(cp / 4096) % 64,
        0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

local Decoder = {}
Decoder.__index = Decoder

local function fail(d, msg, pos) error({ json_error = ("%s at byte %d"):format(msg, pos or d.pos) }, 0) end

function Decoder:ws()
    self.pos = self.s:find("[^ \t\r\n]", self.pos) or (#self.s + 1)
end

function Decoder:value(depth)
    if depth > 500 then fail(self, "nesting too deep") end
    self:ws()
    local s, p = self.s, self.pos
    local c = sub(s, p, p)
    if c == "{" then
        self.pos = p + 1
        local t, keys = {}, {}
        self:ws()
        if sub(s, self.pos, self.pos) == "}" then
            self.pos = self.pos + 1
            key_order[t] = keys
            return t
        end
        while true do
            self:ws()
            if sub(s, self.pos, self.pos) ~= '"' then fail(self, "object key expected") end
            local k = self:string()
            self:ws()
            if sub(s, self.pos, self.pos) ~= ":" then fail(self, "':' expected") end
            self.pos = self.pos + 1
            local v = self:value(depth + 1)
            if t[k] == nil then keys[#keys + 1] = k end
            t[k] = v
            self:ws()
            c = sub(s, self.pos, self.pos)
            self.pos = self.pos + 1
            if c == "}" then break end
            if c ~= "," then fail(self, "',' or '}' expected", self.pos - 1) end
        end
        key_order[t] = keys
        return t
    elseif c == "[" then
        self.pos = p + 1
        local t = {}
        is_array_t[t] = true
        self:ws()
        if sub(s, self.pos, self.pos) == "]" then
            self.pos = self.pos + 1
            return t
        end
        while true do
            t[#t + 1] = self:value(depth + 1)
            self:ws()
            c = sub(s, self.pos, self.pos)
            self.pos = self.pos + 1
            if c == "]" then break end
            if c ~= "," then fail(self, "',' or ']' expected", self.pos - 1) end
        end
        return t
    elseif c == '"' then
        return self:string()
    elseif s:find("^true", p) then
        self.pos = p + 4
        return true
    elseif s:find("^false", p) then
        self.pos = p + 5
        return false
    elseif s:find("^null", p) then
        self.pos = p + 4
        return J.null
    elseif s:find("^NaN", p) then
        self.pos = p + 3
        return boxed("NaN", 0 / 0)
    elseif s:find("^Infinity", p) then
        self.pos = p + 8
        return boxed("Infinity", math.huge)
    elseif s:find("^%-Infinity", p) then
        self.pos = p + 9
        return boxed("-Infinity", -math.huge)
    end
    local int = s:match("^%-?0", p) or s:match("^%-?[1-9]%d*", p)
    if not int then fail(self, "unexpected " .. (c == "" and "end of input" or ("character %q"):format(c))) end
    local q = p + #int
    local frac = s:match("^%.%d+", q) or ""
    q = q + #frac
    local exp = s:match("^[eE][-+]?%d+", q) or ""
    q = q + #exp
    self.pos = q
    local lit = sub(s, p, q - 1)
    local x = tonumber(lit)
    if x == nil then
        -- LuaJIT's tonumber gives up on exponents of very many digits ("1e11031333333333333333333"): the value is
        -- what Python's float() makes of it, an overflow to infinity or an underflow to zero, with the sign
        local m = tonumber(int .. frac)
        local neg = int:sub(1, 1) == "-"
        x = (m == 0 or exp:find("^[eE]%-")) and (neg and -0.0 or 0.0) or (neg and -math.huge or math.huge)
    end
    if frac == "" and exp == "" then
        if math.abs(x) < 2 ^ 53 then return x end
        local digits = int:gsub("^%-", "")
        return boxed((int:sub(1, 1) == "-" and "-" or "") .. digits, x) -- Python ints keep every digit
    end
    if x == math.floor(x) or x ~= x or x == math.huge or x == -math.huge then
        return boxed(J.float_repr(x), x) -- an integral float stays a float ("1.0")
    end
    return x
end

function Decoder:string()
    local s = self.s
    local p = self.pos + 1
    local parts = {}
    while true do
        local q = s:find('["\\%c]', p)
        if not q then fail(self, "unterminated string") end
        local c = sub(s, q, q)
        if c ~= '"' and c ~= "\\" and byte(c) < 32 then fail(self, "invalid control character in string", q) end
        if c == '"' or c == "\\" then
            parts[#parts + 1] = sub(s, p, q - 1)
            if c == '"' then
                self.pos = q + 1
                return concat(parts)
            end
            local e = sub(s, q + 1, q + 1)
            local simple = ({ ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r",
                t = "\t" })[e]
            if simple then
                parts[#parts + 1] = simple
                p = q + 2
            elseif e == "u" then
                local hex = s:match("^%x%x%x%x", q + 2)
                if not hex then fail(self, "bad \\u escape", q) end
                local cp = tonumber(hex, 16)
                p = q + 6
                if cp >= 0xD800 and cp <= 0xDBFF then
                    local lo = s:match("^\\u(%x%x%x%x)", p)
                    lo = lo and tonumber(lo, 16)
                    if lo and lo >= 0xDC00 and lo <= 0xDFFF then
                        cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
                        p = p + 6
                    end
                end
                parts[#parts + 1] = utf8_char(cp)
            else
                fail(self, "bad escape", q)
            end
        else -- DEL: a %c character that JSON allows raw
            parts[#parts + 1] = sub(s, p, q)
            p = q + 1
        end
    end
end

function J.decode(text)
    if type(text) ~= "string" then return nil, "json.decode: string expected, got " .. type(text) end
    local d = setmetatable({ s = text, pos = 1 }, Decoder)
    local ok, v = pcall(function()
        local v = d:value(0)
        d:ws()
        if d.pos <= #text then fail(d, "extra data") end
        return v
    end)
    if ok then return v end
    if type(v) == "table" and v.json_error then return nil, "json.decode: " .. v.json_error end
    error(v, 0)
end

return J
