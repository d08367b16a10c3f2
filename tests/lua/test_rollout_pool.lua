-- test_rollout_pool.lua — the rollout pool and worker state machines (lua/ds4/rollout/), in one process: the pool
-- and real workers (ds4.rollout.worker, each with its own copy of the tiny fixture model) talk through a fake
-- network that carries the real wire frames (ds4.wire encodes and decodes every message) under a fake clock, next
-- to scripted peers that misbehave on purpose. The ZeroMQ sockets, CURVE and real processes are
-- tests/test_rollout.sh's job.
-- Usage: ds4 run tests/lua/test_rollout_pool.lua <fixtures_dir>
--
-- What is checked:
--   (a) results equal the trainer's own model:generate of each prompt with pool.task_seed(seed, p), token for
--       token and log-probability for log-probability (bitwise: the same fp32 kernels on the same weights), with
--       workers that started from zeroed weights (so the weights came over the wire: 64 KiB chunks, a window of
--       4), before and after a publish; an unchanged publish keeps the version;
--   (b) a lease that expires is re-issued (attempt + 1) to another worker, and a silent worker is declared dead;
--   (c) a late answer of an expired lease is dropped as a duplicate: every task is accounted for exactly once;
--   (d) samples older than current - max_staleness are re-queued ("requeue") or kept with their version
--       ("accept_with_version");
--   (e) a task that fails max_attempts times comes back as "failed" results;
--   (f) malformed frames, messages from unknown workers and mismatched hellos get error replies (muted after
--       100 rejects in 60 s) and change nothing; a worker answers garbage with an error and keeps working, says
--       hello again after "unknown worker" or a trainer bye;
--   (g) a corrupted weight buffer (whole-buffer CRC mismatch) is fetched again, then reported as a crc error;
--   (h) issue 18: beside an honest worker, a worker that misbehaves in each way of tests/chaos/bad_worker.lua
--       (out-of-range ids, NaN log-probabilities, error replies, future versions, a new hello, a credit flood,
--       silence, malformed answers): every task completes exactly once, with the honest worker's results; bad answers are rejected
--       and counted, tasks go back to a worker that has not failed them, repeat offenders are quarantined;
--   (i) the checks of answers one by one (Pool:check_samples), and quarantine across hellos and its end;
--   (j) LoRA policies (protocol 4): the frozen base travels once (a version of its own), each publish moves the
--       adapters' bytes only, and results equal the trainer's generation with its adapters bitwise; workers attach
--       the adapters' layout themselves, and drop them when the trainer publishes a plain (merged) model again.
--   (l) streaming (protocol 5): a batch submitted with stream = 3 has its tokens streamed while it runs (cfg.on_partial,
--       pool:progress), the streamed tokens begin the final results, which equal model:generate; an out-of-order
--       partial is rejected and logged; partial messages with per-token versions (protocol 6) give them, and one
--       that goes back to older weights is rejected;
--   (m) partial rollouts (protocol 5): a worker with partial_rollouts takes a new version under running sequences;
--       each token's version is in the result, the tokens before the switch equal model:generate at the old
--       version, policy_version is the oldest; without the option the running tasks finish under the old version.
--   (n) a model with the FP8 KV quantisation-aware option on is not published (workers would decode without it).
--   (k) asynchronous use: batches submitted together and collected out of order, a publish while they are in flight
--       (each result equals model:generate at the version it reports), min_policy as a hard lower bound (re-issued
--       even with accept_with_version), a cancelled batch's late answer dropped as a duplicate, a batch submitted
--       with first = true sent before the queued tasks of earlier batches.
local TEST_DIR = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = TEST_DIR .. "/?.lua;" .. TEST_DIR .. "/../chaos/?.lua;" .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")
local codec = require("ds4.rollout.codec")
local poolmod = require("ds4.rollout.pool")
local workermod = require("ds4.rollout.worker")

local FIX = H.fixtures()
local policy = ds4.load(FIX .. "/tiny_a")
local VOCAB = policy:config().vocab_size

-- ------------------------------------------------------------------------------------------------ fake network

local function new_net()
    local net = { clock = 1000, inbox = {}, peers = {}, order = {}, logs = {}, sent = 0 }
    function net.now() return net.clock end
    function net.log(level, msg) net.logs[#net.logs + 1] = level .. ": " .. msg end
    function net.logged(pat)
        for _, l in ipairs(net.logs) do if l:find(pat) then return true end end
        return false
    end
    function net.run_peers()
        for _, id in ipairs(net.order) do
            local p = net.peers[id]
            if p and not p.gone then p.step() end
        end
    end
    net.transport = {
        recv = function(_, timeout_ms)
            if #net.inbox == 0 then net.run_peers() end
            if #net.inbox == 0 and (timeout_ms or 0) > 0 then
                net.clock = net.clock + timeout_ms / 1000
                net.run_peers()
            end
            local m = table.remove(net.inbox, 1)
            if not m then return nil end
            return m[1], m[2]
        end,
        send = function(_, peer, frames)
            local p = net.peers[peer]
            if not p or p.gone then return nil, "EHOSTUNREACH" end
            net.sent = net.sent + 1
            p.inbox[#p.inbox + 1] = frames
            return true
        end,
        close = function() end,
    }
    -- a peer's own end: it sends into the pool's inbox, receives from its own
    function net.endpoint(id)
        local p = { id = id, inbox = {} }
        net.peers[id] = p
        net.order[#net.order + 1] = id
        p.transport = {
            recv = function() return table.remove(p.inbox, 1) end,
            send = function(_, frames)
                if p.gone then return nil, "EAGAIN" end
                net.inbox[#net.inbox + 1] = { id, frames }
                return true
            end,
            close = function() p.gone = true end,
        }
        return p
    end
    return net
end

local function new_pool(net, cfg)
    cfg = cfg or {}
    cfg.transport, cfg.clock, cfg.log = net.transport, net.now, net.log
    if cfg.model == nil then cfg.model = policy end
    return poolmod.new(cfg)
end

-- A real worker whose model starts from zeroed weights (everything it generates with came over the wire).
local function real_worker(net, id, opts)
    local p = net.endpoint(id)
    local m = ds4.load(FIX .. "/tiny_a")
    m:set_params(ds4.zeros({ m:n_params() }))
    local cfg = { model = m, id = id, transport = p.transport, clock = net.now, log = net.log,
        interrupted = function() return false end, credits = 2 }
    for k, v in pairs(opts or {}) do cfg[k] = v end
    local w = workermod.new(cfg)
    p.worker = w
    w:start()
    p.step = function()
        local st = w:step(0)
        if st then p.gone = true; p.status = st end
    end
    return p, w
end

-- A scripted peer: hello on start, credit on announce, then `on_task(peer, msg)` decides; `beat` sends a heartbeat
-- once per fake second.
local function script_peer(net, id, behaviour)
    local p = net.endpoint(id)
    p.tasks, p.replies, p.due = {}, {}, {}
    local function send(msg, raw) return p.transport:send(codec.encode(msg, raw)) end
    p.send = send
    p.last_beat = net.clock
    p.policy = 0
    local cj = policy:config_json()
    send({ t = "hello", worker = id, policy = 0, max_batch = 8, threads = 1, vocab_size = behaviour.vocab or VOCAB,
        n_params = policy:n_params(), config_crc = codec.crc32(cj, #cj), tables_crc = policy:tables_crc(),
        build = "script" })
    p.step = function()
        while true do
            local fr = table.remove(p.inbox, 1)
            if not fr then break end
            local m, code, why = codec.decode(fr)
            if not m then
                p.replies[#p.replies + 1] = { bad = code, why = why }
            elseif m.t == "weight_announce" then
                p.policy = m.version
                if not p.credited then send({ t = "credit", n = behaviour.credit or 2 }); p.credited = true end
            elseif m.t == "task" then
                p.tasks[#p.tasks + 1] = m
                if behaviour.on_task then behaviour.on_task(p, m) end
            else
                p.replies[#p.replies + 1] = m
            end
        end
        for i = #p.due, 1, -1 do
            local d = p.due[i]
            if net.clock >= d.at then
                table.remove(p.due, i)
                send(d.msg, d.raw)
            end
        end
        if behaviour.beat and net.clock - p.last_beat >= 1 then
            p.last_beat = net.clock
            send({ t = "heartbeat", policy = p.policy, active = 0 })
        end
    end
    return p
end

-- Samples for a task, made up (tokens from the seed) but well-formed; policy as given.
local function fake_samples(m, policy_v)
    local seq, toks, lps = {}, {}, {}
    for i = 1, m.n do
        seq[i] = { prompt_len = m.prompt_len, n_gen = 2, finish = 1, stop_index = -1, n_rows = 0 }
        toks[#toks + 1] = m.seed % 97
        toks[#toks + 1] = i
        lps[#lps + 1] = -1
        lps[#lps + 1] = -2
    end
    return { t = "samples", task_id = m.task_id, attempt = m.attempt, policy = policy_v, n = m.n, seq = seq },
        { tokens = toks, logprobs = lps, sample_logprobs = lps }
end

local PROMPTS = { { 5, 6, 7 }, { 8, 9 }, { 10, 11, 12, 13 }, { 14 }, { 15, 16 }, { 17, 18, 19 } }
local GEN = { n = 3, max_new_tokens = 6, temperature = 1.0, seed = 11 }

local function local_reference(model, prompts, opts, p)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.seed = poolmod.task_seed(opts.seed, p)
    return model:generate({ prompts[p] }, o)
end

-- res from the pool vs the trainer's own generation, prompt by prompt.
local function check_equal_local(res, model, prompts, opts, what)
    local n = opts.n or 1
    H.eq(#res, #prompts * n, what .. ": result count")
    local same = true
    for p = 1, #prompts do
        local ref = local_reference(model, prompts, opts, p)
        for s = 1, n do
            local r, e = res[(p - 1) * n + s], ref[s]
            if r.prompt_index ~= p or r.sample_index ~= s or r.finish_reason ~= e.finish_reason or #r.ids ~= #e.ids then
                same = false
            end
            for j = 1, #e.ids do
                if r.ids[j] ~= e.ids[j] or r.logprobs[j] ~= e.logprobs[j] or r.sample_logprobs[j] ~= e.sample_logprobs[j]
                then same = false end
            end
        end
    end
    H.check(same, what .. ": pool results equal model:generate with pool.task_seed, token for token")
end

-- ------------------------------------------------------------------------------------------------ (a) weights

-- continuous batching: one worker, 5 sequence slots, as many tasks as fit (credits 0); prompts of 1..9 tokens, 2
-- samples each, frequent stop ids: sequences end at mixed lengths, tasks join while others decode, and every result
-- still equals model:generate of its prompt alone
do
    local net = new_net()
    local pool = new_pool(net, { max_staleness = 0, max_credit = 32 })
    local _, w = real_worker(net, "w-batch", { max_batch = 5, credits = 0 })
    local prompts = {}
    for i = 1, 16 do
        local p = {}
        for j = 1, 1 + (i * 5) % 9 do p[j] = (i * 13 + j * 7) % 200 + 2 end
        prompts[i] = p
    end
    local opts = { n = 2, max_new_tokens = 12, temperature = 1.0, seed = 21, stop = { 3, 40, 77, 150 } }
    -- the worker starts from zeroed weights: first load the policy (a greedy task), then batch
    pool:generate({ prompts[1] }, { n = 1, max_new_tokens = 1 })
    local res = pool:generate(prompts, opts)
    check_equal_local(res, policy, prompts, opts, "(batching) 16 tasks through one batching worker")
    local lens = {}
    for _, r in ipairs(res) do lens[#r.ids] = true end
    local distinct = 0
    for _ in pairs(lens) do distinct = distinct + 1 end
    H.check(distinct >= 3, "(batching) sequences ended at " .. distinct .. " different lengths")
    H.check(w.st.max_active >= 3, "(batching) the worker held " .. w.st.max_active .. " tasks at once (>= 3)")
    io.write(("(batching) 16 tasks, up to %d at once in a 5-slot worker, %d distinct lengths: equal to local\n"):format(
        w.st.max_active, distinct))
end

-- stop strings over the wire (protocol v3): a policy with the byte-level tokenizer (ids < 256 are bytes), whose
-- announce carries it to the worker; stop strings are the most frequent byte of a first local run and a two-byte
-- string read off it, so that sequences stop by strings, by the stop id and by length. Every result equals the
-- local model:generate with the model's tokenizer, the finish reasons and matched stops included.
do
    local net = new_net()
    local m = ds4.load(FIX .. "/tiny_a")
    m:set_tokenizer(ds4.tokenizer())
    local pool = new_pool(net, { max_staleness = 0, model = m })
    real_worker(net, "w-stops", { max_batch = 8 })
    local prompts = {}
    for i = 1, 8 do prompts[i] = { (i * 37) % 200 + 2, (i * 11) % 200 + 2, 7 } end
    local first = m:generate(prompts, { n = 2, max_new_tokens = 16, temperature = 1.0, seed = 5 })
    local count, ids = {}, {}
    for _, r in ipairs(first) do
        for _, id in ipairs(r.ids) do
            if id > 0 then
                if not count[id] then ids[#ids + 1] = id end
                count[id] = (count[id] or 0) + 1
            end
        end
    end
    table.sort(ids, function(a, b) return count[a] > count[b] or (count[a] == count[b] and a < b) end)
    local r1 = first[1].ids
    local pair = string.char(r1[2] % 255 + 1, r1[3] % 255 + 1)
    local opts = { n = 2, max_new_tokens = 16, temperature = 1.0, seed = 5,
        stop = { string.char(ids[1]), pair, 9, string.char(ids[2]), string.char(ids[3]) } }
    local res = pool:generate(prompts, opts)
    local lopts = {}
    for k, v in pairs(opts) do lopts[k] = v end
    lopts.tokenizer = m:tokenizer()
    check_equal_local(res, m, prompts, lopts, "(stops) stop strings")
    local by = {}
    for p = 1, #prompts do
        local ref = local_reference(m, prompts, lopts, p)
        for s = 1, 2 do
            local r = res[(p - 1) * 2 + s]
            by[r.finish_reason] = (by[r.finish_reason] or 0) + 1
            H.eq(r.stop, ref[s].stop, "(stops) the matched stop of a remote result")
        end
    end
    H.check((by.stop_string or 0) >= 3, "(stops) sequences ended by stop strings")
    io.write(("(stops) stop_string %d, stop_token %d, length %d, eos %d: equal to local\n"):format(by.stop_string or 0,
        by.stop_token or 0, by.length or 0, by.eos or 0))
    H.raises(function() pool:generate({ { 1 } }, { stop = { "x" }, tokenizer = ds4.tokenizer() }) end,
        { "must be the model's tokenizer" }, "(stops) another tokenizer")
    H.raises(function() pool:generate({ { 1 } }, { stop = { ("y"):rep(65) } }) end, { "1..64 bytes" },
        "(stops) a stop string too long")
end

do
    local net = new_net()
    local pool = new_pool(net, { chunk_bytes = 64 * 1024, max_staleness = 0 })
    local _, w1 = real_worker(net, "w1")
    local _, w2 = real_worker(net, "w2")
    local res = pool:generate(PROMPTS, GEN)
    check_equal_local(res, policy, PROMPTS, GEN, "(a) version 1")
    H.eq(res[1].policy_version, 1, "(a) results carry their policy version")
    H.check(res[1].task and res[1].worker, "(a) results carry task and worker")
    local st = pool:stats()
    H.eq(st.completed, #PROMPTS, "(a) completed")
    H.eq(st.reissued, 0, "(a) nothing re-issued")
    H.eq(st.duplicates, 0, "(a) no duplicates")
    local bytes = 4 * policy:n_params()
    H.eq(st.bytes_served, 2 * bytes, "(a) each worker fetched the weights once")
    H.check(w1.st.tasks > 0 and w2.st.tasks > 0, "(a) both workers got tasks")
    H.eq(pool:publish(policy), 1, "(a) publishing unchanged weights keeps the version")
    -- a training step: new weights, a new version, the workers fetch them
    local p = policy:params()
    local ptr = ffi.cast("float *", p:data_ptr())
    for i = 0, p:numel() - 1, 7 do ptr[i] = ptr[i] * 0.5 end
    local trained = ds4.load(FIX .. "/tiny_a")
    trained:set_params(p)
    H.eq(pool:publish(trained), 2, "(a) a changed model is version 2")
    local res2 = pool:generate(PROMPTS, GEN)
    check_equal_local(res2, trained, PROMPTS, GEN, "(a) version 2")
    H.eq(res2[#res2].policy_version, 2, "(a) max_staleness = 0: version 2 results")
    H.eq(pool:stats().bytes_served, 4 * bytes, "(a) and fetched version 2 once each")
    H.eq(w1.loaded, 2, "(a) worker 1 holds version 2")
    -- record_experts / record_index travel as routing frames
    local ro = { n = 2, max_new_tokens = 4, temperature = 1.0, seed = 3, record_experts = true, record_index = true }
    local res3 = pool:generate({ PROMPTS[3] }, ro)
    local ref3 = local_reference(trained, { PROMPTS[3] }, ro, 1)
    local same = true
    for s = 1, 2 do
        local a, b = res3[s], ref3[s]
        if not (a.experts and a.index_picks) or a.experts:numel() ~= b.experts:numel()
            or a.index_picks:numel() ~= b.index_picks:numel() then
            same = false
        else
            for i = 1, b.experts:numel() do if a.experts[i] ~= b.experts[i] then same = false end end
            for i = 1, b.index_picks:numel() do if a.index_picks[i] ~= b.index_picks[i] then same = false end end
            for d = 1, 3 do if a.experts:size(d) ~= b.experts:size(d) then same = false end end
        end
    end
    H.check(same, "(a) routed experts and indexer picks equal the local generation's")
    H.raises(function() pool:generate({ { 1, 2 } }, { stop = { "x" } }) end, { "stop strings need the model's tokenizer" },
        "(a) stop strings without a tokenizer")
    H.raises(function() pool:generate({ { VOCAB } }, {}) end, { "not a token id" }, "(a) bad prompt")
    H.raises(function() pool:generate({ { 1 } }, { on_token = function() end }) end, { "on_token" }, "(a) on_token")
    H.raises(function() pool:generate({ { 1 } }, { nope = 1 }) end, { "unknown option 'nope'" }, "(a) unknown option")
    local rt = pool:generate(ds4.tensor({ { 5, 6, 7 }, { 8, 9, 10 } }, "I32"), { n = 1, max_new_tokens = 3, seed = 4 })
    local rl = pool:generate({ { 5, 6, 7 }, { 8, 9, 10 } }, { n = 1, max_new_tokens = 3, seed = 4 })
    H.same({ rt[1].ids, rt[2].ids }, { rl[1].ids, rl[2].ids }, "(a) a [B, S] tensor of prompts")
    pool:close()
    local byes = 0
    for _, id in ipairs({ "w1", "w2" }) do
        for _, fr in ipairs(net.peers[id].inbox) do if codec.decode(fr).t == "bye" then byes = byes + 1 end end
    end
    H.eq(byes, 2, "(a) close says bye to every worker")
end

-- ------------------------------------------------------------------------------------------------ (b) leases

do
    local net = new_net()
    local pool = new_pool(net, { lease_s = 2, lease_rate = 1e9, dead_s = 1e9 })
    script_peer(net, "a-hang", { beat = true }) -- takes tasks, never answers
    local _, w = real_worker(net, "b-real")
    local res = pool:generate(PROMPTS, GEN)
    check_equal_local(res, policy, PROMPTS, GEN, "(b) with a hanging worker")
    local st = pool:stats()
    H.check(st.reissued >= 1, "(b) expired leases re-issued: " .. st.reissued)
    H.eq(st.completed, #PROMPTS, "(b) every task completed once")
    H.eq(st.failed, 0, "(b) none failed")
    H.eq(w.st.tasks, #PROMPTS, "(b) the live worker did all of them")
    local reissued_attempt = false
    for _, r in ipairs(res) do if r.attempt > 0 and r.worker == "b-real" then reissued_attempt = true end end
    H.check(reissued_attempt, "(b) a result of attempt > 0")
    H.check(net.logged("lease on a%-hang expired"), "(b) the expiry is logged")

    -- a silent worker (no heartbeats) is declared dead and its leases re-issued
    local net2 = new_net()
    local pool2 = new_pool(net2, { dead_s = 3 })
    script_peer(net2, "a-silent", {})
    real_worker(net2, "b-real")
    local res2 = pool2:generate(PROMPTS, GEN)
    check_equal_local(res2, policy, PROMPTS, GEN, "(b) with a dead worker")
    local st2 = pool2:stats()
    H.eq(st2.dead, 1, "(b) one worker declared dead")
    H.check(st2.reissued >= 1, "(b) its leases re-issued")
    H.eq(st2.completed, #PROMPTS, "(b) every task completed")
    H.eq(st2.n_workers, 1, "(b) the dead worker's session is gone")
end

-- ------------------------------------------------------------------------------------------------ (c) duplicates

do
    local net = new_net()
    local pool = new_pool(net, { lease_s = 1, lease_rate = 1e9, dead_s = 1e9 })
    -- answers every task, but 3 s late: its leases expire first, the tasks are done elsewhere, then the answers
    -- arrive (and one more copy of each, to be sure)
    script_peer(net, "a-late", { beat = true, on_task = function(p, m)
        local msg, raw = fake_samples(m, 1)
        p.due[#p.due + 1] = { at = net.clock + 3, msg = msg, raw = raw }
        p.due[#p.due + 1] = { at = net.clock + 3.5, msg = msg, raw = raw }
    end })
    real_worker(net, "b-real")
    local res = pool:generate(PROMPTS, GEN)
    check_equal_local(res, policy, PROMPTS, GEN, "(c) late answers lose")
    local late = #net.peers["a-late"].tasks
    H.check(late >= 1, "(c) the late worker got tasks")
    -- let the late answers arrive
    local t0 = net.clock
    while net.clock - t0 < 5 do pool:service(100) end
    local st = pool:stats()
    H.eq(st.duplicates, 2 * late, "(c) every late answer dropped as a duplicate")
    H.eq(st.completed, #PROMPTS, "(c) completed once each")
    H.eq(st.completed + st.failed, st.tasks, "(c) every task accounted for exactly once")
    local state_replies = 0
    for _, m in ipairs(net.peers["a-late"].replies) do
        if m.t == "error" and m.code_name == "state" and m.reason:find("already completed") then
            state_replies = state_replies + 1
        end
    end
    H.eq(state_replies, 2 * late, "(c) each duplicate answered 'already completed'")

    -- the first valid answer wins even from an earlier attempt: the late worker answers attempt 0 at 1.5 s, after
    -- its lease (1 s) expired and the re-issue went to a worker that never answers
    local net2 = new_net()
    local pool2 = new_pool(net2, { lease_s = 1, lease_rate = 1e9, dead_s = 1e9, max_attempts = 10 })
    script_peer(net2, "a-late", { beat = true, credit = 1, on_task = function(p, m)
        if m.attempt == 0 then
            local msg, raw = fake_samples(m, 1)
            p.due[#p.due + 1] = { at = net2.clock + 1.5, msg = msg, raw = raw }
        end
    end })
    local r2 = pool2:generate({ { 1, 2, 3 } }, { n = 2, max_new_tokens = 2 })
    H.eq(r2[1].attempt, 0, "(c) an earlier attempt's valid answer completes the task")
    H.eq(#r2[1].ids, 2, "(c) with its samples")
end

-- ------------------------------------------------------------------------------------------------ (d) staleness

-- Versions 1..n of the policy, each with its first weight set to the version number.
local function publish_versions(pool, n)
    local p = policy:params()
    for v = 1, n do
        local m = ds4.load(FIX .. "/tiny_a")
        local q = p:clone()
        ffi.cast("float *", q:data_ptr())[0] = v
        m:set_params(q)
        pool:publish(m)
    end
end

-- A peer that answers each task from version `first`, and the same task re-issued from version 3; `asked` collects
-- the versions the tasks ask for.
local function stale_once_peer(net, id, first, asked)
    return script_peer(net, id, { beat = true, credit = 1, on_task = function(pp, m)
        if asked then asked[#asked + 1] = m.policy end
        pp.seen = pp.seen or {}
        local v = pp.seen[m.task_id] and 3 or first
        pp.seen[m.task_id] = true
        pp.send(fake_samples(m, v))
        pp.send({ t = "credit", n = 1 })
    end })
end

for _, mode in ipairs({ "requeue", "accept_with_version" }) do
    local net = new_net()
    local pool = new_pool(net, { max_staleness = 1, stale = mode, lease_s = 5, dead_s = 1e9 })
    publish_versions(pool, 3)
    H.eq(pool.version, 3, "(d) three versions published")
    -- a worker that answers from version 1 (older than 3 - 1), once per task; then honest answers
    local stale_peer = stale_once_peer(net, "a-stale", 1)
    local res = pool:generate({ { 1, 2 }, { 3, 4 } }, { n = 2, max_new_tokens = 2 })
    local st = pool:stats()
    if mode == "requeue" then
        H.eq(st.stale_requeued, 2, "(d) requeue: both stale answers re-queued")
        H.eq(res[1].policy_version, 3, "(d) requeue: the results are of the current version")
        H.eq(res[1].attempt, 1, "(d) requeue: from attempt 1")
        local stale_err = 0
        for _, m in ipairs(stale_peer.replies) do if m.t == "error" and m.code_name == "stale" then
            stale_err = stale_err + 1 end end
        H.eq(stale_err, 2, "(d) requeue: each stale answer got a stale error")
    else
        H.eq(st.stale_accepted, 2, "(d) accept_with_version: kept")
        H.eq(res[1].policy_version, 1, "(d) accept_with_version: the results say version 1")
    end
    H.eq(st.completed, 2, "(d) completed once each")
end

-- ------------------------------------------------------------------------------------------------ (e) failures

do
    local net = new_net()
    local pool = new_pool(net, { lease_s = 1, lease_rate = 1e9, dead_s = 1e9, max_attempts = 3 })
    script_peer(net, "a-hang", { beat = true, credit = 10 }) -- hung workers keep the credit of their leases
    script_peer(net, "b-hang", { beat = true, credit = 10 })
    local res = pool:generate({ { 1, 2 }, { 3 } }, { n = 2, max_new_tokens = 2 })
    H.eq(res.failed, 4, "(e) every sample of both tasks failed")
    H.eq(res[1].finish_reason, "failed", "(e) finish_reason failed")
    H.eq(#res[1].ids, 0, "(e) no tokens")
    local st = pool:stats()
    H.eq(st.failed, 2, "(e) two tasks failed")
    H.eq(st.completed + st.failed, st.tasks, "(e) every task accounted for")
    -- workers that never completed a task are blamed, not the tasks: both are quarantined, and then nobody is
    -- left to wait for
    H.eq(st.quarantined, 2, "(e) both hung workers quarantined")
    H.check(net.logged("failed after %d failed leases %(last: every connected worker is quarantined%)"), "(e) logged")

    -- workers with a record (each completed a task, then hangs) charge the tasks: max_attempts failed leases fail
    -- a task
    local net2 = new_net()
    local pool2 = new_pool(net2, { lease_s = 1, lease_rate = 1e9, dead_s = 1e9, max_attempts = 3,
        quarantine_after = 100 })
    local function flaky(p, m)
        if p.answered then return end
        p.answered = true
        local seq = { { prompt_len = m.prompt_len, n_gen = 2, finish = 1, stop_index = -1, n_rows = 0 } }
        p.send({ t = "samples", task_id = m.task_id, attempt = m.attempt, policy = 1, n = 1, seq = seq },
            { tokens = { 3, 4 }, logprobs = { -1, -1 }, sample_logprobs = { -1, -1 } })
        p.send({ t = "credit", n = 1 })
    end
    script_peer(net2, "a-flaky", { beat = true, credit = 10, on_task = flaky })
    script_peer(net2, "b-flaky", { beat = true, credit = 10, on_task = flaky })
    local r2 = pool2:generate({ { 1, 2 }, { 3 }, { 4 }, { 5 } }, { n = 1, max_new_tokens = 2 })
    H.eq(r2.failed, 2, "(e) two tasks answered, two failed")
    H.eq(pool2:stats().quarantined, 0, "(e) nobody quarantined (quarantine_after = 100)")
    H.check(net2.logged("failed after 3 failed leases"), "(e) a task charged 3 times fails")
end

-- ------------------------------------------------------------------------------------------------ (f) bad input

do
    local net = new_net()
    local pool = new_pool(net, {})
    pool:publish(policy)
    local g = net.endpoint("garbage")
    g.step = function() end
    local function send_raw(frames) g.transport:send(frames) end
    local function replies()
        local out = {}
        while true do
            local fr = table.remove(g.inbox, 1)
            if not fr then break end
            out[#out + 1] = codec.decode(fr) or { t = "undecodable" }
        end
        return out
    end
    send_raw({ "not msgpack at all" })
    send_raw({ "\129\161v\1" }) -- {v = 1}: a peer of protocol version 1
    send_raw({ "" })
    send_raw({ ds4.wire.encode({ t = "credit", n = 1 })[1], "an extra frame" })
    pool:service(0)
    local r = replies()
    H.eq(#r, 4, "(f) every malformed message answered")
    local codes = {}
    for i, m in ipairs(r) do codes[i] = m.t == "error" and m.code_name or m.t end
    H.check(codes[1] == "parse" or codes[1] == "not_map", "(f) garbage -> " .. tostring(codes[1]))
    H.eq(codes[2], "version", "(f) version mismatch")
    H.check(codes[3] ~= nil and codes[3] ~= "undecodable", "(f) empty frame -> " .. tostring(codes[3]))
    H.eq(codes[4], "frame", "(f) undeclared raw frame")
    H.check(r[1].reason and #r[1].reason > 0, "(f) with the decoder's message")
    -- a valid message from a worker without a session
    send_raw(ds4.wire.encode({ t = "credit", n = 1 }))
    pool:service(0)
    r = replies()
    H.eq(r[1] and r[1].code_name, "state", "(f) unknown worker -> state")
    H.check(r[1] and r[1].reason:find("unknown worker", 1, true), "(f) 'unknown worker: send hello'")
    -- an error message is never answered
    send_raw(ds4.wire.encode({ t = "error", code = 4, reason = "x" }))
    -- {v = VERSION, t = "error", code = 4, bogus = 1}: a malformed error (unknown key) is not answered either
    send_raw({ "\132\161v" .. string.char(ds4.wire.VERSION) .. "\161t\165error\164code\4\165bogus\1" })
    pool:service(0)
    H.eq(#replies(), 0, "(f) errors are not answered")
    -- 150 rejects: replies stop after 100
    for _ = 1, 150 do send_raw({ "junk" }) end
    pool:service(0)
    local n = #replies()
    H.check(n <= 101 and n >= 90, "(f) at most ~100 error replies to a flooding peer, got " .. n)
    H.check(net.logged("more than 100 rejected"), "(f) muting is logged")
    -- mismatched hellos are refused
    local bad = script_peer(net, "wrong-vocab", { vocab = VOCAB + 1 })
    pool:service(0)
    local refused = false
    for _, m in ipairs(bad.replies) do if m.t == "error" and m.code_name == "refused" then refused = true end end
    H.check(refused, "(f) a worker with another vocabulary is refused")
    H.check(net.logged("refused worker wrong%-vocab"), "(f) and the refusal is logged")
    H.eq(pool:stats().n_workers, 0, "(f) nobody joined")
    -- hash-routing tables: a worker from another random init of the same config is refused
    local other = ds4.random_model(FIX .. "/tiny_a", 99)
    local op = net.endpoint("other-tables")
    local ow = workermod.new({ model = other, id = "other-tables", transport = op.transport, clock = net.now,
        log = net.log, interrupted = function() return false end })
    op.step = function() local st = ow:step(0); if st then op.gone = true; op.status = st end end
    ow:start()
    for _ = 1, 3 do pool:service(0) end
    H.eq(op.status, 1, "(f) the worker with other tables stops with status 1")
    H.check(net.logged("hash%-routing tables %(tid2eid%) differ"), "(f) the table mismatch is logged")

    -- a worker gets garbage and an unknown worker error: it replies error / says hello again, and keeps working
    local _, w = real_worker(net, "real")
    for _ = 1, 3 do pool:service(0) end
    H.eq(w.loaded, 1, "(f) the worker loaded version 1")
    local wp = net.peers["real"]
    wp.inbox[#wp.inbox + 1] = { "garbage frame" }
    wp.inbox[#wp.inbox + 1] = ds4.wire.encode({ t = "hello", worker = "x", policy = 0, max_batch = 1, threads = 1,
        vocab_size = 1, n_params = 1, build = "" })
    local before = pool:stats().rejected
    for _ = 1, 3 do pool:service(0) end
    H.eq(w.st.rejected, 1, "(f) the worker rejected the garbage")
    H.check(pool:stats().rejected >= before, "(f) its error replies reached the pool")
    H.check(net.logged("worker real reports parse") or net.logged("worker real reports not_map"),
        "(f) the pool logged the worker's error reply")
    local hellos = w.st.hellos
    wp.inbox[#wp.inbox + 1] = ds4.wire.encode({ t = "error", code = 32, reason = "unknown worker: send hello" })
    for _ = 1, 3 do pool:service(0) end
    H.eq(w.st.hellos, hellos + 1, "(f) 'unknown worker' -> hello again")
    H.check(w.session, "(f) and the session is back")
    local res = pool:generate(PROMPTS, GEN)
    check_equal_local(res, policy, PROMPTS, GEN, "(f) after all that")
    -- a trainer bye: the worker says hello again (to a later trainer)
    wp.inbox[#wp.inbox + 1] = ds4.wire.encode({ t = "bye", reason = "test" })
    hellos = w.st.hellos
    w:step(0)
    H.eq(w.st.hellos, hellos + 1, "(f) bye -> hello")
end

-- ------------------------------------------------------------------------------------------------ (g) CRC

do
    local net = new_net()
    local pool = new_pool(net, { chunk_bytes = 256 * 1024 })
    pool:publish(policy)
    -- corrupt the published buffer after its CRC was taken: every chunk is self-consistent (its CRC is computed
    -- when served), the whole buffer is not
    local v = pool.weights[1]
    ffi.cast("uint8_t *", v.ptr)[12345] = 77 + ffi.cast("uint8_t *", v.ptr)[12345]
    local _, w = real_worker(net, "w")
    local t0 = net.clock
    while net.clock - t0 < 2 do pool:service(100) end
    H.eq(w.loaded, 0, "(g) a corrupt buffer is never loaded")
    H.eq(pool:stats().chunks_served, 2 * v.chunks, "(g) fetched twice (one restart)")
    H.check(net.logged("worker w reports crc"), "(g) then reported as a crc error")
end

-- ------------------------------------------------------------------------------------------------ (h) bad workers

local badmod = require("bad_worker")
local MANY = {}
for i = 1, 16 do MANY[i] = { 2 + i, 40 + (i * 7) % 50, 9 } end
local GEN2 = { n = 2, max_new_tokens = 6, temperature = 1.0, seed = 5 }
for _, mode in ipairs(badmod.MODES) do
    local net = new_net()
    local pool = new_pool(net, { lease_s = 2, lease_rate = 1e9, dead_s = 3 })
    local bp = net.endpoint("a-bad") -- "a" < "b": with equal credit the bad worker is picked first
    local bw = badmod.new(mode, "a-bad", bp.transport, { vocab = VOCAB, n_params = policy:n_params(),
        clock = net.now })
    bp.step = function() bw:step() end
    real_worker(net, "b-honest")
    local res = pool:generate(MANY, GEN2)
    local what = "(h) " .. mode
    check_equal_local(res, policy, MANY, GEN2, what)
    local st = pool:stats()
    H.eq(st.completed, #MANY, what .. ": every task completed")
    H.eq(st.failed, 0, what .. ": no task failed")
    H.eq(st.completed + st.failed, st.tasks, what .. ": every task accounted for once")
    local honest = true
    for _, r in ipairs(res) do if r.worker ~= "b-honest" then honest = false end end
    H.check(honest, what .. ": every result is the honest worker's")
    H.check(bw.tasks >= 1, what .. ": the bad worker was given tasks")
    if mode == "bad_ids" or mode == "nan_logprobs" or mode == "future_version" then
        H.check(st.invalid >= 1, what .. ": its answers were rejected and counted")
        H.check(net.logged("rejected samples for task"), what .. ": and logged")
    end
    -- credit_flood, silence and garbage (malformed answers name no task) leave their leases to expire
    if mode ~= "credit_flood" and mode ~= "silence" and mode ~= "garbage" then
        H.eq(st.quarantined, 1, what .. ": quarantined")
        H.check(net.logged("worker a%-bad quarantined"), what .. ": the quarantine is logged with its reason")
        -- 3 failures quarantine it; a 4th task may have been leased with the 3rd (probation: 2 at a time)
        H.check(bw.tasks <= 4, what .. ": no task after the quarantine (" .. bw.tasks .. " taken)")
    else
        H.check(bw.tasks <= 4, what .. ": at most probation leases at a time (" .. bw.tasks .. " taken)")
    end
end

-- ------------------------------------------------------------------------------------------------ (i) checks

do
    local net = new_net()
    local pool = new_pool(net, { quarantine_after = 2, quarantine_s = 50, lease_s = 1, lease_rate = 1e9,
        dead_s = 1e9 })
    pool:publish(policy)
    local eos = policy:config().eos_token_id
    local t = { sampling = { n = 1, max_new_tokens = 3, stop = { 7 }, ignore_eos = false }, prompt_len = 2 }
    local w = { caps = { vocab_size = VOCAB } }
    local function msg(gen, finish, stop_index, lp, policy_v)
        local m = { n = 1, policy = policy_v or 1, experts_layers = 0, index_layers = 0, experts_k = 0,
            index_topk = 0, seq = { { prompt_len = 2, n_gen = #gen, finish = codec.FINISH_CODE[finish],
                stop_index = stop_index or -1, n_rows = 0 } } }
        local l = {}
        for i = 1, #gen do l[i] = lp or -0.5 end
        m.tokens, m.logprobs, m.sample_logprobs = codec.pack_i32(gen), codec.pack_f32(l), codec.pack_f32(l)
        return m
    end
    local function verdict(...) return pool:check_samples(t, msg(...), w) end
    H.eq(verdict({ 3, 4, 5 }, "length"), nil, "(i) a good sample")
    H.eq(verdict({ 3, eos }, "eos"), nil, "(i) a sample ending with eos")
    H.eq(verdict({ 3, 7 }, "stop_token", 0), nil, "(i) a sample ending with its stop id")
    local function bad(why, ...)
        local v = verdict(...)
        H.check(v ~= nil and v:find(why, 1, true) ~= nil, ("(i) refused (%s): %s"):format(why, tostring(v)))
    end
    bad("is not a token id", { 3, VOCAB, 5 }, "length")
    bad("is not a token id", { -1, 4, 5 }, "length")
    bad("not finite values <= 0", { 3, 4, 5 }, "length", nil, 0 / 0)
    bad("not finite values <= 0", { 3, 4, 5 }, "length", nil, -1 / 0)
    bad("not finite values <= 0", { 3, 4, 5 }, "length", nil, 0.5)
    bad("max_new_tokens is 3", { 3, 4 }, "length")
    bad("its last token is 4", { 3, 4 }, "eos")
    bad("stop id 7 at token 1", { 7, 4, 5 }, "length")
    bad("stop id " .. eos .. " at token 2", { 3, eos, 5 }, "length")
    bad("finished by stop id #1, but its last token is 4", { 3, 4 }, "stop_token", 0)
    bad("cancelled", { 3, 4 }, "cancelled")
    bad("policy version 0", { 3, 4, 5 }, "length", nil, nil, 0)
    bad("no generated token", {}, "length")
    t.sampling.ignore_eos = true
    H.eq(verdict({ eos, eos, 5 }, "length"), nil, "(i) ignore_eos: eos may come anywhere")
    bad("the task ignores eos", { 3, eos }, "eos")
    t.sampling.ignore_eos = false
    -- stop strings (byte-level tokenizer: ids < 256 are bytes): "BC" then "C"; a sample ends at the first token that
    -- completes one, the first of them in the list
    bad("stop_string, which a task cannot end with", { 65, 66 }, "stop_string", 0)
    t.sampling.stop_strings, t.sampling.tokenizer = { "BC", "C" }, ds4.tokenizer()
    H.eq(verdict({ 65, 66, 67 }, "stop_string", 0), nil, "(i) a sample ending with its stop string")
    H.eq(verdict({ 65, 66, 68 }, "length"), nil, "(i) no stop string in the text")
    bad("completes stop string #1 first", { 65, 66, 67 }, "stop_string", 1)
    bad("stop string #2 occurs before the last token", { 67, 65, 66 }, "length")
    bad("its last token completes stop string #2", { 65, 68, 67 }, "length")
    bad("but the last token completes none", { 65, 66, 68 }, "stop_string", 0)
    t.sampling.stop_strings, t.sampling.tokenizer = nil, nil
    local m = msg({ 3, 4, 5 }, "length")
    m.experts_layers, m.experts_k = 4, 2
    H.check((pool:check_samples(t, m, w) or ""):find("not asked for", 1, true), "(i) unasked routing records")
    -- routing records: the model's shape, and values the forward's replay accepts
    local cfg = policy:config()
    local L, K, E, topk = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.index_topk
    local ncsa = 0
    for _, lt in ipairs(cfg.layer_types) do if lt == "compressed_sparse_attention" then ncsa = ncsa + 1 end end
    t.sampling.record_experts, t.sampling.record_index = true, true
    local function routed(experts, index)
        local mm = msg({ 3, 4, 5 }, "length")
        mm.seq[1].n_rows = 4
        mm.experts_layers, mm.experts_k, mm.index_layers, mm.index_topk = L, K, ncsa, topk
        mm.experts, mm.index = codec.pack_i32(experts), codec.pack_i32(index)
        return pool:check_samples(t, mm, w)
    end
    local ex, ix = {}, {}
    for r = 0, 3 do
        for l = 0, L - 1 do for k = 0, K - 1 do ex[#ex + 1] = (l + k + r) % E end end
        for c = 0, ncsa - 1 do for k = 0, topk - 1 do ix[#ix + 1] = k == 0 and (r >= 3 and 0 or -1) or -1 end end
    end
    H.eq(routed(ex, ix), nil, "(i) good routing records")
    local e2 = { unpack(ex) }
    e2[K * L + 1] = E -- row 1, layer 0, slot 0: not an expert
    H.check((routed(e2, ix) or ""):find("expert " .. E .. " is not a distinct expert", 1, true), "(i) expert out of range")
    e2 = { unpack(ex) }
    e2[2] = e2[1] -- row 0, layer 0: a repeated expert
    H.check((routed(e2, ix) or ""):find("is not a distinct expert", 1, true), "(i) repeated expert")
    local i2 = { unpack(ix) }
    i2[1] = 0 -- row 0 sees no compressed entry yet: pick 0 is not causal
    H.check((routed(ex, i2) or ""):find("is not a distinct causal entry", 1, true), "(i) a non-causal index pick")
    local mm = msg({ 3, 4, 5 }, "length")
    mm.experts_layers, mm.experts_k, mm.index_layers, mm.index_topk = L + 1, K, ncsa, topk
    H.check((pool:check_samples(t, mm, w) or ""):find("the model routes", 1, true), "(i) experts of another shape")
    t.sampling.record_experts, t.sampling.record_index = false, false

    -- quarantine is by worker id: a new hello does not lift it; it lapses after quarantine_s
    local bp = net.endpoint("q-bad")
    local bw = badmod.new("error", "q-bad", bp.transport, { vocab = VOCAB, n_params = policy:n_params(),
        clock = net.now })
    bp.step = function() bw:step() end
    local _, hw = real_worker(net, "r-honest")
    local res = pool:generate({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, { n = 1, max_new_tokens = 3, seed = 1 })
    H.eq(res.failed, 0, "(i) nothing failed")
    H.check(pool:stats().workers["q-bad"].quarantined ~= nil, "(i) q-bad quarantined after 2 errors in a row")
    bw:hello()
    for _ = 1, 3 do pool:service(0) end
    H.check(pool:stats().workers["q-bad"].quarantined ~= nil, "(i) still quarantined after a new hello")
    H.check(net.logged("q%-bad is quarantined for"), "(i) the hello is told it stays quarantined")
    local before = bw.tasks
    pool:generate({ { 7, 8 }, { 9, 10 } }, { n = 1, max_new_tokens = 3, seed = 2 })
    H.eq(bw.tasks, before, "(i) a quarantined worker gets no task")
    net.clock = net.clock + 60
    pool:service(0)
    H.eq(pool:stats().workers["q-bad"].quarantined, nil, "(i) the quarantine lapses after quarantine_s")
    H.check(net.logged("quarantine over"), "(i) and its end is logged")
    H.check(hw.st.tasks >= 5, "(i) the honest worker did the work")
end

-- ------------------------------------------------------------------------------------------------ (j) LoRA

do
    local function perturb(m, every, f)
        local a = m:lora_params()
        for i = 1, a:numel(), every do a[i] = f(a[i], i) end
        m:set_lora_params(a)
    end
    local lp = ds4.load(FIX .. "/tiny_a")
    lp:lora{ rank = 2, alpha = 4, seed = 3 }
    -- every B is 0 after lora{}: give the adapters values that change what the model generates
    perturb(lp, 1, function(x, i) return x + 0.05 * ((i * 37) % 11 - 5) end)
    local ref_lora, ref_base = local_reference(lp, PROMPTS, GEN, 1), local_reference(policy, PROMPTS, GEN, 1)
    local differs = false
    for s = 1, GEN.n do
        for j = 1, #ref_lora[s].ids do
            if ref_lora[s].logprobs[j] ~= (ref_base[s].logprobs[j] or 0) then differs = true end
        end
    end
    H.check(differs, "(j) the adapters change the policy's log-probabilities (the check below can fail)")
    local net = new_net()
    local pool = new_pool(net, { model = lp, chunk_bytes = 64 * 1024, max_staleness = 0 })
    local _, w1 = real_worker(net, "w1") -- zeroed weights and no adapters: everything comes over the wire
    local _, w2 = real_worker(net, "w2")
    local res = pool:generate(PROMPTS, GEN)
    check_equal_local(res, lp, PROMPTS, GEN, "(j) LoRA version 2")
    H.eq(res[1].policy_version, 2, "(j) the base is version 1, the adapters version 2")
    local base_b, ad_b = 4 * lp:n_params(), 4 * lp:lora_info().numel
    H.eq(pool:stats().bytes_served, 2 * (base_b + ad_b), "(j) each worker fetched the base and the adapters once")
    H.check(H.same_bytes(w1.model:params(), lp:params()) and H.same_bytes(w1.model:lora_params(), lp:lora_params()),
        "(j) a worker holds the trainer's base and adapters bitwise")
    -- a training step on the adapters: only they travel
    perturb(lp, 3, function(x) return x * 0.5 + 0.001 end)
    H.eq(pool:publish(lp), 3, "(j) changed adapters: version 3")
    H.eq(pool:publish(lp), 3, "(j) publishing them unchanged keeps the version")
    local res2 = pool:generate(PROMPTS, GEN)
    check_equal_local(res2, lp, PROMPTS, GEN, "(j) LoRA version 3")
    H.eq(pool:stats().bytes_served, 2 * (base_b + 2 * ad_b), "(j) version 3 moved the adapters' bytes only")
    H.eq(w2.loaded, 3, "(j) worker 2 holds version 3")
    -- the trainer changes the base (a merge): a plain version again; the workers drop their adapters
    lp:merge_lora()
    H.eq(pool:publish(lp), 4, "(j) the merged model: version 4")
    local res3 = pool:generate(PROMPTS, GEN)
    check_equal_local(res3, lp, PROMPTS, GEN, "(j) merged version 4")
    H.check(w1.model:lora_info() == nil and w2.model:lora_info() == nil, "(j) the workers dropped their adapters")
    H.eq(pool:stats().bytes_served, 2 * (2 * base_b + 2 * ad_b), "(j) version 4 moved the whole model")
    -- adapters again, of another rank, on the merged base: a new base version, then the adapters. Worker 1 has a
    -- task in its batcher meanwhile (its table of running tasks holds one): it fetches both and keeps them staged,
    -- its model unchanged, until the batcher is empty (a generation never mixes two versions)
    local merged = w1.model:params()
    w1.running[{}] = { task_id = -1 }
    lp:lora{ rank = 3, alpha = 3, seed = 5 }
    perturb(lp, 1, function(x, i) return x + 0.03 * ((i * 13) % 7 - 3) end)
    H.eq(pool:publish(lp), 6, "(j) adapters on the merged base: base version 5, adapters version 6")
    for _ = 1, 200 do
        if w1.staged then break end
        pool:service(0)
    end
    H.check(w1.staged and w1.staged.what == "adapters" and w1.staged_base and w1.staged_base.version == 5,
        "(j) with a task running, the new base and adapters wait staged")
    H.check(w1.loaded == 4 and w1.model:lora_info() == nil and H.same_bytes(w1.model:params(), merged),
        "(j) the running task's model is untouched: version 4, no adapters")
    w1.running = {}
    w1:step(0)
    H.check(w1.loaded == 6 and w1.staged == nil and H.same_bytes(w1.model:params(), lp:params())
        and H.same_bytes(w1.model:lora_params(), lp:lora_params()), "(j) once it ends, base and adapters go in together")
    local res4 = pool:generate(PROMPTS, GEN)
    check_equal_local(res4, lp, PROMPTS, GEN, "(j) rank-3 adapters, version 6")
    H.eq(w1.model:lora_info().rank, 3, "(j) the workers re-attached adapters of the announced layout")
    pool:close()
end

-- ------------------------------------------------------------------------------------------------ (k) async use

do
    local net = new_net()
    local pool = new_pool(net, { max_staleness = 1 })
    real_worker(net, "j-w1", { max_batch = 8, credits = 4 })
    real_worker(net, "j-w2", { max_batch = 8, credits = 4 })
    local v1 = ds4.load(FIX .. "/tiny_a")
    H.eq(pool:publish(v1), 1, "(k) version 1")
    local opts = { n = 2, max_new_tokens = 5, temperature = 1.0, seed = 31 }
    local a = pool:submit(PROMPTS, opts)
    local o2 = { n = 2, max_new_tokens = 5, temperature = 1.0, seed = 32, min_policy = 1 }
    local b = pool:submit(PROMPTS, o2)
    H.check(not pool:ready(a) and not pool:ready(b), "(k) two batches in flight")
    for _ = 1, 3 do pool:poll() end
    -- a new version while both are in flight: tasks not yet sent go out asking for version 1 or newer
    local v2 = ds4.load(FIX .. "/tiny_a")
    local q = v2:params()
    ffi.cast("float *", q:data_ptr())[3] = 0.5
    v2:set_params(q)
    H.eq(pool:publish(v2), 2, "(k) version 2 published mid-flight")
    local versions = { v1, v2 }
    local rb = pool:collect(b) -- out of order
    local ra = pool:collect(a)
    for _, c in ipairs({ { ra, opts, "a" }, { rb, o2, "b" } }) do
        local res, o, name = c[1], c[2], c[3]
        local ok, seen = #res == #PROMPTS * 2, {}
        for p = 1, #PROMPTS do
            local r1 = res[(p - 1) * 2 + 1]
            seen[r1.policy_version] = true
            local ref = local_reference(versions[r1.policy_version], PROMPTS, { n = 2, max_new_tokens = 5,
                temperature = 1.0, seed = o.seed }, p)
            for s = 1, 2 do
                local r, e = res[(p - 1) * 2 + s], ref[s]
                ok = ok and #r.ids == #e.ids and r.finish_reason == e.finish_reason
                for j = 1, #e.ids do ok = ok and r.ids[j] == e.ids[j] and r.logprobs[j] == e.logprobs[j] end
            end
        end
        H.check(ok, "(k) batch " .. name .. ": every result equals model:generate at the version it reports")
    end
    H.eq(pool:stats().completed, 2 * #PROMPTS, "(k) every task of both batches completed once")
    H.eq(next(pool.tasks), nil, "(k) nothing left after both are collected")
    H.raises(function() pool:collect(a) end, { "collected already" }, "(k) a batch is collected once")
    H.raises(function() pool:submit(PROMPTS, { n = 1, min_policy = 3 }) end, { "min_policy", "[1, 2]" },
        "(k) min_policy above the current version")
    H.raises(function() pool:submit(PROMPTS, { n = 1, min_policy = 0 }) end, { "min_policy" }, "(k) min_policy 0")
end

-- min_policy is a hard bound: a sample of an older version is re-issued even where max_staleness and
-- accept_with_version would keep it
do
    local net = new_net()
    local pool = new_pool(net, { max_staleness = 5, stale = "accept_with_version", lease_s = 5, dead_s = 1e9 })
    publish_versions(pool, 3)
    local asked = {}
    stale_once_peer(net, "j-stale", 2, asked)
    local res = pool:collect(pool:submit({ { 1, 2 } }, { n = 2, max_new_tokens = 2, min_policy = 3 }))
    H.eq(asked[1], 3, "(k) the task asks for min_policy")
    H.eq(pool:stats().stale_requeued, 1, "(k) the version-2 answer was re-issued")
    H.eq(pool:stats().stale_accepted, 0, "(k) not accepted")
    H.eq(res[1].policy_version, 3, "(k) the result is of version 3")
    -- without min_policy the same pool keeps a version-2 answer (max_staleness 5)
    local r2 = pool:generate({ { 3, 4 } }, { n = 2, max_new_tokens = 2 })
    H.eq(r2[1].policy_version, 2, "(k) without min_policy, max_staleness applies")
end

-- a cancelled batch: its late answer is a duplicate, its queued tasks are never sent
do
    local net = new_net()
    local pool = new_pool(net, { lease_s = 5, dead_s = 1e9 })
    pool:publish(policy)
    local held = {}
    local answer = false
    local peer = script_peer(net, "j-slow", { beat = true, credit = 1, on_task = function(pp, m)
        held[#held + 1] = m
        if answer then
            pp.send(fake_samples(m, 1))
            pp.send({ t = "credit", n = 1 })
        end
    end })
    local b = pool:submit({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, { n = 1, max_new_tokens = 2 })
    for _ = 1, 5 do pool:poll() end
    H.eq(#held, 1, "(k) one task leased (credit 1)")
    pool:cancel(b)
    peer.send(fake_samples(held[1], 1))
    peer.send({ t = "credit", n = 2 })
    for _ = 1, 5 do pool:poll() end
    H.eq(pool:stats().duplicates, 1, "(k) the cancelled batch's late answer is dropped as a duplicate")
    H.eq(#held, 1, "(k) the cancelled batch's queued tasks were never sent")
    answer = true
    local res = pool:generate({ { 7, 8 } }, { n = 1, max_new_tokens = 2 })
    H.eq(#res, 1, "(k) the pool goes on after a cancel")
    H.eq(#held, 2, "(k) with the new batch's task only")
end

-- opts.first: a batch needed now goes out before the queued tasks of batches submitted earlier (the RL trainer's
-- extra batch of the step it trains, while the steps ahead wait)
do
    local net = new_net()
    local pool = new_pool(net, { lease_s = 5, dead_s = 1e9 })
    pool:publish(policy)
    local order, go = {}, false
    local peer = script_peer(net, "k-order", { beat = true, credit = 1, on_task = function(pp, m)
        order[#order + 1] = m.prompt_len
        if go then
            pp.send(fake_samples(m, 1))
            pp.send({ t = "credit", n = 1 })
        else
            pp.held = m
        end
    end })
    local a = pool:submit({ { 1 }, { 2, 2 }, { 3, 3, 3 } }, { n = 1, max_new_tokens = 2 })
    for _ = 1, 5 do pool:poll() end
    H.same(order, { 1 }, "(k) first: batch a's first task leased (credit 1)")
    local b = pool:submit({ { 4, 4, 4, 4 }, { 5, 5, 5, 5, 5 } }, { n = 1, max_new_tokens = 2, first = true })
    go = true
    peer.send(fake_samples(peer.held, 1))
    peer.send({ t = "credit", n = 1 })
    local rb = pool:collect(b)
    local ra = pool:collect(a)
    H.same(order, { 1, 4, 5, 2, 3 }, "(k) first: batch b's tasks went out before batch a's queued ones, in order")
    H.eq(#rb + #ra, 5, "(k) first: both batches complete")
    H.raises(function() pool:submit({ { 1 } }, { n = 1, first = 1 }) end, { "opts.first must be a boolean" },
        "(k) first must be a boolean")
end

-- ------------------------------------------------------------------------------------------------ (l) streaming

do
    local net = new_net()
    local streamed = {} -- prompt -> sample -> ids seen through on_partial, in order
    local pool = new_pool(net, { on_partial = function(p, parts, worker, attempt)
        streamed[p] = streamed[p] or {}
        for s, part in ipairs(parts) do
            local seen = streamed[p][s] or {}
            streamed[p][s] = seen
            H.eq(part.offset, #seen, "(l) a partial continues where the last one ended")
            for j = 1, #part.ids do seen[#seen + 1] = part.ids[j] end
        end
    end })
    real_worker(net, "l-w1", { max_batch = 8, credits = 4 })
    pool:publish(policy)
    local opts = { n = 2, max_new_tokens = 12, temperature = 1.0, seed = 41, ignore_eos = true, stream = 3 }
    local b = pool:submit(PROMPTS, opts)
    local mid
    for _ = 1, 200 do
        pool:poll()
        local pr = pool:progress(b)
        for _, r in ipairs(pr) do
            if r.partial and #r.ids > 0 and #r.ids < 12 then mid = mid or r end
        end
        if pool:ready(b) then break end
    end
    H.check(mid ~= nil, "(l) progress shows a running task's streamed tokens")
    local res = pool:collect(b)
    local o = {}
    for k, v in pairs(opts) do if k ~= "stream" then o[k] = v end end
    check_equal_local(res, policy, PROMPTS, o, "(l) streamed tasks' final results")
    local prefix_ok, n_streamed = true, 0
    for p = 1, #PROMPTS do
        for s = 1, 2 do
            local seen = streamed[p] and streamed[p][s] or {}
            local r = res[(p - 1) * 2 + s]
            n_streamed = n_streamed + #seen
            for j = 1, #seen do prefix_ok = prefix_ok and seen[j] == r.ids[j] end
        end
    end
    H.check(prefix_ok, "(l) what was streamed begins the final result")
    H.check(n_streamed >= #PROMPTS * 2 * 9, ("(l) every 3 tokens streamed (%d tokens)"):format(n_streamed))
    local st = pool:stats()
    H.check(st.partials > 0 and st.partial_tokens == n_streamed, "(l) stats count partials and their tokens")
    H.eq(st.invalid, 0, "(l) no partial rejected")
    -- a partial that does not continue what was streamed is rejected, and the final answer still decides
    local bad_sent = false
    local net2 = new_net()
    local pool2 = new_pool(net2, { lease_s = 5, dead_s = 1e9 })
    pool2:publish(policy)
    script_peer(net2, "l-bad", { beat = true, on_task = function(pp, m)
        H.eq(m.stream, 2, "(l) the task carries stream")
        pp.send({ t = "partial", task_id = m.task_id, attempt = m.attempt, policy = 1,
            seq = { { offset = 1, n_gen = 1 } } }, { tokens = { 3 }, logprobs = { -1 }, sample_logprobs = { -1 } })
        pp.send({ t = "partial", task_id = m.task_id, attempt = m.attempt, policy = 1,
            seq = { { offset = 0, n_gen = 1 } } }, { tokens = { m.seed % 97 }, logprobs = { -1 },
            sample_logprobs = { -1 } })
        pp.send(fake_samples(m, 1))
        bad_sent = true
    end })
    local r2 = pool2:generate({ { 1, 2 } }, { n = 1, max_new_tokens = 2, stream = 2 })
    H.check(bad_sent and r2[1].finish_reason == "length", "(l) the task completed")
    H.eq(pool2:stats().invalid, 1, "(l) the out-of-order partial was rejected")
    H.check(net2.logged("rejected a partial result .* continues at token 2, 0 were streamed"), "(l) and logged")
    H.eq(pool2:stats().partials, 1, "(l) the in-order one was taken")
    H.raises(function() pool2:submit({ { 1 } }, { stream = -1 }) end, { "stream" }, "(l) stream must be >= 0")
    -- protocol 6: partial messages with per-token versions; a sequence never goes back to older weights, also
    -- across messages: version 2, then a token of version 1 after it, is rejected
    local net3 = new_net()
    local seen3 = {}
    local pool3 = new_pool(net3, { lease_s = 5, dead_s = 1e9, on_partial = function(_, parts)
        seen3[#seen3 + 1] = parts[1]
    end })
    pool3:publish(policy)
    local v2 = ds4.load(FIX .. "/tiny_a")
    local q = v2:params()
    ffi.cast("float *", q:data_ptr())[0] = 0.5
    v2:set_params(q)
    H.eq(pool3:publish(v2), 2, "(l) version 2 published")
    script_peer(net3, "l-ver", { beat = true, on_task = function(pp, m)
        pp.send({ t = "partial", task_id = m.task_id, attempt = m.attempt, policy = 2, token_versions = true,
            seq = { { offset = 0, n_gen = 2 } } }, { tokens = { 3, 4 }, logprobs = { -1, -1 },
            sample_logprobs = { -1, -1 }, policy_lag = { 1, 0 } })
        pp.send({ t = "partial", task_id = m.task_id, attempt = m.attempt, policy = 2, token_versions = true,
            seq = { { offset = 2, n_gen = 1 } } }, { tokens = { 5 }, logprobs = { -1 }, sample_logprobs = { -1 },
            policy_lag = { 1 } })
        -- the answer: what was streamed first, each token's version (1, 2, 2)
        pp.send({ t = "samples", task_id = m.task_id, attempt = m.attempt, policy = 2, n = 1, token_versions = true,
            seq = { { prompt_len = m.prompt_len, n_gen = 3, finish = 1, stop_index = -1, n_rows = 0 } } },
            { tokens = { 3, 4, 5 }, logprobs = { -1, -1, -1 }, sample_logprobs = { -1, -1, -1 },
                policy_lag = { 1, 0, 0 } })
    end })
    local r3 = pool3:generate({ { 1, 2 } }, { n = 1, max_new_tokens = 3, stream = 1 })
    H.check(r3[1].token_versions and r3[1].token_versions[3] == 2, "(l) the answer with its versions")
    H.eq(#seen3, 1, "(l) one versioned partial taken")
    H.check(seen3[1] and seen3[1].versions and seen3[1].versions[1] == 1 and seen3[1].versions[2] == 2,
        "(l) its tokens' versions 1, 2")
    H.eq(pool3:stats().invalid, 1, "(l) a token of version 1 after one of version 2 is rejected")
    H.check(net3.logged("rejected a partial result .* version 1 after a streamed token of version 2"), "(l) and logged")
end

-- ------------------------------------------------------------------------------------------------ (m) partial rollouts

-- A worker with partial_rollouts takes version 2 while its sequences run: each answer says which tokens are of which
-- version, the tokens before the switch are model:generate's at version 1 (bitwise), those after are of version 2,
-- and the result's policy_version is the oldest (1). Without the option, the same schedule gives version-1 answers.
local function partial_run(partial)
    local net = new_net()
    local pool = new_pool(net, { max_staleness = 1 })
    local _, w = real_worker(net, "m-w", { max_batch = 16, credits = 8, partial_rollouts = partial })
    local v1 = ds4.load(FIX .. "/tiny_a")
    pool:publish(v1)
    local opts = { n = 2, max_new_tokens = 16, temperature = 1.0, seed = 51, ignore_eos = true }
    local b = pool:submit(PROMPTS, opts)
    -- until the worker has admitted tasks and generated a few tokens under version 1
    for _ = 1, 400 do
        pool:poll()
        if w:active() > 0 and w.bt:stats().decode_tokens >= 4 * w:active() then break end
    end
    local v2 = ds4.load(FIX .. "/tiny_a")
    local q = v2:params()
    local ptr = ffi.cast("float *", q:data_ptr())
    for i = 0, q:numel() - 1, 3 do ptr[i] = ptr[i] * 0.7 end
    v2:set_params(q)
    H.eq(pool:publish(v2), 2, "(m) version 2 published while tasks run")
    return pool:collect(b), { v1, v2 }, opts, pool
end

do
    local res, versions, opts, pool = partial_run(true)
    local mixed, prefix_ok, after_ok, oldest_ok = 0, true, true, true
    for p = 1, #PROMPTS do
        local ref1 = local_reference(versions[1], PROMPTS, opts, p)
        for s = 1, 2 do
            local r = res[(p - 1) * 2 + s]
            -- a task admitted after the switch, or finished before it, is of one version
            local tv = r.token_versions
            if not tv then
                tv = {}
                for j = 1, #r.ids do tv[j] = r.policy_version end
                if r.policy_version == 2 then
                    local ref2 = local_reference(versions[2], PROMPTS, opts, p)
                    for j = 1, #r.ids do after_ok = after_ok and r.ids[j] == ref2[s].ids[j] end
                end
            end
            H.eq(#tv, #r.ids, "(m) every token has a version")
            local first2
            for j = 1, #(tv or {}) do
                if tv[j] == 2 and not first2 then first2 = j end
                if first2 and tv[j] ~= 2 then after_ok = false end
            end
            if first2 and first2 > 1 then mixed = mixed + 1 end
            local cut = first2 and first2 - 1 or #r.ids
            for j = 1, cut do
                prefix_ok = prefix_ok and r.ids[j] == ref1[s].ids[j] and r.logprobs[j] == ref1[s].logprobs[j]
            end
            oldest_ok = oldest_ok and r.policy_version == tv[1]
        end
    end
    H.check(mixed > 0, ("(m) sequences went on under version 2 (%d of %d)"):format(mixed, #res))
    H.check(prefix_ok, "(m) tokens before the switch are model:generate's at version 1, bitwise")
    H.check(after_ok, "(m) versions never go back along a sequence; a task all of version 2 is model:generate's")
    H.check(oldest_ok, "(m) policy_version is the oldest token's version")
    H.check(pool:stats().mixed_versions > 0, "(m) stats count answers with mixed versions")
    -- the checks of per-token versions in an answer
    local t = { sampling = { n = 1, max_new_tokens = 3, stop = {}, ignore_eos = true }, prompt_len = 2, min_policy = 2 }
    local m = { n = 1, policy = 3, token_versions = true, seq = { { n_gen = 3 } } }
    local function tv(lags)
        m.policy_lag = codec.pack_i32(lags)
        return poolmod.check_token_versions(m, t)
    end
    local v, oldest = tv({ 1, 0, 0 })
    H.check(v and oldest == 2 and v[1][1] == 2 and v[1][3] == 3, "(m) versions 2, 3, 3")
    local _, _, why = tv({ 0, 1, 1 })
    H.check(why and why:find("never goes back", 1, true), "(m) a sequence going back to older weights is refused")
    _, _, why = tv({ 2, 0, 0 })
    H.check(why and why:find("older than the task's bound 2", 1, true), "(m) a token below the task's bound")
end

do
    local res, versions, opts = partial_run(false)
    local plain, v1 = true, 0
    for p = 1, #PROMPTS do
        for s = 1, 2 do
            local r = res[(p - 1) * 2 + s]
            local ref = local_reference(versions[r.policy_version], PROMPTS, opts, p)[s]
            plain = plain and r.token_versions == nil and #r.ids == #ref.ids
            for j = 1, #ref.ids do plain = plain and r.ids[j] == ref.ids[j] end
            if r.policy_version == 1 then v1 = v1 + 1 end
        end
    end
    H.check(plain and v1 > 0, ("(m) without partial rollouts the running tasks finish under version 1 (%d results), "
        .. "each result model:generate's at its one version"):format(v1))
end

-- ------------------------------------------------------------------------------------------------ (n) kv_qat refused
do -- workers would decode without the FP8 KV quantisation-aware option: the pool refuses to publish such a model
    local m = ds4.load(FIX .. "/tiny_a")
    m:set_kv_qat(true)
    local pool = new_pool(new_net(), { model = false })
    local ok, err = pcall(pool.publish, pool, m)
    H.check(not ok and tostring(err):find("quantisation-aware", 1, true),
        "(n) publishing a model with kv_qat on is refused: " .. tostring(err))
    m:set_kv_qat(false)
    H.eq(pool:publish(m), 1, "(n) with the option off it publishes")
end

H.done("test_rollout_pool")
