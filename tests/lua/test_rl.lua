-- test_rl.lua — the RL algorithms of lua/ds4/rl/ (pure Lua): advantages, policy losses and their analytic
-- per-token gradients, KL estimators, the entropy surrogate, rollout/train mismatch correction, dynamic
-- sampling and overlong handling, presets.
-- Usage: ds4 run tests/lua/test_rl.lua <fixtures_dir>   (the fixtures are not used)
--
-- Expected values are written out by hand (literals, or the defining arithmetic spelled out in the test, never
-- a call into the module under test); then a finite-difference check of every analytic gradient over random
-- batches for every loss kind x aggregation mode x KL estimator, and an exact check of the entropy surrogate
-- on a small categorical distribution.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local rl = require("ds4.rl")
local adv, loss, corr, filter = rl.advantage, rl.loss, rl.correction, rl.filter

local exp, log, sqrt, abs = math.exp, math.log, math.sqrt, math.abs
local TOL = 1e-12

local function near_all(got, want, tol, what)
    H.eq(#got, #want, what .. " length")
    for i = 1, #want do H.near(got[i], want[i], tol, ("%s[%d]"):format(what, i)) end
end

-- ================================================================================================ advantages
do
    local r, g = { 1, 0, 0, 1 }, { 7, 7, 7, 7 }
    -- mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735026918963; eps 1e-6
    local a = adv.group_mean(r, g, { std = true, eps = 1e-6 })
    local v = 0.5 / (0.57735026918963 + 1e-6) -- = 0.866023903787...
    near_all(a, { v, -v, -v, v }, 1e-12, "grpo std")
    H.near(a[1], 0.8660239037870, 1e-12, "grpo std literal")
    -- population std 0.5
    a = adv.group_mean(r, g, { std = true, eps = 1e-6, unbiased = false })
    near_all(a, { 0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001 }, 1e-12, "grpo biased std")
    -- default eps is 1e-6
    near_all(adv.group_mean(r, g), { v, -v, -v, v }, 1e-12, "grpo default eps")
    near_all(adv.group_mean(r, g, { std = false }), { 0.5, -0.5, -0.5, 0.5 }, TOL, "grpo no std")
    near_all(adv.dr_grpo(r, g), { 0.5, -0.5, -0.5, 0.5 }, TOL, "dr_grpo")
    -- RLOO: baseline = mean of the other three: 1 - 1/3, 0 - 2/3
    near_all(adv.leave_one_out(r, g), { 2 / 3, -2 / 3, -2 / 3, 2 / 3 }, TOL, "rloo")
    near_all(adv.leave_one_out({ 1, 2, 3 }, { 1, 1, 1 }), { 1 - 2.5, 2 - 2, 3 - 1.5 }, TOL, "rloo 1,2,3")
    -- several groups: an all-equal group and a singleton get 0
    local r2, g2 = { 1, 0, 3, 3, 7 }, { "a", "a", "b", "b", "c" }
    near_all(adv.group_mean(r2, g2, { eps = 1e-6 }),
        { 0.5 / (sqrt(0.5) + 1e-6), -0.5 / (sqrt(0.5) + 1e-6), 0, 0, 0 }, 1e-12, "grpo groups")
    near_all(adv.leave_one_out(r2, g2), { 1, -1, 0, 0, 0 }, TOL, "rloo groups")
    H.raises(function() adv.group_mean({ 1, 2 }, { 1 }) end, { "group id of sample 2" }, "missing group")
    H.raises(function() adv.group_mean({ 1, 0 / 0 }, { 1, 1 }) end, { "reward 2" }, "NaN reward")

    -- REINFORCE++-baseline: group g1 rewards 1 (2 tokens), 0 (1 token); g2 singleton reward 2 (1 token).
    -- centred: 0.5, 0.5 | -0.5 | 0; token mean 0.125; deviations .375 .375 -.625 -.125, sum sq .6875,
    -- unbiased var .6875 / 3; whiten (v - mean) / sqrt(var + 1e-8)
    local S = {
        { reward = 1, group = "g1", logp = { -1, -1 } },
        { reward = 0, group = "g1", logp = { -1 } },
        { reward = 2, group = "g2", logp = { -1 } },
    }
    local sd = sqrt(0.6875 / 3 + 1e-8)
    local st = adv.compute(S, { kind = "reinforce_pp_baseline" })
    near_all(S[1].adv, { 0.375 / sd, 0.375 / sd }, 1e-12, "rpp baseline s1")
    near_all(S[2].adv, { -0.625 / sd }, 1e-12, "rpp baseline s2")
    near_all(S[3].adv, { -0.125 / sd }, 1e-12, "rpp baseline s3")
    H.eq(st.groups, 2, "stats groups")
    H.eq(st.zero_std_groups, 1, "stats zero-std groups (the singleton)")

    -- REINFORCE++: one sample, 3 tokens, reward 1 at the last token, kl_reward -0.1 per token, gamma 0.5:
    -- r = {-0.1, -0.1, 0.9}; G3 = 0.9, G2 = -0.1 + 0.45 = 0.35, G1 = -0.1 + 0.175 = 0.075
    local s = { reward = 1, group = 1, logp = { -1, -1, -1 }, kl_reward = { -0.1, -0.1, -0.1 } }
    adv.compute({ s }, { kind = "reinforce_pp", gamma = 0.5 })
    near_all(s.returns, { 0.075, 0.35, 0.9 }, TOL, "rpp returns")
    local m = (0.075 + 0.35 + 0.9) / 3
    local var = ((0.075 - m) ^ 2 + (0.35 - m) ^ 2 + (0.9 - m) ^ 2) / 2
    near_all(s.adv, { (0.075 - m) / sqrt(var + 1e-8), (0.35 - m) / sqrt(var + 1e-8), (0.9 - m) / sqrt(var + 1e-8) },
        1e-12, "rpp whitened")
    -- an untrained token is skipped: mask {1, 0, 1}, no KL, gamma 0.5: G3 = 1, G2 carries 1, G1 = 0 + 0.5 = 0.5
    s = { reward = 1, group = 1, logp = { -1, -1, -1 }, mask = { 1, 0, 1 } }
    local _, rets = adv.reinforce_pp({ s }, { gamma = 0.5 })
    near_all(rets[1], { 0.5, 1, 1 }, TOL, "rpp skips masked")

    -- GAE: r = {0, 0, 1}, V = {0.5, 0.6, 0.7}, gamma 0.9, lambda 0.8
    -- delta3 = 1 - 0.7 = 0.3; delta2 = 0.9*0.7 - 0.6 = 0.03; delta1 = 0.9*0.6 - 0.5 = 0.04
    -- A3 = 0.3; A2 = 0.03 + 0.72*0.3 = 0.246; A1 = 0.04 + 0.72*0.246 = 0.21712; returns = A + V
    local A, R = adv.gae({ 0, 0, 1 }, { 0.5, 0.6, 0.7 }, 0.9, 0.8)
    near_all(A, { 0.21712, 0.246, 0.3 }, 1e-14, "gae advantages")
    near_all(R, { 0.71712, 0.846, 1.0 }, 1e-14, "gae returns")
    -- with the middle token untrained (verl skips it): delta1 = 0.9*0.7 - 0.5 = 0.13, A1 = 0.13 + 0.72*0.3
    A = adv.gae({ 0, 0, 1 }, { 0.5, 0.6, 0.7 }, 0.9, 0.8, { 1, 0, 1 })
    near_all(A, { 0.346, 0.3, 0.3 }, 1e-14, "gae masked")
    -- gamma = lambda = 1: A_t = sum of future rewards - V_t
    A = adv.gae({ 0, 0, 1 }, { 0.5, 0.6, 0.7 }, 1, 1)
    near_all(A, { 0.5, 0.4, 0.3 }, 1e-14, "gae gamma=lambda=1")
    -- compute(kind = "gae") from sample.values, not whitened
    s = { reward = 1, group = 1, logp = { -1, -1, -1 }, values = { 0.5, 0.6, 0.7 } }
    adv.compute({ s }, { kind = "gae", gamma = 0.9, lambda = 0.8, whiten = false })
    near_all(s.adv, { 0.21712, 0.246, 0.3 }, 1e-14, "compute gae")
    H.raises(function() adv.compute({ { reward = 1, logp = { 1 } } }, { kind = "gae" }) end, { "sample.values" },
        "gae without values")

    -- compute: grpo writes a scalar per sample, the scalar kl_reward joins the score
    local B = {
        { reward = 1, group = 1, logp = { -1 } }, { reward = 0, group = 1, logp = { -1 } },
        { reward = 0, group = 1, logp = { -1 } }, { reward = 1, group = 1, logp = { -1 } },
    }
    adv.compute(B, { kind = "grpo", eps = 1e-6 })
    H.near(B[1].adv, v, 1e-12, "compute grpo")
    H.near(B[2].adv, -v, 1e-12, "compute grpo 2")
    B[1].kl_reward = -1 -- scores {0, 0, 0, 1}: mean .25, Dr.GRPO: {-.25, -.25, -.25, .75}
    adv.compute(B, { kind = "dr_grpo" })
    H.near(B[1].adv, -0.25, TOL, "compute dr_grpo with kl_reward")
    H.near(B[4].adv, 0.75, TOL, "compute dr_grpo with kl_reward 4")
    B[1].kl_reward = { -0.5 } -- a per-token kl_reward is summed over trained tokens: scores {0.5, 0, 0, 1}
    adv.compute(B, { kind = "rloo" })
    H.near(B[1].adv, 0.5 - 1 / 3, TOL, "compute rloo with per-token kl_reward")
    H.raises(function() adv.compute(B, { kind = "nope" }) end, { "unknown advantage kind" }, "unknown kind")
    H.raises(function() adv.compute(B, {}) end, { "spec.kind is required" }, "no kind")
end

-- ================================================================================================ PPO clip
do
    local lo, hi = 0.8, 1.2
    local function chk(r, A, c, wl, wd, wside, wdual, what)
        local l, d, side, dual = loss.ppo_clip_token(r, A, lo, hi, c)
        H.near(l, wl, 1e-15, what .. " loss")
        H.near(d, wd, 1e-15, what .. " dl/dr")
        H.eq(side, wside, what .. " clipped side")
        H.eq(dual, wdual, what .. " dual")
    end
    -- A > 0
    chk(1.1, 1, nil, -1.1, -1, nil, false, "A+ inside")
    chk(1.5, 1, nil, -1.2, 0, "high", false, "A+ above")      -- min(1.5, 1.2) = 1.2 (clipped)
    chk(0.5, 1, nil, -0.5, -1, nil, false, "A+ below")       -- min(0.5, 0.8) = 0.5 (unclipped)
    -- A < 0
    chk(0.9, -1, nil, 0.9, 1, nil, false, "A- inside")
    chk(1.5, -1, nil, 1.5, 1, nil, false, "A- above")        -- max(1.5, 1.2) = 1.5 (unclipped)
    chk(0.5, -1, nil, 0.8, 0, "low", false, "A- below")      -- max(0.5, 0.8) = 0.8 (clipped)
    chk(0.5, -2, nil, 1.6, 0, "low", false, "A=-2 below")
    chk(1.1, 2, nil, -2.2, -2, nil, false, "A=2 inside")
    -- dual clip c = 3 (A < 0 only): min(max(-A r, -A clip(r)), -3 A)
    chk(4, -1, 3, 3, 0, nil, true, "dual active")
    chk(2, -1, 3, 2, 1, nil, false, "dual inactive")
    chk(4, -2, 3, 6, 0, nil, true, "dual A=-2")
    chk(4, 1, 3, -1.2, 0, "high", false, "dual ignores A > 0")
    chk(0.5, -1, 3, 0.8, 0, "low", false, "dual + low clip")
    -- torch tie rules: eps = 0, r = 1 exactly: clamp passes the gradient, max splits it evenly between two
    -- operands of equal gradient -> the unclipped gradient -A
    local l, d = loss.ppo_clip_token(1, 1, 1, 1, nil)
    H.eq(l, -1, "tie loss")
    H.eq(d, -1, "tie gradient = -A")
    l, d = loss.ppo_clip_token(1, -3, 1, 1, nil)
    H.eq(d, 3, "tie gradient A<0")
    -- dual-clip tie: -A r == -A c at r = c = 2.5 -> half the gradient (torch.minimum)
    l, d = loss.ppo_clip_token(2.5, -1, lo, hi, 2.5)
    H.eq(l, 2.5, "dual tie loss")
    H.eq(d, 0.5, "dual tie gradient halved")

    -- through compute(): ratio exp(logp - old), gradient dl/dr * r, agg "sum"
    local spec = { loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2 }, agg = "sum" }
    local function one(x, o, A, sp)
        local out = loss.compute({ { logp = { x }, old_logp = { o }, adv = A } }, sp or spec)
        return out.loss, out.grads[1][1], out.metrics
    end
    local J, g, met = one(log(1.1), 0, 1)
    H.near(J, -1.1, 1e-14, "compute inside")
    H.near(g, -1.1, 1e-14, "compute inside grad = -A r")
    H.eq(met.clip_frac, 0, "inside clip_frac")
    J, g, met = one(log(1.5), 0, 1)
    H.near(J, -1.2, 1e-14, "compute above")
    H.eq(g, 0, "compute above grad")
    H.eq(met.clip_frac, 1, "above clip_frac")
    H.eq(met.clip_frac_high, 1, "above clip_frac_high")
    J, g, met = one(log(0.5), 0, -1)
    H.near(J, 0.8, 1e-14, "compute low A-")
    H.eq(g, 0, "compute low A- grad")
    H.eq(met.clip_frac_low, 1, "clip_frac_low")
    J, g = one(log(1.5), 0, -1)
    H.near(g, 1.5, 1e-14, "A- above grad = -A r")
    J, g = one(-0.7, -0.7, 2, { loss = { kind = "ppo_clip", eps_low = 0, eps_high = 0 }, agg = "sum" })
    H.eq(J, -2, "compute r = 1 on both clip boundaries")
    H.eq(g, -2, "compute boundary gradient (torch convention)")
    local dual = { loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2, clip_c = 3 }, agg = "sum" }
    J, g, met = one(log(4), 0, -1, dual)
    H.near(J, 3, 1e-14, "compute dual")
    H.eq(g, 0, "compute dual grad")
    H.eq(met.clip_frac_dual, 1, "clip_frac_dual")
    -- old_logp absent: detached logp, ratio 1, gradient -A
    local out = loss.compute({ { logp = { -0.3, -2 }, adv = 0.7 } }, spec)
    H.near(out.loss, -1.4, 1e-15, "no old_logp loss")
    near_all(out.grads[1], { -0.7, -0.7 }, 1e-15, "no old_logp grads")
    -- log-ratio clamp at 20: ratio exp(20), gradient 0 beyond it
    J, g = one(0, -25, -1, { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum" })
    H.near(J, exp(20), 1e-6, "clamped ratio")
    H.eq(g, 0, "clamped ratio gradient")
    -- metrics: ratios 1.1 (A+), 1.5 (A+, high), 0.5 (A-, low), 2.0 (A-, unclipped)
    out = loss.compute({ { logp = { log(1.1), log(1.5), log(0.5), log(2) }, old_logp = { 0, 0, 0, 0 },
        adv = { 1, 1, -1, -1 } } }, spec)
    H.near(out.metrics.clip_frac, 0.5, TOL, "clip_frac")
    H.near(out.metrics.clip_frac_low, 0.25, TOL, "clip_frac_low")
    H.near(out.metrics.clip_frac_high, 0.25, TOL, "clip_frac_high")
    H.near(out.metrics.ratio_mean, (1.1 + 1.5 + 0.5 + 2) / 4, 1e-14, "ratio_mean")
    H.near(out.metrics.ratio_max, 2, 1e-14, "ratio_max")
    H.near(out.metrics.ppo_kl, -(log(1.1) + log(1.5) + log(0.5) + log(2)) / 4, 1e-14, "ppo_kl")
    H.near(out.loss, -1.1 - 1.2 + 0.8 + 2, 1e-14, "sum of four")
end

-- ================================================================================================ GSPO
do
    -- 3 tokens, log-ratios {0.1, -0.1, 0.2}: mean 0.2/3, s = exp(0.0666...) = 1.0689391057472464
    local x, o = { -1.0, -2.0, -0.5 }, { -1.1, -1.9, -0.7 }
    local s = exp((0.1 - 0.1 + 0.2) / 3)
    H.near(s, 1.0689391057472464, 1e-12, "gspo ratio by hand")
    local function run(A, el, eh, agg, mask)
        return loss.compute({ { logp = x, old_logp = o, adv = A, mask = mask } },
            { loss = { kind = "gspo", eps_low = el, eps_high = eh }, agg = agg or "seq_mean_token_mean" })
    end
    -- inside the band, A = 1: J = mean_t(-s) = -s, dJ/dx_u = -s / 3
    local out = run(1, 0.2, 0.2)
    H.near(out.loss, -s, 1e-12, "gspo loss A+")
    near_all(out.grads[1], { -s / 3, -s / 3, -s / 3 }, 1e-12, "gspo grads A+")
    H.near(out.metrics.ratio_mean, s, 1e-12, "gspo ratio metric")
    out = run(-1, 0.2, 0.2)
    H.near(out.loss, s, 1e-12, "gspo loss A-")
    near_all(out.grads[1], { s / 3, s / 3, s / 3 }, 1e-12, "gspo grads A-")
    -- the paper's tiny range 3e-4 / 4e-4: s > 1.0004 -> clipped for A > 0 (zero gradient), not for A < 0
    out = run(1, 3e-4, 4e-4)
    H.near(out.loss, -1.0004, 1e-12, "gspo clipped loss")
    near_all(out.grads[1], { 0, 0, 0 }, 0, "gspo clipped grads")
    H.eq(out.metrics.clip_frac_high, 1, "gspo clip_frac_high")
    out = run(-1, 3e-4, 4e-4)
    H.near(out.loss, s, 1e-12, "gspo A- above the band is unclipped")
    near_all(out.grads[1], { s / 3, s / 3, s / 3 }, 1e-12, "gspo A- grads")
    -- masked middle token: mean over {0.1, 0.2} -> s2 = exp(0.15); gradient -s2/2 on trained tokens, 0 on the other
    local s2 = exp(0.15)
    out = run(1, 0.2, 0.2, nil, { 1, 0, 1 })
    H.near(out.loss, -s2, 1e-12, "gspo masked loss")
    near_all(out.grads[1], { -s2 / 2, 0, -s2 / 2 }, 1e-12, "gspo masked grads")
    -- per-token advantages {2, 1, 1}, agg sum: J = -4 s, every token gets -4 s / 3 (through the mean)
    out = run({ 2, 1, 1 }, 0.2, 0.2, "sum")
    H.near(out.loss, -4 * s, 1e-12, "gspo per-token adv loss")
    near_all(out.grads[1], { -4 * s / 3, -4 * s / 3, -4 * s / 3 }, 1e-12, "gspo per-token adv grads")
end

-- ================================================================================================ CISPO
do
    -- ratios exp(0.5) = 1.6487 and exp(-1) = 0.3679; clip to [0.8, 1.28]: weights 1.28 and 0.8 (detached)
    -- J = -(1.28 * 1 * -1) - (0.8 * 1 * -2) = 2.88; dJ/dx = -w A
    local S = { { logp = { -1, -2 }, old_logp = { -1.5, -1 }, adv = 1 } }
    local out = loss.compute(S, { loss = { kind = "cispo", eps_low = 0.2, eps_high = 0.28 }, agg = "sum" })
    H.near(out.loss, 2.88, 1e-14, "cispo loss")
    near_all(out.grads[1], { -1.28, -0.8 }, 1e-15, "cispo grads")
    H.eq(out.metrics.clip_frac, 1, "cispo clip_frac")
    H.near(out.metrics.clip_frac_low, 0.5, TOL, "cispo clip_frac_low")
    H.near(out.metrics.clip_frac_high, 0.5, TOL, "cispo clip_frac_high")
    -- the preset: no lower bound, cap 5 (eps_high 4): weights are the raw ratios
    out = loss.compute(S, rl.preset("cispo", { agg = "sum" }))
    near_all(out.grads[1], { -exp(0.5), -exp(-1) }, 1e-15, "cispo preset grads")
    H.eq(out.metrics.clip_frac, 0, "cispo preset clip_frac")
    S[1].old_logp = { -1 - log(6), -2 } -- ratio 6 > 5: capped at 5
    out = loss.compute(S, rl.preset("cispo", { agg = "sum" }))
    near_all(out.grads[1], { -5, -1 }, 1e-14, "cispo cap 5")
    -- negative advantage
    out = loss.compute({ { logp = { -1 }, old_logp = { -1 }, adv = -2 } },
        { loss = { kind = "cispo", eps_low = 0.2, eps_high = 0.2 }, agg = "sum" })
    H.near(out.loss, -2, 1e-15, "cispo A- loss = -(1)(-2)(-1)")
    H.near(out.grads[1][1], 2, 1e-15, "cispo A- grad")
end

-- ================================================================================================ aggregation
do
    -- two sequences of different lengths: per-token values {1, 2, 3} and {4}
    local S = { { logp = { -1, -1, -1 } }, { logp = { -1 } } }
    local V = { { 1, 2, 3 }, { 4 } }
    local function agg(a, o) return loss.aggregate(S, V, a, o) end
    H.near(agg("token_mean"), 10 / 4, TOL, "token_mean")
    H.near(agg("seq_mean_token_mean"), (2 + 4) / 2, TOL, "seq_mean_token_mean")
    H.near(agg("seq_mean_token_sum"), (6 + 4) / 2, TOL, "seq_mean_token_sum")
    H.near(agg({ mode = "seq_mean_token_sum_norm", max_len = 4 }), 10 / (2 * 4), TOL, "seq_mean_token_sum_norm")
    H.near(agg("sum"), 10, TOL, "sum")
    H.near(agg({ mode = "constant", constant = 5 }), 2, TOL, "constant")
    H.near(agg("token-mean"), 2.5, TOL, "verl spelling")
    H.near(agg("token_mean", { denom = 8 }), 10 / 8, TOL, "token_mean global denom")
    H.near(agg("seq_mean_token_mean", { num_seqs = 4 }), 6 / 4, TOL, "seq_mean_token_mean global count")
    -- masked token excluded everywhere: seq 1 mask {1, 0, 1} -> values 1, 3
    S[1].mask = { 1, 0, 1 }
    H.near(agg("token_mean"), 8 / 3, TOL, "token_mean masked")
    H.near(agg("seq_mean_token_mean"), (2 + 4) / 2, TOL, "seq_mean_token_mean masked")
    H.near(agg("seq_mean_token_sum"), (4 + 4) / 2, TOL, "seq_mean_token_sum masked")
    S[1].mask = nil
    -- micro-batch consistency: two halves with the global normalisers sum to the whole
    H.near(loss.aggregate({ S[1] }, { V[1] }, "token_mean", { denom = 4 })
        + loss.aggregate({ S[2] }, { V[2] }, "token_mean", { denom = 4 }), 2.5, TOL, "micro-batches token_mean")
    H.near(loss.aggregate({ S[1] }, { V[1] }, "seq_mean_token_mean", { num_seqs = 2 })
        + loss.aggregate({ S[2] }, { V[2] }, "seq_mean_token_mean", { num_seqs = 2 }), 3, TOL, "micro-batches seq")
    local T, N = loss.count(S)
    H.eq(T, 4, "count tokens")
    H.eq(N, 2, "count seqs")

    -- through compute(): ratio 1 (no old_logp), A = 1 on seq 1 and 2 on seq 2: per-token loss -A, grad -A * f_i
    local B = { { logp = { -1, -2, -3 }, adv = 1 }, { logp = { -0.5 }, adv = 2 } }
    local function run(a, o)
        return loss.compute(B, { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = a }, o)
    end
    local cases = {
        { "token_mean", -(3 + 2) / 4, -1 / 4, -2 / 4 },
        { "seq_mean_token_mean", -(1 + 2) / 2, -1 / 6, -2 / 2 },
        { "seq_mean_token_sum", -(3 + 2) / 2, -1 / 2, -2 / 2 },
        { { mode = "seq_mean_token_sum_norm", max_len = 5 }, -(3 + 2) / 10, -1 / 10, -2 / 10 },
        { "sum", -5, -1, -2 },
        { { mode = "constant", constant = 4 }, -5 / 4, -1 / 4, -2 / 4 },
    }
    for _, c in ipairs(cases) do
        local name = type(c[1]) == "table" and c[1].mode or c[1]
        local out = run(c[1])
        H.near(out.loss, c[2], 1e-15, "compute loss " .. name)
        near_all(out.grads[1], { c[3], c[3], c[3] }, 1e-15, "compute grads seq1 " .. name)
        near_all(out.grads[2], { c[4] }, 1e-15, "compute grads seq2 " .. name)
    end
    H.raises(function() run(nil) end, { "spec.agg is required", "token_mean" }, "agg missing")
    H.raises(function() run("mean") end, { "unknown aggregation mean" }, "agg unknown")
    H.raises(function() run("seq_mean_token_sum_norm") end, { "max_len" }, "dr_grpo norm without max_len")
    H.raises(function() run({ mode = "constant" }) end, { "spec.agg.constant" }, "constant without C")
    -- a fully masked sample: no tokens, zero gradient, counts as a sequence in seq modes
    B[3] = { logp = { -1, -1 }, adv = 5, mask = { 0, 0 } }
    local out = run("seq_mean_token_mean")
    H.near(out.loss, -(1 + 2) / 3, 1e-15, "fully masked sample counts in N")
    near_all(out.grads[3], { 0, 0 }, 0, "fully masked grads")
    out = run("token_mean")
    H.near(out.loss, -5 / 4, 1e-15, "fully masked sample: no tokens")
    H.eq(out.metrics.tokens, 4, "metrics.tokens")
    H.eq(out.metrics.seqs, 3, "metrics.seqs")
end

-- ================================================================================================ KL
do
    local function chk(est, logp, ref, wk, wd, what, clamp)
        local k, d = loss.kl_value(logp, ref, est, clamp)
        H.near(k, wk, 1e-12, what .. " value")
        H.near(d, wd, 1e-12, what .. " gradient")
    end
    -- x = logp - ref = 0.5
    chk("k1", -1, -1.5, 0.5, 1, "k1")
    chk("k2", -1, -1.5, 0.125, 0.5, "k2")
    chk("k3", -1, -1.5, 0.10653065971263342, 0.3934693402873666, "k3 x=0.5") -- e^-0.5 - 0.5, 1 - e^-0.5
    -- x = -0.3
    chk("k1", -1.8, -1.5, -0.3, 1, "k1 x=-0.3")
    chk("k2", -1.8, -1.5, 0.045, -0.3, "k2 x=-0.3")
    chk("k3", -1.8, -1.5, 0.04985880757600310, -0.3498588075760032, "k3 x=-0.3") -- e^0.3 - 1.3, 1 - e^0.3
    chk("k3", -2, -2, 0, 0, "k3 x=0")
    -- clamps (verl low_var_kl): u = ref - logp = 25 -> 20, value e^20 - 21 -> 10, gradient 0
    chk("k3", -25, 0, 10, 0, "k3 clamped")
    chk("k3", -3, 0, exp(3) - 4, 1 - exp(3), "k3 unclamped x=-3", false)            -- 16.09 > 10 without the clamp
    chk("k3", -3, 0, 10, 0, "k3 value clamp at 10")
    H.raises(function() loss.kl_value(0, 0, "k4") end, { "unknown KL estimator k4" }, "k4")

    -- in the loss: beta = 0.1, k2, agg sum, A = 0 (no policy term): J = 0.1 * (0.125 + 0.045), g = 0.1 * x
    local S = { { logp = { -1, -1.8 }, ref_logp = { -1.5, -1.5 }, adv = 0 } }
    local out = loss.compute(S, { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum",
        kl = { coef = 0.1, estimator = "k2" } })
    H.near(out.loss, 0.1 * 0.17, 1e-15, "kl in loss")
    H.near(out.metrics.kl_loss, 0.017, 1e-15, "kl_loss metric")
    near_all(out.grads[1], { 0.05, -0.03 }, 1e-15, "kl grads")
    H.near(out.metrics.kl, 0.085, 1e-15, "kl metric = mean k2")
    -- where = "reward": not in the loss, reported as a metric
    out = loss.compute(S, { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum",
        kl = { coef = 0.1, estimator = "k1", where = "reward" } })
    H.eq(out.loss, 0, "kl in reward: no loss term")
    H.near(out.metrics.kl, (0.5 - 0.3) / 2, 1e-15, "kl metric k1")
    H.raises(function()
        loss.compute({ { logp = { -1 }, adv = 0 } }, { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum",
            kl = { coef = 0.1, estimator = "k3" } })
    end, { "ref_logp is missing" }, "kl needs ref")

    -- kl_in_reward: x = old - ref = {0.5, 0.5}, k1, beta 0.1
    local R = { { old_logp = { -1, -2 }, ref_logp = { -1.5, -2.5 }, logp = { 0, 0 } } }
    local st = loss.kl_in_reward(R, 0.1, "k1")
    near_all(R[1].kl_reward, { -0.05, -0.05 }, 1e-15, "kl_in_reward token")
    H.near(st.kl_mean, 0.5, 1e-15, "kl_in_reward kl_mean")
    loss.kl_in_reward(R, 0.1, "k1", { level = "sequence" })
    H.near(R[1].kl_reward, -0.1, 1e-15, "kl_in_reward sequence")
    R[1].mask = { 1, 0 }
    loss.kl_in_reward(R, 0.1, "k2")
    near_all(R[1].kl_reward, { -0.0125, 0 }, 1e-15, "kl_in_reward masked")
end

-- ================================================================================================ entropy
do
    -- one token, on-policy, H = 0.9, alpha 0.01: value -alpha H = -0.009, gradient alpha (logp + H) = 0.004
    local spec = { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum", entropy_coef = 0.01 }
    local out = loss.compute({ { logp = { -0.5 }, adv = 0, entropy = { 0.9 } } }, spec)
    H.near(out.loss, -0.009, 1e-15, "entropy bonus value")
    H.near(out.grads[1][1], 0.004, 1e-15, "entropy bonus gradient (baseline H)")
    H.near(out.metrics.entropy, 0.9, 1e-15, "entropy metric")
    -- without the entropy: value alpha logp = -0.005 (sampled estimate), gradient alpha (logp + 1) = 0.005
    out = loss.compute({ { logp = { -0.5 }, adv = 0 } }, spec)
    H.near(out.loss, -0.005, 1e-15, "entropy surrogate value without H")
    H.near(out.grads[1][1], 0.005, 1e-15, "entropy surrogate gradient without H")
    H.eq(out.metrics.entropy, nil, "no entropy metric without sample.entropy")

    -- Exact check on a categorical pi = softmax(theta): the expected gradient through backward_logprobs,
    -- sum_a q(a) * dJ/dlogp(a) * d log pi(a)/d theta (tokens sampled from q), must equal the gradient of
    -- -alpha H(pi), computed (1) in closed form, -alpha dH/dtheta_j = alpha pi_j (log pi_j + H), and
    -- (2) by central differences of H itself. On-policy (q = pi) and off-policy (q = pi_old, the IS ratio).
    local theta = { 0.3, -1.2, 0.8, 0.05 }
    local function softmax(th)
        local mx, z, p = -math.huge, 0, {}
        for _, v in ipairs(th) do mx = math.max(mx, v) end
        for i, v in ipairs(th) do p[i] = exp(v - mx); z = z + p[i] end
        for i = 1, #p do p[i] = p[i] / z end
        return p
    end
    local function entropy(th)
        local p, h = softmax(th), 0
        for i = 1, #p do h = h - p[i] * log(p[i]) end
        return h
    end
    local alpha = 0.3
    local p = softmax(theta)
    local Hp = entropy(theta)
    local want = {}
    for j = 1, #p do
        local e = 1e-5
        local tp, tm = { unpack(theta) }, { unpack(theta) }
        tp[j], tm[j] = tp[j] + e, tm[j] - e
        local fd = -alpha * (entropy(tp) - entropy(tm)) / (2 * e)
        want[j] = alpha * p[j] * (log(p[j]) + Hp)
        H.near(fd, want[j], 1e-9, "closed-form entropy gradient vs finite difference " .. j)
    end
    local q = softmax({ -0.2, 0.4, 0.1, -0.6 }) -- a different sampling policy
    for _, case in ipairs({
        { "on-policy, baseline H", p, true }, { "on-policy, baseline 1", p, false },
        { "off-policy, baseline H", q, true }, { "off-policy, baseline 1", q, false } }) do
        local name, samp, with_h = case[1], case[2], case[3]
        local got = { 0, 0, 0, 0 }
        for a = 1, #p do
            local s = { logp = { log(p[a]) }, old_logp = { log(samp[a]) }, adv = 0, entropy = with_h and { Hp } or nil }
            local g = loss.compute({ s }, { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum",
                entropy_coef = alpha }).grads[1][1]
            for j = 1, #p do
                local dlogp = (j == a and 1 or 0) - p[j] -- d log pi(a) / d theta_j
                got[j] = got[j] + samp[a] * g * dlogp
            end
        end
        for j = 1, #p do H.near(got[j], want[j], 1e-14, ("%s: E[grad] %d"):format(name, j)) end
    end
end

-- ================================================================================================ TIS / MIS
do
    -- old - rollout = {0.5, -0.5, 0, 1}: rho = {1.6487, 0.6065, 1, 2.7183}
    local function batch()
        return { { logp = { -1, -1, -1, -1 }, old_logp = { -1, -1, -1, -1 }, rollout_logp = { -1.5, -0.5, -1, -2 },
            adv = 1 } }
    end
    local e5, em5 = exp(0.5), exp(-0.5)
    local c = corr.compute(batch(), { level = "token", mode = "truncate", hi = 2 })
    near_all(c.weights[1], { e5, em5, 1, 2 }, 1e-15, "tis truncate")
    H.near(c.metrics.tis_frac_truncated, 0.25, TOL, "tis truncated fraction")
    H.near(c.metrics.tis_frac_masked, 0, TOL, "tis masked fraction")
    H.near(c.metrics.mismatch_abs_mean, 0.5, 1e-15, "mismatch mean |d|")
    H.near(c.metrics.mismatch_abs_max, 1, 1e-15, "mismatch max |d|")
    -- k3(x) = e^-x - 1 + x at x = 0.5, -0.5, 0, 1
    H.near(c.metrics.mismatch_k3, (0.10653065971263342 + 0.14872127070012819 + 0 + 0.36787944117144233) / 4, 1e-15,
        "mismatch k3")
    H.near(c.metrics.token_mult_prob_error, (e5 + e5 + 1 + exp(1)) / 4, 1e-14, "token_mult_prob_error")
    H.near(c.metrics.tis_ess, (e5 + em5 + 3) ^ 2 / (4 * (e5 ^ 2 + em5 ^ 2 + 1 + 4)), 1e-14, "ess")
    c = corr.compute(batch(), { mode = "truncate", lo = 0.8, hi = 2 })
    near_all(c.weights[1], { e5, 0.8, 1, 2 }, 1e-15, "tis truncate with lower bound")
    H.near(c.metrics.tis_frac_truncated, 0.5, TOL, "both-sided truncation fraction")
    c = corr.compute(batch(), { mode = "mask" }) -- [0.5, 2] by default
    near_all(c.weights[1], { e5, em5, 1, 0 }, 1e-15, "mis mask")
    H.near(c.metrics.tis_frac_masked, 0.25, TOL, "mis masked fraction")
    c = corr.compute(batch(), { mode = "mask", lo = 0.7, hi = 3 })
    near_all(c.weights[1], { e5, 0, 1, exp(1) }, 1e-15, "mis mask low")
    c = corr.compute(batch(), { mode = "reject" })
    near_all(c.weights[1], { 1, 1, 1, 0 }, 0, "reject")
    -- sequence level: product exp(0.5 - 0.5 + 0 + 1) = e > 2
    c = corr.compute(batch(), { level = "sequence", mode = "truncate", hi = 2 })
    near_all(c.weights[1], { 2, 2, 2, 2 }, 0, "sequence truncate")
    c = corr.compute(batch(), { level = "sequence", mode = "mask" })
    near_all(c.weights[1], { 0, 0, 0, 0 }, 0, "sequence mask")
    H.eq(c.metrics.tis_seq_masked, 1, "sequences masked")
    -- geometric: exp(mean) = exp(0.25)
    c = corr.compute(batch(), { level = "geometric", mode = "mask" })
    near_all(c.weights[1], { exp(0.25), exp(0.25), exp(0.25), exp(0.25) }, 1e-15, "geometric")
    -- veto: a token ratio below 0.7 zeroes the sequence
    c = corr.compute(batch(), { mode = "truncate", veto = 0.7 })
    near_all(c.weights[1], { 0, 0, 0, 0 }, 0, "veto")
    -- normalisation to mean 1
    c = corr.compute(batch(), { mode = "reject", normalize = true })
    near_all(c.weights[1], { 4 / 3, 4 / 3, 4 / 3, 0 }, 1e-15, "normalized")
    -- a batch cut in parts (micro-batches, ranks): each part scaled by the whole batch's factor gets the whole
    -- batch's weights. Whole: 3 + 2 kept of 8 tokens -> 8/5; the first part alone would be 4/3
    local two = batch()
    two[2] = { logp = { -1, -1, -1, -1 }, old_logp = { -1, -1, -1, -1 }, rollout_logp = { -1, -4, -1, -4 }, adv = 1 }
    local nrm = { mode = "reject", normalize = true }
    H.near(corr.norm_scale(two, nrm), 8 / 5, 1e-15, "norm_scale: trained tokens / kept weight")
    H.eq(corr.norm_scale(two, { mode = "reject" }), nil, "norm_scale without normalize")
    local whole = corr.compute(two, nrm)
    near_all(whole.weights[1], { 8 / 5, 8 / 5, 8 / 5, 0 }, 1e-15, "normalized over two samples")
    for i = 1, 2 do
        local part = corr.compute({ two[i] }, nrm, nil, corr.norm_scale(two, nrm))
        near_all(part.weights[1], whole.weights[i], 0, ("part %d with the whole batch's factor"):format(i))
    end
    -- masked tokens: weight 0, excluded from the metrics and the geometric mean
    local b = batch()
    b[1].mask = { 1, 1, 1, 0 }
    c = corr.compute(b, { level = "geometric", mode = "truncate" })
    near_all(c.weights[1], { 1, 1, 1, 0 }, 1e-15, "geometric over trained tokens (mean 0)")
    H.near(c.metrics.mismatch_abs_max, 0.5, 0, "max over trained tokens")
    H.raises(function() corr.compute({ { logp = { 1 }, old_logp = { 1 } } }, {}) end, { "rollout_logp" },
        "tis needs rollout_logp")
    H.raises(function() corr.compute(batch(), { mode = "clip" }) end, { "unknown tis.mode" }, "bad mode")

    -- integrated in loss.compute: ratio 1, A = 1, agg sum -> J = -sum w, grads -w
    local out = loss.compute(batch(), { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum",
        tis = { mode = "truncate", hi = 2 } })
    H.near(out.loss, -(e5 + em5 + 1 + 2), 1e-14, "tis loss")
    near_all(out.grads[1], { -e5, -em5, -1, -2 }, 1e-15, "tis grads")
    H.near(out.metrics.tis_frac_truncated, 0.25, TOL, "tis metric via loss")
    -- TIS does not change the denominator (token_mean over 4 tokens even with a masked weight)
    out = loss.compute(batch(), { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "token_mean",
        tis = { mode = "reject" } })
    H.near(out.loss, -3 / 4, 1e-15, "mis keeps the denominator")
    -- mismatch metrics without tis
    out = loss.compute(batch(), { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum" })
    H.near(out.metrics.mismatch_abs_mean, 0.5, 1e-15, "mismatch metrics without tis")
    H.eq(out.metrics.tis_weight_mean, nil, "no tis metrics without tis")
end

-- ================================================================================================ filters
do
    local function mk(g, rewards)
        local out = {}
        for _, r in ipairs(rewards) do out[#out + 1] = { group = g, reward = r, logp = { -1, -1 } } end
        return out
    end
    local S = {}
    for _, part in ipairs({ mk("a", { 1, 0, 0, 1 }), mk("b", { 1, 1, 1, 1 }), mk("c", { 0, 0, 0, 0 }), mk("d", { 1 }),
        mk("e", { 0.5, 0.5, 0.25 }) }) do
        for _, s in ipairs(part) do S[#S + 1] = s end
    end
    local kept, n = filter.keep_groups(S)
    H.eq(#kept, 7, "kept samples")
    H.eq(n.groups, 5, "groups")
    H.eq(n.kept_groups, 2, "kept groups")
    H.eq(n.dropped_groups, 3, "dropped groups")
    H.near(n.frac_zero_std, 0.6, TOL, "frac zero std")
    H.eq(kept[1].group, "a", "order kept")
    H.eq(kept[5].group, "e", "order kept 2")
    kept = filter.keep_groups(S, { tol = 0.3 }) -- group e spans 0.25 only
    H.eq(#kept, 4, "tolerance")
    for _, s in ipairs(S) do s.acc = s.reward > 0 and 1 or 0 end
    kept = filter.keep_groups(S, { key = "acc" }) -- e: all acc 1
    H.eq(#kept, 4, "filter on acc")

    -- fill_batch: every call returns one informative and one all-equal group
    local calls = 0
    local function gen()
        calls = calls + 1
        local out = mk("inf" .. calls, { 1, 0 })
        for _, s in ipairs(mk("flat" .. calls, { 1, 1 })) do out[#out + 1] = s end
        return out
    end
    local got, full, st = filter.fill_batch(gen, 3, 9)
    H.eq(full, true, "fill_batch full")
    H.eq(st.calls, 3, "fill_batch calls")
    H.eq(#got, 6, "fill_batch samples")
    H.eq(got[6].group, "inf3", "fill_batch last group")
    calls = 0
    got, full, st = filter.fill_batch(gen, 3, 1)
    H.eq(full, false, "fill_batch bound hit")
    H.eq(st.calls, 2, "fill_batch 1 + 1 calls")
    H.eq(#got, 4, "fill_batch partial")
    -- more than wanted: trimmed to want_groups whole groups (first come first kept)
    local function gen2()
        local out = mk("p", { 0, 1, 1 })
        for _, s in ipairs(mk("q", { 1, 0 })) do out[#out + 1] = s end
        return out
    end
    got, full, st = filter.fill_batch(gen2, 1, 0)
    H.eq(full, true, "fill_batch one call")
    H.eq(st.calls, 1, "fill_batch no extra call")
    H.eq(#got, 3, "fill_batch trims to one group")
    H.eq(got[3].group, "p", "fill_batch keeps the first group")
    H.eq(st.groups_kept, 2, "fill_batch kept both, used one")
    H.eq(st.groups_used, 1, "fill_batch groups_used")
    H.raises(function() filter.fill_batch(function() return mk("same", { 0, 1 }) end, 2, 3) end,
        { "returned by two gen_fn calls" }, "group id collision")

    -- overlong filtering
    local O = { { finish_reason = "length", logp = { -1, -1, -1 }, reward = 0, group = 1 },
        { finish_reason = "eos", logp = { -1 }, reward = 1, group = 1 }, { truncated = true, ids = { 5, 6 } } }
    H.eq(filter.overlong_filter(O), 2, "overlong filtered count")
    H.same(O[1].mask, { 0, 0, 0 }, "overlong mask")
    H.eq(O[2].mask, nil, "eos untouched")
    H.same(O[3].mask, { 0, 0 }, "truncated flag")

    -- soft overlong punishment, L_max 20, L_cache 4 (expected length 16)
    local f = filter.soft_overlong
    H.eq(f(10, 20, 4), 0, "short")
    H.eq(f(16, 20, 4), 0, "L = Lmax - Lcache")
    H.near(f(17, 20, 4), -0.25, TOL, "L = 17")
    H.near(f(18, 20, 4), -0.5, TOL, "L = 18")
    H.near(f(20, 20, 4), -1, TOL, "L = Lmax")
    H.eq(f(21, 20, 4), -1, "beyond Lmax")
    H.near(f(18, 20, 4, 0.5), -0.25, TOL, "factor")
    H.near(f(20480 - 4096 + 2048, 20480, 4096), -0.5, TOL, "DAPO 32B midpoint")
    local P = { { reward = 1, length = 18 }, { reward = 1, logp = { 1, 1, 1 } } }
    local ps = filter.apply_soft_overlong(P, { max_len = 20, cache = 4 })
    H.near(P[1].reward, 0.5, TOL, "penalty applied")
    H.eq(P[2].reward, 1, "short: no penalty")
    H.eq(ps.penalized, 1, "penalized count")
    filter.apply_soft_overlong(P, { max_len = 20, cache = 4 })
    H.near(P[1].reward, 0.5, TOL, "penalty not applied twice")
end

-- ================================================================================================ presets
do
    local A = rl.algorithms
    H.eq(A.grpo.adv.kind, "grpo", "grpo adv")
    H.eq(A.grpo.adv.eps, 1e-6, "grpo eps")
    H.eq(A.grpo.loss.eps_low, 0.2, "grpo eps_low")
    H.eq(A.grpo.agg, "seq_mean_token_mean", "grpo agg")
    H.eq(A.grpo.kl.estimator, "k3", "grpo kl")
    H.eq(A.dapo.loss.eps_high, 0.28, "dapo clip-higher")
    H.eq(A.dapo.agg, "token_mean", "dapo agg")
    H.eq(A.dapo.kl, nil, "dapo no kl")
    H.eq(A.dapo.dynamic_sampling.enable, true, "dapo dynamic sampling")
    H.eq(A.dapo.overlong.soft.max_len, 20480, "dapo overlong")
    H.eq(A.dr_grpo.agg.mode, "seq_mean_token_sum_norm", "dr_grpo agg")
    H.eq(A.dr_grpo.adv.kind, "dr_grpo", "dr_grpo adv")
    H.eq(A.gspo.loss.eps_low, 3e-4, "gspo eps_low")
    H.eq(A.gspo.loss.eps_high, 4e-4, "gspo eps_high")
    H.eq(A.cispo.loss.kind, "cispo", "cispo")
    H.eq(A.reinforce_pp.kl.where, "reward", "reinforce_pp kl in reward")
    H.eq(A.rloo.adv.kind, "rloo", "rloo")
    local p = rl.preset("grpo", { kl = { coef = 0.04 }, loss = { clip_c = 3 } })
    H.eq(p.kl.coef, 0.04, "override merged")
    H.eq(p.kl.estimator, "k3", "override keeps the rest")
    H.eq(p.loss.clip_c, 3, "override adds")
    H.eq(A.grpo.kl.coef, 0.001, "preset untouched")
    H.eq(rl.preset("grpo", { kl = rl.NIL }).kl, nil, "rl.NIL deletes")
    H.raises(function() rl.preset("ppo2") end, { "unknown algorithm ppo2" }, "unknown preset")
    -- every preset drives a whole step on a small batch
    for name in pairs(A) do
        local spec = rl.preset(name, name == "dr_grpo" and { agg = { max_len = 8 } } or nil)
        local S = {}
        for i = 1, 4 do
            S[i] = { group = 1, reward = (i % 2), logp = { -1 - 0.1 * i, -0.5 }, old_logp = { -1, -0.5 },
                ref_logp = { -1.2, -0.4 }, rollout_logp = { -1, -0.6 } }
        end
        if spec.kl and spec.kl.where == "reward" then
            loss.kl_in_reward(S, spec.kl.coef, spec.kl.estimator, { level = spec.kl.level })
        end
        adv.compute(S, spec.adv)
        local ok, out = pcall(loss.compute, S, spec)
        H.check(ok and type(out.loss) == "number" and out.loss == out.loss, "preset " .. name .. " runs: "
            .. tostring(ok and out.loss or out))
    end
    H.raises(function()
        local S = { { group = 1, reward = 1, logp = { -1 }, adv = 1 } }
        loss.compute(S, rl.preset("dr_grpo"))
    end, { "max_len" }, "dr_grpo preset needs max_len")
end

-- ================================================================================================ errors
do
    local ok = { loss = { kind = "ppo_clip", eps_low = 0.2 }, agg = "sum" }
    H.raises(function() loss.compute({ { logp = { -1 } } }, ok) end, { "adv is missing" }, "adv missing")
    H.raises(function() loss.compute({ { logp = { -1 }, adv = 1, old_logp = { 1, 2 } } }, ok) end,
        { "old_logp must be an array of 1" }, "length mismatch")
    H.raises(function() loss.compute({ { logp = { -1 }, adv = 1 } }, { loss = { kind = "a2c" }, agg = "sum" }) end,
        { "unknown loss kind a2c" }, "unknown loss")
    H.raises(function() loss.compute({ { logp = { -1 }, adv = 1 } }, { loss = { kind = "ppo_clip" }, agg = "sum" }) end,
        { "needs spec.loss.eps_low" }, "eps missing")
    H.raises(function()
        loss.compute({ { logp = { -1 }, adv = 1 } }, { loss = { kind = "ppo_clip", eps_low = 0.2, clip_c = 0.5 },
            agg = "sum" })
    end, { "clip_c must be > 1" }, "dual clip c")
    local out = loss.compute({}, ok)
    H.eq(out.loss, 0, "empty batch")
end

-- ================================================================================================ finite differences
-- Every analytic gradient against a central difference (J(x + h) - J(x - h)) / 2h with h = 1e-6 in double
-- precision, over random batches, for every loss kind x aggregation mode x KL estimator (none, k1, k2, k3),
-- each in a plain variant and one with per-token advantages, TIS weights, the entropy bonus and sometimes no
-- old_logp. Stop-gradient terms are held at the base point (opts.sg_logp), so the difference quotient
-- differentiates exactly the surrogate whose gradient compute() returns.
-- Tolerance |fd - g| <= 1e-6 |g| + 1e-9 max(1, |J|). The difference quotient has two errors: truncation,
-- h^2/6 |d3J/dx3| ~ 1e-13 here (J is a smooth combination of exp and low-degree polynomials of O(1) arguments
-- away from kinks), far below 1e-6 |g|; and rounding, ~ eps_mach |J| / h = 2.2e-16 |J| / 1e-6 = 2.2e-10 |J|,
-- which the second term covers with a 4.5x margin (it matters only where |g| is tiny next to |J|, e.g. a
-- token whose policy and KL gradients almost cancel under the "sum" aggregation). Any real mistake (a wrong
-- branch, a missing factor 1/|o_i|, r or beta) is off by O(|g|), i.e. by 1e5 times the bound or more.
-- The losses are piecewise smooth: a point within 1e-4 (relative) of a kink (clip boundary, dual-clip point)
-- would make the difference straddle it; such points are skipped and counted (the RNG is
-- seeded, so the set is fixed). Untrained tokens must have g == 0 and fd == 0 exactly.
do
    local seed = 12345
    local function rnd() -- Park-Miller LCG: deterministic on every Lua
        seed = (seed * 16807) % 2147483647
        return seed / 2147483647
    end
    local function unif(a, b) return a + (b - a) * rnd() end

    local function make_batch(variant)
        local S = {}
        for i = 1, 3 do
            local n = 1 + math.floor(rnd() * 6)
            local s = { logp = {}, old_logp = {}, ref_logp = {}, rollout_logp = {}, mask = {}, entropy = {},
                group = 1, reward = rnd() }
            for t = 1, n do
                local x = unif(-4, -0.01)
                s.logp[t] = x
                s.old_logp[t] = x + unif(-0.4, 0.4)
                s.ref_logp[t] = x + unif(-0.5, 0.5)
                s.rollout_logp[t] = s.old_logp[t] + unif(-0.3, 0.3)
                s.mask[t] = rnd() < 0.8 and 1 or 0
                s.entropy[t] = unif(0.1, 3)
            end
            if variant == 2 then
                s.adv = {}
                for t = 1, n do s.adv[t] = unif(-2, 2) end
                if rnd() < 0.3 then s.old_logp = nil end
            else
                s.adv = unif(-2, 2)
            end
            S[i] = s
        end
        return S
    end

    local kinds = {
        { "ppo_clip", { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.28 } },
        { "ppo_clip_dual", { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.28, clip_c = 1.3 } },
        { "gspo", { kind = "gspo", eps_low = 0.05, eps_high = 0.06 } },
        { "cispo", { kind = "cispo", eps_low = 0.2, eps_high = 0.28 } },
    }
    local aggs = { "token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
        { mode = "seq_mean_token_sum_norm", max_len = 8 }, "sum", { mode = "constant", constant = 7 } }
    local kls = { false, "k1", "k2", "k3" }
    local h = 1e-6
    local combos, points, skipped, worst, worst_rel = 0, 0, 0, 0, 0

    -- Distance (relative) from the nearest kink of the loss at token t of sample i.
    local function near_kink(spec, s, t)
        local ls = spec.loss
        if ls.kind == "cispo" then return false end
        local lo, hi = 1 - ls.eps_low, 1 + ls.eps_high
        local r
        if ls.kind == "gspo" then
            local sum, cnt = 0, 0
            for u = 1, #s.logp do
                if s.mask[u] ~= 0 then
                    sum = sum + s.logp[u] - (s.old_logp and s.old_logp[u] or s.logp[u])
                    cnt = cnt + 1
                end
            end
            r = exp(sum / cnt)
        else
            r = exp(s.logp[t] - (s.old_logp and s.old_logp[t] or s.logp[t]))
        end
        local d = math.min(abs(r - lo) / lo, abs(r - hi) / hi)
        if ls.clip_c then d = math.min(d, abs(r - ls.clip_c) / ls.clip_c) end
        return d < 1e-4
    end

    for _, kd in ipairs(kinds) do
        for _, ag in ipairs(aggs) do
            for _, est in ipairs(kls) do
                for variant = 1, 2 do
                    combos = combos + 1
                    local S = make_batch(variant)
                    local spec = { loss = kd[2], agg = ag }
                    if est then spec.kl = { coef = 0.3, estimator = est } end
                    local opts = {}
                    if variant == 2 then
                        spec.tis = { level = (combos % 3 == 0) and "geometric" or "token", mode = "truncate", hi = 1.2 }
                        spec.entropy_coef = 0.05
                        spec.entropy_baseline = (combos % 2 == 0) and "auto" or "one"
                        opts.denom, opts.num_seqs = 11, 5 -- global normalisers of a larger batch
                    end
                    local sg = {}
                    for i, s in ipairs(S) do sg[i] = { unpack(s.logp) } end
                    opts.sg_logp = sg
                    local base = loss.compute(S, spec, opts)
                    for i, s in ipairs(S) do
                        for t = 1, #s.logp do
                            local g = base.grads[i][t]
                            local x0 = s.logp[t]
                            s.logp[t] = x0 + h
                            local jp = loss.compute(S, spec, opts).loss
                            s.logp[t] = x0 - h
                            local jm = loss.compute(S, spec, opts).loss
                            s.logp[t] = x0
                            local fd = (jp - jm) / (2 * h)
                            local what = ("%s %s kl=%s v%d sample %d token %d"):format(kd[1],
                                type(ag) == "table" and ag.mode or ag, tostring(est), variant, i, t)
                            if s.mask[t] == 0 then
                                H.check(g == 0 and fd == 0, what .. (": untrained token g %g fd %g"):format(g, fd))
                            elseif near_kink(spec, s, t) then
                                skipped = skipped + 1
                            else
                                points = points + 1
                                local tol = 1e-6 * abs(g) + 1e-9 * math.max(1, abs(base.loss))
                                local err = abs(fd - g)
                                if err / tol > worst then worst = err / tol end
                                if abs(g) >= 1e-3 and err / abs(g) > worst_rel then worst_rel = err / abs(g) end
                                H.check(err <= tol, ("%s: analytic %.12g, finite difference %.12g (|d| %.3g, bound %.3g)")
                                    :format(what, g, fd, err, tol))
                            end
                        end
                    end
                end
            end
        end
    end
    io.write(("finite differences: %d combinations, %d trained tokens checked (%d skipped near a kink); "
        .. "worst |fd - g| / bound %.3g; worst relative error where |g| >= 1e-3: %.3g\n")
        :format(combos, points, skipped, worst, worst_rel))
    H.check(points > 500, "enough finite-difference points: " .. points)
end

H.done("test_rl")
