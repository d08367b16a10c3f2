-- test_reward.lua — ds4.reward: answer extraction, normalisation and equality (the TABLE at the top of
-- lua/ds4/reward/math.lua), the math / exact-match / format rewards, the DAPO soft overlong punishment, combine,
-- and evaluate / evaluate_batch with broken user reward functions.
--
-- Every expected value below is written out by hand from the documented rules (the DAPO penalty from
-- DAPO Eq. 13 as restated in docs/rl.md, "Overlong handling"), not produced by the code under test.
local H = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/harness.lua")
local reward = require("ds4.reward")
local rm = require("ds4.reward.math")

H.check(reward.math == rm and reward.math_equal == rm.math_equal, "ds4.reward re-exports ds4.reward.math")

-- ------------------------------------------------------------------------------------------------ equality table

local T, F = true, false
local EQUAL = {
    -- wrappers and spaces
    { "5", "5", T },
    { "$5$", "5", T },
    { "$$5$$", "5", T },
    { "\\(5\\)", "5", T },
    { "\\[5\\]", "5", T },
    { "  5 \n", "5", T },
    { "\\boxed{7}", "7", T },
    { "{7}", "7", T },
    { "\\$5", "5", T },
    { "\\$5.00", "5", T },
    -- \left \right, spacing commands
    { "\\left(1,2\\right)", "(1,2)", T },
    { "\\!5\\;", "5", T },
    { "\\displaystyle\\frac{3}{4}", "0.75", T },
    -- units
    { "5 cm", "5", T },
    { "5\\text{ cm}", "5", T },
    { "5\\mathrm{cm}^2", "5", T },
    { "$5$ dollars", "5", T },
    { "5 square feet", "5", T },
    { "\\frac{1}{2} cup", "0.5", T },
    { "5cm", "5", F },            -- unit words need whitespace (or \text)
    { "5 m", "5", F },            -- single-letter plain units are kept (could be a variable)
    { "5\\text{ m}", "5", T },    -- ... unless written as \text
    { "5x", "5", F },
    { "5 sqrt 2", "5", F },       -- math words are not units
    -- thousands separators
    { "1,000", "1000", T },
    { "1,234,567", "1234567", T },
    { "1{,}000", "1000", T },
    { "1\\,000", "1000", T },
    { "12", "1,2", F },
    { "1,2345", "12345", F },
    { "1 000", "1000", F },
    { "1,000", "1.000", F },
    -- signs, zeros
    { "+5", "5", T },
    { "-0", "0", T },
    { "-0.0", "+0", T },
    { "007", "7", T },
    { "-5", "5", F },
    { "2", "20", F },
    -- decimals and fractions as exact rationals
    { "2.50", "2.5", T },
    { "2.5", "5/2", T },
    { "2.50", "\\frac{5}{2}", T },
    { "\\frac{1}{2}", "0.5", T },
    { ".5", "0.5", T },
    { "\\dfrac{1}{2}", "1/2", T },
    { "\\tfrac{1}{2}", "\\frac{1}{2}", T },
    { "\\frac12", "\\frac{1}{2}", T },
    { "\\frac1{2}", "1/2", T },
    { "\\frac{1}2", "0.5", T },
    { "\\dfrac{10}{4}", "5/2", T },
    { "-\\frac{1}{2}", "\\frac{-1}{2}", T },
    { "-\\frac{1}{2}", "-0.5", T },
    { "\\frac{6}{-4}", "-1.5", T },
    { "\\frac{0.5}{2}", "1/4", T },
    { "1/2", "0.49", F },
    { "\\frac{1}{3}", "0.333", F },
    { "\\frac{1}{3}", "0.3333333333333333", F },
    { "1/0", "0", F },            -- division by zero is not a number
    { "1e3", "1000", F },         -- no exponents
    -- beyond 2^53: decimal-text comparison
    { "123456789012345678901", "123,456,789,012,345,678,901", T },
    { "9007199254740993", "9007199254740993.0", T },
    { "9007199254740993", "9007199254740992", F },
    { "3.14", "3.140000000000000000001", F },
    -- percentages: the sign is dropped, never rescaled
    { "50\\%", "50", T },
    { "50%", "50", T },
    { "50%", "0.5", F },
    -- equations
    { "x = 5", "5", T },
    { "x=5", "y = 5", T },
    { "a_{n} = 3", "3", T },
    { "\\theta = 30^\\circ", "30", T },
    { "f(x) = 2x", "2x", F },
    { "x <= 5", "5", F },
    -- degrees, trailing period
    { "90°", "90", T },
    { "90^{\\circ}", "90", T },
    { "5.", "5", T },
    { "\\text{Yes}.", "yes", T },
    -- text answers
    { "New   York", "new york", T },
    { "YES", "yes", T },
    { "\\text{Monday}", "monday", T },
    { "(A)", "A", F },
    { "\\Pi", "\\pi", F },        -- LaTeX keeps its case
    -- structure, no algebra
    { "2 x + 3", "2x+3", T },
    { "\\frac{\\sqrt3}{2}", "\\dfrac{\\sqrt{3}}{2}", T },
    { "\\sqrt2", "\\sqrt{2}", T },
    { "\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", F },
    { "x + 1", "1 + x", F },
    -- Lua numbers, empty and missing answers
    { 42, "42", T },
    { 0.5, "\\frac{1}{2}", T },
    { "", "", F },
    { "5", "", F },
    { nil, "5", F },
    { "$$", "", F },
}
H.check(#EQUAL >= 60, "at least 60 equality cases")
for _, c in ipairs(EQUAL) do
    local pred, ref, want = c[1], c[2], c[3]
    H.eq(reward.math_equal(pred, ref), want, ("math_equal(%q, %q)"):format(tostring(pred), tostring(ref)))
    H.eq(reward.math_equal(ref, pred), want, ("math_equal(%q, %q) (swapped)"):format(tostring(ref), tostring(pred)))
end

-- canonical forms
do
    local function norm(s, want, want_num)
        local got, is_num = reward.normalize(s)
        H.eq(got, want, ("normalize(%q)"):format(s))
        H.eq(is_num, want_num, ("normalize(%q) is a number"):format(s))
    end
    norm("0.5", "1/2", true)
    norm("-2.50", "-5/2", true)
    norm("1,000", "1000", true)
    norm("-0", "0", true)
    norm("\\dfrac{4}{6}", "2/3", true)
    norm("\\text{Yes}.", "yes", false)
    norm("\\frac12 + x", "\\frac{1}{2}+x", false)
    norm("1,2", "1,2", false)
    norm("123456789012345678901.500", "123456789012345678901.5", true)
    H.eq(reward.normalize(nil), nil, "normalize(nil)")
    H.eq(reward.normalize({}), nil, "normalize(table)")
    H.eq(reward.normalize(0 / 0), nil, "normalize(NaN)")
end

-- ------------------------------------------------------------------------------------------------ extraction

do
    local B = {
        { "the answer is \\boxed{\\frac{1}{\\sqrt{2}}}.", "\\frac{1}{\\sqrt{2}}" },
        { "\\boxed{1} first, then \\boxed{2}", "2" },
        { "\\boxed {3}", "3" },
        { "\\fbox{4}", "4" },
        { "\\boxed{1} and \\fbox{5}", "5" },
        { "\\boxed{\\{1, 2\\}}", "\\{1, 2\\}" },        -- escaped braces do not count
        { "\\boxed{\\{1, 2}", "\\{1, 2" },                -- \{ opens nothing, } closes the box
        { "\\boxed{1, 2\\}", nil },                       -- \} closes nothing: never closed
        { "\\boxed{a \\\\} b}", "a \\\\" },               -- \\ is an escaped backslash: its } counts
        { "\\boxed{ x = 5 }", "x = 5" },
        { "\\boxed{\\boxed{6}}", "6" },
        { "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}" },
        { "\\boxed{7} ... wait, \\boxed{8", nil },         -- truncated last box: no answer, not the earlier one
        { "\\boxed 9", nil },
        { "\\boxedx{1}", nil },
        { "no box here 10", nil },
        { "\\boxed{}", "" },
    }
    for _, c in ipairs(B) do H.eq(reward.extract_boxed(c[1]), c[2], ("extract_boxed(%q)"):format(c[1])) end
    H.eq(reward.extract_boxed(nil), nil, "extract_boxed(nil)")

    local N = {
        { "so 1,234,567 items", "1,234,567" },
        { "x = -3.5", "-3.5" },
        { "10-7", "7" },
        { "x^2-4", "4" },
        { "the answer is 5.", "5" },
        { "the answer is -3", "-3" },
        { "$-12$", "-12" },
        { "1,2", "2" },
        { "12,34", "34" },
        { "1,2345", "2345" },
        { "1,234,5678", "5678" },
        { "about 3/4 of it", "3/4" },
        { "0.25 and then 1/8", "1/8" },
        { "a .5 b", ".5" },
        { "-.5", "-.5" },
        { "total: 1,234.50!", "1,234.50" },
        { "Price $1,000,000", "1,000,000" },
        { "x = \226\136\1467", "-7" },                     -- U+2212 minus sign
        { "+4 points", "+4" },
        { "(3)", "3" },
        { "no number", nil },
        { "", nil },
    }
    for _, c in ipairs(N) do H.eq(reward.extract_last_number(c[1]), c[2], ("extract_last_number(%q)"):format(c[1])) end

    local text = "I think 3 then \\boxed{4} and finally 5"
    H.eq(reward.extract_answer(text), "4", "default mode prefers the box")
    H.eq(select(2, reward.extract_answer(text)), "boxed", "... and says so")
    H.eq(reward.extract_answer(text, { mode = "last_number" }), "5", "last_number mode")
    H.eq(reward.extract_answer(text, { mode = "boxed" }), "4", "boxed mode")
    H.eq(reward.extract_answer("just 5", { mode = "boxed" }), nil, "boxed mode, no box")
    local a, how = reward.extract_answer("just 5")
    H.check(a == "5" and how == "last_number", "fallback to the last number")
    H.eq(reward.extract_answer("nothing"), nil, "no answer at all")
    local th = "<think>maybe \\boxed{1}</think> The answer is 2"
    H.eq(reward.extract_answer(th), "1", "without after_think a box in the reasoning counts")
    H.eq(reward.extract_answer(th, { after_think = true }), "2", "after_think")
    H.eq(reward.extract_answer("<think>\\boxed{1}", { after_think = true }), nil, "after_think, unfinished thinking")
    H.raises(function() reward.extract_answer("x", { mode = "first" }) end, { "unknown mode", "first" }, "bad mode")
end

-- ------------------------------------------------------------------------------------------------ rewards

do
    local r = reward.math_reward("So $x = \\boxed{\\frac{1}{2}}$.", { answer = "0.5" })
    H.eq(r.score, 1.0, "math_reward correct")
    H.eq(r.info.reason, "correct", "reason correct")
    H.eq(r.info.extracted, "\\frac{1}{2}", "info.extracted")
    H.eq(r.info.reference, "0.5", "info.reference")
    H.eq(r.info.method, "boxed", "info.method")
    H.eq(r.info.normalized, "1/2", "info.normalized")
    r = reward.math_reward("\\boxed{3}", { answer = "4" })
    H.check(r.score == 0.0 and r.info.reason == "wrong", "math_reward wrong")
    r = reward.math_reward("I don't know", { answer = "4" })
    H.check(r.score == 0.0 and r.info.reason == "no_answer" and r.info.extracted == nil, "math_reward no answer")
    r = reward.math_reward("the total is 1,000 dollars", { answer = 1000 })
    H.check(r.score == 1.0 and r.info.method == "last_number", "math_reward numeric reference, last number")
    H.eq(reward.math_reward("\\boxed{4}", "4").score, 1.0, "reference given directly")
    H.eq(reward.math_reward("\\boxed{3}", { answer = "4" }, { wrong = -1 }).score, -1, "DAPO-style wrong = -1")
    H.eq(reward.math_reward("none", { answer = "4" }, { wrong = -1 }).score, -1, "no_answer defaults to wrong")
    H.eq(reward.math_reward("none", { answer = "4" }, { wrong = -1, no_answer = -2 }).score, -2, "no_answer option")
    H.eq(reward.math_reward("\\boxed{4} 5", { answer = "5" }, { mode = "last_number" }).score, 1.0, "mode option")
    H.raises(function() reward.math_reward("\\boxed{4}", {}) end, { "sample.answer" }, "missing reference")

    H.eq(reward.exact_match("  Paris \n", { answer = "Paris" }), 1.0, "exact_match trims")
    H.eq(reward.exact_match("paris", { answer = "Paris" }), 0.0, "exact_match is case-sensitive")
    H.eq(reward.exact_match("42", { answer = 42 }), 1.0, "exact_match numeric reference")
    H.eq(reward.exact_match(nil, { answer = "x" }), 0.0, "exact_match non-string response")
end

do
    local fr = reward.format_reward
    local think = { think = true }
    H.eq(fr("<think>a</think> answer", think), 1.0, "think: opened and closed")
    H.eq(fr("  <think>a</think>\nanswer", think), 1.0, "think: leading whitespace")
    H.eq(fr("a</think> answer", think), 1.0, "think: opened by the prompt")
    H.eq(fr("<think>a</think>  \n", think), 0.0, "think: nothing after </think>")
    H.eq(fr("<think>a</think>x</think> y", think), 0.0, "think: two </think>")
    H.eq(fr("<think>a<think>b</think> c", think), 0.0, "think: two <think>")
    H.eq(fr("x <think>a</think> y", think), 0.0, "think: <think> not at the start")
    H.eq(fr("<think>a", think), 0.0, "think: never closed")
    local boxed = { require_boxed = true }
    H.eq(fr("so \\boxed{5}", boxed), 1.0, "require_boxed")
    H.eq(fr("so 5", boxed), 0.0, "require_boxed: none")
    H.eq(fr("so \\boxed{5", boxed), 0.0, "require_boxed: unclosed")
    local both = { think = true, require_boxed = true }
    H.eq(fr("<think>\\boxed{1}</think> so 1", both), 0.0, "think + box: box only in the reasoning")
    H.eq(fr("<think>hmm</think> \\boxed{1}", both), 1.0, "think + box")
    H.eq(fr("Answer: 42", { pattern = "^Answer: %d+$" }), 1.0, "pattern")
    H.eq(fr("Answer: x", { pattern = "^Answer: %d+$" }), 0.0, "pattern: no match")
    H.eq(fr(nil, boxed), 0.0, "non-string response")
    H.raises(function() fr("x", {}) end, { "no condition" }, "format_reward without conditions")
    H.raises(function() fr("x", { thinking = true }) end, { "unknown option", "thinking" }, "format_reward bad option")
end

-- DAPO soft overlong punishment (Eq. 13): 0 up to L_max - L_cache, then linear down to -1 at L_max, -1 beyond.
do
    local lp = reward.length_penalty
    local dapo = { max_len = 20480, cache_len = 4096 }   -- DAPO 32B recipe: expected max 16384
    H.eq(lp(0, dapo), 0.0, "len 0")
    H.eq(lp(16384, dapo), 0.0, "len = max_len - cache_len")
    H.eq(lp(16385, dapo), -1 / 4096, "first token into the cache zone")
    H.eq(lp(18432, dapo), -0.5, "middle of the cache zone")
    H.eq(lp(20479, dapo), -4095 / 4096, "last token before max_len")
    H.eq(lp(20480, dapo), -1.0, "len = max_len")
    H.eq(lp(20481, dapo), -1.0, "beyond max_len")
    H.eq(lp(18432, { max_len = 20480, cache_len = 4096, factor = 0.5 }), -0.25, "penalty factor")
    H.eq(lp(30000, { max_len = 20480, cache_len = 4096, factor = 0.5 }), -0.5, "factor beyond max_len")
    local small = { max_len = 10, cache_len = 4 }
    H.same({ lp(6, small), lp(7, small), lp(8, small), lp(9, small), lp(10, small), lp(11, small) },
        { 0, -0.25, -0.5, -0.75, -1, -1 }, "max_len 10, cache_len 4")
    H.same({ lp(10, { max_len = 10, cache_len = 0 }), lp(11, { max_len = 10, cache_len = 0 }) }, { 0, -1 },
        "cache_len 0: a hard cut")
    H.raises(function() lp(5, { max_len = 10, cache_len = 11 }) end, { "cache_len" }, "cache_len > max_len")
    H.raises(function() lp(5, { max_len = 10 }) end, { "cache_len" }, "cache_len missing")
    H.raises(function() lp(-1, small) end, { "length" }, "negative length")

    local llp = reward.linear_length_penalty
    H.eq(llp(50, { max_len = 100 }), -0.5, "linear: half")
    H.eq(llp(150, { max_len = 100 }), -1.0, "linear: capped")
    H.eq(llp(20, { max_len = 100, target_len = 20 }), 0.0, "linear: at target")
    H.eq(llp(60, { max_len = 100, target_len = 20, factor = 2 }), -1.0, "linear: target and factor")

    local ov = reward.overlong_reward(small)
    local s, info = reward.evaluate(ov, "text", { response_len = 8 })
    H.check(s == -0.5 and info.length == 8, "overlong_reward from sample.response_len")
    H.eq(reward.evaluate(ov, "text", { response_ids = { 1, 2, 3, 4, 5, 6, 7 } }), -0.25, "from #response_ids")
    H.eq(reward.evaluate(reward.overlong_reward { max_len = 10, cache_len = 4, length = function(r) return #r end },
        "123456789", {}), -0.75, "opts.length")
    H.eq(reward.evaluate(reward.overlong_reward { max_len = 100, linear = true }, "x", { response_len = 25 }), -0.25,
        "overlong_reward linear")
    local s2, _, err = reward.evaluate(ov, "text", {})
    H.check(s2 == nil and err:find("response_len", 1, true), "overlong_reward without a length: per-sample error")
    H.raises(function() reward.overlong_reward { max_len = 10, cache_len = 20 } end, { "cache_len" }, "checked early")
end

-- ------------------------------------------------------------------------------------------------ combine

do
    local f1 = function() return 1 end
    local f2 = function() return { score = 0.5, info = { a = 1 } } end
    local c = reward.combine({ { f1, 1.0, "acc" }, { fn = f2, weight = 0.5, name = "fmt" } })
    local s, info = reward.evaluate(c, "r", {})
    H.eq(s, 1.25, "combine: weighted sum")
    H.same(info.acc, { score = 1, weight = 1, info = {} }, "combine: component info (bare number)")
    H.eq(info.fmt.score, 0.5, "combine: component score")
    H.eq(info.fmt.weight, 0.5, "combine: component weight")
    H.eq(info.fmt.info.a, 1, "combine: component info kept")
    local s2, info2 = reward.evaluate(reward.combine({ f1, f2 }), "r", {})
    H.check(s2 == 1.5 and info2.r1 and info2.r2, "combine: default weights and names")

    local math_and_format = reward.combine({
        { reward.math_reward, 1.0, "math" },
        { function(r) return reward.format_reward(r, { think = true }) end, 0.2, "format" },
    })
    local s3, info3 = reward.evaluate(math_and_format, "<think>2+2</think> \\boxed{4}", { answer = "4" })
    H.near(s3, 1.2, 1e-12, "combine math + format")
    H.eq(info3.math.info.reason, "correct", "combine keeps the math info")
    local s4 = reward.evaluate(math_and_format, "\\boxed{5}", { answer = "4" })
    H.eq(s4, 0.0, "combine: wrong and badly formatted")

    local bad = reward.combine({ { f1, 1, "ok" }, { function() return 0 / 0 end, 1, "bad" } })
    local s5, i5, e5 = reward.evaluate(bad, "r", {})
    H.check(s5 == nil and i5 == nil and e5:find('component "bad"', 1, true) and e5:find("NaN", 1, true),
        "combine: an invalid component fails the sample: " .. tostring(e5))
    local s6, _, e6 = reward.evaluate(reward.combine({ function() error("inner boom") end }), "r", {})
    H.check(s6 == nil and e6:find("inner boom", 1, true), "combine: a component's error fails the sample")

    H.raises(function() reward.combine({ { f1, 1, "x" }, { f2, 1, "x" } }) end, { "duplicate", "x" }, "duplicate names")
    H.raises(function() reward.combine({ { f1, 0 / 0 } }) end, { "weight" }, "NaN weight")
    H.raises(function() reward.combine({ { "nope", 1 } }) end, { "entry 1" }, "not callable")
    H.raises(function() reward.combine({}) end, { "no reward functions" }, "empty")
end

-- ------------------------------------------------------------------------------------------------ evaluate

do
    local ev = reward.evaluate
    local s, info, err = ev(function(r, smp) return #r + smp.k end, "abc", { k = 10 })
    H.check(s == 13 and type(info) == "table" and next(info) == nil and err == nil, "number result, args passed")
    s, info, err = ev(function() return { score = 0.7, info = { k = "v" } } end, "r", {})
    H.check(s == 0.7 and info.k == "v" and err == nil, "{score, info} result")
    s, info, err = ev(function() return { score = -2 } end, "r", {})
    H.check(s == -2 and type(info) == "table" and err == nil, "{score} without info")

    local function fails(fn, needles, what)
        local s1, i1, e1 = ev(fn, "r", {})
        H.check(s1 == nil and i1 == nil and type(e1) == "string", what .. ": score nil, message returned")
        for _, n in ipairs(needles) do
            H.check(type(e1) == "string" and e1:find(n, 1, true) ~= nil,
                ("%s: message has %q: %s"):format(what, n, tostring(e1)))
        end
    end
    local function user_reward_that_errors() error("boom in user code") end
    fails(user_reward_that_errors, { "boom in user code", "stack traceback", "test_reward.lua:" }, "error")
    fails(function() return 0 / 0 end, { "NaN" }, "NaN")
    fails(function() return "1.0" end, { "a string", "1.0" }, "string")
    fails(function() return nil end, { "returned nil" }, "nil")
    fails(function() end, { "returned nil" }, "no return")
    fails(function() return true end, { "boolean" }, "boolean")
    fails(function() return math.huge end, { "infinite" }, "inf")
    fails(function() return -math.huge end, { "infinite" }, "-inf")
    fails(function() return { score = "1" } end, { "without a numeric score" }, "string score")
    fails(function() return { value = 1 } end, { "without a numeric score", "nil" }, "no score")
    fails(function() return { score = 0 / 0 } end, { "NaN" }, "NaN score in a table")
    fails(function() return { score = 1, info = "x" } end, { "info" }, "non-table info")
    fails(function() error({ code = 7 }) end, { "raised an error" }, "error with a table value")
    fails(function() error(setmetatable({}, { __tostring = function() error("nested") end })) end,
        { "raised an error" }, "error object whose __tostring fails")
    fails(function(r, smp) return smp.missing.field end, { "attempt to index" }, "runtime error")
    local s1, _, e1 = ev(nil, "r", {})
    H.check(s1 == nil and e1:find("not callable", 1, true), "nil function")
    local callable_tbl = setmetatable({}, { __call = function(_, r) return #r end })
    H.eq(ev(callable_tbl, "four", {}), 4, "callable table")
end

do
    local function fn(r, smp)
        if smp.bad then error("bad sample " .. r) end
        if smp.nan then return 0 / 0 end
        return reward.math_reward(r, smp)
    end
    local responses = { "\\boxed{1}", "x", "\\boxed{3}", "y", "the answer is 5" }
    local samples = { { answer = "1" }, { bad = true }, { answer = "4" }, { nan = true }, { answer = "5.0" } }
    local scores, infos, errors = reward.evaluate_batch(fn, responses, samples)
    H.eq(scores[1], 1.0, "batch[1]")
    H.eq(scores[2], nil, "batch[2] failed")
    H.eq(scores[3], 0.0, "batch[3] after a failure")
    H.eq(scores[4], nil, "batch[4] NaN")
    H.eq(scores[5], 1.0, "batch[5] after two failures")
    H.eq(#errors, 2, "two errors")
    H.check(errors[1] and errors[1].index == 2 and errors[1].message:find("bad sample x", 1, true),
        "errors[1] = sample 2")
    H.check(errors[2] and errors[2].index == 4 and errors[2].message:find("NaN", 1, true), "errors[2] = sample 4")
    H.check(type(infos[2]) == "table" and infos[2].error == errors[1].message, "failed sample's info.error")
    H.eq(infos[3].reason, "wrong", "infos of good samples")
    H.eq(infos[5].reason, "correct", "infos[5]")

    local s2, _, e2 = reward.evaluate_batch(function(r) return #r end, { "a", "bb" })
    H.same(s2, { 1, 2 }, "samples may be nil")
    H.eq(#e2, 0, "no errors")
    H.raises(function() reward.evaluate_batch(fn, { "a" }, {}) end, { "1 responses but 0 samples" }, "length mismatch")
    H.raises(function() reward.evaluate_batch(fn, "a") end, { "responses" }, "responses not an array")
end

H.done("test_reward")
