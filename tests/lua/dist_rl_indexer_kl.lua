-- dist_rl_indexer_kl.lua — the RL trainer's indexer KL loss over data-parallel ranks: each micro-batch's backward
-- takes κ / Q, Q the real (unpadded) queries of the whole minibatch over every micro-batch and rank
-- (docs/distributed.md, "Loss normalisation"). Run under mpirun -np 1 / 2 / 4 or as torchrun-style ranks
-- (tests/test_dist_mpi.sh, tests/test_dist_tcp.sh); without a launcher it is a world of one.
--
-- Every rank runs ds4.rl.trainer for one GRPO step on tiny_a (two CSA layers) with indexer_kl = 0.5: 3 prompts of
-- 4, 12 and 6 tokens × 4 samples (responses of 1 to 6 tokens: a quarter of the ids stop them), 2 micro-batches per
-- rank, so that packed micro-batches pad their rows and the micro-batches' real query counts differ (checked). The policy loss is a user loss whose gradients are zero, so the
-- summed gradient is the indexer KL's alone, and each rank records the samples of its micro-batches. Then, on every
-- rank, from the gathered micro-batches (in rank order: one process's micro-batches in order):
--   (a) one process accumulating each rank's micro-batches with backward_logprobs(0, {ikl = κ / Q}), the ranks'
--       sums added in rank order: the same bits (MPI and the TCP star sum in rank order: docs/distributed.md);
--   (b) the independent reference: one forward over the whole minibatch as one batch (its rows' lengths given), whose
--       default backward is the mean over all its real queries: every tensor within rel 2e-5 (fp32 summation order
--       over other row groupings, as tests/lua/test_grad_accum.lua; measured ~5e-7), its query count the trainer's
--       global Q, and the logged indexer_kl its indexer_loss (rel 1e-9: double sums grouped otherwise).
-- A per-micro-batch (or per-rank) normalisation weights the parts by κ / Q_k instead: rel ~1 on the indexer's
-- weights (tests/lua/test_rl_indexer_kl.lua measures it), far outside (b).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local dp = require("ds4.dp")
local rl = require("ds4.rl")
local trainer = require("ds4.rl.trainer")
local ffi = require("ffi")

local r, n = dp.init()
ds4.set_threads(1)
local DIR = H.fixtures() .. "/tiny_a"
local KAPPA, MICRO = 0.5, 2
-- one run directory for all ranks (rank 0 writes it)
local out = dp.broadcast_string(r == 0 and H.make_temp_dir() or "", 0)

local model = ds4.load(DIR)
local STOP = {}
for id = 2, model:config().vocab_size - 1, 4 do STOP[#STOP + 1] = id end
local PAD = model:config().eos_token_id or 0
local mine = {} -- this rank's micro-batches, each a list of {seq = prompt .. response ids, prompt = #prompt}
local res = trainer.run({
    model = model,
    algorithm = rl.preset("grpo", { kl = rl.NIL }),
    prompts = H.prompts_of_lengths({ 4, 12, 6 }),
    reward = H.parity_reward,
    decode = H.byte_text,
    -- a quarter of the vocabulary stops a response: their lengths vary (1 to 6 tokens)
    rollout = { n = 4, prompts_per_step = 3, max_new_tokens = 6, temperature = 1.0, stop = STOP },
    optim = { lr = 1e-3, clip = 0 },
    steps = 1,
    minibatches = 1,
    micro_batches = MICRO,
    indexer_kl = KAPPA,
    loss = function(part)
        local rec, grads = {}, {}
        for i, s in ipairs(part) do
            local seq = {}
            for _, v in ipairs(s.prompt) do seq[#seq + 1] = v end
            for _, v in ipairs(s.ids) do seq[#seq + 1] = v end
            rec[i] = { seq = seq, prompt = #s.prompt }
            grads[i] = {}
            for t = 1, #s.ids do grads[i][t] = 0 end
        end
        mine[#mine + 1] = rec
        return { loss = 0, grads = grads }
    end,
    out = out,
    seed = 3,
    progress = false,
    tensorboard = false,
})
local G = {}
for k, t in pairs(model:grads({ canonical = true })) do G[k] = t:clone() end

-- every rank's micro-batches, in rank order: [parts, (samples, prompt, len, ids...)...] per rank
local flat = { #mine }
for _, part in ipairs(mine) do
    flat[#flat + 1] = #part
    for _, s in ipairs(part) do
        flat[#flat + 1] = s.prompt
        flat[#flat + 1] = #s.seq
        for _, v in ipairs(s.seq) do flat[#flat + 1] = v end
    end
end
local parts, ranks_parts = {}, {} -- all micro-batches in order; each rank's
for rk, a in ipairs(dp.gather_numbers(flat)) do
    ranks_parts[rk] = {}
    local i = 1
    local function take() i = i + 1; return a[i - 1] end
    for _ = 1, take() do
        local part = {}
        for k = 1, take() do
            local s = { prompt = take(), seq = {} }
            for t = 1, take() do s.seq[t] = take() end
            part[k] = s
        end
        parts[#parts + 1] = part
        table.insert(ranks_parts[rk], part)
    end
end
H.eq(#parts, n * MICRO, "micro-batches over all ranks")
local all = {}
for _, part in ipairs(parts) do for _, s in ipairs(part) do all[#all + 1] = s end end
H.eq(#all, 12, "the minibatch's samples")

-- a packed forward of samples as the trainer makes it: right-padded ids, labels on the responses, real lengths
local function pack(samples)
    local ids, labels, len, S = {}, {}, {}, 0
    for i, s in ipairs(samples) do
        ids[i], labels[i], len[i] = {}, {}, #s.seq
        for t, v in ipairs(s.seq) do ids[i][t], labels[i][t] = v, t > s.prompt and v or -100 end
        S = math.max(S, #s.seq)
    end
    for i = 1, #samples do
        for t = #ids[i] + 1, S do ids[i][t], labels[i][t] = PAD, -100 end
    end
    return ds4.tensor(ids, "I64"), ds4.tensor(labels, "I64"), len, S
end
local function lengths(samples)
    local l = {}
    for i, s in ipairs(samples) do l[i] = #s.seq end
    return l
end
local Q = model:indexer_queries(lengths(all))
local counts, padded = {}, false
for k, part in ipairs(parts) do
    local l = lengths(part)
    counts[k] = model:indexer_queries(l)
    padded = padded or math.max(unpack(l)) > math.min(unpack(l))
end
H.check(padded, "micro-batches pack rows of different lengths")
local differ = false
for k = 2, #counts do differ = differ or counts[k] ~= counts[1] end
H.check(differ, "the micro-batches' real query counts differ: " .. table.concat(counts, " "))

-- (a) one process accumulating each rank's micro-batches with the global factor, the ranks' sums then added in rank
-- order in fp32 (a Lua double sum of two floats stored into a float is the correctly rounded fp32 sum)
local acc = ds4.load(DIR)
acc:set_train_options({ indexer_kl = KAPPA })
local sum
for _, rparts in ipairs(ranks_parts) do
    acc:zero_grad()
    for _, part in ipairs(rparts) do
        local ids, labels, len, S = pack(part)
        acc:forward(ids, { labels = labels, train = true, logits = false, lengths = len })
        acc:backward_logprobs(ds4.zeros({ #part, S }), { ikl = KAPPA / Q })
    end
    local g = acc:grads({ canonical = true })
    if not sum then
        sum = {}
        for k, t in pairs(g) do sum[k] = t:clone() end
    else
        for k, t in pairs(g) do
            local ps, pg = ffi.cast("float *", sum[k]:data_ptr()), ffi.cast("const float *", t:data_ptr())
            for i = 0, t:numel() - 1 do ps[i] = ps[i] + pg[i] end
        end
    end
end
local bits = H.count_differ(G, sum)
H.eq(bits, 0, "gradients that differ from one process accumulating the same micro-batches")

-- (b) the whole minibatch as one batch, its own (global) query count
local whole = ds4.load(DIR)
whole:set_train_options({ indexer_kl = KAPPA })
whole:zero_grad()
local ids, labels, len, S = pack(all)
local o = whole:forward(ids, { labels = labels, train = true, logits = false, lengths = len })
H.eq(o.indexer_queries, Q, "the whole batch's real queries = the trainer's global Q")
whole:backward_logprobs(ds4.zeros({ #all, S }))
local worst, worst_name, idx_norm = 0, "?", 0
for name, g in pairs(whole:grads({ canonical = true })) do
    local mx, rel, bb = H.f32_diff(G[name], g)
    rel = bb > 0 and rel or mx
    if not (rel <= worst) then worst, worst_name = rel, name end
    if name:find("%.attn%.indexer%.") then idx_norm = idx_norm + bb end
end
H.check(idx_norm > 0, "the indexer gets a gradient")
H.check(worst <= 2e-5, ("vs the whole minibatch as one batch: worst rel %.3g (%s)"):format(worst, worst_name))
local row = res.history[1]
H.near(row.indexer_kl, o.indexer_loss, 1e-9 * o.indexer_loss, "the logged indexer_kl = the whole batch's loss")
if r == 0 then
    print(("dist_rl_indexer_kl: %d ranks (%s) x %d micro-batches, Q %d (parts %s): vs one process accumulating them "
        .. "%d gradients differ; vs one batch worst rel %.3g (%s); indexer_kl %.9g"):format(n, ds4.dist.is_initialized()
        and ds4.dist.backend() or "none", MICRO, Q, table.concat(counts, " "), bits, worst, worst_name, row.indexer_kl))
end
dp.finalize()
H.done("dist_rl_indexer_kl rank " .. r .. " of " .. n)
