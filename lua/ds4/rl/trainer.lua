--[==[ ds4.rl.trainer — the RL loop: rollouts, rewards, dynamic sampling, advantages, policy-loss updates, metrics.

  local summary = require("ds4.rl.trainer").run{
      model = model,                          -- the policy (a ds4.model with gradients)
      algorithm = rl.preset("dapo", {...}),   -- any rl.algorithms preset (or a table of the same shape)
      prompts = function(k, n) ... end,       -- the k-th call's n training samples {prompt = ids, answer = ...}
      reward = function(text, sample) ... end,-- number or {score, info}; errors are reported per sample
      decode = function(ids) ... end,         -- ids -> text (the tokenizer's decode)
      eval = {samples = {...}, every = 50, correct = function(text, sample) -> bool},
      rollout = {n = 8, prompts_per_step = 32, max_new_tokens = 16, temperature = 1.0, top_p = 1, top_k = 0,
                 stop = {...}, source = nil},
      optim = {lr = 3e-4, betas = {0.9, 0.99}, weight_decay = 0, clip = 1.0, warmup = 0},
      steps = 100, minibatches = 1, reference = nil, out = "runs/x", seed = 1, progress = true,
      routing_replay = false,                 -- train with the experts / indexer picks the rollout used
      guard = {max_kl = 10, max_grad_norm = 1e6, max_failed_frac = 0.5, max_idle_steps = 10},  -- when to stop
  }

Rollout source: rollout.source is any object with source:generate(prompts, opts) -> results shaped like
model:generate's (ids, logprobs, finish_reason per sample, prompt-major with opts.n samples per prompt). Default:
the policy itself, in process. The remote worker pool (ds4.rollout.pool, lua/ds4/rollout/) implements the same
method, so switching is one table field; a source with a :publish(model) method is handed the policy after every
step's optimizer updates (the pool makes it a new policy version that its workers fetch).

One step:
  1. rollouts: prompts_per_step prompts × n samples; rewards through ds4.reward.evaluate_batch (a sample whose
     reward function fails is reported and its whole group is dropped); with algorithm.dynamic_sampling.enable,
     groups whose rewards are all equal are dropped and more batches are generated (at most max_extra_batches)
     to fill prompts_per_step groups (DAPO);
  2. overlong: filtering (mask = 0 for samples cut by max_new_tokens) and/or the soft punishment added to the
     reward, as algorithm.overlong says;
  3. old log-probabilities recomputed by a forward at the current weights (the rollout engine's log-probs are
     kept as rollout_logp: their difference is the logprob_mismatch metric and what algorithm.tis corrects);
     with a KL term, the reference model's log-probabilities too (where = "reward" folds it into the reward);
     with routing_replay, every training forward uses the routed experts and indexer picks the rollout recorded
     (model:forward's opts.replay; the token the rollout never ran and padding route themselves);
  4. advantages (algorithm.adv), then `minibatches` optimizer updates, each a training forward, the policy loss
     with its analytic dLoss/dlogp (rl.loss.compute, normalised within the minibatch: one update = one
     normalisation) and model:backward_logprobs.
Metrics (one JSON object per step in out/metrics.jsonl, written whole and flushed by ds4.metrics; a write error
stops the run): step, reward/mean (generated samples that did not fail), reward/kept_mean, groups/kept,
groups/generated, groups/failed, gen_batches, reward/errors, eval/accuracy (eval steps), kl (to the reference
when there is one, else the old→new policy KL estimate), clip_frac, entropy, response_len/mean,
logprob_mismatch/mean, logprob_mismatch/max, loss, grad_norm, lr, tokens_per_s (generated + trained tokens per
wall second), seconds.

Guards: the run stops with an error naming the step and the metric (after writing that step's metrics line) when
  - a rollout group failed (finish_reason "failed": a remote task that ran out of attempts) — each failure is
    counted (groups/failed) and logged, and more than guard.max_failed_frac (0.5) of a step's groups failing
    stops the run before it trains on what is left;
  - the loss, kl, entropy or grad_norm is not finite, or the optimizer refuses an update (ds4.adamw: the update
    would make the weights non-finite);
  - kl exceeds guard.max_kl (10 nats per token) or grad_norm (before clipping) guard.max_grad_norm (1e6): a
    diverging policy (lr 1e3: kl 9.5e6, accuracy to 0) ends with a message instead of exit status 0;
  - guard.max_idle_steps (10) steps in a row trained on nothing (dynamic sampling kept no group: every group's
    rewards were equal): a collapsed policy (or a solved task) is not silently run to the end. With one
    minibatch the old->new KL is not observable within a step, so this is what catches a collapse there.
  guard = false turns the bounds off (non-finite values and failed batches still stop the run).
]==]

local ds4 = require("ds4")
local rl = require("ds4.rl")
local reward_mod = require("ds4.reward")

local M = {}

local ffi = require("ffi")
pcall(ffi.cdef, [[
typedef struct ds4_timespec { long tv_sec; long tv_nsec; } ds4_timespec;
int clock_gettime(int clk, ds4_timespec *tp);
int isatty(int fd);
]])
local ts = ffi.new("ds4_timespec")
local function now() -- wall seconds (CLOCK_MONOTONIC); os.clock would add up the CPU time of every thread
    ffi.C.clock_gettime(1, ts)
    return tonumber(ts.tv_sec) + 1e-9 * tonumber(ts.tv_nsec)
end

-- Greedy accuracy of `model` (or source) on eval samples.
function M.evaluate(model, eval, decode, max_new_tokens, stop)
    local prompts = {}
    for i, s in ipairs(eval.samples) do prompts[i] = s.prompt end
    local res = model:generate(prompts, { max_new_tokens = max_new_tokens, temperature = 0, stop = stop })
    local ok = 0
    for i, r in ipairs(res) do
        local text = decode(r.ids)
        local good
        if eval.correct then
            good = eval.correct(text, eval.samples[i])
        else
            local sc = reward_mod.evaluate(eval.reward, text, eval.samples[i])
            good = sc ~= nil and sc > 0
        end
        if good then ok = ok + 1 end
    end
    return ok / #eval.samples, res
end

-- One batch of rollouts: samples with rewards; `group_base` makes group ids unique across calls.
local function is_failed(r) return r.finish_reason == "failed" end

local function rollout_batch(cfg, k, group_base, stats)
    local ro = cfg.rollout
    local src = ro.source or cfg.model
    local items = cfg.prompts(k, ro.prompts_per_step)
    local prompts = {}
    for i, it in ipairs(items) do prompts[i] = it.prompt end
    local res = src:generate(prompts, { n = ro.n, max_new_tokens = ro.max_new_tokens, temperature = ro.temperature,
        top_p = ro.top_p, top_k = ro.top_k, seed = cfg.seed * 1000003 + k, stop = ro.stop, tokenizer = ro.tokenizer,
        record_experts = cfg.routing_replay or nil, record_index = cfg.routing_replay or nil })
    local texts, smp = {}, {}
    local bad, failed = {}, 0
    for i, r in ipairs(res) do
        local g = math.floor((i - 1) / ro.n)
        texts[i] = cfg.decode(r.ids)
        smp[i] = items[g + 1]
        if is_failed(r) and not bad[g] then
            bad[g] = true
            failed = failed + 1
            if stats.failed_groups + failed <= 5 then
                io.stderr:write(("trainer: rollout group %d failed: %s\n"):format(g + 1, tostring(r.error or
                    "no reason given")))
            end
        end
    end
    stats.failed_groups = stats.failed_groups + failed
    local scores, _, errors = reward_mod.evaluate_batch(cfg.reward, texts, smp)
    for _, e in ipairs(errors) do
        bad[math.floor((e.index - 1) / ro.n)] = true
        stats.errors = stats.errors + 1
        if stats.errors <= 5 then io.stderr:write(("reward error (sample %d): %s\n"):format(e.index, e.message)) end
    end
    local out = {}
    for i, r in ipairs(res) do
        local g = math.floor((i - 1) / ro.n)
        if is_failed(r) then goto continue end
        stats.generated = stats.generated + 1
        stats.gen_tokens = stats.gen_tokens + #r.ids
        stats.len_sum = stats.len_sum + #r.ids
        if scores[i] then stats.reward_sum, stats.reward_n = stats.reward_sum + scores[i], stats.reward_n + 1 end
        if not bad[g] and #r.ids > 0 then
            out[#out + 1] = { prompt = prompts[g + 1], ids = r.ids, rollout_logp = r.logprobs, reward = scores[i],
                group = group_base + g, finish_reason = r.finish_reason, length = #r.ids, sample = smp[i],
                experts = r.experts, index_picks = r.index_picks }
        end
        ::continue::
    end
    stats.groups_generated = stats.groups_generated + #items
    return out
end

-- Rectangular [B, S] ids / labels for samples (prompt then response; labels only on the response), and each
-- sample's offset of its first response log-probability in the flat [B, S] logp (position t scores t + 1).
local function pack(samples, pad)
    local ids, labels, S = {}, {}, 0
    for i, s in ipairs(samples) do
        local x, l = {}, {}
        for _, v in ipairs(s.prompt) do x[#x + 1] = v; l[#l + 1] = -100 end
        for _, v in ipairs(s.ids) do x[#x + 1] = v; l[#l + 1] = v end
        ids[i], labels[i] = x, l
        if #x > S then S = #x end
    end
    for i = 1, #samples do
        for t = #ids[i] + 1, S do ids[i][t], labels[i][t] = pad, -100 end
    end
    return ids, labels, S
end

-- logp rows of the last training forward for each sample's response tokens.
local function gather(lp, samples, S, field)
    for i, s in ipairs(samples) do
        local base = (i - 1) * S + #s.prompt - 1 -- 0-based flat index of the first response token's logp
        local a = {}
        for j = 1, #s.ids do a[j] = lp[base + j] end
        s[field] = a
    end
end

-- Routing replay tensors [B, S, L, K] / [B, S, n_csa, topk] from the samples' recorded rows (-1 elsewhere: padding
-- and the last generated token, which the rollout never ran, route themselves).
local function replay_tensors(samples, S)
    local out = {}
    for _, f in ipairs({ { "experts", "experts" }, { "index_picks", "index" } }) do
        local first = samples[1][f[1]]
        if first then
            local inner = first:numel() / math.max(1, first:size(1))
            local t = ds4.zeros({ #samples, S, inner }, "I32")
            local dst = ffi.cast("int32_t *", t:data_ptr())
            for i = 0, #samples * S * inner - 1 do dst[i] = -1 end
            for i, s in ipairs(samples) do
                local src = s[f[1]]
                local rows = math.min(src:size(1), S)
                ffi.copy(dst + (i - 1) * S * inner, ffi.cast("int32_t *", src:data_ptr()), rows * inner * 4)
            end
            out[f[2]] = t
        end
    end
    return out.experts and out or (out.index and out or nil)
end

local function forward_logp(model, samples, pad, field, entropy_field, replay)
    local ids, labels, S = pack(samples, pad)
    model:forward(ids, { labels = labels, train = true, replay = replay and replay_tensors(samples, S) or nil })
    local lp, en = model:logprobs({ entropy = entropy_field ~= nil })
    gather(lp, samples, S, field)
    if entropy_field then gather(en, samples, S, entropy_field) end
    return ids, labels, S
end

local function split_groups(samples, parts)
    if parts <= 1 then return { samples } end
    local groups, order = {}, {}
    for _, s in ipairs(samples) do
        if not groups[s.group] then groups[s.group] = {}; order[#order + 1] = s.group end
        table.insert(groups[s.group], s)
    end
    local out = {}
    for k = 1, parts do out[k] = {} end
    for gi, g in ipairs(order) do
        local dst = out[(gi - 1) % parts + 1]
        for _, s in ipairs(groups[g]) do dst[#dst + 1] = s end
    end
    local nonempty = {}
    for _, mb in ipairs(out) do if #mb > 0 then nonempty[#nonempty + 1] = mb end end
    return nonempty
end

local function defaults(cfg)
    assert(type(cfg) == "table", "trainer.run: config table expected")
    for _, k in ipairs({ "model", "algorithm", "prompts", "reward", "decode" }) do
        if cfg[k] == nil then error("trainer.run: config." .. k .. " is required", 3) end
    end
    cfg.rollout = cfg.rollout or {}
    local ro = cfg.rollout
    ro.n = ro.n or 8
    ro.prompts_per_step = ro.prompts_per_step or 32
    ro.max_new_tokens = ro.max_new_tokens or 64
    ro.temperature = ro.temperature or 1.0
    cfg.optim = cfg.optim or {}
    cfg.steps = cfg.steps or 100
    cfg.minibatches = cfg.minibatches or 1
    cfg.seed = cfg.seed or 1
    if cfg.progress == nil then cfg.progress = true end
    local g = cfg.guard == nil and {} or cfg.guard
    if g ~= false and type(g) ~= "table" then error("trainer.run: config.guard must be a table or false", 3) end
    g = g or { max_kl = math.huge, max_grad_norm = math.huge, max_idle_steps = math.huge }
    local known = { max_kl = 10, max_grad_norm = 1e6, max_failed_frac = 0.5, max_idle_steps = 10 }
    for k in pairs(g) do
        if not known[k] then
            error("trainer.run: config.guard: unknown key '" .. tostring(k) .. "' (max_kl, max_grad_norm, "
                .. "max_failed_frac, max_idle_steps)", 3)
        end
    end
    cfg.guard = {}
    for k, def in pairs(known) do cfg.guard[k] = g[k] == nil and def or g[k] end
    for k, v in pairs(cfg.guard) do
        if type(v) ~= "number" or not (v >= 0) then
            error(("trainer.run: config.guard.%s must be a number >= 0, got %s"):format(k, tostring(v)), 3)
        end
    end
    local a = cfg.algorithm
    if a.kl and not cfg.reference then
        error("trainer.run: algorithm " .. tostring(a.name) .. " has a KL term: pass config.reference (a frozen " ..
            "copy of the starting policy), or set algorithm.kl = nil", 3)
    end
end

local function finite(x) return type(x) == "number" and x == x and x ~= math.huge and x ~= -math.huge end

-- The divergence guard: an error naming the step and the metric, or nil.
local function diverged(row, guard)
    for _, k in ipairs({ "loss", "kl", "entropy", "grad_norm" }) do
        if row[k] ~= nil and not finite(row[k]) then
            return ("%s is %s: training diverged (a smaller lr, or check the rewards and the data)"):format(k,
                tostring(row[k]))
        end
    end
    if row.kl and row.kl > guard.max_kl then
        return ("kl = %.4g exceeds guard.max_kl = %g: the policy is moving too far per step (lower the learning "
            .. "rate, or raise guard.max_kl)"):format(row.kl, guard.max_kl)
    end
    if row.grad_norm and row.grad_norm > guard.max_grad_norm then
        return ("grad_norm = %.4g exceeds guard.max_grad_norm = %g: exploding gradients (lower the learning rate, "
            .. "or raise guard.max_grad_norm)"):format(row.grad_norm, guard.max_grad_norm)
    end
end

function M.run(cfg)
    defaults(cfg)
    local model, spec, ro = cfg.model, cfg.algorithm, cfg.rollout
    local pad = model:config().eos_token_id or 0
    local o = cfg.optim
    local opt = ds4.adamw(model, { lr = o.lr or 3e-4, betas = o.betas or { 0.9, 0.99 }, weight_decay = o.weight_decay or 0,
        clip = o.clip or 1.0, schedule = o.schedule or "constant", warmup = o.warmup or 0,
        total = cfg.steps * cfg.minibatches })
    local metrics_f = cfg.out and ds4.metrics.open(cfg.out .. "/metrics.jsonl") or nil
    local tty = cfg.progress and ffi.C.isatty(1) == 1
    local history = {}
    local t_start = now()
    local group_base, gen_calls, failed_total, idle = 0, 0, 0, 0
    local eval_acc
    if cfg.eval and cfg.eval.samples then
        eval_acc = M.evaluate(model, cfg.eval, cfg.decode, cfg.eval.max_new_tokens or ro.max_new_tokens, ro.stop)
        history[#history + 1] = { step = 0, ["eval/accuracy"] = eval_acc }
        if metrics_f then metrics_f:write(history[#history]) end
    end
    local first_acc = eval_acc
    for step = 1, cfg.steps do
        local t0 = now()
        local st = { errors = 0, generated = 0, gen_tokens = 0, len_sum = 0, reward_sum = 0, reward_n = 0,
            groups_generated = 0, failed_groups = 0 }
        local function gen()
            gen_calls = gen_calls + 1
            local b = rollout_batch(cfg, gen_calls, group_base, st)
            group_base = group_base + ro.prompts_per_step
            return b
        end
        local samples, batches
        local ds = spec.dynamic_sampling
        if ds and ds.enable then
            local fst
            samples, _, fst = rl.filter.fill_batch(gen, ro.prompts_per_step, ds.max_extra_batches or 9, { key = ds.key })
            batches = fst.calls
        else
            samples, batches = gen(), 1
        end
        local row = { step = step, ["reward/mean"] = st.reward_n > 0 and st.reward_sum / st.reward_n or 0,
            ["groups/generated"] = st.groups_generated, ["groups/failed"] = st.failed_groups, gen_batches = batches,
            ["reward/errors"] = st.errors, ["response_len/mean"] = st.generated > 0 and st.len_sum / st.generated or 0 }
        failed_total = failed_total + st.failed_groups
        local stop
        if st.failed_groups > 0 then
            io.stderr:write(("trainer: step %d: %d of %d rollout groups failed (%d in the run so far)\n"):format(step,
                st.failed_groups, st.groups_generated, failed_total))
            if st.failed_groups > cfg.guard.max_failed_frac * st.groups_generated then
                stop = ("%d of %d rollout groups failed, more than guard.max_failed_frac = %g: the rollout source is "
                    .. "failing (see its log); not training on what is left"):format(st.failed_groups,
                    st.groups_generated, cfg.guard.max_failed_frac)
            end
        end
        local trained_tokens = 0
        if #samples > 0 and not stop then
            if spec.overlong and spec.overlong.filter then rl.filter.overlong_filter(samples) end
            if spec.overlong and spec.overlong.soft then rl.filter.apply_soft_overlong(samples, spec.overlong.soft) end
            -- old policy = the current weights, recomputed (three-policy view: rollout, old, new)
            forward_logp(model, samples, pad, "old_logp", nil, cfg.routing_replay)
            local mm = rl.correction.metrics(samples) or {}
            if spec.kl then
                forward_logp(cfg.reference, samples, pad, "ref_logp")
                if spec.kl.where == "reward" then
                    rl.loss.kl_in_reward(samples, spec.kl.coef, spec.kl.estimator, { level = spec.kl.level })
                end
            end
            rl.advantage.compute(samples, spec.adv)
            local kept_sum = 0
            for _, s in ipairs(samples) do kept_sum = kept_sum + s.reward end
            local agg = { loss = 0, clip_frac = 0, kl = 0, entropy = 0, tokens = 0 }
            local last
            for _, mb in ipairs(split_groups(samples, cfg.minibatches)) do
                model:zero_grad()
                local _, _, S = forward_logp(model, mb, pad, "logp", "entropy", cfg.routing_replay)
                local T, N = rl.loss.count(mb)
                local out = rl.loss.compute(mb, spec, { denom = T, num_seqs = N })
                local g = ds4.zeros({ #mb, S })
                for i, s in ipairs(mb) do
                    local base = (i - 1) * S + #s.prompt - 1
                    for j, v in ipairs(out.grads[i]) do g[base + j] = v end
                end
                local ok, r = pcall(function()
                    model:backward_logprobs(g)
                    return opt:step()
                end)
                if not ok then -- a NaN loss, or an update the optimizer refuses (non-finite weights)
                    stop = "the update failed: " .. tostring(r)
                    break
                end
                last = r
                local m = out.metrics
                local w = m.tokens or T
                agg.tokens = agg.tokens + w
                agg.loss = agg.loss + (out.loss or 0) * w
                agg.clip_frac = agg.clip_frac + (m.clip_frac or 0) * w
                agg.kl = agg.kl + ((spec.kl and m.kl) or m.ppo_kl or 0) * w
                agg.entropy = agg.entropy + (m.entropy or 0) * w
                trained_tokens = trained_tokens + #mb * S
            end
            local w = math.max(agg.tokens, 1)
            row.loss = agg.loss / w
            row.clip_frac = agg.clip_frac / w
            row.kl = agg.kl / w
            row.entropy = agg.entropy / w
            row["reward/kept_mean"] = kept_sum / #samples
            row["logprob_mismatch/mean"] = mm.mismatch_abs_mean or 0
            row["logprob_mismatch/max"] = mm.mismatch_abs_max or 0
            row.grad_norm = last and last.grad_norm
            row.lr = last and last.lr
        end
        row["groups/kept"] = #samples / ro.n
        idle = #samples > 0 and 0 or idle + 1
        if idle > 0 and not stop then
            io.stderr:write(("trainer: step %d trained on nothing: every group's rewards were equal (reward/mean "
                .. "%.3f; %d step(s) in a row)\n"):format(step, row["reward/mean"], idle))
            if idle >= cfg.guard.max_idle_steps then
                stop = ("%d steps in a row trained on nothing (guard.max_idle_steps = %g; reward/mean %.3f): every "
                    .. "group's rewards were equal, so the policy has collapsed or the task is solved"):format(idle,
                    cfg.guard.max_idle_steps, row["reward/mean"])
            end
        end
        stop = stop or diverged(row, cfg.guard)
        -- a remote source (ds4.rollout.pool) gets the new weights: a new policy version its workers fetch
        if ro.source and ro.source.publish and #samples > 0 and not stop then ro.source:publish(model) end
        local dt = now() - t0
        row.seconds = dt
        row.tokens_per_s = (st.gen_tokens + trained_tokens) / math.max(dt, 1e-9)
        if not stop and cfg.eval and cfg.eval.samples and ((cfg.eval.every and step % cfg.eval.every == 0)
            or step == cfg.steps) then
            eval_acc = M.evaluate(model, cfg.eval, cfg.decode, cfg.eval.max_new_tokens or ro.max_new_tokens, ro.stop)
            row["eval/accuracy"] = eval_acc
        end
        history[#history + 1] = row
        if metrics_f then metrics_f:write(row) end
        if stop then
            if metrics_f then metrics_f:close() end
            error(("trainer.run: step %d: %s"):format(step, stop), 0)
        end
        if cfg.progress then
            local msg = ("step %d/%d reward %.3f kept %d/%d groups clip %.3f kl %.2e ent %.3f len %.1f%s %.1fs"):format(
                step, cfg.steps, row["reward/mean"], #samples / ro.n, row["groups/generated"], row.clip_frac or 0,
                row.kl or 0, row.entropy or 0, row["response_len/mean"],
                row["eval/accuracy"] and (" acc %.3f"):format(row["eval/accuracy"]) or "", dt)
            if tty then
                io.write("\r", msg, "   ")
                if row["eval/accuracy"] or step == cfg.steps then io.write("\n") end
                io.flush()
            elseif step == 1 or step % 10 == 0 or row["eval/accuracy"] or step == cfg.steps then
                print(msg)
            end
        end
    end
    if metrics_f then metrics_f:close() end
    return { history = history, eval_before = first_acc, eval_after = eval_acc, seconds = now() - t_start,
        failed_groups = failed_total }
end

return M
