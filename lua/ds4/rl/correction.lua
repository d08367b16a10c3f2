--[==[ ds4.rl.correction — rollout/train mismatch: three-policy importance correction and its metrics.

Citations docs/rl.md, "Name" refer to sections of docs/rl.md.

Three log-probs per token (docs/rl.md, "Mismatch correction"): rollout_logp (reported by the inference engine
with the sample), old_logp (recomputed by the trainer at the same weights, before the update) and logp (current
policy, in ds4.rl.loss). The PPO ratio uses logp - old_logp; this module corrects for old_logp != rollout_logp
(kernel, precision, MoE routing differences) with a DETACHED per-token weight w_t that multiplies the per-token
policy loss ("decoupled / 3-policy PPO", Miles --use-tis, verl rollout_correction, OpenRLHF is_correction, NeMo).
w depends on old_logp and rollout_logp only, never on logp, so it carries no gradient.

  delta_t = clamp(old_logp_t - rollout_logp_t, -20, 20)       (the log-ratio clamp of every framework,
                                                                docs/rl.md, "PPO clip")
  level = "token":      rho_t = exp(delta_t)
  level = "sequence":   rho_t = exp(clamp(sum_u M_u delta_u, -20, 20)) for every token of the sequence
                        (product of token ratios: TRL vllm_importance_sampling_correction "sequence_*")
  level = "geometric":  rho_t = exp(sum_u M_u delta_u / sum_u M_u)  (geometric mean: Miles MIS "geometric")
  mode = "truncate" (TIS):  w = clamp(rho, lo, hi)                        (Miles vanilla_tis_function)
  mode = "mask" (MIS / IcePop):  w = rho if lo <= rho <= hi, else 0       (Miles icepop_function, mis.yaml;
                                                                          OpenRLHF icepop / seq-mask-tis)
  mode = "reject":          w = 1 if lo <= rho <= hi, else 0              (rejection only, verl rollout_rs)
  veto (optional number):   any trained token with exp(delta_t) < veto zeroes the whole sequence (Miles MIS
                            rejection veto, 1e-4)
  normalize = true:         w /= mean of w over the trained tokens of the batch (Miles MIS batch
                            normalisation to mean 1); off by default.
Defaults: hi = 2.0 (Miles --tis-clip 2.0, mis.yaml tis_upper_bound 2.0, verl rollout_is_threshold 2.0);
lo = 0 for "truncate" (Miles --tis-clip-low 0, i.e. only truncation from above as min(rho, C)), 0.5 for "mask" and
"reject" (Miles mis.yaml tis_lower_bound 0.5, OpenRLHF [0.5, 5.0]); level = "token", mode = "truncate".
A token masked by mode = "mask" / "reject" / veto contributes nothing to the policy loss, but it still counts in
the aggregation denominators (they come from sample.mask, so a global token count stays valid across
micro-batches; this is what Miles' multiplicative icepop weights do). KL and entropy terms are not weighted.

Functions
  compute(samples, tis [, old_fallback, scale]) -> {weights = {per-sample arrays, 0 where mask = 0}, metrics = {...}}
      every sample needs rollout_logp and old_logp (error otherwise); old_fallback[i] (an array) stands in for
      a missing old_logp (ds4.rl.loss passes the detached current logp: one update per rollout, old = current);
      scale (normalize): the whole batch's factor when samples are a part of it (norm_scale), else their own
  norm_scale(samples, tis) -> normalize's factor over the whole batch (count / Σ w), or nil (normalize off, or
      nothing to scale): the RL trainer computes it per minibatch and hands it to every micro-batch on every rank,
      so that neither ranks nor micro-batches change the weights
  metrics(samples [, weights, truncated, old_fallback]) -> table, or nil when no sample has rollout_logp:
      mismatch_abs_mean, mismatch_abs_max   mean / max over trained tokens of |old_logp - rollout_logp|
                                            (Miles train_rollout_logprob_abs_diff)
      mismatch_k3                           mean k3 of rollout vs old, x = old - rollout: exp(-x) - 1 + x
                                            (Miles train_rollout_kl)
      token_mult_prob_error                 mean exp|old - rollout| (NeMo; ~1.0, > 1.05 suspicious)
      mismatch_tokens                       trained tokens compared
    and with weights: tis_weight_mean, tis_weight_max, tis_frac_truncated (trained tokens whose rho was
      clamped), tis_frac_masked (trained tokens with weight 0), tis_seq_masked (sequences with every trained
      token at weight 0), tis_ess = (sum w)^2 / (n sum w^2) (Miles ess_ratio, over trained tokens)
]==]

local M = {}

local exp, abs, huge = math.exp, math.abs, math.huge
local CLAMP = 20

local util = require("ds4.rl.util")
local fail = util.failer("correction")
local mask_at = util.mask_at

local function clamp_log(d)
    if d < -CLAMP then return -CLAMP elseif d > CLAMP then return CLAMP end
    return d
end

local LEVELS = { token = true, sequence = true, geometric = true }
local MODES = { truncate = true, mask = true, reject = true }

-- The normalised settings of a tis table (defaults filled in).
function M.settings(tis)
    if type(tis) ~= "table" then fail("settings", "tis must be a table", 3) end
    local level = tis.level or "token"
    local mode = tis.mode or "truncate"
    if not LEVELS[level] then fail("settings", "unknown tis.level " .. tostring(level) .. " (token|sequence|geometric)", 3) end
    if not MODES[mode] then fail("settings", "unknown tis.mode " .. tostring(mode) .. " (truncate|mask|reject)", 3) end
    local lo = tis.lo
    if lo == nil then lo = (mode == "truncate") and 0 or 0.5 end
    local hi = tis.hi or 2.0
    if not (lo <= hi) then fail("settings", ("tis.lo (%g) must not exceed tis.hi (%g)"):format(lo, hi), 3) end
    return { level = level, mode = mode, lo = lo, hi = hi, veto = tis.veto, normalize = tis.normalize == true }
end

-- The unnormalised weights and truncation flags of every sample.
local function raw_weights(samples, cfg, old_fallback)
    local weights, truncated = {}, {}
    for i, s in ipairs(samples) do
        local r, o = s.rollout_logp, s.old_logp
        if o == nil and old_fallback then o = old_fallback[i] end
        if type(r) ~= "table" or type(o) ~= "table" then
            fail("compute", ("sample %d: tis needs both rollout_logp and old_logp"):format(i), 2)
        end
        local n = #o
        if #r ~= n then
            fail("compute", ("sample %d: rollout_logp has %d tokens, old_logp %d"):format(i, #r, n), 2)
        end
        local w, tr = {}, {}
        local seq_rho, vetoed = nil, false
        if cfg.level ~= "token" then
            local sum, cnt = 0, 0
            for t = 1, n do
                local m = mask_at(s, t)
                if m ~= 0 then
                    sum = sum + m * clamp_log(o[t] - r[t])
                    cnt = cnt + m
                end
            end
            if cfg.level == "geometric" and cnt > 0 then sum = sum / cnt end
            seq_rho = exp(clamp_log(sum))
        end
        if cfg.veto then
            for t = 1, n do
                if mask_at(s, t) ~= 0 and exp(clamp_log(o[t] - r[t])) < cfg.veto then vetoed = true break end
            end
        end
        for t = 1, n do
            if mask_at(s, t) == 0 then
                w[t], tr[t] = 0, false
            else
                local rho = seq_rho or exp(clamp_log(o[t] - r[t]))
                local inside = rho >= cfg.lo and rho <= cfg.hi
                local v
                if cfg.mode == "truncate" then
                    v = rho < cfg.lo and cfg.lo or (rho > cfg.hi and cfg.hi or rho)
                    tr[t] = not inside
                elseif cfg.mode == "mask" then
                    v = inside and rho or 0
                    tr[t] = false
                else
                    v = inside and 1 or 0
                    tr[t] = false
                end
                if vetoed then v = 0 end
                w[t] = v
            end
        end
        weights[i], truncated[i] = w, tr
    end
    return weights, truncated
end

-- normalize's factor: trained tokens / Σ weights over them (nil when there is nothing to scale)
local function scale_of(samples, weights)
    local sum, cnt = 0, 0
    for i, s in ipairs(samples) do
        for t = 1, #weights[i] do
            local m = mask_at(s, t)
            if m ~= 0 then
                sum = sum + m * weights[i][t]
                cnt = cnt + m
            end
        end
    end
    return (cnt > 0 and sum > 0) and cnt / sum or nil
end

-- scale (normalize only): the factor to use instead of these samples' own — the whole batch's (norm_scale), when
-- `samples` are one part of it (a micro-batch, a rank's share), so that the split does not change the weights.
function M.compute(samples, tis, old_fallback, scale)
    local cfg = M.settings(tis)
    local weights, truncated = raw_weights(samples, cfg, old_fallback)
    if cfg.normalize then
        local k = scale or scale_of(samples, weights)
        if k then
            for i = 1, #weights do
                local w = weights[i]
                for t = 1, #w do w[t] = w[t] * k end
            end
        end
    end
    return { weights = weights, metrics = M.metrics(samples, weights, truncated, old_fallback) }
end

-- The normalize option's factor over a whole batch (nil: normalize is off, or nothing to scale), for compute's
-- `scale` on each of its parts. Needs every sample's old_logp.
function M.norm_scale(samples, tis)
    local cfg = M.settings(tis)
    if not cfg.normalize then return nil end
    return scale_of(samples, (raw_weights(samples, cfg, nil)))
end

function M.metrics(samples, weights, truncated, old_fallback)
    local n, sabs, mabs, sk3, smult = 0, 0, 0, 0, 0
    local any = false
    for i, s in ipairs(samples) do
        local r, o = s.rollout_logp, s.old_logp
        if o == nil and old_fallback then o = old_fallback[i] end
        if type(r) == "table" and type(o) == "table" then
            any = true
            for t = 1, #o do
                local m = mask_at(s, t)
                if m ~= 0 and r[t] ~= nil then
                    local x = o[t] - r[t]
                    local a = abs(x)
                    n = n + m
                    sabs = sabs + m * a
                    if a > mabs then mabs = a end
                    local xc = clamp_log(x)
                    sk3 = sk3 + m * (exp(-xc) - 1 + xc)
                    smult = smult + m * exp(clamp_log(a))
                end
            end
        end
    end
    if not any then return nil end
    local out = { mismatch_tokens = n, mismatch_abs_max = mabs }
    if n > 0 then
        out.mismatch_abs_mean = sabs / n
        out.mismatch_k3 = sk3 / n
        out.token_mult_prob_error = smult / n
    end
    if weights then
        local cnt, sw, sw2, wmax, ntr, nmask, seqmask = 0, 0, 0, -huge, 0, 0, 0
        for i, s in ipairs(samples) do
            local w, tr = weights[i], truncated and truncated[i]
            local trained, zero = 0, 0
            for t = 1, #w do
                local m = mask_at(s, t)
                if m ~= 0 then
                    cnt = cnt + m
                    trained = trained + 1
                    sw = sw + m * w[t]
                    sw2 = sw2 + m * w[t] * w[t]
                    if w[t] > wmax then wmax = w[t] end
                    if tr and tr[t] then ntr = ntr + m end
                    if w[t] == 0 then
                        nmask = nmask + m
                        zero = zero + 1
                    end
                end
            end
            if trained > 0 and zero == trained then seqmask = seqmask + 1 end
        end
        if cnt > 0 then
            out.tis_weight_mean = sw / cnt
            out.tis_weight_max = wmax
            out.tis_frac_truncated = ntr / cnt
            out.tis_frac_masked = nmask / cnt
            out.tis_ess = sw2 > 0 and (sw * sw) / (cnt * sw2) or 0
        end
        out.tis_seq_masked = seqmask
    end
    return out
end

return M
