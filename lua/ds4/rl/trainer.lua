--[==[ ds4.rl.trainer — the RL loop: rollouts, rewards, dynamic sampling, advantages, policy-loss updates, metrics,
checkpoints.

  local summary = require("ds4.rl.trainer").run{
      model = model,                          -- the policy (a ds4.model with gradients)
      algorithm = rl.preset("dapo", {...}),   -- any rl.algorithms preset (or a table of the same shape)
      prompts = function(k, n) ... end,       -- the k-th call's n training samples {prompt = ids, answer = ...};
                                              -- for an exact resume it must depend on k only (k is restored)
      reward = function(text, sample) ... end,-- number or {score, info}; errors are reported per sample
      decode = function(ids) ... end,         -- ids -> text (the tokenizer's decode)
      eval = {samples = {...}, every = 50, correct = function(text, sample) -> bool},
      rollout = {n = 8, prompts_per_step = 32, max_new_tokens = 16, temperature = 1.0, top_p = 1, top_k = 0,
                 stop = {...}, source = nil},
      optim = {lr = 3e-4, betas = {0.9, 0.99}, weight_decay = 0, clip = 1.0, warmup = 0},
      steps = 100, minibatches = 1, reference = nil, out = "runs/x", seed = 1, progress = true,
      zero = false,                           -- with several ranks: ZeRO-1, each rank keeps and steps its shard of
                                              -- the optimizer (ds4.dist.shard_optimizer; the same bits), and the
                                              -- gradients are reduce-scattered (each rank sums its region only; CPU
                                              -- ranks: not yet on GPUs, ds4.dp.reduce_scatter)
      bucket_mb = nil,                        -- with several ranks: the gradients are summed in buckets of this
                                              -- many MiB while the last micro-batch's backward runs (the same
                                              -- bits); 0: one all-reduce after the backward; nil or -1: 25
                                              -- (ds4.dp.bucket_mb)
      routing_replay = false,                 -- train with the experts / indexer picks the rollout used
      indexer_kl = nil,                       -- κ > 0: train the lightning indexer by its KL loss (set on the model,
                                              -- its other training options kept; nil: the model's own setting),
                                              -- each minibatch's mean over its real queries (below)
      guard = {max_kl = 10, max_grad_norm = 1e6, max_failed_frac = 0.5, max_idle_steps = 10,
               max_reward_error_frac = 0.5},  -- when to stop
      loss = nil,                             -- a user loss: function(mb, spec, opts) -> {loss, grads, metrics}
      checkpoint = {every = 0, keep_last = 3, resume = false, dir = out .. "/ckpt"},
      state = {save = function() -> table, load = function(table)},   -- the caller's own state in checkpoints
      log_completions = {every = 0, n = 4},   -- a table of sampled completions every N steps
      tensorboard = true,                     -- TensorBoard event files beside metrics.jsonl
      on_step = function(step, row) ... end,  -- after each step's metrics (and checkpoint); false stops the run
      async = nil,                            -- {max_staleness = K}: asynchronous RL (below); nil: synchronous
      train_delay_s = nil,                    -- tests: seconds slept in every training micro-batch (a slow step)
  }

Rollout source: rollout.source is any object with source:generate(prompts, opts) -> results shaped like
model:generate's (ids, logprobs, finish_reason per sample, prompt-major with opts.n samples per prompt). Default:
the policy itself, in process. The remote worker pool (ds4.rollout.pool, lua/ds4/rollout/) implements the same
method, so switching is one table field; a source with a :publish(model) method is handed the policy after every
step's optimizer updates (the pool makes it a new policy version that its workers fetch). Every sample carries the
policy version that generated it: a pool's results report theirs; the policy itself (and a source that reports none)
generates with the weights of the moment, version 1 + the steps that have updated them (source.version, when the
source has one, is the version counter instead). A source with :poll (the pool) is served between the pieces of the
trainer's own work — each training micro-batch, each old / reference log-probability forward (then split into
minibatches x micro_batches parts), each evaluation token — at most every 20 ms, so that its workers get their
heartbeats, tasks and weight chunks and their results are taken in while the trainer computes; the longest silence a
worker sees is one such piece (docs/rl.md, "Asynchronous RL").

Several training ranks (ds4.dp) with a rollout source: rank 0 alone holds it (a source on another rank is an error on
every rank). Rank 0 sends each batch's prompts, all of them, to its source with one process's random streams, and
sends the results to every rank, which keeps its share of the prompts and goes on as if it had generated them itself
(rewards, gathering, advantages, micro-batches): the same samples and the same training as one process with that
source. Rank 0 publishes the weights after each step. The other ranks wait for rank 0's batch inside a collective:
DS4_DIST_TIMEOUT (docs/distributed.md) must be longer than the source takes to generate one batch.

Asynchronous RL (async = {max_staleness = K}): the rollout batches of steps t .. t + K are submitted before step t
trains (a step ahead gets as many as the last step used, topped up at each step; dynamic sampling draws several), so that the workers
generate for the next K steps under older weights while the trainer trains. A source with :submit / :collect
(ds4.rollout.pool) generates in the background; a batch of step s, submitted while version v is current during step
t, asks for min_policy = v - K + (s - t) (step s trains on version v + (s - t) at most: one publish per step, so every
sample it trains on is at most K versions old); any other source generates at submission (the policy itself: its
samples are exactly min(s - 1, K) versions old at step s). Further batches a step needs are generated then
(min_policy v - K; with K > 0 a :submit source also gets opts.first = true: the pool sends their tasks before
the queued ones of the steps ahead); batches it did not need are dropped (gen_batches_unused). Lags are measured at every step (staleness/mean, staleness/max) and a
sample more than K versions old stops the run (a source that does not honour min_policy). The off-policy gap is the
rollout / old log-probability mismatch algorithm.tis corrects (decoupled PPO: the ratio is taken against the
recomputed old policy, the importance weight against the rollout's). K = 0 is the synchronous loop, bitwise (with a
pool: a pool of max_staleness 0); without async a pool's own max_staleness applies. With several ranks every rank
runs the same pipeline (a source on rank 0: rank 0 submits, every rank takes its share when the batch is finished).
A checkpoint holds no batch in flight: a resumed asynchronous run draws new prompts for the K steps ahead, at the
checkpoint's weights (valid, not bitwise the run that did not stop).

One step:
  1. rollouts: prompts_per_step prompts × n samples; rewards through ds4.reward.evaluate_batch, each sample seen as
     its prompt's data table plus response_ids (the generated ids), response_len (their count) and finish_reason
     (so ds4.reward.overlong_reward and other length-aware rewards work); a sample whose reward function fails is
     reported and its whole group is dropped; with algorithm.dynamic_sampling.enable, groups whose rewards are all
     equal are dropped and more batches are generated (at most max_extra_batches) to fill prompts_per_step groups
     (DAPO);
  2. overlong: filtering (mask = 0 for samples cut by max_new_tokens) and/or the soft punishment added to the
     reward, as algorithm.overlong says;
  3. old log-probabilities recomputed by a forward at the current weights (the rollout engine's log-probs are
     kept as rollout_logp: their difference is the logprob_mismatch metric and what algorithm.tis corrects);
     with a KL term, the reference model's log-probabilities too (where = "reward" folds it into the reward);
     with routing_replay, every training forward uses the routed experts and indexer picks the rollout recorded
     (model:forward's opts.replay; the token the rollout never ran and padding route themselves);
  4. advantages (algorithm.adv), then `minibatches` optimizer updates, each a training forward, the policy loss
     with its analytic dLoss/dlogp (rl.loss.compute, or config.loss; normalised within the minibatch: one update =
     one normalisation) and model:backward_logprobs. With the indexer KL on (indexer_kl = κ, or the model's own
     train option), its loss is κ · (per CSA layer the mean KL over the minibatch's real queries, summed over
     layers): the micro-batches are packed with their rows' real lengths (the padding takes no part) and each
     backward takes κ / Q, Q the real queries with picks of the whole minibatch over every micro-batch and rank
     (model:indexer_queries of its samples' lengths, known before any forward), so that the split into
     micro-batches and ranks changes nothing but fp32 summation order (docs/distributed.md).

A user loss (config.loss) replaces rl.loss.compute: loss(mb, spec, {denom = T, num_seqs = N, step_tokens,
step_seqs, tis_scale}) gets the minibatch's samples (T its trained tokens and N its samples, what rl.loss.compute normalises
by; step_tokens / step_seqs the same over the whole step), each with, for its response tokens t = 1..#s.ids: s.logp[t] (the current policy's log p of token t, from
model:logprobs of the training forward), s.old_logp[t] (the same before this step's updates), s.rollout_logp[t]
(what the generator reported), s.ref_logp[t] (with a KL term), s.entropy[t], s.mask (nil = all 1), s.adv (a number
or per-token array: algorithm.adv's advantage) and s.reward. It returns {loss = number (minimised), grads = {[i] = {dLoss/dlogp[t] per response token of sample i}},
metrics = {clip_frac = ..., entropy = ..., kl = ..., tokens = ...} (optional)}. The trainer scatters grads into an
F32 [B, S] tensor at each token's position (model:logprobs' layout: logp[b][s] scores labels[b][s + 1]) and calls
model:backward_logprobs, which adds sum g * dlogp/dtheta to the gradients: g is dLoss/dlogp of the loss being
minimised (the SFT loss -mean(logp) is g = -1/N on every scored token).

Metrics: one record per step in out/metrics.jsonl (ds4.metrics: whole lines, flushed; a write error stops the run)
and as TensorBoard scalars in out/events.out.tfevents.* (ds4.runlog): step, reward/mean, reward/std, reward/min,
reward/max, rewards/NAME (each reward component, ds4.reward.combine), reward/kept_mean, reward/errors,
response_len/mean, /min, /max, /clipped_ratio (ds4.rl.stats), groups/kept, groups/generated, groups/failed,
gen_batches, eval/accuracy (eval steps), indexer_kl (with the indexer KL on: the step's indexer KL loss over its real
queries, unweighted), kl (to the reference when there is one, else the old→new policy KL
estimate), clip_frac, entropy, logprob_mismatch/mean, logprob_mismatch/max, loss, grad_norm, lr, tokens_per_s
(generated + trained tokens per wall second), seconds, and the time split time/generate, time/reward, time/train,
time/eval (seconds), policy_version (the version trained), staleness/mean and staleness/max (versions between the
policy trained and the one that generated each sample of the step: its oldest token's, for a sample that workers
with partial rollouts continued under newer weights), staleness/mixed (the fraction of such samples), and with algorithm.tis tis/weight_mean,
tis/frac_truncated, tis/frac_masked, tis/ess (ds4.rl.correction over the whole step). log_completions = {every = N, n = k} writes k sampled completions of every Nth step (prompt,
completion, reward, finish_reason) to out/completions.jsonl and as a TensorBoard text table (and prints them with
progress on).

Checkpoints (checkpoint.every = K RL steps, and the last step): out/ckpt/step_NNNNNN, NNNNNN = completed optimizer
updates, with the policy, the optimizer, the reference model, the loop's counters and config.state.save()
(ds4.rl.resume). checkpoint.resume = true continues from the newest one: the rest of the run is bitwise the one an
uninterrupted run would have done (tests/lua/test_trainer_resume.lua), and out/metrics.jsonl drops the records past
the checkpoint's step. With zero = true every rank gathers the optimizer's moments for a checkpoint (opt:state(), a
collective) and rank 0 writes the whole state, so the checkpoint resumes on any number of ranks, sharded or not.

Guards: the run stops with an error naming the step and the metric (after writing that step's metrics line) when
  - a rollout group failed (finish_reason "failed": a remote task that ran out of attempts) — each failure is
    counted (groups/failed) and logged, and more than guard.max_failed_frac (0.5) of a step's groups failing
    stops the run before it trains on what is left;
  - more than guard.max_reward_error_frac (0.5) of a step's samples got no reward (the reward function raised or
    returned something that is not a finite number): a broken reward, named with its first error;
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
local stats_mod = require("ds4.rl.stats")
local resume = require("ds4.rl.resume")
local dp = require("ds4.dp")
local json = require("ds4.chat.json")
local ffi = require("ffi")

local M = {}

pcall(ffi.cdef, "int isatty(int fd);")
pcall(ffi.cdef, "int usleep(unsigned int usec);")
-- cfg.train_delay_s (tests): a slow training micro-batch, as one long computation would be (no pool served meanwhile)
local function sleep(s)
    local us = math.floor(s * 1e6)
    while us > 0 do
        local d = math.min(us, 100000) -- usleep may refuse a second or more
        ffi.C.usleep(d)
        us = us - d
    end
end
local now = ds4.metrics.clock -- wall seconds (monotonic); os.clock would add up the CPU time of every thread
-- warnings: from rank 0 only (with several ranks every rank holds the same gathered rollouts)
local function warn(msg) if dp.is_root() then io.stderr:write(msg) end end

-- Greedy accuracy of `model` (or source) on eval samples.
-- With several ranks (ds4.dp) each greedily decodes its share of the samples and the counts are summed (greedy
-- decoding is batch-invariant, so the accuracy is the one process's); res then holds this rank's share only.
-- tick (optional): called after every generated token, e.g. to serve a rollout pool while the evaluation runs.
function M.evaluate(model, eval, decode, max_new_tokens, stop, tick)
    local first, count = dp.share(#eval.samples, dp.world(), dp.rank())
    local prompts = {}
    for i = first, first + count - 1 do prompts[#prompts + 1] = eval.samples[i].prompt end
    local res = #prompts > 0 and model:generate(prompts, { max_new_tokens = max_new_tokens, temperature = 0,
        stop = stop, on_token = tick and function() tick() end }) or {}
    local ok = 0
    for j, r in ipairs(res) do
        local sample = eval.samples[first + j - 1]
        local text = decode(r.ids)
        local good
        if eval.correct then
            good = eval.correct(text, sample)
        else
            local sc = reward_mod.evaluate(eval.reward, text, sample)
            good = sc ~= nil and sc > 0
        end
        if good then ok = ok + 1 end
    end
    return dp.sum({ ok })[1] / #eval.samples, res
end

local function is_failed(r) return r.finish_reason == "failed" end

-- What a reward function sees for one sample: the prompt's data table, plus the response's ids, length and finish
-- reason (a copy: the n samples of a prompt share its table).
local function reward_view(item, r)
    local v = {}
    for k, x in pairs(item) do v[k] = x end
    v.response_ids, v.response_len, v.finish_reason = r.ids, #r.ids, r.finish_reason
    return v
end

-- Results sent between ranks: each result's fields as JSON (numbers in the shortest form that reads back exactly),
-- and its routing records (routing replay: I32 tensors [rows, L, K] / [rows, n_csa, topk]) as raw bytes in a binary
-- string beside the JSON, their shapes in it (a JSON array of every routed expert would take ~5× the bytes).
local RECORDS = { { "experts", "xs" }, { "index_picks", "is" } }

local function encode_result(r, blob)
    local x = { ids = json.array(r.ids), lp = json.array(r.logprobs or {}), fr = r.finish_reason,
        err = r.error and tostring(r.error) or nil, pv = r.policy_version,
        tv = r.token_versions and json.array(r.token_versions) or nil }
    for _, f in ipairs(RECORDS) do
        local t = r[f[1]]
        if t then
            x[f[2]] = json.array(t:shape())
            blob[#blob + 1] = ffi.string(t:data_ptr(), t:nbytes())
        end
    end
    return x
end

-- The result of x, its routing records read from blob at byte offset at; returns it and the next offset.
local function decode_result(x, blob, at, who)
    local r = { ids = x.ids, logprobs = x.lp, finish_reason = x.fr, error = x.err, policy_version = x.pv,
        token_versions = x.tv }
    for _, f in ipairs(RECORDS) do
        local shape = x[f[2]]
        if shape then
            local t = ds4.zeros(shape, "I32")
            local n = t:nbytes()
            if at + n > #blob then
                error(("trainer: %s's routing records hold %d bytes, their shapes say more"):format(who, #blob), 0)
            end
            ffi.copy(t:data_ptr(), ffi.cast("const char *", blob) + at, n)
            r[f[1]] = t
            at = at + n
        end
    end
    return r, at
end

-- One batch of rollouts: samples with rewards; `group_base` makes group ids unique across calls. st accumulates the
-- step's counts, timings and ds4.rl.stats.
-- Every rank's rollouts and rewards, in rank order (= prompt order): each rank sends its samples (encode_result) with
-- their scores and reward infos, and its reward errors with their global sample index.
local function gather_rollouts(res, scores, infos, errors, base)
    local mine, blob = { s = {}, e = {} }, {}
    for i, r in ipairs(res) do
        mine.s[i] = encode_result(r, blob)
        mine.s[i].sc, mine.s[i].info = scores[i], infos[i]
    end
    for _, e in ipairs(errors) do mine.e[#mine.e + 1] = { i = e.index + base, m = e.message } end
    local all_res, all_scores, all_infos, all_errors = {}, {}, {}, {}
    local blobs = dp.gather_strings(table.concat(blob))
    for r, text in ipairs(dp.gather_strings(json.encode(mine))) do
        local got, why = json.decode(text)
        if type(got) ~= "table" or type(got.s) ~= "table" or type(got.e) ~= "table" then
            error(("trainer: rank %d's rollouts do not decode: %s"):format(r - 1, tostring(why)), 0)
        end
        local at = 0
        for _, x in ipairs(got.s) do
            local i = #all_res + 1
            all_res[i], at = decode_result(x, blobs[r], at, ("rank %d"):format(r - 1))
            all_scores[i], all_infos[i] = x.sc, x.info
        end
        for _, e in ipairs(got.e) do all_errors[#all_errors + 1] = { index = e.i, message = e.m } end
    end
    return all_res, all_scores, all_infos, all_errors
end

-- Start one batch of rollouts (the k-th call of cfg.prompts): a source with :submit / :collect (ds4.rollout.pool)
-- generates it in the background, with a policy version of at least min_policy when that is given; any other source
-- (the policy itself) generates it now, with the weights it has now, and its results are stamped with the trainer's
-- version (cfg.version()) unless they carry their own.
local function submit_batch(cfg, k, st, min_policy, first)
    local ro = cfg.rollout
    local src = ro.source or cfg.model
    local items = cfg.prompts(k, ro.prompts_per_step)
    local prompts = {}
    for i, it in ipairs(items) do prompts[i] = it.prompt end
    -- this rank's prompts (all of them in a world of one), drawing the random streams the whole batch would
    local p1, pc = dp.share(#items, dp.world(), dp.rank())
    local share = {}
    for i = p1, p1 + pc - 1 do share[#share + 1] = prompts[i] end
    local b = { k = k, items = items, prompts = prompts, p1 = p1 }
    local t0 = now()
    local opts = { n = ro.n, max_new_tokens = ro.max_new_tokens,
        temperature = ro.temperature, top_p = ro.top_p, top_k = ro.top_k, seed = cfg.seed * 1000003 + k,
        prompt_base = p1 > 1 and p1 - 1 or nil, stop = ro.stop, tokenizer = ro.tokenizer,
        record_experts = cfg.routing_replay or nil, record_index = cfg.routing_replay or nil }
    if cfg.remote then
        -- rank 0 generates every prompt through its source, with the random streams of one process (no prompt_base:
        -- the same as the ranks' shares would draw); each rank takes its share of the results in finish_batch
        b.pc = pc
        if dp.is_root() then
            opts.prompt_base = nil
            if min_policy and src.submit and src.collect then
                opts.min_policy, opts.first = min_policy, first
                b.handle = src:submit(prompts, opts)
            else
                b.res = src:generate(prompts, opts)
            end
        end
    elseif #share == 0 then
        b.res = {}
    elseif min_policy and src.submit and src.collect then
        opts.min_policy, opts.first = min_policy, first
        b.handle = src:submit(share, opts)
    else
        b.res = src:generate(share, opts)
        local v = cfg.version()
        for _, r in ipairs(b.res) do r.policy_version = r.policy_version or v end
    end
    st.t_generate = st.t_generate + (now() - t0)
    return b
end

-- Several ranks and rank 0's rollout source: rank 0 collects batch b (every prompt), and every rank receives the
-- results (encode_result: ids, log-probabilities, finish reasons, errors, policy and per-token versions, routing
-- records) and the source's policy version from it, and keeps its share: the results of its prompts
-- p1 .. p1 + pc - 1, which are what it would have generated itself.
local function remote_share(cfg, b, src)
    local ro = cfg.rollout
    local text, blob = "", {}
    if dp.is_root() then
        local s = {}
        for i, r in ipairs(b.res or src:collect(b.handle)) do s[i] = encode_result(r, blob) end
        text = json.encode({ v = src.version, s = s })
    end
    local bytes = dp.broadcast_string(table.concat(blob), 0)
    local got, why = json.decode(dp.broadcast_string(text, 0))
    if type(got) ~= "table" or type(got.s) ~= "table" then
        error("trainer: rank 0's rollouts do not decode: " .. tostring(why), 0)
    end
    if type(got.v) == "number" then cfg.remote_version = got.v end
    local res, at = {}, 0
    for i = 1, (b.p1 - 1 + b.pc) * ro.n do -- the records of the earlier ranks' shares are skipped by reading them
        local x = got.s[i]
        if not x then error(("trainer: rank 0 sent %d rollouts, want %d"):format(#got.s, #b.prompts * ro.n), 0) end
        local r
        r, at = decode_result(x, bytes, at, "rank 0")
        if i > (b.p1 - 1) * ro.n then res[#res + 1] = r end
    end
    return res
end

-- Finish batch b: its results (waiting for them if they are still being generated), rewards and samples with their
-- policy versions; group_base makes group ids unique across calls. st accumulates the step's counts, timings, version
-- lags and ds4.rl.stats.
local function finish_batch(cfg, b, group_base, st)
    local ro = cfg.rollout
    local src = ro.source or cfg.model
    local items, prompts, p1 = b.items, b.prompts, b.p1
    local t0 = now()
    local res
    if cfg.remote then
        res = remote_share(cfg, b, src)
    else
        res = b.res or src:collect(b.handle)
    end
    local t1 = now()
    st.t_generate = st.t_generate + (t1 - t0)
    local texts, views = {}, {}
    for i, r in ipairs(res) do
        local g = math.floor((i - 1) / ro.n) + p1 - 1
        texts[i] = cfg.decode(r.ids)
        views[i] = reward_view(items[g + 1], r)
    end
    local scores, infos, errors = reward_mod.evaluate_batch(cfg.reward, texts, views)
    if dp.world() > 1 then
        res, scores, infos, errors = gather_rollouts(res, scores, infos, errors, (p1 - 1) * ro.n)
        texts, views = {}, {}
        for i, r in ipairs(res) do
            texts[i] = cfg.decode(r.ids)
            views[i] = reward_view(items[math.floor((i - 1) / ro.n) + 1], r)
        end
    end
    st.t_reward = st.t_reward + (now() - t1)
    if cfg.tick then cfg.tick() end
    local bad, failed = {}, 0
    for i, r in ipairs(res) do
        local g = math.floor((i - 1) / ro.n)
        if is_failed(r) and not bad[g] then
            bad[g] = true
            failed = failed + 1
            if st.failed_groups + failed <= 5 then
                warn(("trainer: rollout group %d failed: %s\n"):format(g + 1, tostring(r.error or
                    "no reason given")))
            end
        end
    end
    st.failed_groups = st.failed_groups + failed
    for _, e in ipairs(errors) do
        bad[math.floor((e.index - 1) / ro.n)] = true
        st.errors = st.errors + 1
        st.first_error = st.first_error or e.message
        if st.errors <= 5 then warn(("reward error (sample %d): %s\n"):format(e.index, e.message)) end
    end
    local out = {}
    for i, r in ipairs(res) do
        local g = math.floor((i - 1) / ro.n)
        if not is_failed(r) then
            st.generated = st.generated + 1
            st.gen_tokens = st.gen_tokens + #r.ids
            stats_mod.add(st.acc, { reward = scores[i], info = infos[i], length = #r.ids,
                finish_reason = r.finish_reason })
            if #st.shown < st.show_n then
                st.shown[#st.shown + 1] = { cfg.decode(prompts[g + 1]), texts[i], scores[i] and
                    ("%.4g"):format(scores[i]) or "error", r.finish_reason }
            end
            -- against the version trained next (a pool's first call publishes version 1 only now); a sample continued
            -- under newer weights (a worker's partial rollouts) counts by its oldest token (its policy_version)
            local lag = r.policy_version and cfg.version() - r.policy_version
            local tv = r.token_versions
            if tv and #tv > 0 and tv[#tv] ~= tv[1] then st.mixed = st.mixed + 1 end
            if lag then
                st.lag_n, st.lag_sum, st.lag_max = st.lag_n + 1, st.lag_sum + lag, math.max(st.lag_max, lag)
            end
            if not bad[g] and #r.ids > 0 then
                out[#out + 1] = { prompt = prompts[g + 1], ids = r.ids, rollout_logp = r.logprobs, reward = scores[i],
                    group = group_base + g, finish_reason = r.finish_reason, length = #r.ids, sample = views[i],
                    experts = r.experts, index_picks = r.index_picks, policy_version = r.policy_version,
                    token_versions = r.token_versions }
            end
        end
    end
    st.groups_generated = st.groups_generated + #items
    return out
end

-- Each sample's real length (prompt then response): its row of the packed batch before the padding.
local function lengths(samples)
    local len = {}
    for i, s in ipairs(samples) do len[i] = #s.prompt + #s.ids end
    return len
end

-- Rectangular [B, S] ids / labels for samples (prompt then response; labels only on the response; right-padded with
-- pad, labels -100), and each row's real length (model:forward's opts.lengths: the indexer KL loss leaves the
-- padding out).
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
    return ids, labels, S, lengths(samples)
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

-- The training forward of samples (packed): their log-probabilities into s[field] (and entropies); returns S and the
-- forward's result (its indexer_loss / indexer_queries with the indexer KL on).
local function forward_logp(model, samples, pad, field, entropy_field, replay)
    local ids, labels, S, len = pack(samples, pad)
    -- logits = false: only the log-probabilities are read, so the head runs in chunks and [B, S, V] is never made
    -- (on a GPU it would also come back to the host)
    local res = model:forward(ids, { labels = labels, train = true, logits = false, lengths = len,
        replay = replay and replay_tensors(samples, S) or nil })
    local lp, en = model:logprobs({ entropy = entropy_field ~= nil })
    gather(lp, samples, S, field)
    if entropy_field then gather(en, samples, S, entropy_field) end
    return S, res
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
    cfg.micro_batches = cfg.micro_batches or 1
    if cfg.bucket_mb ~= nil and type(cfg.bucket_mb) ~= "number" then
        error("trainer.run: config.bucket_mb must be a number of MiB >= 0, got " .. tostring(cfg.bucket_mb), 3)
    end
    cfg.bucket_mb = dp.bucket_mb(cfg.bucket_mb)
    if not (cfg.bucket_mb >= 0) then
        error("trainer.run: config.bucket_mb must be a number of MiB >= 0, got " .. tostring(cfg.bucket_mb), 3)
    end
    if type(cfg.micro_batches) ~= "number" or cfg.micro_batches < 1 or cfg.micro_batches ~= math.floor(cfg.micro_batches) then
        error("trainer.run: config.micro_batches must be an integer >= 1, got " .. tostring(cfg.micro_batches), 3)
    end
    if cfg.indexer_kl ~= nil then
        local k = cfg.indexer_kl
        if type(k) ~= "number" or not (k >= 0) or k == math.huge then
            error("trainer.run: config.indexer_kl must be a finite number >= 0, got " .. tostring(k), 3)
        end
        local o = cfg.model:train_options() -- the model's other training options stay as they are
        o.indexer_kl = k
        cfg.model:set_train_options(o)
    end
    -- several ranks and a rollout source (remote workers): rank 0's alone. Every rank learns who holds one (the same
    -- answer everywhere, so that every rank raises the same error or none); the others take each batch's results
    -- from rank 0 (finish_batch).
    cfg.remote = false
    if dp.world() > 1 then
        local has = dp.gather_numbers({ ro.source and 1 or 0 })
        for r = 2, #has do
            if has[r][1] ~= 0 then
                error(("trainer.run: with several training ranks only rank 0 may hold the rollout source (a "
                    .. "ds4.rollout.pool): rank %d has one too"):format(r - 1), 3)
            end
        end
        cfg.remote = has[1][1] ~= 0
    end
    if cfg.async ~= nil then
        local a = cfg.async
        if type(a) ~= "table" then error("trainer.run: config.async must be a table {max_staleness = K}", 3) end
        for k in pairs(a) do
            if k ~= "max_staleness" then
                error("trainer.run: config.async: unknown key '" .. tostring(k) .. "' (max_staleness)", 3)
            end
        end
        local K = a.max_staleness
        if type(K) ~= "number" or K ~= math.floor(K) or K < 0 or K > 64 then
            error("trainer.run: config.async.max_staleness must be an integer in [0, 64], got " .. tostring(K), 3)
        end
    end
    if cfg.train_delay_s ~= nil and (type(cfg.train_delay_s) ~= "number" or not (cfg.train_delay_s >= 0)
        or cfg.train_delay_s > 3600) then
        error("trainer.run: config.train_delay_s must be a number of seconds in [0, 3600]", 3)
    end
    cfg.seed = cfg.seed or 1
    if cfg.progress == nil then cfg.progress = true end
    if cfg.loss ~= nil and type(cfg.loss) ~= "function" then
        error("trainer.run: config.loss must be a function(mb, spec, opts) -> {loss, grads, metrics}, got "
            .. type(cfg.loss), 3)
    end
    local g = cfg.guard == nil and {} or cfg.guard
    if g ~= false and type(g) ~= "table" then error("trainer.run: config.guard must be a table or false", 3) end
    g = g or { max_kl = math.huge, max_grad_norm = math.huge, max_idle_steps = math.huge,
        max_reward_error_frac = 1 }
    local known = { max_kl = 10, max_grad_norm = 1e6, max_failed_frac = 0.5, max_idle_steps = 10,
        max_reward_error_frac = 0.5 }
    for k in pairs(g) do
        if not known[k] then
            error("trainer.run: config.guard: unknown key '" .. tostring(k) .. "' (max_kl, max_grad_norm, "
                .. "max_failed_frac, max_idle_steps, max_reward_error_frac)", 3)
        end
    end
    cfg.guard = {}
    for k, def in pairs(known) do cfg.guard[k] = g[k] == nil and def or g[k] end
    for k, v in pairs(cfg.guard) do
        if type(v) ~= "number" or not (v >= 0) then
            error(("trainer.run: config.guard.%s must be a number >= 0, got %s"):format(k, tostring(v)), 3)
        end
    end
    local ck = cfg.checkpoint or {}
    if type(ck) ~= "table" then error("trainer.run: config.checkpoint must be a table", 3) end
    cfg.checkpoint = { every = ck.every or 0, keep_last = ck.keep_last or 3, resume = ck.resume == true,
        dir = ck.dir or (cfg.out and cfg.out .. "/ckpt") }
    if (cfg.checkpoint.every > 0 or cfg.checkpoint.resume) and not cfg.checkpoint.dir then
        error("trainer.run: checkpoints need config.out or config.checkpoint.dir", 3)
    end
    local lc = cfg.log_completions or {}
    cfg.log_completions = { every = lc.every or 0, n = lc.n or 4 }
    if cfg.state ~= nil and (type(cfg.state) ~= "table" or type(cfg.state.save) ~= "function" or
        type(cfg.state.load) ~= "function") then
        error("trainer.run: config.state must be {save = function() -> table, load = function(table)}", 3)
    end
    local a = cfg.algorithm
    if a.kl and not cfg.reference then
        error("trainer.run: algorithm " .. tostring(a.name) .. " has a KL term: pass config.reference (a frozen " ..
            "copy of the starting policy), or set algorithm.kl = nil", 3)
    end
end

-- A user loss's result, checked: what is wrong with it, or nil.
local function bad_loss_result(out, mb)
    if type(out) ~= "table" then return "returned a " .. type(out) .. ", not {loss, grads, metrics}" end
    if type(out.loss) ~= "number" then return "result.loss is a " .. type(out.loss) .. ", not a number" end
    if type(out.grads) ~= "table" then return "result.grads is a " .. type(out.grads) .. ", not an array" end
    for i, s in ipairs(mb) do
        local g = out.grads[i]
        if type(g) ~= "table" or #g ~= #s.ids then
            return ("result.grads[%d] must hold %d numbers (one per response token), got %s"):format(i, #s.ids,
                type(g) == "table" and #g .. " entries" or type(g))
        end
        for t = 1, #g do
            if type(g[t]) ~= "number" then
                return ("result.grads[%d][%d] is a %s, not a number"):format(i, t, type(g[t]))
            end
        end
    end
    if out.metrics ~= nil and type(out.metrics) ~= "table" then return "result.metrics must be a table" end
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


-- samples[first .. first + count - 1]
local function slice(samples, first, count)
    local out = {}
    for i = first, first + count - 1 do out[#out + 1] = samples[i] end
    return out
end

-- A per-token field (old_logp, ref_logp) computed by each rank for its share of the samples: afterwards every rank
-- has it for every sample (rank order = sample order; each sample's length is known to all, so the numbers of a
-- rank are its samples' fields laid end to end).
local function share_field(samples, field)
    if dp.world() == 1 then return end
    local first, count = dp.share(#samples, dp.world(), dp.rank())
    local flat = {}
    for i = first, first + count - 1 do
        for _, v in ipairs(samples[i][field]) do flat[#flat + 1] = v end
    end
    local parts = dp.gather_numbers(flat)
    for r = 0, dp.world() - 1 do
        local f, c = dp.share(#samples, dp.world(), r)
        local src, at = parts[r + 1], 0
        for i = f, f + c - 1 do
            local a = {}
            for t = 1, #samples[i].ids do a[t] = src[at + t] end
            at = at + #samples[i].ids
            samples[i][field] = a
        end
    end
end

-- Old (or reference) log-probabilities of every sample: each rank forwards its share (a sequence's log-probs do not
-- depend on the batch it is in), then they are shared. With a pool to serve (cfg.tick), the share goes in `parts`
-- forwards with the pool served between them, so that no single forward is longer than a training micro-batch's.
local function logp_all(cfg, model, samples, field, replay)
    local first, count = dp.share(#samples, dp.world(), dp.rank())
    local parts = cfg.tick and cfg.minibatches * cfg.micro_batches or 1
    for j = 0, parts - 1 do
        local f, c = dp.share(count, parts, j)
        if c > 0 then
            forward_logp(model, slice(samples, first + f - 1, c), cfg.pad, field, nil, replay)
            if cfg.tick then cfg.tick() end
        end
    end
    share_field(samples, field)
end

-- This rank's micro-batches of a minibatch: the minibatch's samples (in order) split into world × micro_batches
-- contiguous parts; rank r takes parts r·M .. r·M + M - 1, so the ranks' parts in rank order are one process's.
local function micro_batches(cfg, mb)
    local parts, out = dp.world() * cfg.micro_batches, {}
    for j = 0, cfg.micro_batches - 1 do
        local first, count = dp.share(#mb, parts, dp.rank() * cfg.micro_batches + j)
        if count > 0 then out[#out + 1] = slice(mb, first, count) end
    end
    return out
end

-- One micro-batch's policy loss (its grads normalised by the whole minibatch's counts, lopts): the loss result with
-- the gradient of the log-probabilities (out.g), or nil and the reason to stop. Its backward is micro_backward.
local function micro_loss(cfg, spec, pad, part, lopts, old_from_logp)
    local model = cfg.model
    local S, res = forward_logp(model, part, pad, "logp", "entropy", cfg.routing_replay)
    if old_from_logp then -- the step's first update: no weights changed yet, this forward is the old policy's
        for _, s in ipairs(part) do
            local o = {}
            for t, v in ipairs(s.logp) do o[t] = v end
            s.old_logp = o
        end
    end
    local out
    if cfg.loss then
        local ok, r = pcall(cfg.loss, part, spec, lopts)
        if not ok then return nil, "config.loss raised: " .. tostring(r) end
        local why = bad_loss_result(r, part)
        if why then return nil, "config.loss " .. why end
        out = r
    else
        out = rl.loss.compute(part, spec, { denom = lopts.denom, num_seqs = lopts.num_seqs,
            tis_scale = lopts.tis_scale })
    end
    local g = ds4.zeros({ #part, S })
    for i, s in ipairs(part) do
        local base = (i - 1) * S + #s.prompt - 1
        for j, v in ipairs(out.grads[i]) do g[base + j] = v end
    end
    out.g = g
    out.cells = #part * S
    -- the indexer KL: its global factor (κ / the minibatch's real queries), and Σ KL over this part's queries
    out.ikl = lopts.ikl
    out.ikl_sum = (res.indexer_loss or 0) * (res.indexer_queries or 0)
    return out
end

local function micro_backward(cfg, out)
    cfg.model:backward_logprobs(out.g, out.ikl and { ikl = out.ikl } or nil)
    if cfg.train_delay_s then sleep(cfg.train_delay_s) end
end

-- The updates of one step: old (and reference) log-probabilities, advantages, `minibatches` optimizer updates.
-- Fills the row's loss metrics; returns the trained token count and a reason to stop (nil when fine).
-- With several ranks (ds4.dp) every rank holds every sample (rollout_batch gathered them): the advantages are the
-- global groups', each minibatch is split into the ranks' micro-batches (and cfg.micro_batches on each), normalised by
-- the whole minibatch's counts, the gradients summed over ranks; every rank takes the same update.
local function train(cfg, opt, samples, row)
    local model, spec, pad = cfg.model, cfg.algorithm, cfg.pad
    if spec.overlong and spec.overlong.filter then rl.filter.overlong_filter(samples) end
    if spec.overlong and spec.overlong.soft then rl.filter.apply_soft_overlong(samples, spec.overlong.soft) end
    -- old policy = the current weights (three-policy view: rollout, old, new). The first minibatch's update is the
    -- step's first, so its training forward runs at exactly these weights: its log-probabilities are its old ones,
    -- bit for bit (a sequence's log-probs do not depend on the batch it is in), and only the later minibatches'
    -- samples are forwarded now. Not where old_logp is needed before any training forward: the KL in the reward,
    -- TIS's batch normalisation, and several ranks (each would hold only its own micro-batches' old log-probs).
    local mbs = split_groups(samples, cfg.minibatches)
    local old_later = dp.world() == 1 and not (spec.kl and spec.kl.where == "reward")
        and not (spec.tis and spec.tis.normalize)
    if old_later then
        local rest = {}
        for k = 2, #mbs do for _, s in ipairs(mbs[k]) do rest[#rest + 1] = s end end
        if #rest > 0 then logp_all(cfg, model, rest, "old_logp", cfg.routing_replay) end
    else
        logp_all(cfg, model, samples, "old_logp", cfg.routing_replay)
    end
    if spec.kl then
        logp_all(cfg, cfg.reference, samples, "ref_logp")
        if spec.kl.where == "reward" then
            rl.loss.kl_in_reward(samples, spec.kl.coef, spec.kl.estimator, { level = spec.kl.level })
        end
    end
    rl.advantage.compute(samples, spec.adv)
    local kept_sum = 0
    for _, s in ipairs(samples) do kept_sum = kept_sum + s.reward end
    local T = 0 -- the step's trained tokens (a user loss may want the step's normaliser rather than its minibatch's)
    for _, s in ipairs(samples) do
        if s.mask then for _, v in ipairs(s.mask) do T = T + v end else T = T + #s.ids end
    end
    local agg = { loss = 0, clip_frac = 0, kl = 0, entropy = 0, tokens = 0, ikl = 0, ikl_queries = 0 }
    local kappa = model:train_options().indexer_kl
    local last, stop, trained = nil, nil, 0
    for mbi, mb in ipairs(mbs) do
        model:zero_grad()
        local Tm, Nm = rl.loss.count(mb)
        -- tis.normalize: the whole minibatch's factor, the same in every micro-batch on every rank
        -- the indexer KL (model:set_train_options' indexer_kl = κ > 0): a mean over the real (unpadded) queries of
        -- the whole minibatch, on every rank, known before any forward (model:indexer_queries): each micro-batch's
        -- backward takes κ / Q, so that the parts add up to the one-batch mean whatever the split and the padding
        local Qm = kappa > 0 and model:indexer_queries(lengths(mb)) or 0
        local lopts = { denom = Tm, num_seqs = Nm, step_tokens = T, step_seqs = #samples,
            tis_scale = spec.tis and rl.correction.norm_scale(mb, spec.tis) or nil,
            ikl = Qm > 0 and kappa / Qm or nil }
        -- Σ over this rank's micro-batches of: loss, tokens, and the token-weighted clip_frac, kl, entropy; Σ KL of
        -- the indexer's queries
        local sums = { 0, 0, 0, 0, 0, 0 }
        -- with several ranks and buckets the last micro-batch's backward sums the gradients over ranks as it runs
        -- (ds4.dist.overlap_backward): it waits until every rank has its loss, so that none starts the sums alone
        local overlap = dp.world() > 1 and cfg.bucket_mb > 0
        local pending -- that micro-batch's loss, its backward waiting
        local ok, err = pcall(function()
            local parts = micro_batches(cfg, mb)
            for k, part in ipairs(parts) do
                local out, why = micro_loss(cfg, spec, pad, part, lopts, old_later and mbi == 1)
                if out and overlap and k == #parts then pending = out elseif out then micro_backward(cfg, out) end
                if cfg.tick then cfg.tick() end
                if not out then return why end
                local m = out.metrics or {}
                local w = m.tokens or rl.loss.count(part)
                sums[1] = sums[1] + (out.loss or 0)
                sums[2] = sums[2] + w
                sums[3] = sums[3] + (m.clip_frac or 0) * w
                sums[4] = sums[4] + ((spec.kl and m.kl) or m.ppo_kl or 0) * w
                sums[5] = sums[5] + (m.entropy or 0) * w
                sums[6] = sums[6] + out.ikl_sum
                trained = trained + out.cells
            end
        end)
        -- every rank learns whether one failed (a NaN loss, a user loss that raised), so that none waits alone in a
        -- collective the others left
        local flag = not ok and 2 or (err and 1 or 0)
        local worst = dp.max({ flag })[1]
        if worst > 0 then
            local why = not ok and "the update failed: " .. tostring(err) or err
                or "the update failed on another rank (see its output)"
            if worst == 1 then return trained, why end -- the user loss failed: stop before the update
            stop = why
            break
        end
        if overlap then -- (a rank without a micro-batch in this minibatch sends its zeros in the same buckets)
            ds4.dist.overlap_backward(model)
            local okb, e = true, nil
            if pending then okb, e = pcall(micro_backward, cfg, pending) end
            ds4.dist.all_reduce_grads(model) -- waits for the buckets (a failed backward still sent them all)
            if dp.max({ okb and 0 or 1 })[1] > 0 then
                stop = okb and "the update failed on another rank (see its output)" or "the update failed: " .. tostring(e)
                break
            end
        elseif dp.world() > 1 then
            ds4.dist.all_reduce_grads(model) -- summed in rank order
        end
        sums = dp.sum(sums)
        local okstep, r = pcall(opt.step, opt)
        if not okstep then -- an update the optimizer refuses (non-finite weights)
            stop = "the update failed: " .. tostring(r)
            break
        end
        last = r
        local w = sums[2]
        agg.tokens = agg.tokens + w
        agg.loss = agg.loss + sums[1] * w
        agg.clip_frac = agg.clip_frac + sums[3]
        agg.kl = agg.kl + sums[4]
        agg.entropy = agg.entropy + sums[5]
        agg.ikl, agg.ikl_queries = agg.ikl + sums[6], agg.ikl_queries + Qm
    end
    local w = math.max(agg.tokens, 1)
    row.loss, row.clip_frac, row.kl, row.entropy = agg.loss / w, agg.clip_frac / w, agg.kl / w, agg.entropy / w
    -- per CSA layer the mean KL over the step's real queries, summed over layers (model:forward's indexer_loss)
    if kappa > 0 then row.indexer_kl = agg.ikl / math.max(agg.ikl_queries, 1) end
    row["reward/kept_mean"] = kept_sum / #samples
    -- rollout vs old: kernels, routing, and in asynchronous runs the older policy versions that generated; after the
    -- updates (which change none of these fields), over the samples whose old log-probabilities exist: all of them
    -- unless an update failed before the first minibatch's forward
    local have = {}
    for _, s in ipairs(samples) do if s.old_logp then have[#have + 1] = s end end
    local mm = {}
    if #have > 0 then
        mm = (spec.tis and rl.correction.compute(have, spec.tis).metrics or rl.correction.metrics(have)) or {}
    end
    row["logprob_mismatch/mean"] = mm.mismatch_abs_mean or 0
    row["logprob_mismatch/max"] = mm.mismatch_abs_max or 0
    if mm.tis_weight_mean then
        row["tis/weight_mean"], row["tis/frac_truncated"], row["tis/frac_masked"], row["tis/ess"] =
            mm.tis_weight_mean, mm.tis_frac_truncated, mm.tis_frac_masked, mm.tis_ess
    end
    row.grad_norm = last and last.grad_norm
    row.lr = last and last.lr
    return dp.sum({ trained })[1], stop
end

local function progress_line(cfg, step, row, kept, dt)
    return ("step %d/%d reward %.3f kept %d/%d groups clip %.3f kl %.2e ent %.3f%s len %.1f%s %.1fs"):format(
        step, cfg.steps, row["reward/mean"], kept, row["groups/generated"], row.clip_frac or 0, row.kl or 0,
        row.entropy or 0, row.indexer_kl and (" ikl %.3f"):format(row.indexer_kl) or "", row["response_len/mean"],
        row["eval/accuracy"] and (" acc %.3f"):format(row["eval/accuracy"]) or "", dt)
end

local function print_completions(step, rows)
    print(("completions at step %d:"):format(step))
    for _, r in ipairs(rows) do
        local function cut(s) s = s:gsub("\n", "\\n") return #s > 60 and s:sub(1, 57) .. "..." or s end
        print(("  %-24s -> %-40s reward %s (%s)"):format(cut(r[1]), cut(r[2]), r[3], r[4]))
    end
end

function M.run(cfg)
    defaults(cfg)
    local ROOT = dp.is_root() -- with several ranks (ds4.dp), rank 0 alone logs, prints and writes checkpoints
    cfg.progress = cfg.progress and ROOT
    local model, spec, ro = cfg.model, cfg.algorithm, cfg.rollout
    cfg.pad = model:config().eos_token_id or 0
    local o = cfg.optim
    local opt = ds4.adamw(model, { lr = o.lr or 3e-4, betas = o.betas or { 0.9, 0.99 }, weight_decay = o.weight_decay or 0,
        clip = o.clip or 1.0, schedule = o.schedule or "constant", warmup = o.warmup or 0,
        total = cfg.steps * cfg.minibatches })
    -- ZeRO-1: sharded before a resume loads the state (each rank keeps its region of the saved moments)
    local sharded = cfg.zero and dp.world() > 1
    -- reduce_scatter: each rank sums only the gradients of its region, all its optimizer reads (the same bits)
    if sharded then ds4.dist.shard_optimizer(opt, { reduce_scatter = dp.reduce_scatter() }) end
    if dp.world() > 1 then ds4.dist.bucket_mb(cfg.bucket_mb) end
    local ck = cfg.checkpoint
    -- the loop's counters: what a checkpoint saves and a resume restores
    -- (version: the policy version of a source without its own, the in-process policy's: 1 + the steps that updated it)
    local state = { step = 0, gen_calls = 0, group_base = 0, failed_total = 0, idle = 0, version = 1 }
    local resumed_from
    if ck.resume then
        local st, dir = resume.load(ck.dir, model, opt, cfg.reference)
        if st then
            state, resumed_from = st, dir
            state.version = state.version or 1 -- a checkpoint written before versions were counted
            if cfg.state and st.user ~= nil then cfg.state.load(st.user) end
            -- a remote source serves the resumed weights from the first step on
            if ro.source and ro.source.publish then ro.source:publish(model) end
            if cfg.progress then print(("trainer: resuming from %s (RL step %d)"):format(dir, st.step)) end
        elseif cfg.progress then
            print("trainer: no checkpoint under " .. ck.dir .. ": starting from step 1")
        end
    end
    local log = ROOT and cfg.out and ds4.runlog.open(cfg.out, { resume_step = resumed_from and state.step or nil,
        tensorboard = cfg.tensorboard ~= false, quiet = not cfg.progress }) or nil
    local history = {}
    if resumed_from and log then history = require("ds4.plot").read_jsonl(cfg.out .. "/metrics.jsonl") end
    local tty = cfg.progress and ffi.C.isatty(1) == 1
    local t_start = now()
    -- the policy version the rollouts are measured against: the source's own (a pool's published versions), else ours
    local src = ro.source
    cfg.version = (src and type(src.version) == "number") and function() return src.version end
        or function() return state.version end
    if cfg.remote then -- every rank: rank 0's source's version, as of the last batch or publish it sent
        cfg.sync_version = function()
            cfg.remote_version = tonumber(dp.broadcast_string(dp.is_root() and tostring(src.version) or "", 0))
        end
        cfg.sync_version()
        cfg.version = function() return cfg.remote_version end
    end
    -- a source with :poll (ds4.rollout.pool) is served between the pieces of every computation here (micro-batches,
    -- log-probability forwards, evaluation tokens), at most every 20 ms, so that its workers never hear silence
    local last_tick = 0
    cfg.tick = src and src.poll and function()
        local t = now()
        if t - last_tick >= 0.02 then
            last_tick = t
            src:poll()
        end
    end or nil
    local K = cfg.async and cfg.async.max_staleness -- nil: synchronous
    local pipe = {} -- step -> its rollout batches submitted ahead, up to K steps (asynchronous runs)
    local batches_used = 1 -- by the last step: how many batches a step ahead gets
    local function drop(b) if b.handle and src.cancel then src:cancel(b.handle) end end
    local function finish(msg)
        for _, q in pairs(pipe) do for _, b in ipairs(q) do drop(b) end end
        pipe = {}
        if log then log:close() end
        if msg then error(msg, 0) end
    end
    local function evaluate()
        return M.evaluate(model, cfg.eval, cfg.decode, cfg.eval.max_new_tokens or ro.max_new_tokens, ro.stop, cfg.tick)
    end
    if cfg.eval and cfg.eval.samples and not resumed_from then
        state.eval_acc = evaluate()
        state.first_acc = state.eval_acc
        history[#history + 1] = { step = 0, ["eval/accuracy"] = state.eval_acc }
        if log then log:write(history[#history]) end
    end
    local stopped_at
    for step = state.step + 1, cfg.steps do
        if cfg.tick then cfg.tick() end -- also after the setup, the last step's logging and checkpoint
        local t0 = now()
        local lc = cfg.log_completions
        local st = { errors = 0, generated = 0, gen_tokens = 0, groups_generated = 0, failed_groups = 0,
            t_generate = 0, t_reward = 0, acc = stats_mod.new(), shown = {},
            show_n = (lc.every > 0 and step % lc.every == 0) and lc.n or 0 }
        st.version, st.lag_n, st.lag_sum, st.lag_max, st.mixed = cfg.version(), 0, 0, 0, 0
        local function submit(min_policy, first)
            state.gen_calls = state.gen_calls + 1
            return submit_batch(cfg, state.gen_calls, st, min_policy, first)
        end
        if K then
            -- the batches of steps step .. step + K not yet submitted: those of step s may be generated by any version
            -- from v - K + (s - step) on, v the current one; step s trains on version v + (s - step) at most (one
            -- publish per step), so their lag is at most K. A step ahead gets as many batches as the last step used
            -- (dynamic sampling draws several), the current one (the first step, or after a resume) one: K = 0 draws
            -- exactly what the synchronous loop does, in its order.
            -- A step ahead submitted before the last step showed that steps use more batches (the first steps, or a
            -- run where dynamic sampling begins to draw more) is topped up now rather than when it trains.
            for s = step, math.min(step + K, cfg.steps) do
                local q = pipe[s] or {} -- none taken yet: #q is what was submitted for s
                pipe[s] = q
                for _ = #q + 1, s == step and math.max(#q, 1) or batches_used do
                    q[#q + 1] = submit(math.max(1, st.version - K + (s - step)))
                end
            end
        end
        local function gen()
            -- dynamic sampling's batches beyond those submitted ahead: generated now, trained now; with steps ahead
            -- in flight, before their batches (first = true: a pool sends its tasks ahead of those queued)
            local b = pipe[step] and table.remove(pipe[step], 1)
                or submit(K and math.max(1, st.version - K) or nil, (K and K > 0) or nil)
            local out = finish_batch(cfg, b, state.group_base, st)
            state.group_base = state.group_base + ro.prompts_per_step
            return out
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
        local row = stats_mod.row(st.acc, { step = step, ["groups/generated"] = st.groups_generated,
            ["groups/failed"] = st.failed_groups, gen_batches = batches, ["reward/errors"] = st.errors })
        if K then -- batches submitted ahead that the step did not need (dynamic sampling filled it sooner)
            if K > 0 then row.gen_batches_unused = #(pipe[step] or {}) end -- K = 0: the synchronous row
            for _, b in ipairs(pipe[step] or {}) do drop(b) end
            pipe[step] = nil
            batches_used = math.min(batches, 1 + ((ds and ds.enable) and (ds.max_extra_batches or 9) or 0))
        end
        row.policy_version = cfg.version()
        if st.lag_n > 0 then
            row["staleness/mean"], row["staleness/max"] = st.lag_sum / st.lag_n, st.lag_max
            -- the fraction of samples whose tokens come from several versions (partial rollouts)
            row["staleness/mixed"] = st.mixed / st.lag_n
        end
        state.failed_total = state.failed_total + st.failed_groups
        local stop
        if K and st.lag_max > K then
            stop = ("a rollout of policy version %d is %d versions behind the policy (%d), more than async.max_staleness "
                .. "= %d: the rollout source does not honour opts.min_policy"):format(row.policy_version - st.lag_max,
                st.lag_max, row.policy_version, K)
        end
        if st.failed_groups > 0 then
            warn(("trainer: step %d: %d of %d rollout groups failed (%d in the run so far)\n"):format(step,
                st.failed_groups, st.groups_generated, state.failed_total))
            if st.failed_groups > cfg.guard.max_failed_frac * st.groups_generated then
                stop = ("%d of %d rollout groups failed, more than guard.max_failed_frac = %g: the rollout source is "
                    .. "failing (see its log); not training on what is left"):format(st.failed_groups,
                    st.groups_generated, cfg.guard.max_failed_frac)
            end
        end
        if not stop and st.errors > 0 and st.errors > cfg.guard.max_reward_error_frac * st.generated then
            stop = ("%d of %d rewards failed (more than guard.max_reward_error_frac = %g): the reward function is "
                .. "broken; the first error: %s"):format(st.errors, st.generated, cfg.guard.max_reward_error_frac,
                tostring(st.first_error))
        end
        local trained_tokens, t_train = 0, now()
        if #samples > 0 and not stop then trained_tokens, stop = train(cfg, opt, samples, row) end
        t_train = now() - t_train
        row["groups/kept"] = #samples / ro.n
        state.idle = #samples > 0 and 0 or state.idle + 1
        if state.idle > 0 and not stop then
            warn(("trainer: step %d trained on nothing: every group's rewards were equal (reward/mean "
                .. "%.3f; %d step(s) in a row)\n"):format(step, row["reward/mean"], state.idle))
            if state.idle >= cfg.guard.max_idle_steps then
                stop = ("%d steps in a row trained on nothing: no group survived filtering (guard.max_idle_steps = %g; "
                    .. "reward/mean %.3f): every group's rewards were equal, so the policy has collapsed or the task "
                    .. "is solved"):format(state.idle, cfg.guard.max_idle_steps, row["reward/mean"])
            end
        end
        stop = stop or diverged(row, cfg.guard)
        -- a remote source (ds4.rollout.pool) gets the new weights: a new policy version its workers fetch
        if #samples > 0 and not stop then
            state.version = state.version + 1
            -- ZeRO-1 on GPUs: the fp32 master is sharded and rank 0's publish reads the weights back, which gathers
            -- the master's regions from every rank: each rank joins that read-back here
            if sharded and cfg.remote and not (ro.source and ro.source.publish) then model:params() end
            if ro.source and ro.source.publish then ro.source:publish(model) end
            if cfg.remote then cfg.sync_version() end
        end
        local t_eval = now()
        if not stop and cfg.eval and cfg.eval.samples and ((cfg.eval.every and step % cfg.eval.every == 0)
            or step == cfg.steps) then
            state.eval_acc = evaluate()
            row["eval/accuracy"] = state.eval_acc
        end
        t_eval = now() - t_eval
        local dt = now() - t0
        row.seconds = dt
        row.tokens_per_s = (st.gen_tokens + trained_tokens) / math.max(dt, 1e-9)
        row["time/generate"], row["time/reward"], row["time/train"], row["time/eval"] = st.t_generate, st.t_reward,
            t_train, t_eval
        history[#history + 1] = row
        if log then
            log:write(row)
            if #st.shown > 0 then log:table(step, "completions", { "prompt", "completion", "reward", "finish_reason" },
                st.shown) end
        end
        if stop then finish(("trainer.run: step %d: %s"):format(step, stop)) end
        state.step = step
        if ck.every > 0 and (step % ck.every == 0 or step == cfg.steps) then
            state.user = cfg.state and cfg.state.save() or nil
            if cfg.tick then cfg.tick() end
            -- a sharded optimizer's state is gathered by every rank together; rank 0 writes it
            local ost = sharded and opt:state() or nil
            if ROOT then resume.save(ck.dir, model, opt, cfg.reference, state, ck.keep_last, ost) end
        end
        if cfg.progress then
            local msg = progress_line(cfg, step, row, #samples / ro.n, dt)
            if tty then
                io.write("\r", msg, "   ")
                if row["eval/accuracy"] or step == cfg.steps then io.write("\n") end
                io.flush()
            elseif step == 1 or step % 10 == 0 or row["eval/accuracy"] or step == cfg.steps then
                print(msg)
            end
            if #st.shown > 0 then
                if tty then io.write("\n") end
                print_completions(step, st.shown)
            end
        end
        if cfg.on_step and cfg.on_step(step, row) == false then
            stopped_at = step
            break
        end
    end
    finish()
    return { history = history, eval_before = state.first_acc, eval_after = state.eval_acc,
        seconds = now() - t_start, failed_groups = state.failed_total, stopped_at = stopped_at,
        resumed_from = resumed_from, updates = opt:steps() }
end

return M
