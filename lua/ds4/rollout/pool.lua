--[==[ ds4.rollout.pool — the trainer's side of the rollout protocol (rollout/protocol.md): remote workers behind the
  same :generate a model has, so that ds4.rl.trainer's rollout.source = pool works unchanged.

  local pool = ds4.rollout.pool{
      bind = "tcp://127.0.0.1:5555",   -- the ROUTER endpoint ("tcp://127.0.0.1:*": any free port; pool.endpoint)
      model = policy,                  -- the policy: checks a worker's hello (vocab, n_params, tables) and is what
                                       -- the first generate publishes when nothing has been published yet
      curve = {secret = KEY, public = KEY, allow = {KEY, ...}},  -- CURVE server keys and the workers' public keys
                                       -- (each a Z85 string or a `ds4 keygen` file); required for tcp:// unless
      insecure = false,                -- true: plain TCP, unauthenticated and unencrypted (warns on stderr)
      workers = 0,                     -- the first generate waits (up to wait_s) for this many workers; 0: none
      max_staleness = 1,               -- S: samples of a policy older than current - S are never trained on ...
      stale = "requeue",               -- ... they are re-issued ("requeue") or kept with their version
                                       -- ("accept_with_version": results carry policy_version)
      lease_s = 60, lease_rate = 1000, -- lease deadline: lease_s + n · max_new_tokens / lease_rate seconds
      dead_s = 10,                     -- a worker silent this long is dead: its leases are re-issued
      heartbeat_s = 1, max_attempts = 3, chunk_bytes = 16 MiB, wait_s = 60, timeout_s = nil (generate: no limit),
      max_credit = 16,                 -- leases a worker may hold at once (its credit above this is ignored) ...
      probation = 2,                   -- ... and until it has completed a task, this many
      quarantine_after = 3, quarantine_s = 300,   -- failed leases in a row that quarantine a worker, and for how long
      log = function(level, msg) ... end, verbose = false, quiet = false,
      on_result = function(prompt_index, results, worker) ... end,   -- called as each task completes
      on_partial = function(prompt_index, parts, worker, attempt) ... end, -- a running task's newest tokens (a
                                       -- submit with opts.stream = N): parts[s] = {offset, ids, logprobs, policy,
                                       -- versions}, sample s's tokens offset + 1 .. offset + #ids (versions: each
                                       -- one's policy version, when the task went on under newer weights, protocol 6;
                                       -- nil: all of version `policy`); a new attempt starts again from 0
  }
  pool:generate(prompts, opts)   -- model:generate's interface and results (prompt-major, opts.n per prompt)
  local b = pool:submit(prompts, opts)   -- the same, without waiting: a batch in flight (several may be); opts may
                                 -- add min_policy = V: every sample of the batch is of version V or newer, and
                                 -- first = true: its tasks go out before those already queued (a batch needed now
                                 -- while batches for later wait)
  pool:poll()                    -- serve without waiting (dispatch, results, heartbeats, weight chunks); a trainer
                                 -- calls it between pieces of its own computation
  pool:ready(b)  pool:collect(b) -- done yet?; wait for b (serving meanwhile) -> generate's results
  pool:cancel(b)                 -- give b up (its late answers are dropped as duplicates)
  pool:progress(b)               -- what has arrived so far, generate's layout: a completed task's results, else the
                                 -- tokens streamed by its current lease (opts.stream = N: a partial message every N
                                 -- new tokens, protocol 5), each {ids, logprobs, partial = true, token_versions
                                 -- once a streamed token was of newer weights}
  pool:publish(model)            -- a new policy version from the model's parameters (no-op when unchanged); a model
                                 -- with LoRA adapters: the adapters only, over its frozen weights sent once
  pool:stats()  pool:close()  pool.endpoint  pool.version

  Sampling. One task per prompt carries all opts.n samples and its own seed, pool.task_seed(opts.seed, p): result
  (p, s) equals model:generate({prompts[p]}, opts with seed = pool.task_seed(opts.seed, p)) [s] at the policy
  version the result reports (res[i].policy_version), whichever worker made it and however often it was re-issued.
  Each result also has task, attempt and worker; a task that failed max_attempts times (its leases expired, its
  workers died, or they reported errors) yields n results with ids = {} and finish_reason "failed" (res.failed
  counts them). opts.stop holds token ids and stop strings (protocol v3: at most 64 ids and 16 strings of 1..64
  bytes); the workers decode their output with the model's tokenizer (sent to them with the weights), so strings
  need a model with a tokenizer, and a result equals model:generate with opts.tokenizer = model:tokenizer(). on_token
  is refused (samples arrive per task: cfg.on_result reports progress; opts.stream = N has the workers stream each
  task's tokens every N of them, cfg.on_partial and pool:progress show them, the final results unchanged);
  max_batch, prefill_chunk and tokenizer are accepted and not used (each worker has its own --max-batch;
  opts.tokenizer, when given, must be the model's).

  Partial rollouts (protocol 5). A worker started with --partial-rollouts continues its running sequences under
  new weights instead of finishing them under the old ones; its answer then gives every token's version. A result
  of such an answer has token_versions (one per token) and policy_version = the oldest of them, which is what the
  staleness bounds (max_staleness, min_policy) and the RL trainer's lag metrics use; the answer is checked (each
  sample's versions never decrease, the oldest is at least the task's bound).

  A worker's answer is trusted only after it is checked (Pool:check_samples): every token id in [0, vocab), every
  log-probability finite and <= 0, each sample ending the way its finish reason says (max_new_tokens reached, the
  EOS, the named stop id or a new match of the named stop string last, none of them earlier), a policy version the trainer published, routing records
  only when asked for and shaped and valued as the model's forward accepts them. A bad answer is rejected (error
  reply, logged, counted in stats().invalid) and its task re-issued. A task never goes back to a worker that
  failed it (an error reply, a rejected answer, an expired lease, a new hello or death while holding it) while a
  live worker that has not failed it exists: the task waits for that worker's credit. quarantine_after failed
  leases in a row quarantine a worker (by id, through new hellos) for quarantine_s: it gets no task, its leases are
  re-issued, and the reason is logged (stats().quarantined, stats().workers[id].quarantined). A worker holds at most
  max_credit leases, and probation until its first completed task, so a worker that grants credit and never answers
  delays a few tasks by a lease, not a whole batch.

  Testing: cfg.transport = {recv = function(self, timeout_ms) -> peer, frames | nil, send = function(self, peer,
  frames) -> true | nil, err, close = function(self)} replaces the socket and cfg.clock = function() -> seconds
  replaces the monotonic clock (tests/lua/test_rollout_pool.lua drives the whole state machine that way).
]==]

local ffi = require("ffi")
local ds4 = require("ds4")
local codec = require("ds4.rollout.codec")

local M = {}
local Pool = {}
Pool.__index = Pool

local MAX_CREDIT = 1024
local MAX_CHUNK = 16 * 1024 * 1024
local TWO53 = 9007199254740992

-- ------------------------------------------------------------------------------------------------ helpers

local function printable(id)
    return (id:gsub("[^\33-\126]", function(c) return ("\\x%02x"):format(c:byte()) end))
end

-- The per-task seed of prompt p (1-based) of a generate call with seed `seed`: a counter-based hash (the engine's
-- own uniform draw), so prompts of one call and calls with nearby seeds do not share sampling streams.
function M.task_seed(seed, p)
    return math.floor(ds4.sample_uniform(seed or 0, 4503599627370496 + p, 0) * TWO53)
end

local GEN_KEYS = { max_new_tokens = true, temperature = true, top_k = true, top_p = true, min_p = true, n = true,
    seed = true, stop = true, tokenizer = true, ignore_eos = true, record_experts = true, record_index = true,
    max_batch = true, prefill_chunk = true, on_token = true, stream = true }

-- d: how many more stack levels lie between the user's call and check_gen_opts's caller (error positions)
local function check_gen_opts(opts, d)
    for k in pairs(opts) do
        if not GEN_KEYS[k] then
            error("pool:generate: unknown option '" .. tostring(k) .. "' (known: model:generate's options)", 3 + d)
        end
    end
    local function int(k, def, lo, hi)
        local v = opts[k]
        if v == nil then return def end
        if type(v) ~= "number" or v ~= math.floor(v) or v < lo or v > hi then
            error(("pool:generate: opts.%s must be an integer in [%s, %s], got %s"):format(k, lo, hi, tostring(v)), 4 + d)
        end
        return v
    end
    local function num(k, def, lo, hi)
        local v = opts[k]
        if v == nil then return def end
        if type(v) ~= "number" or not (v >= lo and v <= hi) then
            error(("pool:generate: opts.%s must be a number in [%s, %s], got %s"):format(k, lo, hi, tostring(v)), 4 + d)
        end
        return v
    end
    if opts.on_token ~= nil then
        error("pool:generate: on_token is not supported by remote workers (a task's samples arrive whole; use "
            .. "cfg.on_result for progress)", 3 + d)
    end
    local s = {
        max_new_tokens = int("max_new_tokens", 64, 1, 2 ^ 20),
        temperature = num("temperature", 1.0, 0, 1000),
        top_k = int("top_k", 0, 0, 2 ^ 31 - 1),
        top_p = num("top_p", 1.0, 0, 1),
        min_p = num("min_p", 0.0, 0, 1),
        n = int("n", 1, 1, 64),
        seed = int("seed", 0, 0, TWO53),
        ignore_eos = opts.ignore_eos and true or false,
        record_experts = opts.record_experts and true or false,
        record_index = opts.record_index and true or false,
        stream = int("stream", 0, 0, 2 ^ 20),
        stop = {},
        stop_strings = {},
    }
    if s.n * s.max_new_tokens > 2 ^ 20 then
        error(("pool:generate: n · max_new_tokens = %d exceeds the protocol's 2^20 tokens per task"):format(
            s.n * s.max_new_tokens), 3 + d)
    end
    for i, v in ipairs(opts.stop or {}) do
        if type(v) == "string" then
            if #v < 1 or #v > 64 or v:find("\0", 1, true) then
                error(("pool:generate: opts.stop[%d]: a stop string of 1..64 bytes without NUL, got %d bytes"):format(i,
                    #v), 3 + d)
            end
            s.stop_strings[#s.stop_strings + 1] = v
        elseif type(v) ~= "number" or v ~= math.floor(v) or v < 0 or v > 2 ^ 31 - 1 then
            error(("pool:generate: opts.stop[%d] must be a token id or a stop string, got %s"):format(i, tostring(v)), 3 + d)
        else
            s.stop[#s.stop + 1] = v
        end
    end
    if #s.stop > 64 then error("pool:generate: at most 64 stop ids", 3 + d) end
    if #s.stop_strings > 16 then error("pool:generate: at most 16 stop strings", 3 + d) end
    return s
end

-- ------------------------------------------------------------------------------------------------ transport

local function zmq_transport(cfg, log)
    local zmq = ds4.zmq or error("ds4.rollout.pool: this ds4 was built without ZeroMQ (ds4.zmq)", 3)
    local ep = cfg.bind or error("ds4.rollout.pool: cfg.bind (an endpoint) is required", 3)
    local t = { zap = nil }
    local secret, public
    if cfg.curve then
        secret = codec.read_key(cfg.curve.secret, "ds4.rollout.pool: curve.secret")
        public = codec.read_key(cfg.curve.public, "ds4.rollout.pool: curve.public")
        local allow = {}
        for i, k in ipairs(cfg.curve.allow or {}) do allow[i] = codec.read_key(k, "ds4.rollout.pool: curve.allow") end
        if #allow == 0 then log("warn", "curve.allow is empty: every worker will be refused") end
        t.zap = zmq.zap{ allow = allow } -- before the CURVE server binds, or early handshakes go unauthenticated
    elseif codec.needs_curve(ep) then
        if not cfg.insecure then
            error("ds4.rollout.pool: " .. ep .. " is plain TCP: give curve = {secret = ..., public = ..., allow = "
                .. "{worker public keys}} (keys from `ds4 keygen --out PREFIX`), or insecure = true to accept "
                .. "unauthenticated, unencrypted workers", 3)
        end
        io.stderr:write("ds4 pool: WARNING: " .. ep .. " is plain TCP without CURVE (insecure = true): anyone who "
            .. "can reach it can connect, and weights and samples travel unencrypted\n")
    end
    local s = zmq.socket("ROUTER")
    t.sock = s
    s:set{ linger = 0, sndhwm = 1000, rcvhwm = 1000, router_mandatory = true, heartbeat_ivl = 1000,
        heartbeat_timeout = 10000, maxmsgsize = 2 ^ 30 }
    pcall(s.set, s, { router_handover = true }) -- protocol.md §6; not every binding build knows the option
    if secret then s:set{ curve_server = true, curve_secretkey = secret, curve_publickey = public } end
    t.endpoint = s:bind(ep)
    function t:recv(timeout_ms)
        local fr = self.sock:recv(timeout_ms)
        if not fr then return nil end
        local peer = table.remove(fr, 1)
        return peer, fr
    end
    function t:send(peer, frames)
        local fr = { peer }
        for i = 1, #frames do fr[i + 1] = frames[i] end
        return self.sock:send(fr)
    end
    function t:close()
        if self.sock then self.sock:close(); self.sock = nil end
        self.zap = nil
    end
    function t:refused()
        if not self.zap then return nil end
        return self.zap:stats()
    end
    return t
end

-- ------------------------------------------------------------------------------------------------ construction

function M.new(cfg)
    if type(cfg) ~= "table" then error("ds4.rollout.pool: a config table expected", 2) end
    local known = { bind = 1, model = 1, curve = 1, insecure = 1, workers = 1, max_staleness = 1, stale = 1,
        lease_s = 1, lease_rate = 1, dead_s = 1, heartbeat_s = 1, max_attempts = 1, chunk_bytes = 1, wait_s = 1,
        timeout_s = 1, log = 1, verbose = 1, transport = 1, clock = 1, quiet = 1, on_result = 1, on_partial = 1,
        max_credit = 1,
        probation = 1, quarantine_after = 1, quarantine_s = 1 }
    for k in pairs(cfg) do
        if not known[k] then error("ds4.rollout.pool: unknown option '" .. tostring(k) .. "'", 2) end
    end
    local self = setmetatable({}, Pool)
    self.cfg = cfg
    self.now = cfg.clock or codec.now
    self.verbose = cfg.verbose
    self.logf = cfg.log or function(level, msg)
        if level == "debug" and not self.verbose then return end
        if level == "info" and cfg.quiet then return end
        io.stderr:write(("ds4 pool: %s%s\n"):format(level == "warn" and "warning: " or "", msg))
    end
    self.S = cfg.max_staleness or 1
    self.stale_mode = cfg.stale or "requeue"
    if self.stale_mode ~= "requeue" and self.stale_mode ~= "accept_with_version" then
        error("ds4.rollout.pool: stale must be \"requeue\" or \"accept_with_version\"", 2)
    end
    self.lease_s = cfg.lease_s or 60
    self.lease_rate = cfg.lease_rate or 1000
    self.dead_s = cfg.dead_s or 10
    self.heartbeat_s = cfg.heartbeat_s or 1
    self.max_attempts = cfg.max_attempts or 3
    local function count(k, def, lo, hi)
        local v = cfg[k] == nil and def or cfg[k]
        if type(v) ~= "number" or v ~= math.floor(v) or v < lo or v > hi then
            error(("ds4.rollout.pool: %s must be an integer in [%d, %d], got %s"):format(k, lo, hi, tostring(v)), 3)
        end
        return v
    end
    self.max_credit = count("max_credit", 16, 1, MAX_CREDIT)
    self.probation = count("probation", 2, 1, MAX_CREDIT)
    self.quarantine_after = count("quarantine_after", 3, 1, 2 ^ 31)
    self.quarantine_s = cfg.quarantine_s or 300
    if type(self.quarantine_s) ~= "number" or not (self.quarantine_s >= 0) then
        error("ds4.rollout.pool: quarantine_s must be a number of seconds >= 0", 2)
    end
    self.chunk_bytes = cfg.chunk_bytes or MAX_CHUNK
    if self.chunk_bytes % 4 ~= 0 or self.chunk_bytes < 4 or self.chunk_bytes > MAX_CHUNK then
        error("ds4.rollout.pool: chunk_bytes must be a multiple of 4 in [4, 16 MiB]", 2)
    end
    self.expect = cfg.workers or 0
    self.model = cfg.model
    if self.model then
        local c = self.model:config()
        self.vocab, self.n_params = c.vocab_size, self.model:n_params()
        self.tables = self.model.tables_crc and self.model:tables_crc() or nil
        local cj = self.model.config_json and self.model:config_json()
        self.config_crc = cj and codec.crc32(cj, #cj) or nil
        self.eos = c.eos_token_id and c.eos_token_id >= 0 and c.eos_token_id or nil
        -- what routing records must look like (the model's forward refuses anything else: tests/test_replay.c)
        local ncsa = 0
        for _, lt in ipairs(c.layer_types or {}) do if lt == "compressed_sparse_attention" then ncsa = ncsa + 1 end end
        self.routing = { layers = c.num_hidden_layers, k = c.num_experts_per_tok, experts = c.n_routed_experts,
            ncsa = ncsa, topk = c.index_topk, rate = (c.compress_rates or {}).compressed_sparse_attention }
    end
    self.transport = cfg.transport or zmq_transport(cfg, function(l, m) self.logf(l, m) end)
    self.endpoint = self.transport.endpoint or cfg.bind
    self.workers = {}     -- id -> session
    self.tasks = {}       -- id -> task of a batch not yet collected (several batches may be in flight)
    self.queue = {}       -- task ids waiting for a lease, in order
    self.done_ids = {}    -- completed, failed or collected ids at or above low_water (the lowest live task id)
    -- ids increase within a run and start from the wall clock, so that a late answer meant for a previous
    -- trainer process on the same endpoint can never be taken for one of this run's tasks
    self.next_id = math.floor(os.time() % 2 ^ 31) * 2 ^ 21
    self.low_water = self.next_id
    self.version = 0
    self.weights = {}     -- version -> {version, tensor, ptr, bytes, chunk, chunks, crc, chunk_crc}
    self.rejects = {}     -- peer -> {t0, n, muted, log_t0, log_n, suppressed}
    self.health = {}      -- worker id -> {streak, failures, completed, quarantined = {reason, since, till} | nil}
    self.zap_refused = 0
    self.st = { tasks = 0, completed = 0, failed = 0, reissued = 0, duplicates = 0, stale_requeued = 0,
        stale_accepted = 0, rejected = 0, refused = 0, invalid = 0, quarantined = 0, publishes = 0, partials = 0,
        partial_tokens = 0, mixed_versions = 0,
        publish_seconds = 0, bytes_served = 0,
        chunks_served = 0, samples = 0, tokens = 0, generate_seconds = 0, dead = 0, hellos = 0, syncs = {} }
    self.last_service = self.now()
    self.logf("info", ("listening on %s (%s)"):format(tostring(self.endpoint),
        cfg.curve and "CURVE" or (codec.needs_curve(tostring(self.endpoint)) and "INSECURE plain TCP" or "local")))
    return self
end

function Pool:log(level, msg) self.logf(level, msg) end

-- ------------------------------------------------------------------------------------------------ sending

-- Send msg to a worker; false when the worker is gone (its session is dropped and its leases re-issued).
function Pool:send(peer, msg, raw)
    local frames = codec.encode(msg, raw)
    local ok, err = self.transport:send(peer, frames)
    local w = self.workers[peer]
    if ok then
        if w then w.last_sent = self.now() end
        return true
    end
    if err == "EAGAIN" then
        self:log("debug", ("send to %s: high-water mark reached, %s dropped"):format(printable(peer), msg.t))
        return false
    end
    if w then
        self:log("warn", ("worker %s unreachable (%s): its leases are re-issued"):format(printable(peer),
            tostring(err)))
        self:drop_worker(w, true)
    end
    return false
end

function Pool:reply_error(peer, code, reason, ref_t, ref_id, ref_n)
    return self:send(peer, codec.error_msg(code, reason, ref_t, ref_id, ref_n))
end

-- ------------------------------------------------------------------------------------------------ leases

-- ------------------------------------------------------------------------------------------------ worker health

-- Per worker id, kept across sessions (a new hello does not wipe a record): failed leases in a row, in all,
-- completed tasks, and the quarantine if any.
function Pool:health_of(id)
    local h = self.health[id]
    if not h then
        h = { streak = 0, failures = 0, completed = 0 }
        self.health[id] = h
    end
    return h
end

-- The quarantine of worker `id` while it lasts, else nil (a lapsed one is lifted, with a fresh streak).
function Pool:quarantine_of(id)
    local h = self.health[id]
    local q = h and h.quarantined
    if q and self.now() >= q.till then
        h.quarantined, h.streak = nil, 0
        self:log("warn", ("worker %s: quarantine over after %.0f s: it gets tasks again"):format(printable(id),
            self.now() - q.since))
        return nil
    end
    return q
end

-- A lease of task t (nil: no task in particular) on worker `id` ended as a failure: t never goes back to it while
-- another worker could take it, and quarantine_after failures in a row quarantine the worker.
function Pool:note_failure(id, t, why)
    if t then t.failed_by[id] = true end
    local h = self:health_of(id)
    h.streak, h.failures = h.streak + 1, h.failures + 1
    if h.quarantined or h.streak < self.quarantine_after then return end
    local now = self.now()
    h.quarantined = { reason = why, since = now, till = now + self.quarantine_s }
    self.st.quarantined = self.st.quarantined + 1
    self:log("warn", ("worker %s quarantined for %g s after %d failed leases in a row (last: %s): it gets no task, "
        .. "its credit is ignored"):format(printable(id), self.quarantine_s, h.streak, tostring(why)))
    local w = self.workers[id]
    if w then -- its other leases go elsewhere now; they did not fail (yet), so they do not count against the tasks
        local ids = {}
        for tid in pairs(w.leases) do ids[#ids + 1] = tid end
        table.sort(ids, function(a, b) return a > b end)
        for _, tid in ipairs(ids) do
            local lt = self.tasks[tid]
            if lt then self:requeue(lt, "worker " .. printable(id) .. " quarantined", false) end
        end
    end
end

-- True when workers are connected and every one of them is quarantined.
function Pool:all_quarantined()
    local any = false
    for id in pairs(self.workers) do
        if not self:quarantine_of(id) then return false end
        any = true
    end
    return any
end

function Pool:note_success(id)
    local h = self:health_of(id)
    h.streak, h.completed = 0, h.completed + 1
end

-- A task that will not complete: n "failed" results for the caller.
function Pool:fail_task(t, why)
    t.state = "failed"
    t.error = why
    self.done_ids[t.id] = true
    self.st.failed = self.st.failed + 1
    self:log("warn", ("task %d failed after %d failed leases (last: %s)"):format(t.id, t.bounces, why))
end

-- Put a task back at the front of the queue with attempt + 1. failure: whether this lease failed (it counts against
-- its worker, and may count toward the task's max_attempts) or not (the worker left cleanly, the samples were
-- stale). Only a worker that has completed a task before charges the task: a worker that never has may be the
-- problem itself (a buggy or hostile one), so its failures count against it (quarantine) and a task is not lost
-- to a crowd of such workers failing it in turn. Any 4 x max_attempts failed leases fail the task all the same.
function Pool:requeue(t, why, failure)
    if t.state ~= "leased" then return end
    local holder = t.worker
    local lw = self.workers[holder]
    if lw then lw.leases[t.id] = nil end
    t.worker, t.deadline = nil, nil
    if failure then
        t.bounces = t.bounces + 1
        if holder and self:health_of(holder).completed > 0 then t.failures = t.failures + 1 end
    end
    if t.failures >= self.max_attempts or t.bounces >= 4 * self.max_attempts then
        self:fail_task(t, why)
        if holder then self:note_failure(holder, t, why) end
        return
    end
    t.state = "queued"
    t.attempt = t.attempt + 1
    table.insert(self.queue, 1, t.id)
    self.st.reissued = self.st.reissued + 1
    self:log("debug", ("task %d re-issued as attempt %d: %s"):format(t.id, t.attempt, why))
    if failure and holder then self:note_failure(holder, t, why) end
end

function Pool:drop_worker(w, failure, why)
    if self.workers[w.id] ~= w then return end
    self.workers[w.id] = nil
    local ids = {}
    for id in pairs(w.leases) do ids[#ids + 1] = id end
    table.sort(ids, function(a, b) return a > b end) -- requeue inserts at the front: keep id order
    for _, id in ipairs(ids) do
        local t = self.tasks[id]
        if t then self:requeue(t, why or ("worker " .. printable(w.id) .. " gone"), failure) end
    end
end

local function lease_deadline(self, t, now)
    return now + self.lease_s + t.sampling.n * t.sampling.max_new_tokens / self.lease_rate
end

-- How many more leases worker w may hold: max_credit, or probation until it has completed a task.
local function lease_room(self, w)
    local n = 0
    for _ in pairs(w.leases) do n = n + 1 end
    return (self:health_of(w.id).completed > 0 and self.max_credit or self.probation) - n
end

-- Ranks the workers that may take task t: for a task that failed before, one that has completed tasks first; then
-- one that never had t; then the most credit; then the smallest id.
local function rank(self, w, t)
    local proven = t.bounces > 0 and self:health_of(w.id).completed > 0 and 1 or 0
    return proven, t.tried[w.id] and 0 or 1, w.credit
end

local function better(self, a, b, t)
    local p1, f1, c1 = rank(self, a, t)
    local p2, f2, c2 = rank(self, b, t)
    if p1 ~= p2 then return p1 > p2 end
    if f1 ~= f2 then return f1 > f2 end
    if c1 ~= c2 then return c1 > c2 end
    return a.id < b.id
end

-- The worker for task t now, or nil (it waits). Quarantined workers get nothing. A worker that failed t gets it
-- again only when every other live, unquarantined worker has failed it too (else t waits for their credit).
function Pool:pick_worker(t)
    local best, fallback, someone_clean
    for _, w in pairs(self.workers) do
        if not self:quarantine_of(w.id) then
            local failed = t.failed_by[w.id]
            if not failed then someone_clean = true end
            if w.credit > 0 and lease_room(self, w) > 0 then
                if not failed then
                    if not best or better(self, w, best, t) then best = w end
                elseif not fallback or w.credit > fallback.credit then
                    fallback = w
                end
            end
        end
    end
    if best then return best end
    if not someone_clean then return fallback end
    return nil
end

function Pool:dispatch()
    -- most calls find every worker busy: say so without looking at each queued task
    local room = false
    for _, w in pairs(self.workers) do
        if w.credit > 0 and not self:quarantine_of(w.id) and lease_room(self, w) > 0 then
            room = true
            break
        end
    end
    if not room and not self:all_quarantined() then return end
    local i = 1
    while i <= #self.queue do
        local t = self.tasks[self.queue[i]]
        if not t or t.state ~= "queued" then
            table.remove(self.queue, i)
        else
            local w = self:pick_worker(t)
            if not w and self:all_quarantined() then
                -- waiting would be waiting for a quarantine to lapse: fail now, so that the caller sees it
                table.remove(self.queue, i)
                self:fail_task(t, "every connected worker is quarantined")
                goto next_task
            elseif not w then
                i = i + 1 -- it waits; a task behind it may have a worker
                goto next_task
            end
            table.remove(self.queue, i)
            w.credit = w.credit - 1
            t.state, t.worker = "leased", w.id
            t.deadline = lease_deadline(self, t, self.now())
            t.tried[w.id] = true
            t.issued[t.attempt] = w.id
            t.part = nil -- what this lease streams (opts.stream) starts from nothing
            w.leases[t.id] = true
            local s = t.sampling
            local ok = self:send(w.id, { t = "task", task_id = t.id, attempt = t.attempt, policy = t.min_policy or
                math.max(1, self.version - self.S), prompt_len = t.prompt_len, max_new_tokens = s.max_new_tokens,
                temperature = s.temperature, top_k = s.top_k, top_p = s.top_p, min_p = s.min_p, n = s.n,
                seed = t.seed, stop = s.stop, stop_strings = s.stop_strings, ignore_eos = s.ignore_eos,
                record_experts = s.record_experts,
                record_index = s.record_index, stream = s.stream }, { prompt = t.prompt_bytes })
            if not ok and t.state == "leased" and t.worker == w.id then
                -- high-water mark: no lease was made; the task keeps its attempt number and its place
                w.leases[t.id] = nil
                t.issued[t.attempt] = nil
                t.state, t.worker, t.deadline = "queued", nil, nil
                w.credit = 0
                table.insert(self.queue, i, t.id)
                i = i + 1
            end -- else the worker was unreachable: drop_worker re-queued the task (attempt + 1)
        end
        ::next_task::
    end
end

-- ------------------------------------------------------------------------------------------------ messages

local FINITE_LOGP_MAX = 1e-3 -- a log-probability is <= 0; fp32 rounding never gets near this

local function count_reject(self, peer, code, why, ref_t)
    self.st.rejected = self.st.rejected + 1
    local now = self.now()
    local r = self.rejects[peer]
    if not r or now - r.t0 > 60 then
        r = { t0 = now, n = 0, log_t0 = now, log_n = 0, suppressed = 0, muted = false }
        self.rejects[peer] = r
    end
    r.n = r.n + 1
    if now - r.log_t0 >= 1 then
        if r.suppressed > 0 then
            self:log("warn", ("%d more rejected messages from %s"):format(r.suppressed, printable(peer)))
        end
        r.log_t0, r.log_n, r.suppressed = now, 0, 0
    end
    if r.log_n < 10 then
        r.log_n = r.log_n + 1
        self:log("warn", ("rejected a message from %s: %s (%s)"):format(printable(peer), tostring(why), tostring(code)))
    else
        r.suppressed = r.suppressed + 1
    end
    if r.n > 100 then
        if not r.muted then
            self:log("warn", ("%s sent more than 100 rejected messages in 60 s: no more error replies until its next "
                .. "valid hello"):format(printable(peer)))
        end
        r.muted = true
        return
    end
    if ref_t ~= "error" then self:reply_error(peer, code, why, ref_t) end
end

function Pool:on_message(peer, frames)
    local m, code, why, ref_t = codec.decode(frames)
    if not m then
        if ref_t == "" then ref_t = nil end
        if ref_t == "error" then -- never answer an error with an error
            self.st.rejected = self.st.rejected + 1
            self:log("debug", ("bad error message from %s: %s"):format(printable(peer), tostring(why)))
            return
        end
        count_reject(self, peer, code or "parse", why, ref_t)
        return
    end
    local w = self.workers[peer]
    local now = self.now()
    if w then w.last_seen = now end
    local t = m.t
    if t == "hello" then return self:on_hello(peer, m) end
    if t == "error" then return self:on_error(peer, w, m) end
    if not w then
        if t == "bye" then return end
        if t == "task" or t == "weight_announce" or t == "weight_chunk" then
            return count_reject(self, peer, "state", "a trainer-to-worker message sent to the trainer", t)
        end
        local r = self.rejects[peer]
        if r and r.muted then return end
        self:reply_error(peer, "state", "unknown worker: send hello", t)
        return
    end
    if t == "credit" then
        local c = w.credit + m.n
        if c > self.max_credit then
            if not w.credit_capped then
                w.credit_capped = true
                self:log("warn", ("worker %s: credit %d above max_credit %d, excess ignored"):format(printable(peer), c,
                    self.max_credit))
            end
            c = self.max_credit
        end
        w.credit = c
    elseif t == "heartbeat" then
        self:note_policy(w, m.policy)
    elseif t == "samples" then
        self:on_samples(w, m)
    elseif t == "partial" then
        self:on_partial(w, m)
    elseif t == "weight_request" then
        self:on_weight_request(w, m)
    elseif t == "bye" then
        self:log("info", ("worker %s said bye%s"):format(printable(peer), (m.reason and m.reason ~= "") and
            (": " .. m.reason) or ""))
        self:drop_worker(w, false, "worker " .. printable(peer) .. " left")
    else
        count_reject(self, peer, "state", "a trainer-to-worker message (" .. t .. ") sent to the trainer", t)
    end
end

function Pool:note_policy(w, v)
    w.policy = v
    local sy = w.sync
    if sy and v >= sy.version then
        sy.seconds = self.now() - sy.t0
        w.sync = nil
        local rec = self.st.syncs[#self.st.syncs]
        if rec and rec.version == sy.version then
            rec.workers = rec.workers + 1
            rec.max_seconds = math.max(rec.max_seconds, sy.seconds)
        end
        self:log("debug", ("worker %s loaded version %d in %.3f s"):format(printable(w.id), sy.version, sy.seconds))
    end
end

function Pool:on_hello(peer, m)
    local caps = m
    local refuse
    -- n_params 0: a worker without local files, which builds its model from our announce (protocol v2); one with
    -- a model must have ours exactly: other routing tables or config would generate other tokens, silently
    if m.worker ~= peer then
        refuse = ("worker id %q differs from the connection's routing id"):format(tostring(m.worker))
    elseif caps.n_params == 0 then
        refuse = nil
    elseif self.vocab and caps.vocab_size ~= self.vocab then
        refuse = ("vocab_size %d, the trainer's model has %d"):format(caps.vocab_size, self.vocab)
    elseif self.n_params and caps.n_params ~= self.n_params then
        refuse = ("n_params %d, the trainer's model has %d"):format(caps.n_params, self.n_params)
    elseif self.tables and caps.tables_crc ~= self.tables then
        refuse = ("hash-routing tables (tid2eid) differ: crc %08x, the trainer's %08x; start the worker without "
            .. "--model (it takes the trainer's) or from the trainer's checkpoint"):format(caps.tables_crc, self.tables)
    elseif self.config_crc and caps.config_crc ~= self.config_crc then
        refuse = ("model config differs: crc %08x, the trainer's %08x; start the worker without --model (it takes "
            .. "the trainer's) or from the trainer's checkpoint"):format(caps.config_crc, self.config_crc)
    end
    if refuse then
        self.st.refused = self.st.refused + 1
        self:log("warn", ("refused worker %s: %s"):format(printable(peer), refuse))
        self:reply_error(peer, "refused", refuse, "hello")
        return
    end
    self.rejects[peer] = nil
    local old = self.workers[peer]
    if old then self:drop_worker(old, true, "worker " .. printable(peer) .. " sent a new hello") end
    local now = self.now()
    -- the hello's policy is a version of whichever trainer the worker talked to last: only heartbeats after our
    -- announce say what it holds
    local w = { id = peer, credit = 0, leases = {}, last_seen = now, last_sent = 0, policy = 0,
        caps = { max_batch = m.max_batch, threads = m.threads, build = m.build, vocab_size = m.vocab_size }, tasks = 0,
        tokens = 0, since = now }
    self.workers[peer] = w
    self.st.hellos = self.st.hellos + 1
    self:log("info", ("worker %s joined (%s, max_batch %d, %d threads)%s"):format(printable(peer),
        tostring(m.build), m.max_batch or 0, m.threads or 0, old and " again: a new session, its leases re-issued" or ""))
    local q = self:quarantine_of(peer)
    if q then
        self:log("warn", ("worker %s is quarantined for %.0f s more (%s): no task until then"):format(printable(peer),
            q.till - now, tostring(q.reason)))
    end
    if self.version > 0 then self:announce(w) end
end

function Pool:announce(w)
    local cur = self.weights[self.version]
    if w.policy < cur.version then w.sync = { version = cur.version, t0 = self.now() } end
    local d = cur.model
    local msg = { t = "weight_announce", version = cur.version, bytes = cur.bytes, chunk = cur.chunk,
        chunks = cur.chunks, n_params = self.n_params, dtype = "f32", crc = cur.crc, chat_template = d.chat_template,
        config_crc = d.config_crc, tokenizer_crc = d.tokenizer_crc, tables_crc = d.tables_crc }
    local frames = { config = d.config, tokenizer = d.tokenizer, tables = d.tables }
    local lo = cur.lora
    if lo then -- a LoRA policy (protocol 4): the adapters' buffer over the base version's frozen weights
        msg.lora_rank, msg.lora_alpha, msg.lora_rslora = lo.rank, lo.alpha, lo.rslora
        msg.lora_base_version, msg.lora_base_chunk, msg.lora_base_crc = cur.base.version, cur.base.chunk, cur.base.crc
        frames.lora_masks = lo.masks
    end
    self:send(w.id, msg, frames)
end

function Pool:on_error(peer, w, m)
    local name = codec.CODE_NAME[m.code] or ("code " .. tostring(m.code))
    if not w then
        self:log("debug", ("error from unknown peer %s: %s %s"):format(printable(peer), name, tostring(m.reason)))
        return
    end
    self:log("warn", ("worker %s reports %s: %s%s"):format(printable(peer), name, tostring(m.reason),
        m.ref_t and m.ref_t ~= "" and (" (about %s %.0f)"):format(m.ref_t, m.ref_id or -1) or ""))
    if m.ref_t == "task" or m.ref_t == "samples" then
        local t = self.tasks[m.ref_id]
        if t and t.state == "leased" and t.worker == peer and t.attempt == m.ref_n then
            -- the worker could not do it (generation error, bad prompt): it gets its credit back by itself
            self:requeue(t, "worker " .. printable(peer) .. ": " .. name .. ": " .. tostring(m.reason), true)
        end
    end
end

function Pool:on_weight_request(w, m)
    local v = self.weights[m.version]
    if not v then
        return self:reply_error(w.id, "state", ("weight version %d is not kept (current %d)"):format(m.version,
            self.version), "weight_request", m.version, m.index)
    end
    if m.index >= v.chunks then
        return count_reject(self, w.id, "range", ("chunk index %d of version %d, which has %d chunks"):format(
            m.index, m.version, v.chunks), "weight_request")
    end
    local off = m.index * v.chunk
    local len = math.min(v.chunk, v.bytes - off)
    local bytes = ffi.string(v.ptr + off, len)
    local crc = v.chunk_crc[m.index]
    if not crc then
        crc = codec.crc32(v.ptr + off, len)
        v.chunk_crc[m.index] = crc
    end
    if self:send(w.id, { t = "weight_chunk", version = v.version, index = m.index, offset = off, bytes = v.bytes,
            chunk = v.chunk, crc = crc }, { weights = bytes }) then
        self.st.bytes_served = self.st.bytes_served + len
        self.st.chunks_served = self.st.chunks_served + 1
    end
end

-- Per-token versions of samples m for task t (protocol 5, a worker with --partial-rollouts): per sample the version
-- of each token, never decreasing (a sequence only moves to newer weights), the oldest at least the version the task
-- allows (its policy bound). Returns versions (per sample, an array), the oldest of all, or nil, nil, why.
local function token_versions(m, t)
    local lag = ffi.cast("const int32_t *", codec.raw(m, "policy_lag") or "")
    local floor = t.min_policy or 1
    local out, oldest, off = {}, m.policy, 0
    for i = 1, m.n do
        local v, prev = {}, 0
        for j = 0, m.seq[i].n_gen - 1 do
            local x = m.policy - lag[off + j]
            if x < prev then
                return nil, nil, ("sample %d token %d is of version %d, after a token of version %d: a sequence "
                    .. "never goes back to older weights"):format(i, j + 1, x, prev)
            end
            v[j + 1], prev = x, x
            if x < oldest then oldest = x end
        end
        off = off + m.seq[i].n_gen
        out[i] = v
    end
    if oldest < floor then
        return nil, nil, ("a token of version %d, older than the task's bound %d"):format(oldest, floor)
    end
    return out, oldest
end

-- The tokens a lease streamed (its partial messages) must begin its final answer: what a consumer saw is what it
-- gets. Why not, or nil.
M.check_token_versions = token_versions -- tests

local function streamed_prefix(part, m)
    local ids = ffi.cast("const int32_t *", codec.raw(m, "tokens") or "")
    local off = 0
    for i = 1, m.n do
        local seen = part[i]
        if #seen.ids > m.seq[i].n_gen then
            return ("sample %d: %d tokens streamed, %d in the answer"):format(i, #seen.ids, m.seq[i].n_gen)
        end
        for j = 1, #seen.ids do
            if seen.ids[j] ~= ids[off + j - 1] then
                return ("sample %d token %d: %d streamed, %d in the answer"):format(i, j, seen.ids[j], ids[off + j - 1])
            end
        end
        off = off + m.seq[i].n_gen
    end
end

-- A running task's newest tokens (protocol 5, a task sent with stream = N). Only from the lease's holder, in order
-- (offsets continue what it sent), each token checked as the final answer's are; a bad one is rejected and counted
-- (stats().invalid) without ending the lease: its final answer decides. Late partials of a lease that ended are
-- dropped.
function Pool:on_partial(w, m)
    local t, peer = self.tasks[m.task_id], w.id
    if not t or t.state ~= "leased" or t.worker ~= peer or t.attempt ~= m.attempt then
        self:log("debug", ("dropped a partial result for task %d attempt %d from %s: not its lease"):format(m.task_id,
            m.attempt, printable(peer)))
        return
    end
    local s = t.sampling
    local part = t.part or { attempt = m.attempt }
    local vocab = self.vocab or w.caps.vocab_size
    local ids = ffi.cast("const int32_t *", codec.raw(m, "tokens") or "")
    local lp = ffi.cast("const float *", codec.raw(m, "logprobs") or "")
    local bad
    if m.n ~= s.n then bad = ("%d samples, the task asked for %d"):format(m.n, s.n) end
    if m.policy > self.version then bad = ("policy version %d is newer than the trainer's %d"):format(m.policy,
        self.version) end
    -- each token's version (protocol 6: the task went on under newer weights), continuing what was streamed
    local versions
    if not bad and m.token_versions then
        local why
        versions, _, why = token_versions(m, t)
        bad = why
        for i = 1, bad and 0 or m.n do
            local before = part[i] and part[i].versions
            local last = before and before[#before] or (part[i] and #part[i].ids > 0 and part[i].policy) or nil
            if last and versions[i][1] and versions[i][1] < last then
                bad = ("sample %d goes on with version %d after a streamed token of version %d"):format(i,
                    versions[i][1], last)
            end
        end
    end
    local off = 0
    for i = 1, bad and 0 or m.n do
        local q, have = m.seq[i], part[i] and #part[i].ids or 0
        if q.offset ~= have then
            bad = ("sample %d continues at token %d, %d were streamed"):format(i, q.offset + 1, have)
            break
        end
        if q.offset + q.n_gen > s.max_new_tokens then
            bad = ("sample %d would have %d tokens, max_new_tokens is %d"):format(i, q.offset + q.n_gen, s.max_new_tokens)
            break
        end
        for j = 0, q.n_gen - 1 do
            local id, a = ids[off + j], lp[off + j]
            if id < 0 or (vocab and id >= vocab) or not (a <= FINITE_LOGP_MAX and a > -math.huge) then
                bad = ("sample %d token %d: id %d, log-probability %s"):format(i, q.offset + j + 1, id, tostring(a))
                break
            end
        end
        if bad then break end
        off = off + q.n_gen
    end
    if bad then
        self.st.invalid = self.st.invalid + 1
        self:log("warn", ("rejected a partial result for task %d attempt %d from %s: %s"):format(m.task_id, m.attempt,
            printable(peer), bad))
        return self:reply_error(peer, "state", bad, "partial", m.task_id, m.attempt)
    end
    local tokens, lps = codec.raw(m, "tokens") or "", codec.raw(m, "logprobs") or ""
    local parts = {}
    off = 0
    for i = 1, m.n do
        local q = m.seq[i]
        part[i] = part[i] or { ids = {}, logprobs = {} }
        local new = { offset = q.offset, ids = codec.unpack_i32(tokens, off, q.n_gen),
            logprobs = codec.unpack_f32(lps, off, q.n_gen) }
        -- versions: every token's, from the first message that had them (earlier tokens were of one version,
        -- part.policy); a message without them is of its policy
        local pv = part[i].versions
        if versions and not pv and #part[i].ids > 0 then
            pv = {}
            for j = 1, #part[i].ids do pv[j] = part[i].policy end
        end
        new.versions, new.policy = versions and versions[i] or nil, m.policy
        for j = 1, q.n_gen do
            part[i].ids[#part[i].ids + 1] = new.ids[j]
            part[i].logprobs[#part[i].logprobs + 1] = new.logprobs[j]
            if pv or versions then
                pv = pv or {}
                pv[#pv + 1] = versions and versions[i][j] or m.policy
            end
        end
        part[i].versions = pv
        part[i].policy = part[i].policy or m.policy
        parts[i] = new
        off = off + q.n_gen
    end
    t.part = part
    self.st.partials = self.st.partials + 1
    self.st.partial_tokens = self.st.partial_tokens + off
    if self.cfg.on_partial then self.cfg.on_partial(t.index, parts, peer, m.attempt) end
end

function Pool:on_samples(w, m)
    local t = self.tasks[m.task_id]
    local peer = w.id
    if not t or t.state == "done" or t.state == "failed" then
        if (m.task_id < self.low_water or self.done_ids[m.task_id] or (t and (t.state == "done" or t.state == "failed"))) then
            self.st.duplicates = self.st.duplicates + 1
            self:log("debug", ("dropped a late answer for task %d (attempt %d) from %s"):format(m.task_id, m.attempt,
                printable(peer)))
            self:reply_error(peer, "state", ("task %d already completed"):format(m.task_id), "samples", m.task_id, m.attempt)
        else
            self:reply_error(peer, "state", ("unknown task %d"):format(m.task_id), "samples", m.task_id, m.attempt)
        end
        return
    end
    if t.issued[m.attempt] ~= peer then
        return self:reply_error(peer, "state", ("task %d attempt %d was not leased to %s"):format(m.task_id, m.attempt,
            printable(peer)), "samples", m.task_id, m.attempt)
    end
    local holder = t.state == "leased" and t.worker == peer and t.attempt == m.attempt
    -- consistency with the task as issued
    local bad
    if m.n ~= t.sampling.n then
        bad = ("%d samples, the task asked for %d"):format(m.n, t.sampling.n)
    else
        for i = 1, m.n do
            local q = m.seq[i]
            if q.prompt_len ~= t.prompt_len then
                bad = ("sample %d has prompt_len %d, the task's prompt has %d"):format(i, q.prompt_len, t.prompt_len)
                break
            end
            if q.n_gen > t.sampling.max_new_tokens then
                bad = ("sample %d has %d tokens, max_new_tokens is %d"):format(i, q.n_gen, t.sampling.max_new_tokens)
                break
            end
        end
    end
    if not bad and m.policy > self.version then
        bad = ("policy version %d is newer than the trainer's %d"):format(m.policy, self.version)
    end
    bad = bad or self:check_samples(t, m, w)
    local versions, oldest
    if not bad and m.token_versions then versions, oldest, bad = token_versions(m, t) end
    if not bad and t.part and t.part.attempt == m.attempt then bad = streamed_prefix(t.part, m) end
    if bad then
        self.st.invalid = self.st.invalid + 1
        self:log("warn", ("rejected samples for task %d attempt %d from %s: %s"):format(m.task_id, m.attempt,
            printable(peer), bad))
        self:reply_error(peer, "state", bad, "samples", m.task_id, m.attempt)
        local why = "bad samples from " .. printable(peer) .. ": " .. bad
        if holder then self:requeue(t, why, true) else self:note_failure(peer, t, why) end
        return
    end
    -- a batch's own lower bound (submit's min_policy) is a hard one; otherwise current - max_staleness
    -- (per-token versions: the oldest token's version is the answer's)
    local floor = t.min_policy or self.version - self.S
    local policy = oldest or m.policy
    local stale = policy < floor
    if stale and (self.stale_mode == "requeue" or t.min_policy) then
        self.st.stale_requeued = self.st.stale_requeued + 1
        self:reply_error(peer, "stale", ("policy %d is older than %d"):format(policy, floor),
            "samples", m.task_id, m.attempt)
        if holder then self:requeue(t, ("stale samples (policy %d, current %d)"):format(policy, self.version),
            false) end
        return
    end
    if stale then self.st.stale_accepted = self.st.stale_accepted + 1 end
    -- accept: the first valid answer completes the task; any other lease of it is now moot
    if t.state == "leased" then
        local lw = self.workers[t.worker]
        if lw then lw.leases[t.id] = nil end
    else -- queued again (a re-issue not yet sent): take it out
        for qi, id in ipairs(self.queue) do
            if id == t.id then table.remove(self.queue, qi); break end
        end
    end
    t.state, t.worker, t.deadline = "done", peer, nil
    self.done_ids[t.id] = true
    t.result = self:build_results(t, m, peer, versions)
    t.part = nil
    if versions then self.st.mixed_versions = self.st.mixed_versions + 1 end
    w.tasks = w.tasks + 1
    self:note_success(peer)
    self.st.completed = self.st.completed + 1
    self.st.samples = self.st.samples + m.n
    if self.cfg.on_result then self.cfg.on_result(t.index, t.result, peer) end
    return true
end


-- Stop strings (core/generate.c's rule): after each token, the first stop string with a match that ends in that
-- token's bytes stops the sample (after eos and stop ids, which take precedence); so no stop string may occur in
-- the text of the tokens before the last, and the last token's new matches must agree with the finish reason.
local function check_stop_strings(s, ids, off, g, finish, stop_index)
    -- the text as generation decodes it: each id's bytes (an id the tokenizer does not know adds none)
    local V = s.tokenizer:vocab_size()
    local list = {}
    for j = 0, g - 1 do
        local id = ids[off + j]
        if id < V then list[#list + 1] = id end
    end
    local ok, full = pcall(s.tokenizer.decode, s.tokenizer, list)
    if ids[off + g - 1] < V then list[#list] = nil end
    local ok2, prev = pcall(s.tokenizer.decode, s.tokenizer, list)
    if not ok or not ok2 then return "its tokens do not decode with the model's tokenizer" end
    local first_new
    for k, str in ipairs(s.stop_strings) do
        if prev:find(str, 1, true) then
            return ("the stop string #%d occurs before the last token: generation ends there"):format(k)
        end
        if not first_new and full:find(str, math.max(1, #prev - #str + 2), true) then first_new = k end
    end
    if finish == "stop_string" then
        if first_new == nil or first_new ~= stop_index + 1 then
            return ("finished by stop string #%d, but the last token completes %s"):format(stop_index + 1,
                first_new and ("stop string #" .. first_new .. " first") or "none")
        end
    elseif finish == "length" and first_new then
        return ("finished by length, but its last token completes stop string #%d"):format(first_new)
    end
end

-- Why the samples m for task t (from worker w) cannot be trained on, or nil. The codec has checked the message's
-- shape (counts, frame sizes, finish codes, stop_index against finish); this checks the values against the task
-- and the model. Nothing here trusts the worker: one holding an allowed key can still be buggy.
function Pool:check_samples(t, m, w)
    local s = t.sampling
    if m.policy < 1 then return "policy version 0: generated before any published weights were loaded" end
    if m.experts_layers > 0 and not s.record_experts then return "routing records (experts) that were not asked for" end
    if m.index_layers > 0 and not s.record_index then return "routing records (index) that were not asked for" end
    if (s.record_experts and m.experts_layers == 0) or (s.record_index and m.index_layers == 0) then
        return "routing records were asked for and are missing"
    end
    local R = self.routing
    if R and m.experts_layers > 0 and (m.experts_layers ~= R.layers or m.experts_k ~= R.k) then
        return ("experts records of shape [rows, %d, %d], the model routes [rows, %d, %d]"):format(m.experts_layers,
            m.experts_k, R.layers, R.k)
    end
    if R and m.index_layers > 0 and (m.index_layers ~= R.ncsa or m.index_topk ~= R.topk) then
        return ("index records of shape [rows, %d, %d], the model picks [rows, %d, %d]"):format(m.index_layers,
            m.index_topk, R.ncsa, R.topk)
    end
    local vocab = self.vocab or w.caps.vocab_size
    local ids = ffi.cast("const int32_t *", codec.raw(m, "tokens") or "")
    local lp = ffi.cast("const float *", codec.raw(m, "logprobs") or "")
    local slp = ffi.cast("const float *", codec.raw(m, "sample_logprobs") or "")
    local stop = {}
    for _, v in ipairs(s.stop) do stop[v] = true end
    local eos = not s.ignore_eos and self.eos or nil
    local off = 0
    for i = 1, m.n do
        local q = m.seq[i]
        local g = q.n_gen
        if g < 1 then return ("sample %d has no generated token"):format(i) end
        for j = 0, g - 1 do
            local id = ids[off + j]
            if id < 0 or (vocab and id >= vocab) then
                return ("sample %d token %d = %d is not a token id (vocabulary %s)"):format(i, j + 1, id, tostring(vocab))
            end
            local a, b = lp[off + j], slp[off + j]
            if not (a <= FINITE_LOGP_MAX and a > -math.huge) or not (b <= FINITE_LOGP_MAX and b > -math.huge) then
                return ("sample %d token %d has log-probabilities %s / %s: not finite values <= 0"):format(i, j + 1,
                    tostring(a), tostring(b))
            end
            if j < g - 1 and (stop[id] or id == eos) then
                return ("sample %d has the stop id %d at token %d of %d: generation ends there"):format(i, id, j + 1, g)
            end
        end
        local last, finish = ids[off + g - 1], codec.FINISH[q.finish]
        if finish == "length" then
            if g ~= s.max_new_tokens then
                return ("sample %d finished by length after %d tokens, max_new_tokens is %d"):format(i, g,
                    s.max_new_tokens)
            end
        elseif finish == "eos" then
            if s.ignore_eos or (self.eos and last ~= self.eos) then
                return ("sample %d finished by eos, but %s"):format(i, s.ignore_eos and "the task ignores eos" or
                    ("its last token is %d, not %d"):format(last, self.eos))
            end
        elseif finish == "stop_token" then
            if q.stop_index >= #s.stop or last ~= s.stop[q.stop_index + 1] then
                return ("sample %d finished by stop id #%d, but its last token is %d"):format(i, q.stop_index + 1, last)
            end
        elseif finish ~= "stop_string" or #(s.stop_strings or {}) == 0 then
            return ("sample %d finished by %s, which a task cannot end with"):format(i, tostring(finish))
        end
        if #(s.stop_strings or {}) > 0 then
            local why = check_stop_strings(s, ids, off, g, finish, q.stop_index)
            if why then return ("sample %d: %s"):format(i, why) end
        end
        off = off + g
    end
    if R and (m.experts_layers > 0 or m.index_layers > 0) then return self:check_routing(m) end
end

-- The first of the K values at p outside [lo, hi) or repeating an earlier non-negative one, or nil.
local function bad_slot(p, K, lo, hi)
    for k = 0, K - 1 do
        local e = p[k]
        if e < lo or e >= hi then return e end
        if e >= 0 then
            for j = 0, k - 1 do if p[j] == e then return e end end
        end
    end
end

-- Routing records as the forward's replay accepts them (core/forward.c check_args): per row, either -1 first
-- (the row routes itself) or K distinct experts in [0, E); index picks -1 or distinct causal entries.
function Pool:check_routing(m)
    local R = self.routing
    local ex = m.experts_layers > 0 and ffi.cast("const int32_t *", codec.raw(m, "experts") or "")
    local ix = m.index_layers > 0 and ffi.cast("const int32_t *", codec.raw(m, "index") or "")
    local row0 = 0
    for i = 1, m.n do
        local q = m.seq[i]
        for r = 0, q.n_rows - 1 do
            for l = 0, (ex and R.layers or 0) - 1 do
                local p = ex + ((row0 + r) * R.layers + l) * R.k
                local e = p[0] >= 0 and bad_slot(p, R.k, 0, R.experts)
                if e then
                    return ("sample %d row %d layer %d: expert %d is not a distinct expert in [0, %d)"):format(i, r, l,
                        e, R.experts)
                end
            end
            local valid = R.rate and math.floor((r + 1) / R.rate) or math.huge
            for c = 0, (ix and R.ncsa or 0) - 1 do
                local p = ix + ((row0 + r) * R.ncsa + c) * R.topk
                local e = p[0] >= 0 and bad_slot(p, R.topk, -1, valid)
                if e then
                    return ("sample %d row %d CSA layer %d: index pick %d is not a distinct causal entry in [0, %s) "
                        .. "or -1"):format(i, r, c, e, tostring(valid))
                end
            end
        end
        row0 = row0 + q.n_rows
    end
end

function Pool:build_results(t, m, peer, versions)
    local tokens = codec.raw(m, "tokens") or ""
    local lps = codec.raw(m, "logprobs") or ""
    local slps = codec.raw(m, "sample_logprobs") or ""
    local ex, ix = codec.raw(m, "experts"), codec.raw(m, "index")
    local ex_inner = m.experts_layers > 0 and m.experts_layers * m.experts_k
    local ix_inner = m.index_layers > 0 and m.index_layers * m.index_topk
    local out, off, roff = {}, 0, 0
    for i = 1, m.n do
        local q = m.seq[i]
        local g = q.n_gen
        local finish = codec.FINISH[q.finish] or "length"
        local r = { ids = codec.unpack_i32(tokens, off, g), logprobs = codec.unpack_f32(lps, off, g),
            sample_logprobs = codec.unpack_f32(slps, off, g), finish_reason = finish, prompt_index = t.index,
            sample_index = i, prompt_len = q.prompt_len, policy_version = m.policy, task = t.id,
            attempt = m.attempt, worker = peer }
        if versions then
            r.token_versions = versions[i]
            r.policy_version = versions[i][1] or m.policy -- the oldest: versions never decrease along a sample
        end
        if finish == "stop_token" and q.stop_index >= 0 then r.stop = t.sampling.stop[q.stop_index + 1] end
        if finish == "stop_string" and q.stop_index >= 0 then r.stop = t.sampling.stop_strings[q.stop_index + 1] end
        local rows = q.n_rows
        if ex_inner then
            local tt = ds4.zeros({ rows, m.experts_layers, m.experts_k }, "I32")
            if rows > 0 then ffi.copy(tt:data_ptr(), ffi.cast("const char *", ex) + roff * ex_inner * 4,
                rows * ex_inner * 4) end
            r.experts = tt
        end
        if ix_inner then
            local tt = ds4.zeros({ rows, m.index_layers, m.index_topk }, "I32")
            if rows > 0 then ffi.copy(tt:data_ptr(), ffi.cast("const char *", ix) + roff * ix_inner * 4,
                rows * ix_inner * 4) end
            r.index_picks = tt
        end
        off, roff = off + g, roff + rows
        self.st.tokens = self.st.tokens + g
        out[i] = r
    end
    return out
end

-- ------------------------------------------------------------------------------------------------ the loop

-- Handle what has arrived (waiting up to timeout_ms for the first message), then liveness, leases, heartbeats.
function Pool:service(timeout_ms)
    local now = self.now()
    -- time spent outside the pool (training) is nobody's silence: shift the clocks it would have expired
    local gap = now - self.last_service
    if gap > self.heartbeat_s then
        for _, w in pairs(self.workers) do w.last_seen = w.last_seen + gap end
        for _, t in pairs(self.tasks) do if t.deadline then t.deadline = t.deadline + gap end end
    end
    local peer, frames = self.transport:recv(timeout_ms or 0)
    local n = 0
    while peer do
        self:on_message(peer, frames)
        n = n + 1
        if n >= 10000 then break end
        peer, frames = self.transport:recv(0)
    end
    now = self.now()
    for _, w in pairs(self.workers) do
        if now - w.last_seen > self.dead_s then
            self.st.dead = self.st.dead + 1
            self:log("warn", ("worker %s silent for %.1f s: declared dead, its leases re-issued"):format(
                printable(w.id), now - w.last_seen))
            self:drop_worker(w, true, "worker " .. printable(w.id) .. " died")
        end
    end
    for _, t in pairs(self.tasks) do
        if t.state == "leased" and t.deadline and now > t.deadline then
            self:log("warn", ("task %d attempt %d: lease on %s expired"):format(t.id, t.attempt, printable(t.worker)))
            self:requeue(t, "lease expired on " .. printable(t.worker), true)
        end
    end
    for _, w in pairs(self.workers) do
        if now - w.last_sent >= self.heartbeat_s then
            local active = 0
            for _ in pairs(w.leases) do active = active + 1 end
            self:send(w.id, { t = "heartbeat", policy = self.version, active = active })
        end
    end
    if self.transport.refused then
        local zs = self.transport:refused()
        if zs and zs.refused and zs.refused > self.zap_refused then
            self:log("warn", ("CURVE: refused %d handshake(s) from unknown keys: %s"):format(zs.refused -
                self.zap_refused, table.concat(zs.refused_keys or {}, ", ")))
            self.zap_refused = zs.refused
        end
    end
    self.last_service = self.now()
    return n
end

function Pool:n_workers()
    local n = 0
    for _ in pairs(self.workers) do n = n + 1 end
    return n
end

-- Wait until n workers have a session (or timeout_s passes); returns how many there are.
function Pool:wait(n, timeout_s)
    local t0 = self.now()
    while self:n_workers() < n and self.now() - t0 < (timeout_s or math.huge) do self:service(100) end
    return self:n_workers()
end

-- Queue the prompts as tasks and return at once: a batch handle for pool:collect. Tasks go out as workers have
-- credit: now, and in every later pool call (poll, collect, generate, publish, sync, service). Batches of several
-- submits are in flight together, served in submission order (a re-issued task goes first).
-- opts.min_policy (a published version, at most the current one): the batch's samples are generated with that version
-- or a newer one, whatever max_staleness says; an answer of an older version is re-issued (stale), even with
-- stale = "accept_with_version". Without it each task asks for current - max_staleness when it is sent.
-- opts.first = true: the batch's tasks go to the front of the queue, in prompt order (before batches submitted
-- earlier and not yet sent; tasks already leased run on).
local function submit(self, prompts, opts)
    if ds4.is_tensor(prompts) then prompts = prompts:totable() end -- [B, S]: B prompts
    if type(prompts) ~= "table" then error("pool:generate: bad argument #1 (array of prompts expected)", 3) end
    opts = opts or {}
    local min_policy, first = opts.min_policy, opts.first
    if min_policy ~= nil or first ~= nil then
        local o = {}
        for k, v in pairs(opts) do if k ~= "min_policy" and k ~= "first" then o[k] = v end end
        opts = o
    end
    if first ~= nil and type(first) ~= "boolean" then
        error(("pool:submit: opts.first must be a boolean, got %s"):format(tostring(first)), 3)
    end
    local s = check_gen_opts(opts, 1)
    if #s.stop_strings > 0 then
        local tok = self.model and self.model:tokenizer()
        if not tok then
            error("pool:generate: stop strings need the model's tokenizer (the workers decode their output with the "
                .. "tokenizer the announce sends them): this model has none", 3)
        end
        if opts.tokenizer ~= nil and not rawequal(opts.tokenizer, tok) then
            error("pool:generate: opts.tokenizer must be the model's tokenizer (model:tokenizer()): the workers decode "
                .. "with that one", 3)
        end
        s.tokenizer = tok
    end
    if self.version == 0 then
        if not self.model then error("pool:generate: nothing published yet: call pool:publish(model) first", 3) end
        self:publish(self.model)
    end
    if min_policy ~= nil and (type(min_policy) ~= "number" or min_policy ~= math.floor(min_policy) or min_policy < 1
        or min_policy > self.version) then
        error(("pool:submit: opts.min_policy must be a published version in [1, %d], got %s"):format(self.version,
            tostring(min_policy)), 3)
    end
    if self.expect > 0 and not self.waited then
        self.waited = true
        local n = self:wait(self.expect, self.cfg.wait_s or 60)
        if n < self.expect then
            self:log("warn", ("%d of %d workers after %d s: starting with those"):format(n, self.expect,
                self.cfg.wait_s or 60))
        end
    end
    local order = {}
    for p, pr in ipairs(prompts) do
        local ids = pr
        if ds4.is_tensor(pr) then ids = pr:totable() end
        if type(ids) ~= "table" or #ids == 0 then
            error(("pool:generate: prompts[%d] must be a non-empty array of token ids"):format(p), 3)
        end
        for j, v in ipairs(ids) do
            if type(v) ~= "number" or v ~= math.floor(v) or v < 0 or (self.vocab and v >= self.vocab) then
                error(("pool:generate: prompts[%d][%d] = %s is not a token id"):format(p, j, tostring(v)), 3)
            end
        end
        if #ids > 4096 then error(("pool:generate: prompts[%d] has %d tokens, the protocol's limit is 4096"):format(
            p, #ids), 3) end
        order[p] = { index = p, prompt_bytes = codec.pack_i32(ids), prompt_len = #ids }
    end
    -- ids are taken only now that every prompt is valid: a refused call leaves no task behind
    for p, t in ipairs(order) do
        t.id = self.next_id
        self.next_id = self.next_id + 1
        t.sampling, t.seed, t.min_policy = s, M.task_seed(s.seed, p), min_policy
        t.attempt, t.failures, t.state, t.tried, t.issued, t.failed_by, t.bounces = 0, 0, "queued", {}, {}, {}, 0
        self.tasks[t.id] = t
        if first then table.insert(self.queue, p, t.id) else self.queue[#self.queue + 1] = t.id end
    end
    self.st.tasks = self.st.tasks + #order
    self:dispatch()
    return { order = order, n = s.n, t0 = self.now(), pool = self }
end

function Pool:submit(prompts, opts)
    local b = submit(self, prompts, opts)
    return b
end

-- Give up batch b: its queued tasks are dropped, its leased ones forgotten (a late answer is a duplicate).
function Pool:cancel(b)
    if b.collected then return end
    b.collected = true
    for _, t in ipairs(b.order) do
        if t.state == "leased" then
            local w = self.workers[t.worker]
            if w then w.leases[t.id] = nil end
        end
        if t.state ~= "done" and t.state ~= "failed" then t.state = "failed" end
        self.done_ids[t.id] = true
        self.tasks[t.id] = nil
    end
    self:prune_done()
end

local function unfinished(b)
    local n = 0
    for _, t in ipairs(b.order) do
        if t.state ~= "done" and t.state ~= "failed" then n = n + 1 end
    end
    return n
end

-- Serve without waiting: send what workers have credit for, handle what has arrived, keep heartbeats, leases and
-- weight downloads going. A trainer calls it between pieces of its own work (ds4.rl.trainer: between micro-batches)
-- so that no worker hears silence while it computes.
function Pool:poll()
    self:dispatch()
    local n = self:service(0)
    self:dispatch()
    return n
end

-- What batch b has so far, prompt-major as collect returns it: a completed task's results; for one still running,
-- what its current lease has streamed (opts.stream), {ids, logprobs, partial = true, prompt_index, sample_index}
-- (empty before its first partial message, or after a re-issue until the new lease streams).
function Pool:progress(b)
    if type(b) ~= "table" or b.pool ~= self or not b.order then
        error("pool:progress: bad argument #1 (a batch from pool:submit expected)", 2)
    end
    local out = {}
    for p, t in ipairs(b.order) do
        for s = 1, b.n do
            local r = t.result and t.result[s]
            if not r then
                local part = t.part and t.part[s]
                r = { ids = {}, logprobs = {}, partial = true, prompt_index = p, sample_index = s }
                for j = 1, part and #part.ids or 0 do r.ids[j], r.logprobs[j] = part.ids[j], part.logprobs[j] end
                if part and part.versions then
                    r.token_versions = {}
                    for j = 1, #part.versions do r.token_versions[j] = part.versions[j] end
                end
            end
            out[#out + 1] = r
        end
    end
    return out
end

-- True when every task of batch b has completed or failed (collect would not wait).
function Pool:ready(b)
    return unfinished(b) == 0
end

-- Wait for batch b (serving meanwhile) and return its results as generate does. A batch is collected once.
function Pool:collect(b)
    if type(b) ~= "table" or b.pool ~= self or not b.order then
        error("pool:collect: bad argument #1 (a batch from pool:submit expected)", 2)
    end
    if b.collected then error("pool:collect: this batch was collected already", 2) end
    b.collected = true
    local t0 = self.now()
    local last_note = t0
    local remaining = unfinished(b)
    while remaining > 0 do
        self:dispatch()
        self:service(20)
        self:dispatch()
        remaining = unfinished(b)
        local now = self.now()
        if remaining > 0 and now - last_note > 10 then
            last_note = now
            local quarantined = 0
            for id in pairs(self.workers) do if self:quarantine_of(id) then quarantined = quarantined + 1 end end
            self:log(quarantined > 0 and "warn" or "info", ("waiting: %d of %d tasks left, %d workers (%d quarantined)")
                :format(remaining, #b.order, self:n_workers(), quarantined))
        end
        if self.cfg.timeout_s and now - t0 > self.cfg.timeout_s then
            b.collected = false
            self:cancel(b)
            error(("pool:generate: %d of %d tasks unfinished after %g s (%d workers)"):format(remaining, #b.order,
                self.cfg.timeout_s, self:n_workers()), 2)
        end
    end
    local res, failed = {}, 0
    local stats = { prefill_tokens = 0, decode_tokens = 0 }
    for p, t in ipairs(b.order) do
        for si = 1, b.n do
            local r
            if t.state == "done" then
                r = t.result[si]
            else
                r = { ids = {}, logprobs = {}, sample_logprobs = {}, finish_reason = "failed", error = t.error,
                    prompt_index = p, sample_index = si, prompt_len = t.prompt_len, task = t.id, attempt = t.attempt }
                failed = failed + 1
            end
            res[#res + 1] = r
            stats.decode_tokens = stats.decode_tokens + #r.ids
        end
        stats.prefill_tokens = stats.prefill_tokens + t.prompt_len
        self.tasks[t.id] = nil -- its id stays in done_ids: a late answer is still recognised as a duplicate
    end
    self:prune_done()
    local now = self.now()
    self.st.generate_seconds = self.st.generate_seconds + (now - t0)
    stats.seconds = now - b.t0 -- from submit: the time the batch took, whatever overlapped it
    stats.wait_seconds = now - t0
    stats.decode_tokens_per_s = stats.decode_tokens / math.max(stats.seconds, 1e-9)
    res.stats = stats
    res.failed = failed
    return res
end

-- Completed ids below every live task's are recognised by low_water alone: forget them.
function Pool:prune_done()
    local low = self.next_id
    for id in pairs(self.tasks) do if id < low then low = id end end
    self.low_water = low
    for id in pairs(self.done_ids) do if id < low then self.done_ids[id] = nil end end
end

-- model:generate's interface: submit the prompts and wait for them.
function Pool:generate(prompts, opts)
    return self:collect(submit(self, prompts, opts))
end

-- ------------------------------------------------------------------------------------------------ weights

-- What protocol v2's announce carries besides the weights: enough for a worker without local files to build the
-- very model the weights belong to (config, tokenizer, chat template, hash-routing tables), with their CRCs.
local function describe_model(model)
    local tok, template = model:tokenizer()
    local d = { config = model:config_json(), tokenizer = tok and tok:to_json() or "", chat_template = template or "",
        tables = model:tables() }
    d.config_crc = codec.crc32(d.config, #d.config)
    d.tokenizer_crc = codec.crc32(d.tokenizer, #d.tokenizer)
    d.tables_crc = codec.crc32(d.tables, #d.tables)
    return d
end

-- The next version number holding a snapshot of buf (an F32 tensor the pool keeps): its CRC and chunking.
local function new_version(self, buf)
    local bytes = buf:nbytes()
    local ptr = ffi.cast("const uint8_t *", buf:data_ptr())
    self.version = self.version + 1
    local v = { version = self.version, tensor = buf, ptr = ptr, bytes = bytes, chunk = math.min(self.chunk_bytes,
        bytes), crc = codec.buffer_crc(ptr, bytes), chunk_crc = {} }
    v.chunks = math.ceil(bytes / v.chunk)
    self.weights[v.version] = v
    return v
end

local function same_tensor(v, buf)
    return v ~= nil and v.bytes == buf:nbytes() and codec.same_bytes(v.ptr, ffi.cast("const uint8_t *",
        buf:data_ptr()), v.bytes)
end

-- A LoRA policy (protocol 4, rollout/protocol.md §7.6): the frozen weights are a version of their own, snapshotted
-- again only when they changed and never announced, and each policy version is the adapters' buffer, announced with
-- that base version and the adapters' layout. So a publish moves the adapters' bytes, and the base moves once.
-- Returns the new current version (nil: nothing changed).
local function publish_lora(self, model, base, lora)
    local ad = model:lora_params()
    local cur, bv = self.weights[self.version], self.weights[self.base_version or -1]
    local base_same = same_tensor(bv, base)
    if base_same and cur and cur.lora and codec.same_layout(cur.lora, lora) and same_tensor(cur, ad) then return nil end
    local base_bytes = 0
    if not base_same then
        bv = new_version(self, base)
        self.base_version, base_bytes = bv.version, bv.bytes
    end
    local v = new_version(self, ad)
    v.lora, v.base, v.base_bytes = lora, bv, base_bytes
    return v
end

-- Versions kept: the current and the previous policy, and the base versions they stand on.
local function prune(self, prev)
    local keep = {}
    for _, k in ipairs({ self.version, prev }) do
        local v = self.weights[k or -1]
        if v then
            keep[v.version] = true
            if v.base then keep[v.base.version] = true end
        end
    end
    for k in pairs(self.weights) do if not keep[k] then self.weights[k] = nil end end
end

function Pool:publish(model)
    model = model or self.model
    if not model then error("pool:publish: a model is required", 2) end
    -- the protocol does not carry the FP8 KV quantisation-aware option: workers would decode without it, and the
    -- trainer's log-probabilities (with it) would no longer equal the rollout's
    if model.kv_qat and model:kv_qat() then
        error("pool:publish: the model's FP8 KV quantisation-aware option (set_kv_qat) is on, and rollout workers "
            .. "would decode without it (the protocol does not carry it): turn it off, or generate in-process", 2)
    end
    local t0 = self.now()
    local buf = model:params()
    local bytes = buf:nbytes()
    if self.n_params and bytes ~= 4 * self.n_params then
        error(("pool:publish: the model has %d parameters, the pool's %d"):format(bytes / 4, self.n_params), 2)
    end
    local prev = self.version
    local lora = model.lora_layout and model:lora_layout()
    local v
    if lora then
        v = publish_lora(self, model, buf, lora)
    elseif not same_tensor(self.weights[self.version], buf) or self.weights[self.version].lora then
        v = new_version(self, buf)
        v.base_bytes = 0
        self.base_version = nil
    end
    if not v then
        self:service(0)
        return self.version
    end
    v.model = describe_model(model)
    prune(self, prev)
    if not self.n_params then self.n_params = bytes / 4 end
    local dt = self.now() - t0
    self.st.publishes = self.st.publishes + 1
    self.st.publish_seconds = self.st.publish_seconds + dt
    self.st.syncs[#self.st.syncs + 1] = { version = v.version, bytes = v.bytes, base_bytes = v.base_bytes,
        t0 = self.now(), workers = 0, max_seconds = 0, snapshot_seconds = dt }
    if #self.st.syncs > 64 then table.remove(self.st.syncs, 1) end
    for _, w in pairs(self.workers) do self:announce(w) end
    self:log("debug", ("published version %d (%.1f MB%s, crc %08x) in %.3f s"):format(v.version, v.bytes / 1e6,
        v.lora and (", LoRA adapters over base version %d"):format(v.base.version) or "", v.crc, dt))
    self:service(0)
    return v.version
end

-- ------------------------------------------------------------------------------------------------ the rest

function Pool:stats()
    local st = {}
    for k, v in pairs(self.st) do st[k] = v end
    st.version = self.version
    st.workers = {}
    local n = 0
    for id, w in pairs(self.workers) do
        local leases = 0
        for _ in pairs(w.leases) do leases = leases + 1 end
        local h = self:health_of(id)
        local q = self:quarantine_of(id)
        st.workers[id] = { credit = w.credit, leases = leases, policy = w.policy, tasks = w.tasks,
            failures = h.failures, streak = h.streak, quarantined = q and q.reason or nil }
        n = n + 1
    end
    st.n_workers = n
    if self.transport.refused then
        local zs = self.transport:refused()
        if zs then st.curve_accepted, st.curve_refused, st.curve_refused_keys = zs.accepted, zs.refused,
            zs.refused_keys end
    end
    return st
end

-- Wait (up to timeout_s) until every live worker has loaded the current version; returns the seconds it took.
function Pool:sync(timeout_s)
    local t0 = self.now()
    while self.now() - t0 < (timeout_s or 60) do
        local all = true
        for _, w in pairs(self.workers) do if w.policy < self.version then all = false end end
        if all then break end
        self:service(20)
    end
    return self.now() - t0
end

function Pool:close(reason)
    if self.closed then return end
    self.closed = true
    for id in pairs(self.workers) do
        pcall(self.send, self, id, { t = "bye", reason = reason or "trainer shutting down" })
    end
    self.workers = {}
    self.transport:close()
end

M.Pool = Pool
setmetatable(M, { __call = function(_, cfg) return M.new(cfg) end })
return M
