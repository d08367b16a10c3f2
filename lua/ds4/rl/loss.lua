--[==[ ds4.rl.loss — policy losses per token with their exact gradient w.r.t. each token's log-probability.

Citations docs/rl.md, "Name" refer to sections of docs/rl.md (formulas, defaults, and the frameworks and files
they follow).

There is no autograd in Lua: compute() returns the loss value AND dLoss/dlogp for every response token; the
trainer scatters those numbers into an F32 [B, S] tensor and calls model:backward_logprobs(g) (lua/train_lua.c),
which back-propagates sum_{b,s} g[b][s] * logp[b][s]. The loss is MINIMISED (it is minus the objective).

Sample fields (response tokens only; arrays of equal length n):
  logp          current policy log pi_theta(o_t | ...), recomputed by the trainer (model:logprobs())
  old_logp      the policy the PPO ratio is taken against (the trainer's recompute before the update, or the
                rollout's log-probs in "bypass" mode, docs/rl.md, "Mismatch correction"). Optional: when absent it
                is the current logp DETACHED, i.e. ratio = 1 with gradient A (one update per rollout).
  rollout_logp  optional, log-probs the inference engine reported (spec.tis; mismatch metrics)
  ref_logp      optional, reference policy (needed when spec.kl puts KL in the loss)
  mask          optional, 1 = trained token, 0 = not (default all 1); the gradient is 0 where mask = 0
  adv           advantage: a number (broadcast) or a per-token array (ds4.rl.advantage.compute writes it)
  entropy       optional per-token entropy H_t of pi_theta at that position (model:logprobs{entropy = true}):
                reported as a metric and used as the entropy-bonus baseline
Notation: x_t = logp_t, o_t = old_logp_t, M_t = mask, A_t = advantage, |o_i| = sum_t M_t.
Every ratio is exp of a log-ratio clamped to [-20, 20] (verl, Miles, OpenRLHF, docs/rl.md, "PPO clip"); outside
the clamp the gradient is 0.

Policy losses (spec.loss.kind; per-token loss l_t, minimised)
  "ppo_clip"  r_t = exp(x_t - o_t)                               (docs/rl.md, "PPO clip", "DAPO")
              l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
              dual clip (spec.loss.clip_c = c > 1, only where A_t < 0): l_t = min(l_t, -c A_t)
              eps_high defaults to eps_low (Miles --eps-clip-high); clip_c default off (Miles, OpenRLHF, NeMo;
              verl always applies c = 3).
  "gspo"      s_i = exp( sum_t M_t (x_t - o_t) / |o_i| )   (sequence geometric-mean ratio, docs/rl.md, "GSPO")
              l_t = the ppo_clip loss at ratio s_i (per-token A_t allowed; the dual clip too), i.e. Miles'
              broadcast of the sequence log-ratio to every token before the standard clip. The gradient flows
              to every token through the mean: dJ/dx_u = (sum_t w_t dl_t/ds) * s_i M_u / |o_i|, where w_t
              is the aggregation (and TIS) weight of token t. With seq_mean_token_mean and a scalar A this is
              exactly the GSPO paper's sequence objective and verl's GSPO-token straight-through form.
  "cispo"     l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t x_t,   dl_t/dx_t = -clip(r_t, ...) A_t
              (MiniMax-M1, docs/rl.md, "CISPO"; verl compute_policy_loss_cispo). eps_low = nil: no lower bound (the
              paper's choice); eps_high = nil: no upper bound. Its value is the surrogate, not an objective.
Loss-kind-agnostic metric: clip_frac = fraction of trained tokens whose gradient is zeroed by the clip
(ppo_clip / gspo: the clipped branch strictly larger, verl pg_clipfrac), or whose weight was clipped (cispo);
clip_frac_low (ratio below 1 - eps_low) + clip_frac_high (above 1 + eps_high) = clip_frac; clip_frac_dual =
trained tokens where the dual clip is active (verl pg_clipfrac_lower).

Gradients at kinks follow torch autograd exactly (so results match a torch implementation bit-for-bit in
structure): clamp(r, a, b) passes the gradient for a <= r <= b (boundaries included) and blocks it strictly
outside; max(u, v) / min(u, v) give the full gradient to the selected operand and split it half-half when
u == v (torch.maximum / torch.minimum backward). Consequence: at r exactly on 1 +- eps the PPO gradient is the
unclipped one (both operands have gradient -A there); at r exactly at the dual-clip point -c A the gradient is
halved.

Aggregation (spec.agg; REQUIRED — frameworks differ silently, docs/rl.md, "Aggregation").
J = sum_i f_i sum_t M_t lhat_t where lhat_t is the per-token total loss (policy loss times the TIS weight, plus KL
and entropy terms):
  "token_mean"               f_i = 1 / T,  T = opts.denom or the number of trained tokens in `samples`
                             (DAPO; verl token-mean, OpenRLHF, TRL "dapo", NeMo). For micro-batching pass the
                             GLOBAL token count as opts.denom (loss.count(all_samples)).
  "seq_mean_token_mean"      f_i = 1 / (N |o_i|)      (original GRPO; Miles default; TRL "grpo"; GSPO)
  "seq_mean_token_sum"       f_i = 1 / N              (verl seq-mean-token-sum)
  "seq_mean_token_sum_norm"  f_i = 1 / (N L)          (Dr.GRPO: TRL dr_grpo with L = max_completion_length,
                             verl seq-mean-token-sum-norm); L = spec.agg.max_len (required)
  "sum"                      f_i = 1
  "constant"                 f_i = 1 / C,  C = spec.agg.constant (required; Miles' Dr.GRPO reducer uses 1000)
  N = opts.num_seqs or #samples (every sample of the batch counts, as Miles divides by the global batch size
  and TRL by the batch dimension; a sample whose tokens are all masked contributes 0 to the numerator).
  opts.tis_scale: spec.tis.normalize's factor of the whole batch (ds4.rl.correction.norm_scale), for a part of it.
  spec.agg is a mode string or {mode = ..., max_len = L, constant = C}; "-" spellings (token-mean) accepted.

KL to the reference policy (spec.kl = {coef = beta, estimator = "k1"|"k2"|"k3", where = "loss"|"reward",
clamp = true}; docs/rl.md, "KL"). With x = logp - ref_logp:
  k1 = x                           dk1/dx = 1
  k2 = x^2 / 2                     dk2/dx = x
  k3 = exp(-x) - 1 + x             dk3/dx = 1 - exp(-x)      ("low_var_kl")
  k3 applies verl's / Miles' / NeMo's clamps unless clamp = false: u = clamp(ref - logp, -20, 20),
  k3 = clamp(exp(u) - u - 1, -10, 10) (gradient 0 outside, torch convention at the boundaries); k1/k2 unclamped.
  where = "loss": J += beta * sum_i f_i sum_t M_t k_t (same aggregation as the policy loss, not TIS-weighted).
  where = "reward": compute() ignores it; the RL loop calls kl_in_reward(samples, beta, estimator, opts) before
  the advantages: per token (opts.level = "token", default; verl use_kl_in_reward, OpenRLHF, REINFORCE++)
  sample.kl_reward[t] = -beta k_t (0 where untrained), or per sequence (opts.level = "sequence")
  sample.kl_reward = -beta sum_t M_t k_t. There x = old_logp - ref_logp (the policy that generated, as verl
  apply_kl_penalty; rollout_logp when old_logp is absent): a constant, no gradient. ds4.rl.advantage adds it:
  outcome estimators to the score, token estimators per token.

Entropy bonus (spec.entropy_coef = alpha; default 0 = report only, every framework's default, docs/rl.md,
"Entropy").
The entropy H(s) = -sum_a pi(a|s) log pi(a|s) is not a function of the sampled token's logp alone, so its
gradient cannot be passed through backward_logprobs directly. Its exact gradient is an expectation over the
sampled token a ~ pi:
      grad H = -sum_a grad pi(a) (log pi(a) + 1) = -E_a[ (log pi(a) + 1) grad log pi(a) ]
             = -E_a[ (log pi(a) + b) grad log pi(a) ]   for any b independent of a, since E_a[grad log pi(a)] = 0.
The loss term -alpha H therefore has the unbiased single-sample score-function estimate
      alpha * rho_t * (sg(x_t) + b_t) * grad x_t,      rho_t = sg(exp(x_t - o_t))
(rho corrects for tokens sampled from pi_old; = 1 on-policy). Baseline b_t (spec.entropy_baseline): "auto"
(default) = H_t when sample.entropy is given (log pi(a) + H has mean 0 under pi: a variance-reducing control
variate), else 1 (the plain form above); "entropy", "one", or a number. Implemented as the surrogate
      e_t(x) = alpha * ( v_t + rho_t (s_t + b_t) (x_t - s_t) ),  s_t = sg(x_t),  v_t = -H_t if given, else s_t
whose value is -alpha * (entropy, or its sampled estimate -logp) and whose gradient is the estimate above.
tests/lua/test_rl.lua checks E_a[dJ/dx_a * grad log pi(a)] = grad(-alpha H) on a small categorical exactly.

Stop-gradient point: every sg(.) above (CISPO's clipped weight, the entropy surrogate, a missing old_logp)
reads opts.sg_logp[i][t] when given, else logp itself. Passing the base logp there lets a finite-difference
check differentiate exactly the surrogate whose gradient compute() returns (tests/lua/test_rl.lua).

Rollout/train mismatch (spec.tis, see ds4.rl.correction): the detached weight w_t multiplies the per-token
policy loss l_t (not the KL or entropy terms; denominators unchanged). Mismatch metrics are reported whenever
the samples carry rollout_logp, with or without spec.tis. A sample without old_logp uses the detached current
logp as old_logp there too.

API
  compute(samples, spec, opts) -> {loss = J, grads = {per-sample arrays dJ/dlogp_t (0 where mask = 0)},
                                   metrics = {...}}
      spec: loss = {kind, eps_low, eps_high, clip_c}, agg, kl, entropy_coef, entropy_baseline, tis
            (an rl.algorithms preset is a valid spec)
      opts: denom (global trained-token count for token_mean), num_seqs (global sequence count for the seq_*
            modes), sg_logp
      metrics: loss, pg_loss, kl_loss, entropy_loss, tokens (trained tokens here), seqs, clip_frac,
            clip_frac_low, clip_frac_high, clip_frac_dual, ratio_mean, ratio_max, ratio_min, ppo_kl
            (mean of o - x, verl), kl (mean per trained token of the KL estimator when ref_logp is present:
            spec.kl.estimator, or k3), entropy (mean of sample.entropy when every sample has it), adv_mean,
            and ds4.rl.correction's mismatch_* / tis_* metrics.
  count(samples) -> trained tokens, sequences         (the global opts.denom / opts.num_seqs)
  agg_factors(samples, agg, opts) -> {f_i}            aggregate(samples, values, agg, opts) -> number
  kl_value(logp, ref, estimator [, clamp]) -> k, dk/dlogp
  kl_in_reward(samples, beta, estimator [, {level = "token"|"sequence", clamp = true}]) -> {kl_mean, kl_seq_mean}
  ppo_clip_token(r, A, lo, hi [, c]) -> l, dl/dr, clipped ("low"|"high"|nil), dual (bool)   lo = 1 - eps_low, hi = 1 + eps_high
]==]

local M = {}

local correction = require("ds4.rl.correction")

local exp, huge = math.exp, math.huge
local CLAMP = 20

local util = require("ds4.rl.util")
local fail = util.failer("loss")
local mask_at = util.mask_at

-- exp of a clamped log-ratio, and its derivative w.r.t. the unclamped log-ratio (torch clamp convention).
local function clamped_exp(d)
    if d < -CLAMP then return exp(-CLAMP), 0 end
    if d > CLAMP then return exp(CLAMP), 0 end
    local r = exp(d)
    return r, r
end

-- ------------------------------------------------------------------------------------------------ aggregation

M.AGG_MODES = { token_mean = true, seq_mean_token_mean = true, seq_mean_token_sum = true,
    seq_mean_token_sum_norm = true, sum = true, constant = true }
local AGG_LIST = "token_mean|seq_mean_token_mean|seq_mean_token_sum|seq_mean_token_sum_norm|sum|constant"

function M.parse_agg(agg, fn)
    fn = fn or "parse_agg"
    if agg == nil then fail(fn, "spec.agg is required (" .. AGG_LIST .. ")", 3) end
    local mode, max_len, constant
    if type(agg) == "string" then
        mode = agg
    elseif type(agg) == "table" then
        mode, max_len, constant = agg.mode, agg.max_len, agg.constant
    else
        fail(fn, "spec.agg must be a mode string or {mode = ...}", 3)
    end
    if type(mode) ~= "string" then fail(fn, "spec.agg.mode is required (" .. AGG_LIST .. ")", 3) end
    mode = mode:gsub("-", "_")
    if not M.AGG_MODES[mode] then fail(fn, "unknown aggregation " .. mode .. " (" .. AGG_LIST .. ")", 3) end
    if mode == "seq_mean_token_sum_norm" and not (type(max_len) == "number" and max_len > 0) then
        fail(fn, "aggregation seq_mean_token_sum_norm needs spec.agg.max_len > 0 (Dr.GRPO: the maximum response length)", 3)
    end
    if mode == "constant" and not (type(constant) == "number" and constant > 0) then
        fail(fn, "aggregation constant needs spec.agg.constant > 0", 3)
    end
    return { mode = mode, max_len = max_len, constant = constant }
end

local function trained(s)
    local n, len = 0, #(s.logp or s.ids) -- before its training forward a sample has ids of the same length
    local m = s.mask
    if m == nil then return len end
    for t = 1, len do n = n + m[t] end
    return n
end

function M.count(samples)
    local tokens = 0
    for _, s in ipairs(samples) do tokens = tokens + trained(s) end
    return tokens, #samples
end

function M.agg_factors(samples, agg, opts)
    opts = opts or {}
    if type(agg) ~= "table" or not agg.mode then agg = M.parse_agg(agg, "agg_factors") end
    local mode = agg.mode
    local nseq = opts.num_seqs or #samples
    local f = {}
    local T
    if mode == "token_mean" then T = opts.denom or (M.count(samples)) end
    for i, s in ipairs(samples) do
        local v
        if mode == "token_mean" then
            v = T > 0 and 1 / T or 0
        elseif mode == "seq_mean_token_mean" then
            local n = trained(s)
            v = (n > 0 and nseq > 0) and 1 / (nseq * n) or 0
        elseif mode == "seq_mean_token_sum" then
            v = nseq > 0 and 1 / nseq or 0
        elseif mode == "seq_mean_token_sum_norm" then
            v = nseq > 0 and 1 / (nseq * agg.max_len) or 0
        elseif mode == "sum" then
            v = 1
        else
            v = 1 / agg.constant
        end
        f[i] = v
    end
    return f
end

function M.aggregate(samples, values, agg, opts)
    local f = M.agg_factors(samples, agg, opts)
    local J = 0
    for i, s in ipairs(samples) do
        local v = values[i]
        for t = 1, #s.logp do
            local m = mask_at(s, t)
            if m ~= 0 then J = J + f[i] * m * v[t] end
        end
    end
    return J
end

-- ------------------------------------------------------------------------------------------------ KL

M.KL_ESTIMATORS = { k1 = true, k2 = true, k3 = true }

function M.kl_value(logp, ref, estimator, clamp)
    if estimator == "k1" then
        return logp - ref, 1
    elseif estimator == "k2" then
        local x = logp - ref
        return 0.5 * x * x, x
    elseif estimator == "k3" then
        local u, du = ref - logp, -1
        if clamp ~= false then
            if u < -CLAMP then u, du = -CLAMP, 0 elseif u > CLAMP then u, du = CLAMP, 0 end
        end
        local eu = exp(u)
        local k, dk = eu - u - 1, (eu - 1) * du
        if clamp ~= false then
            if k > 10 then k, dk = 10, 0 elseif k < -10 then k, dk = -10, 0 end
        end
        return k, dk
    end
    error("ds4.rl.loss.kl_value: unknown KL estimator " .. tostring(estimator) .. " (k1|k2|k3)", 2)
end

function M.kl_in_reward(samples, beta, estimator, opts)
    opts = opts or {}
    local level = opts.level or "token"
    if level ~= "token" and level ~= "sequence" then
        fail("kl_in_reward", "opts.level must be token or sequence", 2)
    end
    if not M.KL_ESTIMATORS[estimator] then
        fail("kl_in_reward", "unknown KL estimator " .. tostring(estimator) .. " (k1|k2|k3)", 2)
    end
    if type(beta) ~= "number" then fail("kl_in_reward", "beta must be a number", 2) end
    local n, sum, seqsum = 0, 0, 0
    for i, s in ipairs(samples) do
        local p, ref = s.old_logp or s.rollout_logp, s.ref_logp
        if type(p) ~= "table" or type(ref) ~= "table" or #p ~= #ref then
            fail("kl_in_reward", ("sample %d needs old_logp (or rollout_logp) and ref_logp of equal length"):format(i), 2)
        end
        local per, tot = {}, 0
        for t = 1, #p do
            local m = mask_at(s, t)
            if m ~= 0 then
                local k = M.kl_value(p[t], ref[t], estimator, opts.clamp)
                per[t] = -beta * k
                tot = tot + m * k
                n = n + m
                sum = sum + m * k
            else
                per[t] = 0
            end
        end
        seqsum = seqsum + tot
        if level == "token" then s.kl_reward = per else s.kl_reward = -beta * tot end
    end
    return { kl_mean = n > 0 and sum / n or 0, kl_seq_mean = #samples > 0 and seqsum / #samples or 0 }
end

-- ------------------------------------------------------------------------------------------------ per token

-- PPO clipped loss at ratio r: value, d/dr (torch conventions, see the header), which side clipped, dual active.
function M.ppo_clip_token(r, A, lo, hi, c)
    local p1, d1 = -A * r, -A
    local cr, dcr = r, 1
    if r < lo then cr, dcr = lo, 0 elseif r > hi then cr, dcr = hi, 0 end
    local p2, d2 = -A * cr, -A * dcr
    local l, dl, side
    if p1 > p2 then
        l, dl = p1, d1
    elseif p2 > p1 then
        l, dl = p2, d2
        side = r < lo and "low" or "high"
    else
        l, dl = p1, 0.5 * (d1 + d2)
    end
    local dual = false
    if c and A < 0 then
        local p3 = -A * c
        if l > p3 then
            l, dl, dual = p3, 0, true
        elseif l == p3 then
            dl = 0.5 * dl
        end
    end
    return l, dl, side, dual
end

-- ------------------------------------------------------------------------------------------------ compute

M.LOSSES = { ppo_clip = true, gspo = true, cispo = true }

local function loss_settings(ls)
    if type(ls) ~= "table" or type(ls.kind) ~= "string" then
        fail("compute", "spec.loss = {kind = ppo_clip|gspo|cispo, eps_low = ..., eps_high = ...} is required", 3)
    end
    local kind = ls.kind
    if not M.LOSSES[kind] then fail("compute", "unknown loss kind " .. kind .. " (ppo_clip|gspo|cispo)", 3) end
    local el, eh = ls.eps_low, ls.eps_high
    if el == nil then el = ls.eps end
    if kind ~= "cispo" then
        if type(el) ~= "number" then fail("compute", kind .. " needs spec.loss.eps_low", 3) end
        if eh == nil then eh = el end
    end
    local lo = el and 1 - el or -huge
    local hi = eh and 1 + eh or huge
    if not (lo <= hi) then fail("compute", "clip range is empty (1 - eps_low > 1 + eps_high)", 3) end
    local c = ls.clip_c
    if c ~= nil and not (type(c) == "number" and c > 1) then fail("compute", "spec.loss.clip_c must be > 1", 3) end
    return kind, lo, hi, c
end

local function check_array(a, n, what, i)
    if a == nil then return end
    if type(a) ~= "table" or #a ~= n then
        fail("compute", ("sample %d: %s must be an array of %d values"):format(i, what, n), 3)
    end
end

function M.compute(samples, spec, opts)
    opts = opts or {}
    if type(samples) ~= "table" then fail("compute", "samples must be an array of samples", 2) end
    if type(spec) ~= "table" then fail("compute", "spec must be a table", 2) end
    local agg = M.parse_agg(spec.agg, "compute")
    local kind, lo, hi, clip_c = loss_settings(spec.loss)
    local kl = spec.kl
    local beta, est, kclamp = 0, nil, nil
    if kl ~= nil then
        if type(kl) ~= "table" then fail("compute", "spec.kl must be a table", 2) end
        local where = kl.where or "loss"
        if where ~= "loss" and where ~= "reward" then fail("compute", "spec.kl.where must be loss or reward", 2) end
        est = kl.estimator or "k3"
        if not M.KL_ESTIMATORS[est] then fail("compute", "unknown KL estimator " .. tostring(est) .. " (k1|k2|k3)", 2) end
        if where == "loss" then beta = kl.coef or 0 end
        kclamp = kl.clamp
    end
    local alpha = spec.entropy_coef or 0
    local ebase = spec.entropy_baseline or "auto"
    local sg_all = opts.sg_logp

    for i, s in ipairs(samples) do
        if type(s) ~= "table" or type(s.logp) ~= "table" then
            fail("compute", ("sample %d: logp (array) is required"):format(i), 2)
        end
        local n = #s.logp
        check_array(s.old_logp, n, "old_logp", i)
        check_array(s.mask, n, "mask", i)
        check_array(s.ref_logp, n, "ref_logp", i)
        check_array(s.rollout_logp, n, "rollout_logp", i)
        check_array(s.entropy, n, "entropy", i)
        if type(s.adv) == "table" then
            check_array(s.adv, n, "adv", i)
        elseif type(s.adv) ~= "number" then
            fail("compute", ("sample %d: adv is missing (run ds4.rl.advantage.compute first)"):format(i), 2)
        end
        if beta ~= 0 and s.ref_logp == nil then
            fail("compute", ("sample %d: spec.kl puts KL in the loss but ref_logp is missing"):format(i), 2)
        end
        if sg_all then check_array(sg_all[i], n, "opts.sg_logp", i) end
        if alpha ~= 0 and ebase == "entropy" and s.entropy == nil then
            fail("compute", ("sample %d: entropy_baseline = entropy needs sample.entropy"):format(i), 2)
        end
    end

    -- a missing old_logp is the detached current logp, for the correction as for the ratio
    local old_fallback = {}
    for i, s in ipairs(samples) do old_fallback[i] = sg_all and sg_all[i] or s.logp end
    local corr
    if spec.tis then corr = correction.compute(samples, spec.tis, old_fallback, opts.tis_scale) end
    local f = M.agg_factors(samples, agg, opts)

    local Jpg, Jkl, Jent = 0, 0, 0
    local ntok, nclip, nlow, nhigh, ndual = 0, 0, 0, 0, 0
    local rsum, rmax, rmin, pkl = 0, -huge, huge, 0
    local klsum, kln, klok = 0, 0, true
    local esum, eok = 0, true
    local asum = 0
    local grads = {}

    for i, s in ipairs(samples) do
        local x, o, ref, H = s.logp, s.old_logp, s.ref_logp, s.entropy
        local sg = sg_all and sg_all[i] or x
        local n = #x
        local A = s.adv
        local ascalar = type(A) == "number"
        local w = corr and corr.weights[i]
        local fi = f[i]
        local g = {}
        for t = 1, n do g[t] = 0 end
        if ref == nil then klok = false end
        if H == nil then eok = false end

        if kind == "gspo" then
            local cnt, dsum = 0, 0
            for t = 1, n do
                local m = mask_at(s, t)
                if m ~= 0 then
                    cnt = cnt + m
                    dsum = dsum + m * (x[t] - (o and o[t] or sg[t]))
                end
            end
            if cnt > 0 then
                local si, dsdm = clamped_exp(dsum / cnt)
                local dJds = 0
                for t = 1, n do
                    local m = mask_at(s, t)
                    if m ~= 0 then
                        local a = ascalar and A or A[t]
                        local wt = w and w[t] or 1
                        local l, dl, side, dual = M.ppo_clip_token(si, a, lo, hi, clip_c)
                        Jpg = Jpg + fi * m * wt * l
                        dJds = dJds + fi * m * wt * dl
                        if side then
                            nclip = nclip + m
                            if side == "low" then nlow = nlow + m else nhigh = nhigh + m end
                        end
                        if dual then ndual = ndual + m end
                        rsum = rsum + m * si
                        if si > rmax then rmax = si end
                        if si < rmin then rmin = si end
                    end
                end
                local k = dJds * dsdm / cnt
                for t = 1, n do
                    local m = mask_at(s, t)
                    if m ~= 0 then g[t] = k * m end
                end
            end
        else
            for t = 1, n do
                local m = mask_at(s, t)
                if m ~= 0 then
                    local a = ascalar and A or A[t]
                    local wt = w and w[t] or 1
                    local ot = o and o[t] or sg[t]
                    local r
                    if kind == "ppo_clip" then
                        local drdx
                        r, drdx = clamped_exp(x[t] - ot)
                        local l, dl, side, dual = M.ppo_clip_token(r, a, lo, hi, clip_c)
                        Jpg = Jpg + fi * m * wt * l
                        g[t] = fi * m * wt * dl * drdx
                        if side then
                            nclip = nclip + m
                            if side == "low" then nlow = nlow + m else nhigh = nhigh + m end
                        end
                        if dual then ndual = ndual + m end
                    else -- cispo: the clipped weight is detached (read at the stop-gradient point)
                        r = clamped_exp(sg[t] - ot)
                        local cw = r
                        if r < lo then
                            cw = lo
                            nclip, nlow = nclip + m, nlow + m
                        elseif r > hi then
                            cw = hi
                            nclip, nhigh = nclip + m, nhigh + m
                        end
                        Jpg = Jpg + fi * m * wt * (-cw * a * x[t])
                        g[t] = fi * m * wt * (-cw * a)
                    end
                    rsum = rsum + m * r
                    if r > rmax then rmax = r end
                    if r < rmin then rmin = r end
                end
            end
        end

        -- per-token extras: KL (in the loss / as metric), entropy bonus, metrics
        for t = 1, n do
            local m = mask_at(s, t)
            if m ~= 0 then
                ntok = ntok + m
                local ot = o and o[t] or sg[t]
                pkl = pkl + m * (ot - x[t])
                asum = asum + m * (ascalar and A or A[t])
                if ref then
                    local k, dk = M.kl_value(x[t], ref[t], est or "k3", kclamp)
                    klsum = klsum + m * k
                    kln = kln + m
                    if beta ~= 0 then
                        Jkl = Jkl + beta * fi * m * k
                        g[t] = g[t] + beta * fi * m * dk
                    end
                end
                if H then esum = esum + m * H[t] end
                if alpha ~= 0 then
                    local st = sg[t]
                    local rho = clamped_exp(st - ot)
                    local b
                    if ebase == "auto" then
                        b = H and H[t] or 1
                    elseif ebase == "entropy" then
                        b = H[t]
                    elseif ebase == "one" then
                        b = 1
                    elseif type(ebase) == "number" then
                        b = ebase
                    else
                        fail("compute", "spec.entropy_baseline must be auto|entropy|one or a number", 2)
                    end
                    local v = H and -H[t] or st
                    local gt = rho * (st + b)
                    Jent = Jent + alpha * fi * m * (v + gt * (x[t] - st))
                    g[t] = g[t] + alpha * fi * m * gt
                end
            end
        end
        grads[i] = g
    end

    local J = Jpg + Jkl + Jent
    local met = { loss = J, pg_loss = Jpg, kl_loss = Jkl, entropy_loss = Jent, tokens = ntok, seqs = #samples }
    if ntok > 0 then
        met.clip_frac = nclip / ntok
        met.clip_frac_low = nlow / ntok
        met.clip_frac_high = nhigh / ntok
        met.clip_frac_dual = ndual / ntok
        met.ratio_mean = rsum / ntok
        met.ratio_max = rmax
        met.ratio_min = rmin
        met.ppo_kl = pkl / ntok
        met.adv_mean = asum / ntok
        if klok and kln > 0 then met.kl = klsum / kln end
        if eok and #samples > 0 then met.entropy = esum / ntok end
    end
    local cm = corr and corr.metrics or correction.metrics(samples, nil, nil, old_fallback)
    if cm then
        for k, v in pairs(cm) do met[k] = v end
    end
    return { loss = J, grads = grads, metrics = met }
end

return M
