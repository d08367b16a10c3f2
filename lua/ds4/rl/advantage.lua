--[==[ ds4.rl.advantage — advantage estimators (pure Lua; LuaJIT 2.1 / Lua 5.1).

Citations docs/rl.md, "Name" refer to sections of docs/rl.md (formulas, defaults and the frameworks they follow).

Data layout (shared by every ds4.rl module). A batch is an array of samples; a sample holds response tokens
only (the prompt is not part of these arrays):
  sample.reward        scalar task reward R_i (outcome reward)
  sample.group         group id (any Lua value usable as a table key): the G responses of one prompt share it
  sample.mask          optional array, 1 = trained token, 0 = not (default all 1)
  sample.logp / old_logp / rollout_logp / ref_logp   per-token log-probabilities (see ds4.rl.loss)
  sample.token_rewards optional per-token rewards (process rewards) for the token-level estimators
  sample.kl_reward     optional, written by ds4.rl.loss.kl_in_reward: per-token array or scalar (-beta * KL)
  sample.values        per-token value estimates V_t (only for kind = "gae")
Outputs written by compute(): sample.adv (a number, broadcast over the response, for the outcome estimators;
a per-token array for the token-level ones) and sample.returns (per-token, "gae" / "reinforce_pp").

Functions
  group_mean(rewards, groups [, {std = true, eps = 1e-6, unbiased = true}]) -> advantages (array)
      GRPO (docs/rl.md, "GRPO"):  A_i = (R_i - mean_g R) / (std_g R + eps)   with std = true
                                   A_i =  R_i - mean_g R                 with std = false ("Dr.GRPO")
      std is the unbiased (Bessel-corrected, n - 1) sample standard deviation: torch.std's default, which verl
      compute_grpo_outcome_advantage calls (the other frameworks use torch's default .std() too); unbiased =
      false uses the population std. eps = 1e-6 is the verl / Miles / NeMo value (OpenRLHF 1e-9, TRL 1e-4: pass it).
      A group of one gets A = 0 (its baseline is its own reward: NeMo, and Miles which switches std off for
      n = 1; verl instead uses mean 0, std 1 there, i.e. A = R).
  leave_one_out(rewards, groups) -> advantages
      RLOO (docs/rl.md, "RLOO"): A_i = R_i - (sum_{j in g, j != i} R_j) / (n_g - 1)  (= n/(n-1) (R_i - mean));
      n = 1 -> 0.
  dr_grpo(rewards, groups) -> advantages           Dr.GRPO (docs/rl.md, "Dr.GRPO"): R_i - mean_g R, no std division.
  whiten(samples, values [, {eps = 1e-8, unbiased = true}]) -> values (new per-sample arrays)
      Batch whitening over the masked tokens of the whole batch, as verl masked_whiten (docs/rl.md, "Whitening"):
      (v - mean) / sqrt(var + eps), var the masked variance with Bessel correction N/(N-1); masked-out tokens
      get 0. One trained token (N = 1): v - mean = 0.
  reinforce_pp_baseline(samples [, {eps = 1e-8}]) -> per-sample arrays
      REINFORCE++-baseline (docs/rl.md, "REINFORCE++"; verl core_algos.py:422-473, Miles, OpenRLHF
      reinforce_baseline):
      A_t = (S_i - mean_g S) + kl_t, then whitened over all masked tokens of the batch. S_i = reward (+ the
      scalar kl_reward), kl_t = the per-token kl_reward (0 when absent). Singleton group: mean = S_i.
  reinforce_pp(samples [, {gamma = 1, eps = 1e-8}]) -> advantages, returns (per-sample arrays)
      REINFORCE++ (docs/rl.md, "REINFORCE++", arXiv 2501.03262; verl core_algos.py:582-618, Miles
      get_reinforce_plus_plus_returns): token rewards r_t (see token_rewards below), discounted return
      G_t = r_t + gamma G_{t+1} over the trained tokens (untrained tokens are skipped: they carry G through
      unchanged, as verl's GAE does for observation tokens), then advantages = whiten(G).
  token_rewards(sample) -> array
      sample.token_rewards (copied) or zeros with sample.reward at the last trained token (docs/rl.md,
      "REINFORCE++": the scalar reward sits at the last masked token), plus sample.kl_reward (per token, or a
      scalar added at the last trained token).
  gae(token_rewards, values, gamma, lambda [, mask]) -> advantages, returns (arrays)
      GAE (docs/rl.md, "GAE"; verl core_algos.py:214-262): delta_t = r_t + gamma V_{t+1} - V_t (V after the last
      token = 0), A_t = delta_t + gamma lambda A_{t+1}, returns = A + V. With a mask, untrained tokens are
      skipped exactly as verl does: the next value and the running A are carried through them unchanged (their
      own A is the carried value; they are not trained). Defaults elsewhere: gamma = lambda = 1 (Miles, verl,
      OpenRLHF). NOTE: ds4 has no value head yet (deferred: critic model, value loss = clipped MSE, docs/rl.md,
      "GAE"); gae is implemented and tested so a value head can plug in: put per-token V_t in sample.values.
  compute(samples, spec) -> stats
      spec.kind:
        "grpo"                   group_mean with spec.std (default true), spec.eps (1e-6), spec.unbiased
        "dr_grpo"                group_mean, std = false
        "rloo"                   leave_one_out
        "reinforce_pp_baseline"  per-token, see above (spec.eps)
        "reinforce_pp"           per-token, see above (spec.gamma, spec.eps); also writes sample.returns
        "gae"                    per-token from sample.values, spec.gamma (1), spec.lambda (1); writes
                                 sample.returns; whitened unless spec.whiten == false (verl, OpenRLHF)
        "given"                  keep sample.adv as set by the caller
      Outcome kinds use the score S_i = sample.reward + kl_reward (a scalar kl_reward, or the sum of a
      per-token one over the trained tokens, as verl sums token_level_rewards) and write sample.adv = number.
      spec.whiten = true after an outcome kind: additional batch whitening over masked tokens (Miles
      --normalize-advantages, docs/rl.md, "GRPO"), which turns sample.adv into per-token arrays.
      stats = {adv_mean, adv_std, adv_min, adv_max (over trained tokens), reward_mean, groups,
               zero_std_groups (groups whose scores are all equal), tokens}
]==]

local M = {}

local sqrt, huge = math.sqrt, math.huge

local util = require("ds4.rl.util")
local fail = util.failer("advantage")
local mask_at = util.mask_at

local function ntok(s)
    local lp = s.logp or s.old_logp or s.rollout_logp or s.mask or s.token_rewards or s.values
    if type(lp) ~= "table" then return nil end
    return #lp
end

-- Groups in first-appearance order: ids (array), members[id] = array of indices.
local function collect_groups(groups, n, fn)
    if type(groups) ~= "table" then fail(fn, "groups must be an array of group ids", 3) end
    local ids, members = {}, {}
    for i = 1, n do
        local g = groups[i]
        if g == nil then fail(fn, ("group id of sample %d is missing"):format(i), 3) end
        local list = members[g]
        if not list then
            list = {}
            members[g] = list
            ids[#ids + 1] = g
        end
        list[#list + 1] = i
    end
    return ids, members
end

local function check_rewards(rewards, fn)
    if type(rewards) ~= "table" then fail(fn, "rewards must be an array of numbers", 3) end
    for i = 1, #rewards do
        if type(rewards[i]) ~= "number" or rewards[i] ~= rewards[i] then
            fail(fn, ("reward %d is not a number (%s)"):format(i, tostring(rewards[i])), 3)
        end
    end
end

-- Mean and standard deviation of the rewards of one group.
local function group_stats(rewards, list, unbiased)
    local n, sum = #list, 0
    for _, i in ipairs(list) do sum = sum + rewards[i] end
    local mean = sum / n
    local ss = 0
    for _, i in ipairs(list) do
        local d = rewards[i] - mean
        ss = ss + d * d
    end
    local std = 0
    if n > 1 then std = sqrt(ss / (unbiased and (n - 1) or n)) end
    return mean, std, sum
end

function M.group_mean(rewards, groups, opts)
    opts = opts or {}
    check_rewards(rewards, "group_mean")
    local use_std = opts.std ~= false
    local eps = opts.eps or 1e-6
    local unbiased = opts.unbiased ~= false
    local n = #rewards
    local ids, members = collect_groups(groups, n, "group_mean")
    local adv = {}
    for _, g in ipairs(ids) do
        local list = members[g]
        local mean, std = group_stats(rewards, list, unbiased)
        for _, i in ipairs(list) do
            if #list == 1 then
                adv[i] = 0
            elseif use_std then
                adv[i] = (rewards[i] - mean) / (std + eps)
            else
                adv[i] = rewards[i] - mean
            end
        end
    end
    return adv
end

function M.dr_grpo(rewards, groups)
    return M.group_mean(rewards, groups, { std = false })
end

function M.leave_one_out(rewards, groups)
    check_rewards(rewards, "leave_one_out")
    local n = #rewards
    local ids, members = collect_groups(groups, n, "leave_one_out")
    local adv = {}
    for _, g in ipairs(ids) do
        local list = members[g]
        local k = #list
        local _, _, sum = group_stats(rewards, list, true)
        for _, i in ipairs(list) do
            if k == 1 then adv[i] = 0 else adv[i] = rewards[i] - (sum - rewards[i]) / (k - 1) end
        end
    end
    return adv
end

-- ------------------------------------------------------------------------------------------------ whitening

function M.whiten(samples, values, opts)
    opts = opts or {}
    local eps = opts.eps or 1e-8
    local unbiased = opts.unbiased ~= false
    local n, sum = 0, 0
    for i, s in ipairs(samples) do
        local v = values[i]
        for t = 1, #v do
            local m = mask_at(s, t)
            if m ~= 0 then
                n = n + m
                sum = sum + m * v[t]
            end
        end
    end
    local out = {}
    if n == 0 then
        for i = 1, #samples do
            local o = {}
            for t = 1, #values[i] do o[t] = 0 end
            out[i] = o
        end
        return out
    end
    local mean = sum / n
    local ss = 0
    for i, s in ipairs(samples) do
        local v = values[i]
        for t = 1, #v do
            local m = mask_at(s, t)
            if m ~= 0 then
                local d = v[t] - mean
                ss = ss + m * d * d
            end
        end
    end
    local var = ss / n
    if unbiased then
        if n > 1 then var = var * n / (n - 1) else var = 0 end
    end
    local scale = 1 / sqrt(var + eps)
    for i, s in ipairs(samples) do
        local v, o = values[i], {}
        for t = 1, #v do
            if mask_at(s, t) ~= 0 then o[t] = (v[t] - mean) * scale else o[t] = 0 end
        end
        out[i] = o
    end
    return out
end

-- ------------------------------------------------------------------------------------------------ scores

-- The outcome score S_i: reward plus the KL shaping written by ds4.rl.loss.kl_in_reward (scalar, or the sum
-- of a per-token array over the trained tokens).
local function score(s, i, fn)
    local r = s.reward
    if type(r) ~= "number" or r ~= r then
        fail(fn, ("sample %d: reward must be a number (got %s)"):format(i, tostring(r)), 3)
    end
    local k = s.kl_reward
    if type(k) == "number" then
        r = r + k
    elseif type(k) == "table" then
        for t = 1, #k do
            if mask_at(s, t) ~= 0 then r = r + k[t] end
        end
    end
    return r
end

local function last_trained(s, n)
    for t = n, 1, -1 do
        if mask_at(s, t) ~= 0 then return t end
    end
    return nil
end

function M.token_rewards(s)
    local n = ntok(s)
    if not n then error("ds4.rl.advantage.token_rewards: sample has no per-token arrays", 2) end
    local r = {}
    local last = last_trained(s, n)
    if type(s.token_rewards) == "table" then
        for t = 1, n do r[t] = s.token_rewards[t] or 0 end
    else
        for t = 1, n do r[t] = 0 end
        if last then r[last] = r[last] + (s.reward or 0) end
    end
    local k = s.kl_reward
    if type(k) == "table" then
        for t = 1, n do r[t] = r[t] + (k[t] or 0) end
    elseif type(k) == "number" and last then
        r[last] = r[last] + k
    end
    return r
end

-- ------------------------------------------------------------------------------------------------ token-level

function M.reinforce_pp_baseline(samples, opts)
    opts = opts or {}
    local scores, groups = {}, {}
    for i, s in ipairs(samples) do
        local r = s.reward
        if type(r) ~= "number" or r ~= r then
            fail("reinforce_pp_baseline", ("sample %d: reward must be a number"):format(i), 2)
        end
        if type(s.kl_reward) == "number" then r = r + s.kl_reward end
        scores[i] = r
        groups[i] = s.group
    end
    local centered = M.group_mean(scores, groups, { std = false })
    local vals = {}
    for i, s in ipairs(samples) do
        local n = ntok(s)
        if not n then fail("reinforce_pp_baseline", ("sample %d has no per-token arrays"):format(i), 2) end
        local v, k = {}, s.kl_reward
        for t = 1, n do
            v[t] = centered[i] + (type(k) == "table" and (k[t] or 0) or 0)
        end
        vals[i] = v
    end
    return M.whiten(samples, vals, { eps = opts.eps })
end

function M.reinforce_pp(samples, opts)
    opts = opts or {}
    local gamma = opts.gamma or 1.0
    local rets = {}
    for i, s in ipairs(samples) do
        local r = M.token_rewards(s)
        local g, running = {}, 0
        for t = #r, 1, -1 do
            if mask_at(s, t) ~= 0 then running = r[t] + gamma * running end
            g[t] = running
        end
        rets[i] = g
    end
    return M.whiten(samples, rets, { eps = opts.eps }), rets
end

function M.gae(token_rewards, values, gamma, lambda, mask)
    if type(token_rewards) ~= "table" or type(values) ~= "table" or #token_rewards ~= #values then
        error("ds4.rl.advantage.gae: token_rewards and values must be arrays of the same length", 2)
    end
    gamma = gamma or 1.0
    lambda = lambda or 1.0
    local n = #values
    local adv, ret = {}, {}
    local nextv, lastgae = 0, 0
    for t = n, 1, -1 do
        local delta = token_rewards[t] + gamma * nextv - values[t]
        local a = delta + gamma * lambda * lastgae
        local m = mask and mask[t] or 1
        if m ~= 0 then
            nextv = values[t]
            lastgae = a
        end
        adv[t] = lastgae
    end
    for t = 1, n do ret[t] = adv[t] + values[t] end
    return adv, ret
end

-- ------------------------------------------------------------------------------------------------ dispatch

local OUTCOME = { grpo = true, dr_grpo = true, rloo = true }

function M.compute(samples, spec)
    if type(samples) ~= "table" then fail("compute", "samples must be an array of samples", 2) end
    if type(spec) ~= "table" or type(spec.kind) ~= "string" then
        fail("compute", "spec.kind is required (grpo|dr_grpo|rloo|reinforce_pp|reinforce_pp_baseline|gae|given)", 2)
    end
    local kind = spec.kind
    local scores, groups = {}, {}
    for i, s in ipairs(samples) do
        if type(s) ~= "table" then fail("compute", ("sample %d is not a table"):format(i), 2) end
        if OUTCOME[kind] or kind == "reinforce_pp_baseline" then
            scores[i] = score(s, i, "compute")
            groups[i] = s.group
        elseif type(s.reward) == "number" then
            scores[i] = s.reward
            groups[i] = s.group
        end
    end
    if OUTCOME[kind] then
        local adv
        if kind == "grpo" then
            adv = M.group_mean(scores, groups, { std = spec.std ~= false, eps = spec.eps, unbiased = spec.unbiased })
        elseif kind == "dr_grpo" then
            adv = M.group_mean(scores, groups, { std = false })
        else
            adv = M.leave_one_out(scores, groups)
        end
        for i, s in ipairs(samples) do s.adv = adv[i] end
        if spec.whiten then
            local vals = {}
            for i, s in ipairs(samples) do
                local v = {}
                for t = 1, ntok(s) do v[t] = adv[i] end
                vals[i] = v
            end
            local w = M.whiten(samples, vals, { eps = spec.whiten_eps })
            for i, s in ipairs(samples) do s.adv = w[i] end
        end
    elseif kind == "reinforce_pp_baseline" then
        local adv = M.reinforce_pp_baseline(samples, { eps = spec.eps })
        for i, s in ipairs(samples) do s.adv = adv[i] end
    elseif kind == "reinforce_pp" then
        local adv, ret = M.reinforce_pp(samples, { gamma = spec.gamma, eps = spec.eps })
        for i, s in ipairs(samples) do
            s.adv = adv[i]
            s.returns = ret[i]
        end
    elseif kind == "gae" then
        local advs = {}
        for i, s in ipairs(samples) do
            if type(s.values) ~= "table" then
                fail("compute", ("sample %d: kind gae needs sample.values (per-token V_t; no value head in ds4 yet)")
                    :format(i), 2)
            end
            local a, r = M.gae(M.token_rewards(s), s.values, spec.gamma, spec.lambda, s.mask)
            advs[i] = a
            s.returns = r
        end
        if spec.whiten ~= false then advs = M.whiten(samples, advs, { eps = spec.whiten_eps }) end
        for i, s in ipairs(samples) do s.adv = advs[i] end
    elseif kind == "given" then
        for i, s in ipairs(samples) do
            if s.adv == nil then fail("compute", ("sample %d: kind given needs sample.adv"):format(i), 2) end
        end
    else
        fail("compute", "unknown advantage kind " .. tostring(kind), 2)
    end
    return M.stats(samples, scores, groups)
end

-- Summary of sample.adv over trained tokens, and of the group scores.
function M.stats(samples, scores, groups)
    local n, sum, sq, lo, hi = 0, 0, 0, huge, -huge
    for _, s in ipairs(samples) do
        local a, len = s.adv, ntok(s) or 0
        for t = 1, len do
            local m = mask_at(s, t)
            if m ~= 0 then
                local v = type(a) == "table" and a[t] or a
                if type(v) == "number" then
                    n = n + m
                    sum = sum + m * v
                    sq = sq + m * v * v
                    if v < lo then lo = v end
                    if v > hi then hi = v end
                end
            end
        end
    end
    local st = { tokens = n }
    if n > 0 then
        st.adv_mean = sum / n
        st.adv_std = sqrt(math.max(sq / n - st.adv_mean ^ 2, 0))
        st.adv_min, st.adv_max = lo, hi
    end
    local complete = scores ~= nil and groups ~= nil and #samples > 0
    for i = 1, complete and #samples or 0 do
        if type(scores[i]) ~= "number" or groups[i] == nil then complete = false break end
    end
    if complete then
        local rs = 0
        for i = 1, #scores do rs = rs + scores[i] end
        st.reward_mean = rs / #scores
        local ids, members = collect_groups(groups, #scores, "stats")
        local zero = 0
        for _, g in ipairs(ids) do
            local l = members[g]
            local same = true
            for k = 2, #l do
                if scores[l[k]] ~= scores[l[1]] then same = false break end
            end
            if same then zero = zero + 1 end
        end
        st.groups, st.zero_std_groups = #ids, zero
    end
    return st
end

return M
