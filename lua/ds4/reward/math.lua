--[[ ds4.reward.math — answer extraction, normalisation and equality for math rewards (pure Lua, no C).

  local rm = require("ds4.reward.math")       -- also re-exported by require("ds4.reward")
  rm.extract_boxed(text)                      -- content of the LAST \boxed{...} / \boxed {...} / \fbox{...}, or nil
  rm.extract_last_number(text)                -- the last number, as written ("-1,234.5", "3/4"), or nil
  rm.extract_answer(text [, opts])            -- opts.mode = "boxed" | "last_number" | "boxed_or_last_number"
                                              -- (default); opts.after_think = true: only the text after the
                                              -- last "</think>" (nil when there is none) -> answer, how
  rm.normalize(s)                             -- canonical string, is_number (nil for a non-string/number)
  rm.math_equal(pred, ref)                    -- normalize both; equal canonical forms (never equal when empty)

Extraction
  extract_boxed   the box whose command starts LAST in the text ("\boxed{\boxed{5}}" -> "5"). Braces are
                  counted; a backslash escapes the next character, so \{ \} (and the second brace of \\})
                  do not count. When that last box is never closed (a truncated response) -> nil, NOT an
                  earlier box. "\boxed 5" (no braces) is not a box. The content is returned trimmed.
  extract_last_number   [sign] digits [, ddd groups] [.digits] | [sign] .digits | [sign] digits/digits.
                  Thousands groups only when correctly grouped (1-3 digits, then groups of exactly 3): in
                  "1,234,567" one number; in "1,2" two ("2" is last); in "1,2345" -> "2345". A '-' / '+'
                  is a sign unless it directly follows a letter, digit or closing bracket ("10-7" -> "7",
                  "x=-3" -> "-3", "is -3" -> "-3", "5 - 3" -> "-3": a spaced binary minus reads as a sign).
                  A trailing "." is not part of the number ("is 5." -> "5"). U+2212 (−) counts as '-'.
                  No exponents: "1e5" -> "5".

Normalisation and equality TABLE (what normalize() maps to the same canonical form; rules in order):
  wrappers        $5$, $$5$$, \(5\), \[5\], \$5 (currency), \boxed{5}, \fbox{5}, {5}        = 5
                  surrounding spaces; U+2212 minus; no-break space                            stripped / -
  spacing         \! \, \; \: "\ " \quad \qquad ~ : removed between digits ("1\,000" = 1000), a space
                  elsewhere; \left \right \big.. \displaystyle removed                         "\left(1\right)" = "(1)"
  "{,}"           "1{,}000" = "1,000" (= 1000)
  degrees         5^\circ, 5^{\circ}, 5° = 5
  percent         "\%" and "%" are dropped: 50\% = 50% = 50. They are NOT rescaled: 50% ≠ 0.5.
  fractions       \dfrac \tfrac \cfrac -> \frac; shorthand \frac12 = \frac1{2} = \frac{1}2 = \frac{1}{2};
                  \sqrt2 = \sqrt{2} (also inside non-numeric answers)
  text commands   \text{..} \textbf \textit \textrm \textnormal \mathrm \mathbf \mathit \mbox ..: unwrapped
                  ("\text{Yes}" = "yes"); when such a command ENDS the answer, holds only unit-like words
                  (letters, spaces, . / ^ digits) and follows a value (something with a digit, a command
                  or a closing bracket), it is a unit and dropped with any exponent after it:
                  "5\text{ cm}" = "5\mathrm{cm}^2" = "\sqrt{2}\text{ m}" minus the unit.
  unit words      plain trailing words after a NUMBER, separated by whitespace, each >= 2 letters (with an
                  optional ^2 / ^{3}, "/" between words), not a math word (pi, sqrt, e, i, log, ...):
                  "5 cm" = "$5$ dollars" = "5 square feet" = 5. "5cm" and "5 m" keep their text (≠ 5):
                  single-letter units need \text{m}.
  trailing "."    removed ("5." = 5, "Yes." = yes)
  equations       exactly one "=" whose left side is a short name (x, y_1, \theta, a_{n}; <= 12 chars,
                  no operators): the right side is the answer. "x = 5" = "5" = "y=5" (lenient).
                  "f(x) = 2x" and "a < b = c" are left alone; "<=", ">=", "!=" are not equations.
  whitespace      runs collapse; a space survives only between two letters ("new york", "\pi r") or two
                  digits ("1 000" ≠ 1000); elsewhere removed ("2 x + 3" = "2x+3").
  numbers         [+|-] decimal | [+|-] decimal/decimal | [+|-] \frac{[+|-]decimal}{[+|-]decimal}, where
                  decimal = digits with optional correct thousands groups and optional .digits (".5" ok):
                  compared as exact reduced rationals: "+5" = 5, "-0" = 0, "007" = 7, "1,000" = 1000,
                  "2.50" = "2.5" = "5/2" = "\frac{5}{2}" = "\dfrac{10}{4}", "-\frac{1}{2}" = "\frac{-1}{2}"
                  = "-0.5". The canonical form is "n" or "n/d" in lowest terms ("0.5" -> "1/2").
                  Exact only while every numerator / denominator (and their cross products) stays below
                  2^53 and a decimal has <= 15 fraction digits; beyond that the canonical form is the
                  decimal text (leading zeros, trailing fraction zeros and a "/1" dropped) and comparison
                  is by that string. Division by zero is not a number.
                  NOT equal: "1/2" vs "0.49", "\frac{1}{3}" vs "0.333", "12" vs "1,2" (bad grouping: "1,2"
                  stays text), "-5" vs "5", "2" vs "20", 1e3 vs 1000 (no exponents).
  text            what is not a number is compared as the normalized string, lower-cased when it holds no
                  LaTeX command (no backslash): "YES" = "yes", "\text{Monday}" = "monday", but "\Pi" ≠ "\pi".
                  No symbolic algebra: "\frac{1}{\sqrt{2}}" ≠ "\frac{\sqrt{2}}{2}", "x+1" ≠ "1+x".
  empty           an empty (or nil) answer equals nothing, not even another empty one.
]]

local M = {}

local type, tostring, tonumber = type, tostring, tonumber
local sfind, ssub, smatch, sgsub, sbyte, slower = string.find, string.sub, string.match, string.gsub,
    string.byte, string.lower
local concat = table.concat
local floor, abs, fmod = math.floor, math.abs, math.fmod

local EXACT = 2 ^ 53   -- doubles hold every integer below this exactly
local POW10 = { [0] = 1 }
for i = 1, 15 do POW10[i] = POW10[i - 1] * 10 end

local BACKSLASH, LBRACE, RBRACE = 92, 123, 125
local MINUS_U2212 = "\226\136\146"
local NBSP = "\194\160"
local DEGREE = "\194\176"

local function trim(s)
    return (sgsub(s, "^%s+", ""):gsub("%s+$", ""))
end

-- Position of the "}" closing the "{" at position `open` (backslash escapes the next character), or nil.
local function close_brace(s, open)
    local depth, k, n = 1, open + 1, #s
    while k <= n do
        local c = sbyte(s, k)
        if c == BACKSLASH then
            k = k + 2
        else
            if c == LBRACE then
                depth = depth + 1
            elseif c == RBRACE then
                depth = depth - 1
                if depth == 0 then return k end
            end
            k = k + 1
        end
    end
    return nil
end

-- ------------------------------------------------------------------------------------------------ extraction

local BOX_COMMANDS = { "\\boxed", "\\fbox" }

function M.extract_boxed(text)
    if type(text) ~= "string" then return nil end
    local best_cmd, best_brace
    for _, cmd in ipairs(BOX_COMMANDS) do
        local init = 1
        while true do
            local a, e = sfind(text, cmd, init, true)
            if not a then break end
            local _, brace = sfind(text, "^%s*{", e + 1)
            if brace and (not best_cmd or a > best_cmd) then best_cmd, best_brace = a, brace end
            init = a + 1
        end
    end
    if not best_cmd then return nil end
    local close = close_brace(text, best_brace)
    if not close then return nil end
    return trim(ssub(text, best_brace + 1, close - 1))
end

local function is_digit(c) return c ~= "" and sfind(c, "^%d") ~= nil end

-- The number token starting at position a (a digit, or the "." of ".5"); -> token text, last position.
local function number_at(s, a)
    local st, e = a, nil
    local int_end, grouped, has_int
    if ssub(s, a, a) == "." then
        local _, e2 = sfind(s, "^%.%d+", a)
        return ssub(s, a, e2), e2
    end
    local _, ie = sfind(s, "^%d+", a)
    int_end, has_int = ie, true
    if ie - a + 1 <= 3 then
        while sfind(s, "^,%d%d%d", int_end + 1) and not is_digit(ssub(s, int_end + 5, int_end + 5)) do
            int_end, grouped = int_end + 4, true
        end
    end
    e = int_end
    local _, de = sfind(s, "^%.%d+", e + 1)
    if de then
        e = de
    elseif not grouped and has_int then
        local _, fe = sfind(s, "^/%d+", e + 1)
        if fe then e = fe end
    end
    return ssub(s, st, e), e
end

function M.extract_last_number(text)
    if type(text) ~= "string" then return nil end
    local s = sgsub(text, MINUS_U2212, "-")
    local pos, last = 1, nil
    while true do
        local a = sfind(s, "%d", pos)
        if not a then break end
        -- ".5": a decimal point not preceded by a digit starts the number
        if a > 1 and ssub(s, a - 1, a - 1) == "." and not is_digit(ssub(s, a - 2, a - 2)) then a = a - 1 end
        local tok, e = number_at(s, a)
        local sc = a > 1 and ssub(s, a - 1, a - 1) or ""
        if sc == "-" or sc == "+" then
            local before = a > 2 and ssub(s, a - 2, a - 2) or ""
            if not sfind(before, "^[%w%)%]}]") then tok = sc .. tok end
        end
        last = tok
        pos = e + 1
    end
    return last
end

local MODES = { boxed = true, last_number = true, boxed_or_last_number = true }

function M.extract_answer(text, opts)
    local mode = opts and opts.mode or "boxed_or_last_number"
    if not MODES[mode] then
        error("ds4.reward.extract_answer: unknown mode " .. tostring(mode)
            .. " (\"boxed\", \"last_number\" or \"boxed_or_last_number\")", 2)
    end
    if type(text) ~= "string" then return nil end
    if opts and opts.after_think then
        local last
        local init = 1
        while true do
            local _, e = sfind(text, "</think>", init, true)
            if not e then break end
            last, init = e, e + 1
        end
        if not last then return nil end
        text = ssub(text, last + 1)
    end
    if mode ~= "last_number" then
        local b = M.extract_boxed(text)
        if b then return b, "boxed" end
        if mode == "boxed" then return nil end
    end
    local n = M.extract_last_number(text)
    if n then return n, "last_number" end
    return nil
end

-- ------------------------------------------------------------------------------------------------ numbers

local function gcd(a, b)
    a, b = abs(a), abs(b)
    while b ~= 0 do a, b = b, fmod(a, b) end
    return a
end

-- Unsigned decimal text -> integer digits (grouping removed), fraction digits; nil if not a decimal.
local function dec_parts(t)
    local ip, fp = smatch(t, "^([%d,]*)%.(%d+)$")
    if not ip then
        ip, fp = smatch(t, "^([%d,]+)$"), ""
        if not ip then return nil end
    end
    if sfind(ip, ",", 1, true) then
        local first = smatch(ip, "^%d%d?%d?")
        if not first then return nil end
        local k = #first + 1
        if ssub(ip, k, k) ~= "," then return nil end
        while k <= #ip do
            if not sfind(ip, "^,%d%d%d", k) then return nil end
            k = k + 4
        end
        ip = sgsub(ip, ",", "")
    end
    if ip == "" and fp == "" then return nil end
    return { ip = ip, fp = fp }
end

-- Signed decimal text -> {neg, ip, fp} or nil.
local function signed_dec(t)
    local sign, body = smatch(t, "^([%+%-]?)(.*)$")
    local d = dec_parts(body)
    if d then d.neg = sign == "-" end
    return d
end

-- Exact reduced n, d (d > 0, n >= 0) of an unsigned decimal, or nil when not exactly representable.
local function dec_rat(d)
    local fp = sgsub(d.fp, "0+$", "")
    local digits = sgsub(d.ip .. fp, "^0+", "")
    if digits == "" then return 0, 1 end
    if #fp > 15 then return nil end
    local v = tonumber(digits)
    if not v or v >= EXACT then return nil end
    local den = POW10[#fp]
    local g = gcd(v, den)
    return v / g, den / g
end

local function dec_text(d)
    local ip = sgsub(d.ip, "^0+", "")
    local fp = sgsub(d.fp, "0+$", "")
    if ip == "" then ip = "0" end
    return fp == "" and ip or ip .. "." .. fp
end

local function is_zero(d) return not sfind(d.ip .. d.fp, "[1-9]") end

local function int_text(v) return ("%.0f"):format(v) end

-- Canonical text of a whole-string number (see the TABLE), or nil when s is not a number.
local function parse_number(s)
    local sign, body = smatch(s, "^([%+%-]?)(.+)$")
    if not sign then return nil end
    local x, y
    local a, b = smatch(body, "^\\frac{([^{}]*)}{([^{}]*)}$")
    if a then
        x, y = signed_dec(a), signed_dec(b)
        if not x or not y then return nil end
    else
        a, b = smatch(body, "^([^/]+)/([^/]+)$")
        if a then
            x, y = dec_parts(a), dec_parts(b)
            if not x or not y then return nil end
        else
            x = dec_parts(body)
            if not x then return nil end
        end
    end
    if y and is_zero(y) then return nil end
    local neg = (sign == "-") ~= (x.neg == true) ~= (y ~= nil and y.neg == true)
    local nx, dx = dec_rat(x)
    local ny, dy = 1, 1
    if y then ny, dy = dec_rat(y) end
    if nx and ny then
        local n, d = nx * dy, dx * ny
        if n < EXACT and d < EXACT then
            if n == 0 then return "0" end
            local g = gcd(n, d)
            n, d = n / g, d / g
            local txt = (neg and "-" or "") .. int_text(n)
            if d ~= 1 then txt = txt .. "/" .. int_text(d) end
            return txt
        end
    end
    -- beyond exact doubles: compare the decimal texts
    local txt = dec_text(x)
    if y then
        local yt = dec_text(y)
        if yt ~= "1" then txt = txt .. "/" .. yt end
    end
    if txt == "0" then return "0" end
    return (neg and "-" or "") .. txt
end

-- ------------------------------------------------------------------------------------------------ LaTeX

local FRAC = { frac = true, dfrac = true, tfrac = true, cfrac = true }
local UNWRAP = { text = true, textbf = true, textit = true, textrm = true, textnormal = true, textsf = true,
    texttt = true, textup = true, mathrm = true, mathbf = true, mathit = true, mathsf = true, mathtt = true,
    mbox = true, hbox = true, boxed = true, fbox = true }
local UNIT_CMD = { text = true, textrm = true, textnormal = true, textit = true, textup = true,
    mathrm = true, mathit = true, mbox = true, hbox = true }
local DROP = { left = "", right = "", displaystyle = "", textstyle = "", bigl = "", bigr = "", Bigl = "",
    Bigr = "", big = "", Big = "", bigg = "", Bigg = "", biggl = "", biggr = "", quad = " ", qquad = " " }
local MATH_WORDS = { pi = true, sqrt = true, e = true, i = true, inf = true, infty = true, infinity = true,
    log = true, ln = true, lg = true, sin = true, cos = true, tan = true, sec = true, csc = true, cot = true,
    exp = true, mod = true, ["and"] = true, ["or"] = true, to = true, plus = true, minus = true, times = true,
    over = true, by = true, divided = true, of = true, no = true, none = true, undefined = true,
    real = true, integer = true, integers = true, even = true, odd = true, positive = true, negative = true }

-- One macro argument at position i: a {group}, a \command or one character. -> text, next position.
local function read_arg(s, i)
    local _, j = sfind(s, "^%s*", i)
    i = j + 1
    local c = ssub(s, i, i)
    if c == "{" then
        local k = close_brace(s, i)
        if not k then return nil end
        return ssub(s, i + 1, k - 1), k + 1
    elseif c == "\\" then
        local cmd = smatch(s, "^\\%a+", i) or ssub(s, i, i + 1)
        return cmd, i + #cmd
    elseif c ~= "" and c ~= "}" then
        return c, i + 1
    end
    return nil
end

local function read_brace_arg(s, i)
    local _, j = sfind(s, "^%s*{", i)
    if not j then return nil end
    local k = close_brace(s, j)
    if not k then return nil end
    return ssub(s, j + 1, k - 1), k + 1
end

local function is_unit_text(x)
    return sfind(x, "^%s*%a[%a%s%.%^%d{}/]*$") ~= nil
end

-- Rewrite commands: \frac / \sqrt arguments braced, text commands unwrapped (or dropped as a trailing unit
-- at the top level), \left \right ... removed.
local function canon(s, top)
    local out, i, n = {}, 1, #s
    while i <= n do
        local a = sfind(s, "\\", i, true)
        if not a then
            out[#out + 1] = ssub(s, i)
            break
        end
        out[#out + 1] = ssub(s, i, a - 1)
        local name = smatch(s, "^%a+", a + 1)
        if not name then
            out[#out + 1] = ssub(s, a, a + 1)
            i = a + 2
        else
            local j = a + 1 + #name
            if FRAC[name] then
                local x, j1 = read_arg(s, j)
                local y, j2
                if x then y, j2 = read_arg(s, j1) end
                if y then
                    out[#out + 1] = "\\frac{" .. canon(x) .. "}{" .. canon(y) .. "}"
                    i = j2
                else
                    out[#out + 1] = "\\frac"
                    i = j
                end
            elseif name == "sqrt" then
                local idx = smatch(s, "^%s*(%b[])", j)
                if idx then
                    local _, k = sfind(s, "^%s*%b[]", j)
                    j = k + 1
                end
                local x, j1 = read_arg(s, j)
                out[#out + 1] = "\\sqrt" .. (idx or "")
                if x then
                    out[#out + 1] = "{" .. canon(x) .. "}"
                    i = j1
                else
                    i = j
                end
            elseif UNWRAP[name] then
                local x, j1 = read_brace_arg(s, j)
                if not x then
                    i = j
                elseif top and UNIT_CMD[name] and is_unit_text(x) and sfind(ssub(s, j1), "^[%s%^%d{}]*$")
                    and sfind(concat(out), "[%d\\%)%]}]") then
                    i = n + 1   -- a trailing unit: drop it and any exponent after it
                else
                    out[#out + 1] = " " .. canon(x) .. " "
                    i = j1
                end
            elseif DROP[name] then
                out[#out + 1] = DROP[name]
                i = j
            else
                out[#out + 1] = "\\" .. name
                i = j
            end
        end
    end
    return concat(out)
end

local function strip_trailing_periods(s)
    return (sgsub(s, "[%s%.]+$", ""))
end

-- "x = 5" -> "5" (see the TABLE).
local function strip_equation(s)
    local p = sfind(s, "=", 1, true)
    if not p or sfind(s, "=", p + 1, true) then return s end
    if sfind(ssub(s, p - 1, p - 1), "^[<>!:]") then return s end
    local lhs, rhs = trim(ssub(s, 1, p - 1)), trim(ssub(s, p + 1))
    if rhs == "" or #lhs > 12 then return s end
    if sfind(lhs, "^%a[%w_{}]*$") or sfind(lhs, "^\\%a+[%w_{}]*$") then return rhs end
    return s
end

local function strip_outer_braces(s)
    while ssub(s, 1, 1) == "{" and close_brace(s, 1) == #s do s = trim(ssub(s, 2, -2)) end
    return s
end

-- Keep a space only between two letters or two digits.
local function squeeze(s)
    s = trim(sgsub(s, "%s+", " "))
    return (sgsub(s, "() ", function(p)
        local l, r = ssub(s, p - 1, p - 1), ssub(s, p + 1, p + 1)
        if (sfind(l, "^%a") and sfind(r, "^%a")) or (sfind(l, "^%d") and sfind(r, "^%d")) then return " " end
        return ""
    end))
end

local function unit_words(post)
    for word in string.gmatch(post, "[^%s/]+") do
        local w = sgsub((sgsub(word, "%.$", "")), "%^{?%d+}?$", "")
        if not sfind(w, "^%a%a+$") or MATH_WORDS[slower(w)] then return false end
    end
    return true
end

-- "5 cm" -> "5" (plain trailing unit words after a number).
local function strip_unit_words(s)
    local pre, post = smatch(s, "^(.-)%s+(%a[%a%s/%^{}%d%.]*)$")
    if pre and unit_words(post) and parse_number(squeeze(pre)) then return pre end
    return s
end

-- ------------------------------------------------------------------------------------------------ API

function M.normalize(s)
    if type(s) == "number" then
        if s ~= s then return nil end
        if s == floor(s) and abs(s) < EXACT then s = int_text(s) else s = ("%.17g"):format(s) end
    end
    if type(s) ~= "string" then return nil end
    s = sgsub(s, MINUS_U2212, "-")
    s = sgsub(s, NBSP, " ")
    s = sgsub(s, "\\%$", "")
    s = sgsub(s, "%$", "")
    s = sgsub(s, "\\[%(%)%[%]]", "")
    s = sgsub(s, "(%d)\\[,!;: ](%d)", "%1%2")
    s = sgsub(s, "\\[,!;: ]", " ")
    s = sgsub(s, "~", " ")
    s = sgsub(s, "{,}", ",")
    s = sgsub(s, "%^%s*{%s*\\circ%s*}", "")
    s = sgsub(s, "%^%s*\\circ", "")
    s = sgsub(s, DEGREE, "")
    s = sgsub(s, "\\%%", "")
    s = sgsub(s, "%%", "")
    s = strip_trailing_periods(trim(s))
    s = trim(canon(s, true))
    s = strip_trailing_periods(s)
    s = strip_equation(s)
    s = strip_outer_braces(s)
    s = strip_unit_words(s)
    s = strip_trailing_periods(squeeze(s))
    local num = parse_number(s)
    if num then return num, true end
    if not sfind(s, "\\", 1, true) then s = slower(s) end
    return s, false
end

function M.math_equal(pred, ref)
    local a = M.normalize(pred)
    local b = M.normalize(ref)
    if a == nil or b == nil or a == "" or b == "" then return false end
    return a == b
end

-- Internals, for tests.
M._parse_number = parse_number

return M
