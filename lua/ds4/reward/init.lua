--[[ ds4.reward — reward functions for RL rollouts, and a safe way to call user ones (pure Lua).

  local reward = require("ds4.reward")

A reward function is fn(response_text, sample) -> number, or {score = number, info = table}. `sample` is the
prompt's data table (sample.answer = the reference answer for the math rewards). Anything else returned
(nil, NaN, +-inf, a string, a boolean, a table without a numeric score or with a non-table info) is an
error; evaluate / evaluate_batch turn every error into a per-sample message, so a buggy reward never
kills a run.

Math answers (lua/ds4/reward/math.lua: its header TABLE says exactly what counts as equal)
  reward.extract_boxed(text)        content of the last \boxed{...} / \fbox{...} (nested braces), or nil
  reward.extract_last_number(text)  the last number as written ("1,234", "-2.5", "3/4"), or nil
  reward.extract_answer(text [, {mode = "boxed"|"last_number"|"boxed_or_last_number", after_think = bool}])
                                    -> answer, "boxed"|"last_number" (or nil); default boxed_or_last_number;
                                    after_think: only the text after the last "</think>" (none: nil)
  reward.normalize(s)               canonical form ("0.5" -> "1/2", "\text{Yes}." -> "yes"), is_number
  reward.math_equal(pred, ref)      true when both normalize to the same form (exact rationals for numbers)

Rewards
  reward.math_reward(response, sample [, opts])   sample.answer (or sample itself, a string/number) is the
        reference -> {score = 1.0 if extract_answer(response, opts) is math_equal to it, else 0.0,
        info = {extracted, reference, method = "boxed"|"last_number", normalized, reference_normalized,
        reason = "correct"|"wrong"|"no_answer"}}. opts: mode, after_think (extract_answer's), correct (1.0),
        wrong (0.0), no_answer (= wrong): DAPO's +1/-1 is {wrong = -1}. Error when the reference is missing.
  reward.exact_match(response, sample)   1.0 when trimmed response == trimmed tostring(sample.answer), else 0.0
  reward.format_reward(response, opts)   1.0 when every condition given holds, else 0.0 (no condition: error):
        opts.pattern        a Lua pattern that string.find must find in the response (anchor it yourself)
        opts.require_boxed  a closed \boxed{} / \fbox{} (with think: in the text after "</think>")
        opts.think          exactly one "</think>", followed by non-blank text; "<think>" optional (the
                            DeepSeek-V4 template may put it in the prompt) but at most one, and only at the
                            start of the response (after whitespace)
  reward.length_penalty(len, {max_len, cache_len, factor = 1})   DAPO soft overlong punishment (Eq. 13):
        0 if len <= max_len - cache_len; ((max_len - cache_len) - len) / cache_len * factor if
        max_len - cache_len < len <= max_len; -factor if len > max_len. cache_len = 0: 0 / -factor.
  reward.linear_length_penalty(len, {max_len, target_len = 0, factor = 1})
        0 if len <= target_len, else -factor * min(1, (len - target_len) / (max_len - target_len))
  reward.overlong_reward(opts)      a reward function fn(response, sample) -> {score = length_penalty(L, opts),
        info = {length = L}}; L = opts.length(response, sample) if given, else sample.response_len, else
        #sample.response_ids (token counts: no byte-length guess; neither present is an error).
        opts.linear = true uses linear_length_penalty.
  Options-taking rewards in a combination: wrap them, function(r, s) return reward.format_reward(r, {think = true}) end.

Combining and calling
  reward.combine(list)              list entries: fn, {fn, weight [, name]} or {fn = f, weight = w, name = n}
                                    (weight default 1, name default "r<i>", names unique) -> a reward function
                                    returning {score = sum of weight * score, info = {[name] = {score, weight,
                                    info}}}; a component's error or invalid result is an error of the whole.
  reward.evaluate(fn, response, sample) -> score, info, nil  |  nil, nil, message
                                    calls fn with xpcall (message = error + traceback, or what was wrong with
                                    the result); info is {} when fn returned a bare number. Never raises.
  reward.evaluate_batch(fn, responses, samples) -> scores, infos, errors
                                    scores[i] = number or nil (failed), infos[i] = info or {error = message}
                                    for a failed sample, errors = {{index = i, message = ...}, ...} (empty when
                                    none failed); iterate 1..#responses (scores may have holes). samples may be
                                    nil; else it must have #responses entries. Raises only on bad arguments.
  reward.check_result(r)            -> score, info | nil, nil, what is wrong: the check evaluate applies to a
                                    reward function's result

Not covered: a reward that never returns (an infinite loop) blocks its caller; run untrusted rewards in a
separate worker.
]]

local rm = require("ds4.reward.math")

local M = {}
M.math = rm
M.extract_boxed = rm.extract_boxed
M.extract_last_number = rm.extract_last_number
M.extract_answer = rm.extract_answer
M.normalize = rm.normalize
M.math_equal = rm.math_equal

local type, tostring, error, pairs, ipairs = type, tostring, error, pairs, ipairs
local huge = math.huge

local function trim(s)
    return (s:gsub("^%s+", ""):gsub("%s+$", ""))
end

local function reference_of(sample, fname)
    local ref
    if type(sample) == "table" then ref = sample.answer else ref = sample end
    if ref == nil then
        error("ds4.reward." .. fname .. ": sample.answer (the reference answer) is missing", 3)
    end
    return ref
end

local function callable(f)
    if type(f) == "function" then return true end
    local mt = (type(f) == "table" or type(f) == "userdata") and getmetatable(f)
    return type(mt) == "table" and mt.__call ~= nil
end

-- ------------------------------------------------------------------------------------------------ results

local function describe(v)
    if type(v) == "string" then
        local s = #v > 40 and v:sub(1, 40) .. "..." or v
        return ("a string (%q)"):format(s)
    end
    if type(v) == "number" then return tostring(v) end
    return type(v) == "nil" and "nil" or "a " .. type(v)
end

-- A reward function's result -> score, info; or nil, nil, what is wrong with it.
local function check_result(r)
    local score, info
    if type(r) == "number" then
        score = r
    elseif type(r) == "table" then
        score, info = r.score, r.info
        if type(score) ~= "number" then
            return nil, nil, "returned a table without a numeric score (score = " .. describe(score) .. ")"
        end
        if info ~= nil and type(info) ~= "table" then
            return nil, nil, "returned info that is not a table (" .. describe(info) .. ")"
        end
    else
        return nil, nil, "returned " .. describe(r) .. " (expected a number or {score = number, info = table})"
    end
    if score ~= score then return nil, nil, "returned NaN as its score" end
    if score == huge or score == -huge then return nil, nil, "returned an infinite score (" .. tostring(score) .. ")" end
    return score, info or {}
end

M.check_result = check_result

local function traceback(e)
    local ok, msg = pcall(tostring, e)
    if not ok then msg = "(error object whose __tostring failed)" end
    return debug.traceback(msg, 2)
end

function M.evaluate(fn, response, sample)
    if not callable(fn) then
        return nil, nil, "reward function is not callable (" .. describe(fn) .. ")"
    end
    local ok, r = xpcall(fn, traceback, response, sample)
    if not ok then return nil, nil, "reward function raised an error: " .. tostring(r) end
    local score, info, why = check_result(r)
    if score == nil then return nil, nil, "reward function " .. why end
    return score, info, nil
end

function M.evaluate_batch(fn, responses, samples)
    if type(responses) ~= "table" then
        error("ds4.reward.evaluate_batch: responses must be an array, got " .. type(responses), 2)
    end
    local n = #responses
    if samples ~= nil then
        if type(samples) ~= "table" then
            error("ds4.reward.evaluate_batch: samples must be an array or nil, got " .. type(samples), 2)
        end
        if #samples ~= n then
            error(("ds4.reward.evaluate_batch: %d responses but %d samples"):format(n, #samples), 2)
        end
    end
    local scores, infos, errors = {}, {}, {}
    for i = 1, n do
        local score, info, err = M.evaluate(fn, responses[i], samples and samples[i])
        if err then
            infos[i] = { error = err }
            errors[#errors + 1] = { index = i, message = err }
        else
            scores[i], infos[i] = score, info
        end
    end
    return scores, infos, errors
end

-- ------------------------------------------------------------------------------------------------ rewards

function M.math_reward(response, sample, opts)
    local ref = reference_of(sample, "math_reward")
    local correct = opts and opts.correct or 1.0
    local wrong = opts and opts.wrong or 0.0
    local no_answer = opts and opts.no_answer or wrong
    local extracted, how = rm.extract_answer(response, opts)
    local info = { extracted = extracted, reference = ref, method = how,
        reference_normalized = (rm.normalize(ref)) }
    if extracted == nil then
        info.reason = "no_answer"
        return { score = no_answer, info = info }
    end
    info.normalized = (rm.normalize(extracted))
    if rm.math_equal(extracted, ref) then
        info.reason = "correct"
        return { score = correct, info = info }
    end
    info.reason = "wrong"
    return { score = wrong, info = info }
end

function M.exact_match(response, sample)
    local ref = reference_of(sample, "exact_match")
    if type(response) ~= "string" then return 0.0 end
    return trim(response) == trim(tostring(ref)) and 1.0 or 0.0
end

local FORMAT_KEYS = { pattern = true, require_boxed = true, think = true }

local function count(s, needle)
    local n, init = 0, 1
    while true do
        local _, e = s:find(needle, init, true)
        if not e then return n end
        n, init = n + 1, e + 1
    end
end

function M.format_reward(response, opts)
    if type(opts) ~= "table" then error("ds4.reward.format_reward: opts table expected, got " .. type(opts), 2) end
    for k in pairs(opts) do
        if not FORMAT_KEYS[k] then
            error("ds4.reward.format_reward: unknown option " .. tostring(k) .. " (pattern, require_boxed, think)", 2)
        end
    end
    if opts.pattern == nil and not opts.require_boxed and not opts.think then
        error("ds4.reward.format_reward: no condition given (pattern, require_boxed, think)", 2)
    end
    if opts.pattern ~= nil and type(opts.pattern) ~= "string" then
        error("ds4.reward.format_reward: pattern must be a string", 2)
    end
    if type(response) ~= "string" then return 0.0 end
    local answer_part = response
    if opts.think then
        if count(response, "</think>") ~= 1 then return 0.0 end
        local opens = count(response, "<think>")
        if opens > 1 or (opens == 1 and not response:find("^%s*<think>")) then return 0.0 end
        local _, e = response:find("</think>", 1, true)
        answer_part = response:sub(e + 1)
        if not answer_part:find("%S") then return 0.0 end
    end
    if opts.require_boxed and rm.extract_boxed(answer_part) == nil then return 0.0 end
    if opts.pattern and not response:find(opts.pattern) then return 0.0 end
    return 1.0
end

local function check_len(fname, len)
    if type(len) ~= "number" or len ~= len or len < 0 then
        error("ds4.reward." .. fname .. ": length must be a non-negative number, got " .. tostring(len), 3)
    end
end

local function opt_number(fname, opts, key, default)
    local v = opts[key]
    if v == nil then v = default end
    if type(v) ~= "number" or v ~= v then
        error("ds4.reward." .. fname .. ": opts." .. key .. " must be a number, got " .. tostring(v), 3)
    end
    return v
end

function M.length_penalty(len, opts)
    check_len("length_penalty", len)
    if type(opts) ~= "table" then error("ds4.reward.length_penalty: opts table expected", 2) end
    local max_len = opt_number("length_penalty", opts, "max_len")
    local cache_len = opt_number("length_penalty", opts, "cache_len")
    local factor = opt_number("length_penalty", opts, "factor", 1.0)
    if max_len <= 0 or cache_len < 0 or cache_len > max_len then
        error(("ds4.reward.length_penalty: need 0 <= cache_len <= max_len and max_len > 0 (max_len = %s, "
            .. "cache_len = %s)"):format(tostring(max_len), tostring(cache_len)), 2)
    end
    local expected = max_len - cache_len
    if len <= expected then return 0.0 end
    if len <= max_len then return (expected - len) / cache_len * factor end
    return -factor
end

function M.linear_length_penalty(len, opts)
    check_len("linear_length_penalty", len)
    if type(opts) ~= "table" then error("ds4.reward.linear_length_penalty: opts table expected", 2) end
    local max_len = opt_number("linear_length_penalty", opts, "max_len")
    local target = opt_number("linear_length_penalty", opts, "target_len", 0)
    local factor = opt_number("linear_length_penalty", opts, "factor", 1.0)
    if target < 0 or max_len <= target then
        error("ds4.reward.linear_length_penalty: need 0 <= target_len < max_len", 2)
    end
    if len <= target then return 0.0 end
    local frac = (len - target) / (max_len - target)
    if frac > 1 then frac = 1 end
    return -factor * frac
end

function M.overlong_reward(opts)
    if type(opts) ~= "table" then error("ds4.reward.overlong_reward: opts table expected", 2) end
    local penalty = opts.linear and M.linear_length_penalty or M.length_penalty
    local popts = {}
    for k, v in pairs(opts) do
        if k ~= "linear" and k ~= "length" then popts[k] = v end
    end
    penalty(0, popts) -- validate the options now
    local length_fn = opts.length
    return function(response, sample)
        local len
        if length_fn then
            len = length_fn(response, sample)
        elseif type(sample) == "table" and sample.response_len ~= nil then
            len = sample.response_len
        elseif type(sample) == "table" and type(sample.response_ids) == "table" then
            len = #sample.response_ids
        else
            error("ds4.reward.overlong_reward: no response length (give sample.response_len, "
                .. "sample.response_ids or opts.length)", 2)
        end
        return { score = penalty(len, popts), info = { length = len } }
    end
end

function M.combine(list)
    if type(list) ~= "table" then error("ds4.reward.combine: array of reward functions expected", 2) end
    local comps, seen = {}, {}
    for i, e in ipairs(list) do
        local fn, weight, name
        if callable(e) and type(e) ~= "table" then
            fn = e
        elseif type(e) == "table" then
            fn, weight, name = e.fn or e[1], e.weight or e[2], e.name or e[3]
        end
        if not callable(fn) then error(("ds4.reward.combine: entry %d has no callable reward function"):format(i), 2) end
        if weight == nil then weight = 1.0 end
        if type(weight) ~= "number" or weight ~= weight or weight == huge or weight == -huge then
            error(("ds4.reward.combine: entry %d: weight must be a finite number"):format(i), 2)
        end
        name = name == nil and ("r" .. i) or tostring(name)
        if seen[name] then error(("ds4.reward.combine: duplicate component name %q"):format(name), 2) end
        seen[name] = true
        comps[#comps + 1] = { fn = fn, weight = weight, name = name }
    end
    if #comps == 0 then error("ds4.reward.combine: no reward functions", 2) end
    return function(response, sample)
        local total, info = 0.0, {}
        for _, c in ipairs(comps) do
            local score, ci, why = check_result(c.fn(response, sample))
            if score == nil then error(("combine: component %q %s"):format(c.name, why), 0) end
            total = total + c.weight * score
            info[c.name] = { score = score, weight = c.weight, info = ci }
        end
        return { score = total, info = info }
    end
end

return M
