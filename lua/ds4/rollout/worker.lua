--[==[ ds4.rollout.worker — the worker's side of the rollout protocol (rollout/protocol.md): one DEALER connection
  to a trainer's pool, its own copy of the model, tasks in, samples out. `ds4 worker ...` runs worker.main(arg).

  require("ds4.rollout.worker").run{
      connect = "tcp://HOST:PORT",     -- the pool's endpoint
      model = model,                   -- this worker's engine copy (any weights of the trainer's architecture: its
                                       -- policy replaces them; config and hash-routing tables must equal the
                                       -- trainer's, else refused); nil: built from the trainer's announce
      id = "name",                     -- routing id / worker id (1..64 printable ASCII); default host-pid
      curve = {secret = KEY, server = KEY [, public = KEY]} | insecure = true,  -- keys or key files; public:
                                       -- derived from the secret when absent
      max_batch = 32,                  -- sequences decoded together, over all running tasks (continuous batching)
      credits = 0,                     -- tasks in flight: 0 asks for more while the batch has room (one queued);
                                       -- N asks for N at first and one per answer
      partial_rollouts = false,        -- true: new weights go in at once, the running sequences continue under
                                       -- them (their prefix's cache as computed under the old ones) and the answer
                                       -- gives every token's version (protocol 5); false: new weights wait until
                                       -- the running tasks have finished (a generation never mixes two versions)
      silence_s = 10, hello_s = 5, heartbeat_s = 1, quiet = false, verbose = false,
      give_up_s = 120,                 -- without a trainer (never joined, or its session lost) this long: exit 1
      interrupted = function() -> bool,-- default: the ds4 host's Ctrl-C / SIGTERM flag
      transport = ..., clock = ...,    -- tests: replace the socket and the clock (as the pool's)
      max_tasks = nil,                 -- tests: leave after this many tasks
  } -> exit status (0: stopped by a signal or by max_tasks, after a bye; 1: refused, or no trainer for give_up_s)

  Loop: hello (caps: max_batch, threads, vocab, n_params, config and tables CRCs; 0s without a model) -> the
  trainer's weight_announce, which carries its model (config, tokenizer, template, tables): built from it when this
  worker has none, else compared with ours (a mismatch: error refused, exit 1) -> weights fetched if the announced (version, CRC) is not what is loaded: weight_request with at
  most 4 chunks in flight, each chunk checked (geometry, CRC) and copied into a staging tensor at its offset, the
  whole buffer's CRC checked, then model:set_params(staging) — between tasks, so a generation never mixes two
  versions (a LoRA policy, protocol 4: its base version fetched once, or recognised in the starting weights, and
  staged, then the adapters; both go in together, adapters of the announced layout attached when ours differ) ->
  credit -> tasks, each submitted to the model's continuous batcher (model:batcher: one prompt, n
  samples, the task's seed; up to max_batch sequences of all running tasks decode in one step, a task is admitted
  as soon as its n sequences fit, and its result is model:generate's alone, bit for bit, whoever generates it and
  whatever runs beside it) with a version at least the task's policy -> samples + one more credit, as each task
  finishes; a task sent with stream = N also gets a partial message whenever one of its samples has N tokens more
  than the last one carried (protocol 5). New weights are loaded once the running tasks have finished (no task is
  admitted meanwhile), or at once with partial_rollouts (the answer then carries each token's version). Between
  two decode steps the loop reads the trainer and sends heartbeats (after 1 s without sending); a trainer silent
  for silence_s, its bye, or its "unknown worker" error (a restarted trainer) -> hello again (every hello_s) and
  queued and running tasks are dropped (the trainer re-issues them). A malformed message is logged (rate-limited) and answered with error; a `refused` or
  `version` error ends the worker with status 1.
]==]

local ffi = require("ffi")
local ds4 = require("ds4")
local codec = require("ds4.rollout.codec")

local M = {}
local W = {}
W.__index = W

local WINDOW = 4

local function printable(id)
    return (tostring(id):gsub("[^\33-\126]", function(c) return ("\\x%02x"):format(c:byte()) end))
end

-- The ds4 host's interrupt flag (lua/main.c: set by Ctrl-C and, for `ds4 worker`, SIGTERM).
local function host_interrupted()
    local ud = debug.getregistry()["ds4.interrupt"]
    if type(ud) ~= "userdata" then return function() return false end end
    local p = ffi.cast("volatile int *", ud)
    return function() return p[0] ~= 0 end
end

local function zmq_transport(cfg, log)
    local zmq = ds4.zmq or error("ds4 worker: this ds4 was built without ZeroMQ (ds4.zmq)", 3)
    local ep = cfg.connect or error("ds4 worker: connect (an endpoint) is required", 3)
    local s = zmq.socket("DEALER")
    local t = { sock = s }
    s:set{ routing_id = cfg.id, immediate = true, linger = 0, sndhwm = 1000, rcvhwm = 1000, heartbeat_ivl = 1000,
        heartbeat_timeout = 10000, heartbeat_ttl = 10000, reconnect_ivl = 100, reconnect_ivl_max = 5000,
        -- the largest message is the weight announcement: the model's config, tokenizer.json (~8 MB for a 129k
        -- vocabulary) and hash-routing tables (layers x vocab x top-k int32: ~9 MB for DeepSeek-V4's three hash
        -- layers), each frame also checked against the wire limits; weight chunks are at most 16 MiB
        maxmsgsize = 256 * 1024 * 1024 }
    if cfg.curve then
        local secret = codec.read_key(cfg.curve.secret, "ds4 worker: this worker's secret key")
        local public = cfg.curve.public and codec.read_key(cfg.curve.public, "ds4 worker: this worker's public key")
            or zmq.public_from_secret(secret)
        s:set{ curve_serverkey = codec.read_key(cfg.curve.server, "ds4 worker: the trainer's public key"),
            curve_publickey = public, curve_secretkey = secret }
    elseif codec.needs_curve(ep) then
        if not cfg.insecure then
            error("ds4 worker: " .. ep .. " is plain TCP: give --key FILE --server-key FILE (CURVE keys from "
                .. "`ds4 keygen --out PREFIX`), or --insecure to connect unauthenticated and unencrypted", 0)
        end
        io.stderr:write("ds4 worker: WARNING: " .. ep .. " is plain TCP without CURVE (--insecure): unauthenticated, "
            .. "weights and samples travel unencrypted\n")
    end
    s:connect(ep)
    function t:recv(timeout_ms)
        -- the binding raises "interrupted" when the host's Ctrl-C / SIGTERM flag is set while it waits: the loop
        -- sees the flag itself
        local ok, fr = pcall(self.sock.recv, self.sock, timeout_ms)
        if ok then return fr end
        if tostring(fr):find("interrupted", 1, true) then return nil end
        error(fr, 0)
    end
    function t:send(frames) return self.sock:send(frames) end
    function t:close(linger_ms)
        if not self.sock then return end
        if linger_ms then pcall(self.sock.set, self.sock, { linger = linger_ms }) end
        self.sock:close()
        self.sock = nil
    end
    return t
end

-- ------------------------------------------------------------------------------------------------ state

-- The model this worker generates with, and what its hello says about it (0s: none yet).
function W:adopt(model)
    self.model = model
    if not model then
        self.vocab, self.n_params, self.config_crc, self.tables = 0, 0, 0, 0
        return
    end
    self.vocab = model:config().vocab_size
    self.n_params = model:n_params()
    self.config_json = model:config_json()
    self.config_crc = codec.crc32(self.config_json, #self.config_json)
    self.tables = model:tables_crc()
end

function M.new(cfg)
    local self = setmetatable({}, W)
    self.cfg = cfg
    self:adopt(cfg.model) -- nil: built from the trainer's first announce (protocol v2)
    self.id = cfg.id or (((os.getenv("HOSTNAME") or "worker") .. "-" .. tostring(math.random(1, 1e9))):sub(1, 64))
    if #self.id < 1 or #self.id > 64 or self.id:find("[^\33-\126]") then
        error("ds4 worker: the worker id must be 1..64 printable ASCII characters without spaces, got '" ..
            self.id .. "'", 2)
    end
    self.now = cfg.clock or codec.now
    self.interrupted = cfg.interrupted or host_interrupted()
    self.logf = cfg.log or function(level, msg)
        if level == "debug" and not cfg.verbose then return end
        if level == "info" and cfg.quiet then return end
        io.stderr:write(("ds4 worker %s: %s%s\n"):format(self.id, level == "warn" and "warning: " or "", msg))
    end
    self.credits = cfg.credits or 0
    self.partial = cfg.partial_rollouts and true or false
    self.max_batch = (cfg.max_batch or 0) > 0 and cfg.max_batch or 32
    self.owed = 0             -- tasks asked for (credit) that have not arrived
    self.running = {}         -- batcher tag -> task: admitted, not answered
    self.silence_s = cfg.silence_s or 10
    self.hello_s = cfg.hello_s or 5
    self.heartbeat_s = cfg.heartbeat_s or 1
    self.give_up_s = cfg.give_up_s or 120
    self.build = ("%s %s"):format("ds4", tostring(ds4.version))
    self.transport = cfg.transport or zmq_transport({ connect = cfg.connect, id = self.id, curve = cfg.curve,
        insecure = cfg.insecure }, self.logf)
    self.session = false      -- a weight_announce answered our latest hello
    self.loaded, self.loaded_crc = 0, nil -- the version in the model's parameters (of this session's trainer)
    self.queue = {}           -- tasks received, not yet generated
    self.dl = nil             -- the download in progress
    self.last_recv, self.last_sent, self.hello_at = self.now(), 0, -math.huge
    self.st = { tasks = 0, samples = 0, tokens = 0, gen_seconds = 0, downloads = 0, download_bytes = 0,
        download_seconds = 0, rejected = 0, hellos = 0, errors = 0, max_active = 0, partials = 0, mixed = 0 }
    self.log_t0, self.log_n, self.log_suppressed = 0, 0, 0
    return self
end

function W:log(level, msg) self.logf(level, msg) end

function W:send(msg, raw)
    local frames = codec.encode(msg, raw)
    local ok, err = self.transport:send(frames)
    if ok then
        self.last_sent = self.now()
        return true
    end
    self:log("debug", ("send %s: %s"):format(msg.t, tostring(err)))
    return false, err
end

function W:hello()
    self.hello_at = self.now()
    self.st.hellos = self.st.hellos + 1
    local ok, err = self:send({ t = "hello", worker = self.id, policy = self.loaded, max_batch =
        math.min(65536, self.max_batch), threads = math.max(1, ds4.threads()),
        vocab_size = self.vocab, n_params = self.n_params, config_crc = self.config_crc, tables_crc = self.tables,
        build = self.build })
    self.hello_ok = ok
    if not ok and not self.warned_unconnected and self.now() - (self.started or self.now()) > 10 then
        self.warned_unconnected = true
        self:log("warn", "no connection to the trainer after 10 s (is it running? with CURVE: is --server-key the "
            .. "trainer's public key, and this worker's key in its allow-list?)")
    end
    return ok, err
end

function W:heartbeat(active)
    self:send({ t = "heartbeat", policy = self.loaded, active = active or 0 })
end

-- A new session is needed (trainer restart, bye, silence): forget tasks and leases, say hello.
function W:lose_session(why)
    if self.session then self:log("info", "session lost (" .. why .. "): saying hello again") end
    self.session = false
    self.credit_sent = false
    self.owed = 0
    if next(self.running) ~= nil then
        self:log("debug", ("dropping %d running tasks (the trainer re-issues them)"):format(self:active()))
        self:drop_running()
    end
    if #self.queue > 0 then
        self:log("debug", ("dropping %d queued tasks (the trainer re-issues them)"):format(#self.queue))
        self.queue = {}
    end
    self:hello()
end

local function rate_log(self, msg)
    local now = self.now()
    if now - self.log_t0 >= 1 then
        if self.log_suppressed > 0 then self:log("warn", ("%d more messages rejected"):format(self.log_suppressed)) end
        self.log_t0, self.log_n, self.log_suppressed = now, 0, 0
    end
    if self.log_n < 10 then
        self.log_n = self.log_n + 1
        self:log("warn", msg)
    else
        self.log_suppressed = self.log_suppressed + 1
    end
end

-- ------------------------------------------------------------------------------------------------ weights

-- Protocol v2: the announce carries the trainer's model (its frames' CRCs checked by the decoder). Without a model
-- of our own we build it from that; with one (--model), it must be the trainer's exactly: other hash-routing tables
-- or another config would generate other tokens under the same weights, silently. Returns an error or nil.
function W:check_model(m)
    if not self.model then
        local ok, err = pcall(function()
            local model = require("ds4.core").random_model_json(m.config, 0)
            if model:config_json() ~= m.config then
                error("the model built from the trainer's config does not reproduce it (another ds4 version?)", 0)
            end
            model:set_tables(m.tables)
            if #m.tokenizer > 0 then
                model:set_tokenizer(ds4.tokenizer_from_json(m.tokenizer),
                    { chat_template = m.chat_template ~= "" and m.chat_template or nil })
            end
            self:adopt(model)
        end)
        if not ok then return "cannot build the trainer's model: " .. tostring(err) end
        self:log("info", ("built the trainer's model from its announce: %d parameters, vocabulary %d, tables crc "
            .. "%08x%s"):format(self.n_params, self.vocab, self.tables, #m.tokenizer > 0 and (", tokenizer, template "
            .. (m.chat_template ~= "" and m.chat_template or "none")) or ", no tokenizer"))
    end
    if self.tables ~= m.tables_crc then
        return ("the trainer's hash-routing tables (tid2eid) differ from this worker's --model: crc %08x, this "
            .. "worker's %08x; start the worker without --model (it takes the trainer's model) or from the trainer's "
            .. "checkpoint"):format(m.tables_crc, self.tables)
    end
    if self.config_crc ~= m.config_crc then
        return ("the trainer's model config differs from this worker's --model: crc %08x, this worker's %08x; "
            .. "start the worker without --model or from the trainer's checkpoint"):format(m.config_crc, self.config_crc)
    end
    return nil
end

-- The CRC-32 of the model's own parameters (what the worker started from may be the trainer's weights already).
local function own_crc(model, bytes)
    return codec.buffer_crc(ffi.cast("const uint8_t *", model:params():data_ptr()), bytes)
end

-- A LoRA policy's announce (protocol 4): its adapter layout, checked against this model; nil + why if it does not fit.
local function announced_layout(self, m)
    local layout = { rank = m.lora_rank, alpha = m.lora_alpha, rslora = m.lora_rslora,
        masks = codec.unpack_i32(codec.raw(m, "lora_masks") or "") }
    local ok, n = pcall(self.model.lora_layout_numel, self.model, layout)
    if not ok then return nil, "the trainer's adapter layout does not fit this model: " .. tostring(n) end
    if m.bytes ~= 4 * n then
        return nil, ("announce of %d adapter bytes, the layout makes %d values"):format(m.bytes, n)
    end
    return layout
end

function W:on_announce(m)
    local mismatch = self:check_model(m)
    if mismatch then
        self:log("warn", "refusing the trainer's model: " .. mismatch)
        self:send(codec.error_msg("refused", mismatch, "weight_announce", m.version))
        self.exit_status = 1
        return
    end
    -- stop strings are matched in the text of the trainer's tokenizer (a --model's own may differ)
    if #m.tokenizer > 0 and m.tokenizer_crc ~= self.stop_tok_crc then
        local ok, tok = pcall(ds4.tokenizer_from_json, m.tokenizer)
        if ok then self.stop_tok, self.stop_tok_crc = tok, m.tokenizer_crc end
    end
    if not self.session then
        self.session = true
        self:log("info", ("session with the trainer: policy version %d (%.1f MB), %d CPU threads"):format(m.version,
            m.bytes / 1e6, ds4.threads()))
        -- versions belong to a trainer run: what we hold counts only if it is byte-for-byte the announced one
        if self.loaded ~= m.version or self.loaded_crc ~= m.crc then self.loaded, self.loaded_crc = 0, nil end
    end
    self.announced = m.version
    if m.version == self.loaded and m.crc == self.loaded_crc then return self:grant_initial() end
    if self.dl and self.dl.announce.version == m.version and self.dl.announce.crc == m.crc then return end
    if self.staged and self.staged.announce.version == m.version and self.staged.announce.crc == m.crc then return end
    if m.version < self.loaded then return self:grant_initial() end
    local bad, layout
    if m.n_params ~= self.n_params then
        bad = ("the trainer's model has %s parameters, this worker's %d"):format(tostring(m.n_params), self.n_params)
    elseif m.dtype ~= "f32" then
        bad = ("announce of dtype %s, expected f32"):format(tostring(m.dtype))
    elseif m.lora_rank then
        layout, bad = announced_layout(self, m)
    elseif m.bytes ~= 4 * self.n_params then
        bad = ("announce of %d bytes, expected %d f32"):format(m.bytes, 4 * self.n_params)
    end
    if bad then
        self:log("warn", "cannot load the announced weights: " .. bad)
        self:send(codec.error_msg("refused", bad, "weight_announce", m.version))
        return
    end
    -- the model we started from may already be these weights (the trainer's own checkpoint), or the LoRA base
    local first = self.loaded == 0 and not self.checked_own
    if first then self.checked_own = true end
    if layout then
        local function is_base(b) return b and b.version == m.lora_base_version and b.crc == m.lora_base_crc end
        if not is_base(self.base) and not is_base(self.staged_base) then
            if first and own_crc(self.model, 4 * self.n_params) == m.lora_base_crc then
                self.base = { version = m.lora_base_version, crc = m.lora_base_crc }
                self:log("info", ("the starting weights are base version %d already"):format(m.lora_base_version))
            else
                return self:start_download(m, "base", { version = m.lora_base_version, bytes = 4 * self.n_params,
                    chunk = m.lora_base_chunk, chunks = math.ceil(4 * self.n_params / m.lora_base_chunk),
                    crc = m.lora_base_crc })
            end
        end
        m.layout = layout
        return self:start_download(m, "adapters", m)
    end
    if first and own_crc(self.model, m.bytes) == m.crc then
        self.loaded, self.loaded_crc = m.version, m.crc
        self:log("info", ("the starting weights are version %d already"):format(m.version))
        self:heartbeat()
        return self:grant_initial()
    end
    self:start_download(m, "weights", m)
end

-- Fetch one buffer: "weights" (a plain policy: every parameter), "base" (a LoRA policy's frozen weights, staged
-- until its adapters are in) or "adapters". target: {version, bytes, chunk, chunks, crc}; m: the announce.
function W:start_download(m, what, target)
    self.staged = nil -- a staging buffer is about to hold a newer version
    local staging
    if what == "adapters" then
        if not self.lora_staging or self.lora_staging:numel() ~= target.bytes / 4 then
            self.lora_staging = ds4.zeros({ target.bytes / 4 })
        end
        staging = self.lora_staging
    else
        self.staged_base = nil
        if not self.staging then self.staging = ds4.zeros({ self.n_params }) end
        staging = self.staging
    end
    local old = self.dl
    self.dl = { version = target.version, bytes = target.bytes, chunk = target.chunk, chunks = target.chunks,
        crc = target.crc, what = what, announce = m, next = 0, outstanding = 0, received = 0, got = {},
        t0 = self.now(), restarts = (old and old.version == target.version) and old.restarts or 0,
        ptr = ffi.cast("uint8_t *", staging:data_ptr()) }
    self:log("debug", ("fetching version %d (%s): %d chunks of %d bytes"):format(target.version, what, target.chunks,
        target.chunk))
    self:pump()
end

-- A complete, CRC-checked download of a policy version ("weights" or "adapters") goes into the model, with the
-- staged base of a LoRA policy (W:apply_staged calls it when no task runs).
function W:install(d)
    local model, m = self.model, d.announce
    if d.what == "weights" then
        if model:lora_info() then model:drop_lora() end
        model:set_params(self.staging)
        self.base = nil
    else
        if self.staged_base then
            model:set_params(self.staging)
            self.base, self.staged_base = self.staged_base, nil
        end
        local have = model:lora_layout()
        if not have or not codec.same_layout(have, m.layout) then model:lora_from_layout(m.layout) end
        model:set_lora_params(self.lora_staging)
    end
    self.loaded, self.loaded_crc = m.version, m.crc
end

function W:pump()
    local d = self.dl
    if not d or (d.retry_at and self.now() < d.retry_at) then return end
    d.retry_at = nil
    local now = self.now()
    if d.outstanding > 0 and now - (d.progress_at or d.t0) > 30 then
        -- a request or chunk was lost (a full queue, a reconnect): ask again for what is missing
        self:log("warn", ("version %d: no chunk for 30 s, requesting the missing ones again"):format(d.version))
        d.next, d.outstanding, d.progress_at = 0, 0, now
    end
    while d.outstanding < WINDOW and d.next < d.chunks do
        if not d.got[d.next] then
            if not self:send({ t = "weight_request", version = d.version, index = d.next }) then return end
            d.outstanding = d.outstanding + 1
            d.progress_at = d.progress_at or now
        end
        d.next = d.next + 1
    end
end

function W:on_chunk(m)
    local d = self.dl
    if not d or m.version ~= d.version then
        self:log("debug", ("ignoring chunk %d of version %d (not being fetched)"):format(m.index, m.version))
        return
    end
    if m.bytes ~= d.bytes or m.chunk ~= d.chunk or m.index >= d.chunks then
        rate_log(self, ("weight chunk %d of version %d disagrees with the announce"):format(m.index, m.version))
        self:send(codec.error_msg("range", "weight_chunk disagrees with the announce", "weight_chunk", m.version,
            m.index))
        return
    end
    if d.got[m.index] then return end
    local data = codec.raw(m, "weights")
    ffi.copy(d.ptr + m.offset, data, #data)
    d.got[m.index] = true
    d.progress_at = self.now()
    d.received = d.received + 1
    d.outstanding = math.max(0, d.outstanding - 1)
    if d.received < d.chunks then return self:pump() end
    local crc = codec.buffer_crc(d.ptr, d.bytes)
    if crc ~= d.crc then
        self.st.errors = self.st.errors + 1
        if d.restarts < 1 then
            self:log("warn", ("version %d: whole-buffer CRC %08x, announced %08x: fetching again"):format(d.version,
                crc, d.crc))
            d.restarts = d.restarts + 1
            d.next, d.outstanding, d.received, d.got = 0, 0, 0, {}
            return self:pump()
        end
        self:log("warn", ("version %d: CRC mismatch again: reporting it, retrying in 5 s"):format(d.version))
        self:send(codec.error_msg("crc", ("weights of version %d: CRC %08x, announced %08x"):format(d.version, crc,
            d.crc), "weight_announce", d.version))
        d.restarts = 0
        d.next, d.outstanding, d.received, d.got = 0, 0, 0, {}
        d.retry_at = self.now() + 5
        return
    end
    local dt = self.now() - d.t0
    self.dl = nil
    self.st.downloads = self.st.downloads + 1
    self.st.download_bytes = self.st.download_bytes + d.bytes
    self.st.download_seconds = self.st.download_seconds + dt
    self:log("info", ("fetched %s of version %d (%.1f MB in %.3f s, %.1f MB/s)"):format(d.what, d.version,
        d.bytes / 1e6, dt, d.bytes / 1e6 / math.max(dt, 1e-9)))
    if d.what == "base" then -- kept staged: the model changes only when the adapters are in too
        self.staged_base = { version = d.version, crc = d.crc }
        return self:on_announce(d.announce)
    end
    -- the swap waits for the running tasks (W:apply_staged): a generation never mixes two versions
    self.staged = d
    self:apply_staged()
end

-- Load downloaded weights once no task runs: one memcpy into the model's parameter buffer (and, for a LoRA policy,
-- one into its adapters' buffer).
function W:apply_staged()
    local d = self.staged
    local running = next(self.running) ~= nil
    if not d or (running and not (self.partial and self:swappable(d))) then return end
    self.staged = nil
    if running then self:mark_switch(d.announce.version) end
    self:install(d)
    self:log("info", ("loaded policy version %d%s"):format(self.loaded, d.what == "adapters" and " (LoRA adapters)"
        or ""))
    self:heartbeat()
    self:grant_initial()
end

-- Partial rollouts: whether staged weights may go in under running sequences. New values of the same parameters
-- (plain weights on a model without adapters, or adapters of the layout already attached, over the same base) may;
-- what changes the model's structure (attaching, dropping or re-shaping adapters, a new base) waits for the running
-- tasks, as without partial rollouts.
function W:swappable(d)
    local model = self.model
    if d.what == "weights" then return not model:lora_info() end
    local have = model:lora_layout()
    return not self.staged_base and have ~= nil and codec.same_layout(have, d.announce.layout)
end

-- Before new weights go in under running tasks: each running task notes how many tokens each of its sequences has
-- (those are of the old version; what follows is of `version`).
function W:mark_switch(version)
    for tag, t in pairs(self.running) do
        t.switches[#t.switches + 1] = { counts = self.bt:peek(tag) or {}, version = version }
    end
    self:log("debug", ("policy version %d goes in under %d running tasks (partial rollouts)"):format(version,
        self:active()))
end

function W:grant_initial()
    if self.session and not self.credit_sent and self.loaded > 0 then
        if self:credit(self.credits > 0 and self.credits or 1) then self.credit_sent = true end
    end
end

-- Ask for n more tasks; owed counts the tasks asked for that have not arrived yet.
function W:credit(n)
    local ok = self:send({ t = "credit", n = n })
    if ok then self.owed = self.owed + n end
    return ok
end

-- ------------------------------------------------------------------------------------------------ tasks

function W:on_task(m)
    self.owed = math.max(0, self.owed - 1)
    if not self.session then
        self:log("debug", ("dropping task %d: no session (it belongs to a session the trainer has ended)"):format(
            m.task_id))
        return
    end
    local ids = codec.unpack_i32(codec.raw(m, "prompt") or "")
    local bad
    for i, v in ipairs(ids) do
        if v < 0 or v >= self.vocab then
            bad = ("prompt token %d is %d, outside the vocabulary [0, %d)"):format(i, v, self.vocab)
            break
        end
    end
    if not bad and type(m.seed) ~= "number" then bad = "seed above 2^53 is not supported by this worker" end
    if not bad and #(m.stop_strings or {}) > 0 and not self.stop_tok then
        bad = "stop strings need the trainer's tokenizer, and its announce carried none"
    end
    if bad then
        rate_log(self, ("task %d refused: %s"):format(m.task_id, bad))
        self:send(codec.error_msg("range", bad, "task", m.task_id, m.attempt))
        self:credit(1)
        return
    end
    m.ids = ids
    self.owed = math.max(0, self.owed - 1)
    self.queue[#self.queue + 1] = m
end

-- ------------------------------------------------------------------------------------------------ batching

-- Tasks run in the model's continuous batcher (model:batcher, core/generate.c): up to max_batch sequences decode
-- together, a task is admitted as soon as its n sequences fit, and each task's results equal model:generate of
-- its prompt with its seed alone (per-sequence sampling streams, a batch-invariant step), whatever runs beside it.
function W:batcher()
    if not self.bt or self.bt_model ~= self.model then
        self.bt = self.model:batcher{ max_seqs = self.max_batch }
        self.bt_model = self.model
    end
    return self.bt
end

-- Tasks admitted to the batcher and not answered yet.
function W:active()
    local n = 0
    for _ in pairs(self.running) do n = n + 1 end
    return n
end

-- Admit the queued tasks this worker's weights may serve. Not while new weights wait for the running tasks to
-- finish (a generation never mixes two versions): the batcher drains, the weights are swapped, then admission
-- goes on.
function W:admit()
    if self.staged or not self.session then return end
    local i = 1
    while i <= #self.queue do
        local t = self.queue[i]
        if t.policy <= self.loaded then
            table.remove(self.queue, i)
            self:submit(t)
        else
            i = i + 1
        end
    end
end

function W:submit(t)
    local stop = {}
    for i, v in ipairs(t.stop or {}) do stop[i] = v end
    t.stop_ids = t.stop or {}
    for _, v in ipairs(t.stop_strings or {}) do stop[#stop + 1] = v end
    local ok, tag = pcall(self.batcher, self)
    if ok then
        ok, tag = pcall(self.bt.submit, self.bt, { t.ids }, { n = t.n, max_new_tokens = t.max_new_tokens,
            temperature = t.temperature, top_k = t.top_k, top_p = t.top_p, min_p = t.min_p, seed = t.seed, stop = stop,
            ignore_eos = t.ignore_eos or false, record_experts = t.record_experts or false,
            record_index = t.record_index or false,
            tokenizer = #(t.stop_strings or {}) > 0 and self.stop_tok or nil })
    end
    if not ok then return self:task_failed(t, tag) end
    t.t0, t.policy_used, t.switches, t.sent = self.now(), self.loaded, {}, {}
    self.running[tag] = t
    self.last_n = t.n
    local active = self:active()
    self.st.max_active = math.max(self.st.max_active, active)
    self:log("debug", ("task %d attempt %d admitted: %d tasks in the batcher"):format(t.task_id, t.attempt, active))
end

function W:task_failed(t, why)
    self.st.errors = self.st.errors + 1
    self:log("warn", ("task %d: generation failed: %s"):format(t.task_id, tostring(why)))
    self:send(codec.error_msg("internal", "generation failed: " .. tostring(why), "task", t.task_id, t.attempt))
    self:credit(1)
end

-- One step of every running sequence, then the answers of the tasks that finished.
function W:decode()
    if not self.bt or next(self.running) == nil then return end
    local ok, err = pcall(self.bt.step, self.bt)
    if not ok then self:log("warn", "decode step failed: " .. tostring(err)) end
    while true do
        local tag, res, why = self.bt:take()
        if not tag then break end
        local t = self.running[tag]
        self.running[tag] = nil
        if t then
            if res then self:answer(t, res) else self:task_failed(t, why) end
        end
    end
    for tag, t in pairs(self.running) do
        if (t.stream or 0) > 0 then self:stream(tag, t) end
    end
end

-- Partial rollouts: token j of sequence i of task t is of the newest version whose switch found fewer than j tokens.
local function token_version(t, i, j)
    local v = t.policy_used
    for _, sw in ipairs(t.switches) do
        if j > (sw.counts[i] or 0) then v = sw.version end
    end
    return v
end

-- A task sent with stream = N: once one of its samples has N tokens more than the partial messages carried so far,
-- one more carries every sample's new tokens (protocol 5), with each token's version when the task went on under
-- newer weights (protocol 6).
function W:stream(tag, t)
    local counts = self.bt:peek(tag)
    if not counts then return end
    local due = false
    for i, c in ipairs(counts) do
        if c - (t.sent[i] or 0) >= t.stream then due = true break end
    end
    if not due then return end
    local _, parts = self.bt:peek(tag, t.sent)
    local seq, toks, lps, slps, lag = {}, {}, {}, {}, {}
    local newest = #t.switches > 0 and t.switches[#t.switches].version
    for i, part in ipairs(parts) do
        local from = t.sent[i] or 0
        seq[i] = { offset = from, n_gen = #part.ids }
        for j = 1, #part.ids do
            toks[#toks + 1] = part.ids[j]
            lps[#lps + 1] = part.logprobs[j]
            slps[#slps + 1] = part.sample_logprobs[j]
            if newest then lag[#lag + 1] = newest - token_version(t, i, from + j) end
        end
        t.sent[i] = from + #part.ids
    end
    local msg = { t = "partial", task_id = t.task_id, attempt = t.attempt, policy = math.max(self.loaded, 1), seq = seq }
    local raw = { tokens = codec.pack_i32(toks), logprobs = codec.pack_f32(lps), sample_logprobs = codec.pack_f32(slps) }
    if newest then -- the task went on under newer weights: each token's version (protocol 6), as the answer gives them
        msg.policy, msg.token_versions, raw.policy_lag = newest, true, codec.pack_i32(lag)
    end
    self:send(msg, raw)
    self.st.partials = self.st.partials + 1
end

-- Drop every admitted task (a lost session, or leaving): their leases are re-issued by the trainer.
function W:drop_running()
    if not self.bt then return end
    for tag in pairs(self.running) do self.bt:cancel(tag) end
    while self.bt:take() do end
    self.running = {}
end

-- More credit while the batcher has room and nothing waits (credits = 0: as many tasks as fit, one queued);
-- with --credits N the worker asks for N at first and one per answer.
function W:grow_credit()
    if self.credits > 0 or not self.credit_sent or #self.queue > 0 or self.owed > 0 or self.staged then return end
    local room = self.bt and self.bt:stats().free_seqs or self.max_batch
    if room >= (self.last_n or 1) and self:active() + self.owed < 1024 then
        self:credit(1)
    end
end

function W:answer(t, res)
    local n = #res
    local seq = {}
    local toks, lps, slps = {}, {}, {}
    local ex, ix, exs, ixs = {}, {}, nil, nil
    for i, r in ipairs(res) do
        local q = { prompt_len = r.prompt_len or #t.ids, n_gen = #r.ids, finish = codec.FINISH_CODE[r.finish_reason]
            or 1, stop_index = -1, n_rows = 0 }
        seq[i] = q
        if r.finish_reason == "stop_token" then
            for k, v in ipairs(t.stop_ids) do if v == r.stop then q.stop_index = k - 1 break end end
            if q.stop_index < 0 then q.finish = codec.FINISH_CODE.eos end
        elseif r.finish_reason == "stop_string" then
            for k, v in ipairs(t.stop_strings or {}) do if v == r.stop then q.stop_index = k - 1 break end end
        end
        for j = 1, #r.ids do
            toks[#toks + 1] = r.ids[j]
            lps[#lps + 1] = r.logprobs[j]
            slps[#slps + 1] = r.sample_logprobs[j]
        end
        if r.experts or r.index_picks then
            local e, x = r.experts, r.index_picks
            q.n_rows = (e or x):size(1)
            if e then
                exs = { e:size(2), e:size(3) }
                ex[#ex + 1] = ffi.string(e:data_ptr(), e:nbytes())
            end
            if x then
                ixs = { x:size(2), x:size(3) }
                ix[#ix + 1] = ffi.string(x:data_ptr(), x:nbytes())
            end
        end
    end
    local msg = { t = "samples", task_id = t.task_id, attempt = t.attempt, policy = t.policy_used, n = n, seq = seq }
    local raw = { tokens = codec.pack_i32(toks), logprobs = codec.pack_f32(lps), sample_logprobs = codec.pack_f32(slps) }
    if #t.switches > 0 then
        local newest, lag = t.switches[#t.switches].version, {}
        for i, r in ipairs(res) do
            for j = 1, #r.ids do lag[#lag + 1] = newest - token_version(t, i, j) end
        end
        msg.policy, msg.token_versions, raw.policy_lag = newest, true, codec.pack_i32(lag)
        self.st.mixed = self.st.mixed + 1
    end
    if exs then msg.experts_layers, msg.experts_k, raw.experts = exs[1], exs[2], table.concat(ex) end
    if ixs then msg.index_layers, msg.index_topk, raw.index = ixs[1], ixs[2], table.concat(ix) end
    self:send(msg, raw)
    self:credit(1)
    local dt = self.now() - t.t0
    self.st.tasks = self.st.tasks + 1
    self.st.samples = self.st.samples + n
    self.st.tokens = self.st.tokens + #toks
    self.st.gen_seconds = self.st.gen_seconds + dt
    self:log("debug", ("task %d attempt %d: %d samples, %d tokens in %.3f s (policy %d%s)"):format(t.task_id, t.attempt,
        n, #toks, dt, t.policy_used, #t.switches > 0 and (" to " .. msg.policy) or ""))
end

-- ------------------------------------------------------------------------------------------------ messages

function W:on_message(frames)
    self.last_recv = self.now()
    local m, code, why, ref_t = codec.decode(frames)
    if not m then
        self.st.rejected = self.st.rejected + 1
        if ref_t == "" then ref_t = nil end
        rate_log(self, ("rejected a message from the trainer: %s (%s)"):format(tostring(why), tostring(code)))
        if ref_t ~= "error" then self:send(codec.error_msg(code or "parse", why, ref_t)) end
        if code == "version" then
            -- a trainer of another protocol version: nothing it sends can be understood, so waiting is pointless
            self:log("warn", "the trainer speaks another protocol version (" .. tostring(why) .. "): run the same "
                .. "ds4 version on the trainer and the workers")
            self.exit_status = 1
        end
        return
    end
    local t = m.t
    if t == "weight_announce" then
        self:on_announce(m)
    elseif t == "weight_chunk" then
        self:on_chunk(m)
    elseif t == "task" then
        self:on_task(m)
    elseif t == "heartbeat" then
        if self.session and m.policy > self.loaded and not self.dl and (self.announced or 0) < m.policy then
            -- an announce was lost (it was sent while we were not connected): ask again
            self:lose_session("the trainer is at version " .. m.policy .. ", no announce seen")
        end
    elseif t == "error" then
        local name = codec.CODE_NAME[m.code] or tostring(m.code)
        if m.code == codec.CODE.refused then
            self:log("warn", "the trainer refused this worker: " .. tostring(m.reason))
            self.exit_status = 1
        elseif m.code == codec.CODE.version then
            self:log("warn", "protocol version mismatch: " .. tostring(m.reason))
            self.exit_status = 1
        elseif m.code == codec.CODE.state and tostring(m.reason):find("unknown worker", 1, true) then
            self:lose_session("the trainer does not know this worker (restarted?)")
        elseif m.code == codec.CODE.state and m.ref_t == "weight_request" then
            self:log("debug", "weight version " .. tostring(m.ref_id) .. " no longer kept")
            if self.dl and self.dl.version == m.ref_id then self.dl = nil end
        else
            self.st.errors = self.st.errors + 1
            local lvl = (m.code == codec.CODE.state or m.code == codec.CODE.stale) and "debug" or "warn"
            self:log(lvl, ("trainer error %s: %s"):format(name, tostring(m.reason)))
        end
    elseif t == "bye" then
        self.session = true -- lose_session logs it
        self:lose_session("the trainer said bye" .. ((m.reason and m.reason ~= "") and (": " .. m.reason) or ""))
        self.dl = nil
    else
        rate_log(self, "unexpected " .. t .. " from the trainer")
        self:send(codec.error_msg("state", "a worker-to-trainer message (" .. t .. ") sent to a worker", t))
    end
end

-- ------------------------------------------------------------------------------------------------ run

function W:start()
    self.started = self.now()
    self:log("info", ("connecting to %s (%s)"):format(tostring(self.cfg.connect or "transport"), self.model and
        ("%d parameters"):format(self.n_params) or "no model: it comes from the trainer"))
    self:hello()
end

-- One turn of the loop: admit what may run, one decode step of every running sequence (answering the tasks that
-- finished), then handle what arrived (waiting up to timeout_ms when nothing runs), fetch weights, keep the
-- session alive. Between two decode steps the worker reads the trainer and sends heartbeats, so it is never
-- silent for longer than one step. Returns an exit status when the worker should stop, else nil.
function W:step(timeout_ms)
    if self.interrupted() then return 0 end
    if self.exit_status then return self.exit_status end
    self:admit()
    local tasks_before = self.st.tasks
    self:decode()
    if self.cfg.max_tasks and self.st.tasks >= self.cfg.max_tasks and self.st.tasks > tasks_before then return 0 end
    if self.interrupted() then return 0 end
    self:apply_staged()
    local busy = next(self.running) ~= nil or (self.session and not self.staged and self:peek_runnable())
    local fr = self.transport:recv(busy and 0 or (timeout_ms or 50))
    local n = 0
    while fr do
        self:on_message(fr)
        n = n + 1
        if n >= 256 then break end
        fr = self.transport:recv(0)
    end
    self:pump()
    self:grow_credit()
    local now = self.now()
    if self.session then
        self.alone_since = nil
    else
        -- no trainer: not started yet, or gone (killed, finished). A worker does not wait forever for one.
        self.alone_since = self.alone_since or now
        if now - self.alone_since >= self.give_up_s then
            self:log("error", ("no trainer at %s for %.0f s (it is gone, or was never started): giving up "
                .. "(--give-up S waits longer)"):format(tostring(self.cfg.connect or "the transport"),
                now - self.alone_since))
            self.exit_status = 1
            return 1
        end
    end
    if not self.session then
        local every = self.hello_ok and self.hello_s or 0.25
        if now - self.hello_at >= every then self:hello() end
    elseif now - self.last_recv > self.silence_s then
        self:lose_session(("no message from the trainer for %.0f s"):format(now - self.last_recv))
    elseif now - self.last_sent >= self.heartbeat_s then
        self:heartbeat(self:active())
    end
    return self.exit_status
end

function W:finish(status)
    self:drop_running() -- unanswered: the bye re-issues them
    if self.session or self.hello_ok then self:send({ t = "bye", reason = status == 0 and "stopping" or "refused" }) end
    self.transport:close(1000)
    self:log("info", ("stopped: %d tasks, %d samples, %d tokens"):format(self.st.tasks, self.st.samples,
        self.st.tokens))
    return status
end

function W:run()
    self:start()
    local status
    repeat status = self:step(50) until status
    return self:finish(status)
end

function W:peek_runnable()
    for _, t in ipairs(self.queue) do if t.policy <= self.loaded then return true end end
    return false
end

function M.run(cfg)
    return M.new(cfg):run()
end

-- ------------------------------------------------------------------------------------------------ ds4 worker

local USAGE = [[
usage: ds4 worker --connect ENDPOINT [--model DIR|CONFIG.json] [--threads N] [--device D] [--dtype T]
                  [--key FILE --server-key FILE | --insecure] [--id NAME] [--max-batch N] [--credits N]
                  [--give-up S] [--silence S] [--partial-rollouts] [--quiet] [--verbose]

  --connect EP        the trainer pool's endpoint (tcp://HOST:PORT, ipc://PATH)
  --model DIR         optional: without it the worker needs no local files and builds its model from what the
                      trainer sends (config, tokenizer, hash-routing tables, weights). With it (a checkpoint
                      directory, or a config.json: random weights) the trainer's weights replace its
                      parameters, and its config and hash-routing tables must equal the trainer's: a
                      mismatch is refused on both sides (start from the trainer's checkpoint, or without it)
  --threads N         CPU threads (default 0: one per physical core, at most 16); several workers, or a worker
                      beside its trainer, on one host: give each its share of the cores
  --device D          where the model generates: cpu (default), cuda or cuda:N
  --dtype T           the GPU's working dtype: bf16 (default) or fp32; the trainer's log-probabilities equal the
                      worker's only when both compute on the same kind of device in the same dtype
  --key FILE          this worker's CURVE secret key (`ds4 keygen --out PREFIX` writes PREFIX.key, PREFIX.pub)
  --server-key FILE   the trainer's CURVE public key (its .pub file)
  --insecure          plain TCP without CURVE (unauthenticated, unencrypted); not needed for ipc://
  --id NAME           worker id (1..64 printable ASCII; default HOST-PID)
  --max-batch N       sequences decoded together over all running tasks (continuous batching; default and 0: 32):
                      a task of n samples runs as soon as n of them are free
  --credits N         tasks in flight (running and queued) at most; default 0: as many as fit --max-batch,
                      plus one queued (--credits 2 --max-batch n: one task of n samples at a time)
  --give-up S         exit (status 1) after S seconds without a trainer: never reached, or gone (default 120)
  --silence S         a trainer silent this long has lost the session: hello again (default 10)
  --partial-rollouts  new weights go in at once and the running sequences continue under them (the cache of what
                      they generated so far stays as computed under the old weights), each token's version in the
                      answer; default: new weights wait until the running tasks have finished
Ctrl-C or SIGTERM: finish nothing more, say bye, exit 0.]]

local function hostname()
    local f = io.open("/proc/sys/kernel/hostname")
    local h = f and f:read("*l") or "worker"
    if f then f:close() end
    return h
end

local function pid()
    local f = io.open("/proc/self/stat")
    local p = f and f:read("*l"):match("^(%d+)") or tostring(os.time())
    if f then f:close() end
    return p
end

function M.main(argv)
    local o = { threads = -1, ["max-batch"] = 32, credits = 0, ["give-up"] = 120, silence = 10 }
    local flags = { insecure = true, quiet = true, verbose = true, ["partial-rollouts"] = true }
    local valued = { connect = true, model = true, threads = true, key = true, ["server-key"] = true, id = true,
        ["max-batch"] = true, credits = true, ["give-up"] = true, silence = true, device = true, dtype = true }
    local i = 1
    while i <= #argv do
        local a = argv[i]
        if a == "-h" or a == "--help" then
            print(USAGE)
            return 0
        end
        local k, v = a:match("^%-%-([%w%-]+)=(.*)$")
        if not k then k = a:match("^%-%-([%w%-]+)$") end
        if k and flags[k] and not v then
            o[k] = true
        elseif k and valued[k] then
            if not v then
                i = i + 1
                v = argv[i]
            end
            if not v or v == "" then
                io.stderr:write("ds4 worker: --" .. k .. " needs a value\n\n" .. USAGE .. "\n")
                return 2
            end
            o[k] = v
        else
            io.stderr:write("ds4 worker: unknown option '" .. tostring(a) .. "'\n\n" .. USAGE .. "\n")
            return 2
        end
        i = i + 1
    end
    local function num(k, lo, hi)
        local n = tonumber(o[k])
        if not n or n ~= math.floor(n) or n < lo or n > hi then
            io.stderr:write(("ds4 worker: --%s needs an integer in [%d, %d], got '%s'\n"):format(k, lo, hi,
                tostring(o[k])))
            return nil
        end
        return n
    end
    if not o.connect then
        io.stderr:write("ds4 worker: --connect ENDPOINT is required\n\n" .. USAGE .. "\n")
        return 2
    end
    local threads, max_batch, credits = num("threads", -1, 4096), num("max-batch", 0, 65536), num("credits", 0, 1024)
    local give_up, silence = num("give-up", 1, 86400 * 365), num("silence", 1, 86400)
    if not threads or not max_batch or not credits or not give_up or not silence then return 2 end
    local curve
    if o.key or o["server-key"] then
        if not (o.key and o["server-key"]) then
            io.stderr:write("ds4 worker: CURVE needs both --key FILE (this worker's secret key) and --server-key FILE "
                .. "(the trainer's public key)\n")
            return 2
        end
        if o.insecure then
            io.stderr:write("ds4 worker: --insecure and --key/--server-key exclude each other\n")
            return 2
        end
        curve = {}
        local ok, err = pcall(function()
            curve.secret = codec.read_key(o.key, "--key")
            curve.public = ds4.zmq.public_from_secret(curve.secret)
            curve.server = codec.read_key(o["server-key"], "--server-key")
        end)
        if not ok then
            io.stderr:write("ds4 worker: " .. tostring(err) .. "\n")
            return 2
        end
    elseif codec.needs_curve(o.connect) and not o.insecure then
        io.stderr:write("ds4 worker: " .. o.connect .. " is plain TCP: give --key FILE --server-key FILE (CURVE keys "
            .. "from `ds4 keygen --out PREFIX`), or --insecure to connect unauthenticated and unencrypted\n")
        return 2
    end
    if threads >= 0 then ds4.set_threads(threads) end
    if o.device or o.dtype then
        local ok, err = pcall(ds4.set_device, o.device or "cuda", o.dtype)
        if not ok then
            io.stderr:write("ds4 worker: " .. tostring(err) .. "\n")
            return 2
        end
    end
    local model
    local ok, err = pcall(function()
        if not o.model then return end -- built from the trainer's announce
        if o.model:match("%.json$") then model = ds4.random_model(o.model, 0) else model = ds4.load(o.model) end
    end)
    if not ok then
        io.stderr:write("ds4 worker: cannot load the model: " .. tostring(err) .. "\n")
        return 1
    end
    local id = o.id or (hostname() .. "-" .. pid()):sub(1, 64)
    local w = M.new{ connect = o.connect, model = model, id = id, curve = curve, insecure = o.insecure,
        max_batch = max_batch, credits = credits, quiet = o.quiet, verbose = o.verbose, give_up_s = give_up,
        silence_s = silence, partial_rollouts = o["partial-rollouts"] }
    return w:run()
end

return M
