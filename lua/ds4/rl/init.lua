--[==[ ds4.rl — RL algorithms as pure Lua (LuaJIT 2.1 / Lua 5.1): advantages, policy losses with analytic
per-token gradients, rollout/train mismatch correction, dynamic sampling and overlong handling.

  local rl = require("ds4.rl")
  rl.advantage   ds4.rl.advantage   group_mean, leave_one_out, dr_grpo, reinforce_pp(_baseline), gae, whiten, compute
  rl.loss        ds4.rl.loss        compute (loss + dLoss/dlogp per token + metrics), kl_value, kl_in_reward, ...
  rl.correction  ds4.rl.correction  TIS / MIS / sequence-level weights, mismatch metrics
  rl.filter      ds4.rl.filter      keep_groups, fill_batch, overlong_filter, soft_overlong, apply_soft_overlong
  rl.algorithms  presets (plain tables, below);  rl.preset(name [, overrides]) -> a deep copy merged with overrides;
                 rl.merge(dst, src) the merge it applies (tables key by key, rl.NIL deletes a field)

Each module's header has the formulas, the data layout and the framework each default follows; a citation
docs/rl.md, "Name" is the section of docs/rl.md that explains it with its sources. One training step, as the RL
loop is expected to drive it:

  local spec = rl.preset("dapo")
  -- samples: {reward, group, finish_reason, rollout_logp, mask, ...} per response (response tokens only)
  if spec.dynamic_sampling.enable then samples = rl.filter.keep_groups(samples) end   (or rl.filter.fill_batch)
  if spec.overlong.filter then rl.filter.overlong_filter(samples) end
  if spec.overlong.soft then rl.filter.apply_soft_overlong(samples, spec.overlong.soft) end
  -- old_logp (and ref_logp when spec.kl) from trainer forwards
  if spec.kl and spec.kl.where == "reward" then
      rl.loss.kl_in_reward(samples, spec.kl.coef, spec.kl.estimator, {level = spec.kl.level}) end
  rl.advantage.compute(samples, spec.adv)
  local T, N = rl.loss.count(samples)                   -- global normalisers for micro-batches
  for each micro-batch mb: forward with train = true; s.logp = model:logprobs() rows;
      local out = rl.loss.compute(mb, spec, {denom = T, num_seqs = N})
      scatter out.grads into an F32 [B, S] tensor at the response positions; model:backward_logprobs(g)
  opt:step()

Preset fields (read by the RL loop; a preset is also a valid spec for rl.loss.compute):
  adv              {kind = grpo|dr_grpo|rloo|reinforce_pp|reinforce_pp_baseline|gae|given, std, eps, gamma, ...}
                   -> rl.advantage.compute(samples, preset.adv)
  loss             {kind = ppo_clip|gspo|cispo, eps_low, eps_high, clip_c}
  agg              aggregation mode string, or {mode = ..., max_len = L | constant = C}
  kl               nil (no KL) or {coef, estimator = k1|k2|k3, where = "loss"|"reward", level = token|sequence}
                   (level only for where = "reward"; the loop calls rl.loss.kl_in_reward then)
  entropy_coef     entropy bonus coefficient (0 = entropy reported only)
  dynamic_sampling {enable, max_extra_batches, key}   -> rl.filter.keep_groups / fill_batch
  overlong         {filter = bool, soft = nil | {max_len, cache, factor}}  -> rl.filter
  tis              nil or {level, mode, lo, hi, veto, normalize} (rl.correction); off in every preset as in
                   Miles / verl / NeMo (TRL turns its sequence-mask correction on by default, docs/rl.md,
                   "Mismatch correction");
                   rl.tis_default is Miles' --use-tis setting, ready to assign.
  refs             where the numbers come from (text)
]==]

local M = {}

M.advantage = require("ds4.rl.advantage")
M.loss = require("ds4.rl.loss")
M.correction = require("ds4.rl.correction")
M.filter = require("ds4.rl.filter")

-- Miles --use-tis --tis-clip 2.0 --tis-clip-low 0: token-level truncation w = min(old/rollout, 2).
M.tis_default = { level = "token", mode = "truncate", lo = 0, hi = 2.0 }

local function off() return { enable = false } end

M.algorithms = {
    -- GRPO (DeepSeekMath) as the frameworks run it (docs/rl.md, "GRPO", "PPO clip", "Aggregation", "KL"):
    -- std-normalised group baseline (unbiased std, eps 1e-6: verl / Miles), PPO clip 0.2 both sides (every
    -- framework), sequence-mean of token-means (the GRPO paper; Miles default; TRL loss_type "grpo"), k3 KL in the
    -- loss. KL coefficient: verl's kl_loss_coef 0.001 with kl_loss_type low_var_kl (= k3); NeMo uses 0.01, TRL 0.0,
    -- the GRPO paper 0.04 (arXiv 2402.03300): override kl.coef to taste, or kl = nil for no reference model.
    grpo = {
        name = "grpo",
        adv = { kind = "grpo", std = true, eps = 1e-6 },
        loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2 },
        agg = "seq_mean_token_mean",
        kl = { coef = 0.001, estimator = "k3", where = "loss" },
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "GRPO" (verl/Miles eps 1e-6), "PPO clip" (eps 0.2), "Aggregation" (seq-mean-token-mean), '
            .. '"KL" (verl k3 0.001)',
    },
    -- DAPO (arXiv 2503.14476; docs/rl.md, "DAPO"): clip-higher 0.2 / 0.28, token-mean over the global batch, no KL,
    -- dynamic sampling (verl recipe max_num_gen_batches 10 = 1 + 9 extra), soft overlong punishment with the
    -- 32B recipe's L_max 20480, L_cache 4096, factor 1.0; overlong filtering off (verl docs: most paper runs
    -- without it). DAPO's reward is +1 / -1 (verl math_dapo): that is the reward function's business.
    dapo = {
        name = "dapo",
        adv = { kind = "grpo", std = true, eps = 1e-6 },
        loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.28 },
        agg = "token_mean",
        kl = nil,
        entropy_coef = 0,
        dynamic_sampling = { enable = true, max_extra_batches = 9, key = "reward" },
        overlong = { filter = false, soft = { max_len = 20480, cache = 4096, factor = 1.0 } },
        refs = 'docs/rl.md, "DAPO" (verl docs/algo/dapo.md, recipe/dapo/run_dapo_qwen2.5_32b.sh; Miles DSV4 0.2/0.28)',
    },
    -- Dr.GRPO (docs/rl.md, "Dr.GRPO"): no std division, no per-sequence length normalisation: sum / (N * L_max) with
    -- L_max = the maximum response length (TRL max_completion_length, verl response length). agg.max_len has
    -- no universal value: set it, e.g. rl.preset("dr_grpo", {agg = {max_len = 4096}}); rl.loss.compute errors
    -- until it is set. No KL (TRL beta 0).
    dr_grpo = {
        name = "dr_grpo",
        adv = { kind = "dr_grpo" },
        loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2 },
        agg = { mode = "seq_mean_token_sum_norm", max_len = nil },
        kl = nil,
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "Dr.GRPO" (TRL scale_rewards none + loss_type dr_grpo; verl seq-mean-token-sum-norm)',
    },
    -- GSPO (docs/rl.md, "GSPO"): sequence-level geometric-mean ratio, tiny clip range 3e-4 / 4e-4 (verl
    -- examples/gspo_trainer/run_qwen30b_gspo.sh, the paper's values; Miles recipes use 4e-4 both sides),
    -- sequence-mean aggregation (forced by verl and OpenRLHF), no KL.
    gspo = {
        name = "gspo",
        adv = { kind = "grpo", std = true, eps = 1e-6 },
        loss = { kind = "gspo", eps_low = 3e-4, eps_high = 4e-4 },
        agg = "seq_mean_token_mean",
        kl = nil,
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "GSPO" (verl run_qwen30b_gspo.sh 3e-4/4e-4, seq-mean-token-mean)',
    },
    -- CISPO (MiniMax-M1, docs/rl.md, "CISPO"): detached clipped IS weight times logp. No lower bound (the paper's
    -- choice; TRL clamps only from above), upper cap 5.0 on the ratio (TRL epsilon_high = 5.0 "ScaleRL
    -- recommends", i.e. eps_high = 4 in the 1 + eps_high form), token-level normalisation as in the MiniMax-M1
    -- objective (1 / sum |o_i|), group-normalised advantage, no KL.
    cispo = {
        name = "cispo",
        adv = { kind = "grpo", std = true, eps = 1e-6 },
        loss = { kind = "cispo", eps_low = nil, eps_high = 4.0 },
        agg = "token_mean",
        kl = nil,
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "CISPO" (verl compute_policy_loss_cispo; TRL cispo cap 5.0)',
    },
    -- REINFORCE++ (arXiv 2501.03262, docs/rl.md, "REINFORCE++"): KL in the per-token reward (OpenRLHF's default: reward
    -- shaping, k1, init_coef 0.01), outcome reward at the last token, discounted return with gamma 1, batch
    -- whitening; PPO clip 0.2, token-mean (OpenRLHF token_level_loss).
    reinforce_pp = {
        name = "reinforce_pp",
        adv = { kind = "reinforce_pp", gamma = 1.0, eps = 1e-8 },
        loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2 },
        agg = "token_mean",
        kl = { coef = 0.01, estimator = "k1", where = "reward", level = "token" },
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "REINFORCE++" (verl core_algos.py:582-618), "KL" (OpenRLHF init_coef 0.01, k1)',
    },
    -- REINFORCE++-baseline (docs/rl.md, "REINFORCE++"): (R - group mean) + per-token KL reward, batch-whitened.
    reinforce_pp_baseline = {
        name = "reinforce_pp_baseline",
        adv = { kind = "reinforce_pp_baseline", eps = 1e-8 },
        loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2 },
        agg = "token_mean",
        kl = { coef = 0.01, estimator = "k1", where = "reward", level = "token" },
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "REINFORCE++" (verl core_algos.py:422-473, OpenRLHF reinforce_baseline), "KL"',
    },
    -- RLOO (docs/rl.md, "RLOO"): leave-one-out baseline; PPO clip 0.2, token-mean, KL as reward shaping (OpenRLHF's
    -- default for every estimator: k1, 0.01).
    rloo = {
        name = "rloo",
        adv = { kind = "rloo" },
        loss = { kind = "ppo_clip", eps_low = 0.2, eps_high = 0.2 },
        agg = "token_mean",
        kl = { coef = 0.01, estimator = "k1", where = "reward", level = "token" },
        entropy_coef = 0,
        dynamic_sampling = off(),
        overlong = { filter = false },
        refs = 'docs/rl.md, "RLOO" (OpenRLHF experience_maker.py:264-266), "KL"',
    },
}

local function deep_copy(v)
    if type(v) ~= "table" then return v end
    local o = {}
    for k, x in pairs(v) do o[k] = deep_copy(x) end
    return o
end

-- Tables merge key by key; anything else (false included) replaces. Use rl.NIL to delete a field (kl = rl.NIL).
M.NIL = setmetatable({}, { __tostring = function() return "rl.NIL" end })

local function merge(dst, src)
    for k, v in pairs(src) do
        if v == M.NIL then
            dst[k] = nil
        elseif type(v) == "table" and type(dst[k]) == "table" then
            merge(dst[k], v)
        else
            dst[k] = deep_copy(v)
        end
    end
    return dst
end

-- merge(dst, src): src's fields into dst, tables key by key (rl.NIL deletes); returns dst. What preset applies.
M.merge = merge

function M.preset(name, overrides)
    local p = M.algorithms[name]
    if not p then
        local names = {}
        for k in pairs(M.algorithms) do names[#names + 1] = k end
        table.sort(names)
        error("ds4.rl.preset: unknown algorithm " .. tostring(name) .. " (" .. table.concat(names, ", ") .. ")", 2)
    end
    local out = deep_copy(p)
    if overrides ~= nil then
        if type(overrides) ~= "table" then error("ds4.rl.preset: overrides must be a table", 2) end
        merge(out, overrides)
    end
    return out
end

return M
