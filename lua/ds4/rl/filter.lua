--[==[ ds4.rl.filter — DAPO dynamic sampling and overlong handling (the filter side).

Citations docs/rl.md, "Name" refer to sections of docs/rl.md.

  keep_groups(samples [, {key = "reward", tol = 0}]) -> kept, counts
      DAPO dynamic sampling (docs/rl.md, "Dynamic sampling"): drop every group whose rewards are all equal
      (max - min <= tol; zero std: no learning signal for a group-relative advantage). A group of one is
      all-equal and is dropped.
      key names the sample field compared (default "reward"; verl-recipe#125: filter on the binary accuracy,
      not on a shaped score, so pass key = "acc" when rewards are shaped). Order is preserved.
      counts = {groups, kept_groups, dropped_groups, samples, kept_samples, frac_zero_std}
  fill_batch(gen_fn, want_groups [, max_extra_batches = 9 [, opts]]) -> samples, full, stats
      Calls gen_fn() (-> array of samples, whole groups) once, then up to max_extra_batches more times, keeping
      informative groups (keep_groups with opts) until want_groups are collected. Returns exactly want_groups
      groups when full (later groups are dropped, as verl trims to the train batch), else everything collected,
      with full = false (verl raises at the cap, max_num_gen_batches = 10 in total: 1 + 9 extra; the caller
      decides here). Group ids must be unique across calls (e.g. a prompt uid): a repeat is an error.
      stats = {calls, groups_seen, groups_kept, groups_used, samples}
  overlong_filter(samples [, {reason = "length"}]) -> n_masked
      Overlong filtering (docs/rl.md, "Overlong handling"): a sample truncated at the length limit
      (finish_reason == "length", or sample.truncated == true) gets mask = all 0 (as many zeros as its mask /
      logp / rollout_logp / old_logp / ids array has entries, else sample.length). Its reward stays, so it still
      counts in its group's baseline (NeMo overlong_filtering). Off in the DAPO preset (verl docs: most paper
      experiments ran without it).
  soft_overlong(len, max_len, cache [, factor = 1]) -> penalty
      DAPO Eq. 13 soft overlong punishment (docs/rl.md, "Overlong handling"; TRL other_rewards.py, verl dapo
      reward manager):
          0                                  if L <= Lmax - Lcache
          ((Lmax - Lcache) - L) / Lcache     if Lmax - Lcache < L <= Lmax
          -1                                 if L > Lmax
      times factor (verl penalty_factor; DAPO 32B: Lmax 20480, Lcache 4096, factor 1.0).
  apply_soft_overlong(samples, {max_len, cache, factor}) -> {penalized, penalty_mean}
      adds soft_overlong(L) to sample.reward and records it as sample.overlong_penalty (a second call replaces
      the earlier penalty instead of adding twice). L = sample.length or #sample.logp (or #sample.ids / #mask).
      NOTE: ds4.reward (another module) may apply its own reward-side length penalty; use one of the two.
]==]

local M = {}

local util = require("ds4.rl.util")
local fail = util.failer("filter")

-- Groups in first-appearance order.
local function groups_of(samples, fn)
    local ids, members = {}, {}
    for i, s in ipairs(samples) do
        if type(s) ~= "table" then fail(fn, ("sample %d is not a table"):format(i), 3) end
        local g = s.group
        if g == nil then fail(fn, ("sample %d has no group id"):format(i), 3) end
        local l = members[g]
        if not l then
            l = {}
            members[g] = l
            ids[#ids + 1] = g
        end
        l[#l + 1] = i
    end
    return ids, members
end

local function informative(samples, list, key, tol, fn)
    local lo, hi = math.huge, -math.huge
    for _, i in ipairs(list) do
        local v = samples[i][key]
        if type(v) ~= "number" then fail(fn, ("sample %d: %s must be a number"):format(i, key), 4) end
        if v < lo then lo = v end
        if v > hi then hi = v end
    end
    return hi - lo > tol
end

function M.keep_groups(samples, opts)
    opts = opts or {}
    local key, tol = opts.key or "reward", opts.tol or 0
    local ids, members = groups_of(samples, "keep_groups")
    local keep = {}
    local kept_groups = 0
    for _, g in ipairs(ids) do
        if informative(samples, members[g], key, tol, "keep_groups") then
            keep[g] = true
            kept_groups = kept_groups + 1
        end
    end
    local kept = {}
    for _, s in ipairs(samples) do
        if keep[s.group] then kept[#kept + 1] = s end
    end
    local n = #ids
    return kept, { groups = n, kept_groups = kept_groups, dropped_groups = n - kept_groups, samples = #samples,
        kept_samples = #kept, frac_zero_std = n > 0 and (n - kept_groups) / n or 0 }
end

function M.fill_batch(gen_fn, want_groups, max_extra_batches, opts)
    if type(gen_fn) ~= "function" then fail("fill_batch", "gen_fn must be a function", 2) end
    if type(want_groups) ~= "number" or want_groups < 1 then fail("fill_batch", "want_groups must be >= 1", 2) end
    max_extra_batches = max_extra_batches or 9
    local seen_ids = {}
    local groups = {} -- array of arrays of samples, in arrival order
    local stats = { calls = 0, groups_seen = 0, groups_kept = 0 }
    while #groups < want_groups and stats.calls <= max_extra_batches do
        local batch = gen_fn()
        stats.calls = stats.calls + 1
        if type(batch) ~= "table" then fail("fill_batch", "gen_fn must return an array of samples", 2) end
        local ids, members = groups_of(batch, "fill_batch")
        for _, g in ipairs(ids) do
            if seen_ids[g] then
                fail("fill_batch", ("group id %s returned by two gen_fn calls (ids must be unique)"):format(tostring(g)), 2)
            end
            seen_ids[g] = true
        end
        stats.groups_seen = stats.groups_seen + #ids
        local kept = M.keep_groups(batch, opts)
        local _, kmembers = groups_of(kept, "fill_batch")
        for _, g in ipairs(ids) do
            local l = kmembers[g]
            if l then
                local list = {}
                for _, i in ipairs(l) do list[#list + 1] = kept[i] end
                groups[#groups + 1] = list
                stats.groups_kept = stats.groups_kept + 1
            end
        end
    end
    local full = #groups >= want_groups
    local out = {}
    local used = math.min(#groups, want_groups)
    for k = 1, used do
        for _, s in ipairs(groups[k]) do out[#out + 1] = s end
    end
    stats.groups_used = used
    stats.samples = #out
    return out, full, stats
end

function M.overlong_filter(samples, opts)
    opts = opts or {}
    local reason = opts.reason or "length"
    local n = 0
    for i, s in ipairs(samples) do
        if s.finish_reason == reason or s.truncated == true then
            local arr = s.mask or s.logp or s.rollout_logp or s.old_logp or s.ids
            local len = type(arr) == "table" and #arr or s.length
            if type(len) ~= "number" then
                fail("overlong_filter", ("sample %d: cannot tell its token count"):format(i), 2)
            end
            local m = {}
            for t = 1, len do m[t] = 0 end
            s.mask = m
            n = n + 1
        end
    end
    return n
end

function M.soft_overlong(len, max_len, cache, factor)
    if type(len) ~= "number" or type(max_len) ~= "number" or type(cache) ~= "number" or cache <= 0
        or cache > max_len then
        fail("soft_overlong", "needs numbers len, max_len and 0 < cache <= max_len", 2)
    end
    factor = factor or 1.0
    local expected = max_len - cache
    if len <= expected then return 0 end
    if len <= max_len then return (expected - len) / cache * factor end
    return -factor
end

local function length_of(s)
    if type(s.length) == "number" then return s.length end
    local a = s.logp or s.ids or s.mask
    if type(a) == "table" then return #a end
    return nil
end

function M.apply_soft_overlong(samples, opts)
    if type(opts) ~= "table" then fail("apply_soft_overlong", "opts = {max_len, cache, factor} required", 2) end
    local np, sum = 0, 0
    for i, s in ipairs(samples) do
        local L = length_of(s)
        if not L then fail("apply_soft_overlong", ("sample %d: cannot tell its length"):format(i), 2) end
        if type(s.reward) ~= "number" then fail("apply_soft_overlong", ("sample %d: reward must be a number"):format(i), 2) end
        local p = M.soft_overlong(L, opts.max_len, opts.cache, opts.factor)
        s.reward = s.reward - (s.overlong_penalty or 0) + p
        s.overlong_penalty = p
        if p ~= 0 then np = np + 1 end
        sum = sum + p
    end
    return { penalized = np, penalty_mean = #samples > 0 and sum / #samples or 0 }
end

return M
