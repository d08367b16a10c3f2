--[==[ ds4.rl.stats — the per-step rollout metrics of ds4.rl.trainer, from the step's generated samples.

  local stats = require("ds4.rl.stats")
  local acc = stats.new()
  stats.add(acc, {reward = number | nil, info = table | nil, length = n, finish_reason = "..."})  -- each sample
  stats.row(acc, row)            -- adds the metrics below to `row`

Metrics (over the step's generated samples that did not fail; a sample whose reward errored counts for the lengths
but not for the rewards):
  reward/mean, reward/std (population), reward/min, reward/max
  rewards/NAME           the mean of each reward component by name (TRL's rewards/<name>): an entry of the
                         reward's info that is a table with a numeric score (ds4.reward.combine's
                         {[name] = {score, weight, info}})
  response_len/mean, response_len/min, response_len/max   generated tokens per sample (a final EOS included)
  response_len/clipped_ratio   the fraction cut by max_new_tokens (finish_reason "length": TRL's clipped_ratio)
]==]

local M = {}

function M.new()
    return { n = 0, rn = 0, sum = 0, sq = 0, min = math.huge, max = -math.huge, len_sum = 0, len_min = math.huge,
        len_max = 0, clipped = 0, comp = {}, comp_order = {} }
end

function M.add(acc, s)
    acc.n = acc.n + 1
    acc.len_sum = acc.len_sum + s.length
    acc.len_min = math.min(acc.len_min, s.length)
    acc.len_max = math.max(acc.len_max, s.length)
    if s.finish_reason == "length" then acc.clipped = acc.clipped + 1 end
    local r = s.reward
    if r == nil then return end
    acc.rn, acc.sum, acc.sq = acc.rn + 1, acc.sum + r, acc.sq + r * r
    acc.min, acc.max = math.min(acc.min, r), math.max(acc.max, r)
    if type(s.info) == "table" then
        for name, c in pairs(s.info) do
            if type(name) == "string" and type(c) == "table" and type(c.score) == "number" then
                local e = acc.comp[name]
                if not e then
                    e = { sum = 0, n = 0 }
                    acc.comp[name] = e
                    acc.comp_order[#acc.comp_order + 1] = name
                end
                e.sum, e.n = e.sum + c.score, e.n + 1
            end
        end
    end
end

function M.row(acc, row)
    if acc.rn > 0 then
        local mean = acc.sum / acc.rn
        row["reward/mean"] = mean
        row["reward/std"] = math.sqrt(math.max(0, acc.sq / acc.rn - mean * mean))
        row["reward/min"], row["reward/max"] = acc.min, acc.max
    else
        row["reward/mean"] = 0
    end
    for _, name in ipairs(acc.comp_order) do
        local e = acc.comp[name]
        row["rewards/" .. name] = e.sum / e.n
    end
    if acc.n > 0 then
        row["response_len/mean"] = acc.len_sum / acc.n
        row["response_len/min"], row["response_len/max"] = acc.len_min, acc.len_max
        row["response_len/clipped_ratio"] = acc.clipped / acc.n
    else
        row["response_len/mean"] = 0
    end
    return row
end

return M
