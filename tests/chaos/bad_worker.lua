--[==[ tests/chaos/bad_worker.lua — a rollout worker that misbehaves on purpose, in the ways issue 18 found
  (not itself a test: tests/lua/test_rollout_pool.lua drives it over a fake network, tests/chaos/test_bad_workers.sh
  runs it as processes over ZeroMQ through tests/chaos/run_bad_worker.lua).

  local bad = require("bad_worker")
  local w = bad.new(mode, id, transport, {vocab = V, n_params = P, clock = fn})
  w:step()            -- handle what arrived, answer as the mode says, heartbeat (not in "silence")

  transport: send(frames) -> ok, recv() -> frames | nil (never blocks). Every message it sends is well-formed (the
  codec encodes it): what is wrong is its content or its timing. Modes (bad.MODES):
    bad_ids         samples whose first token is not a token id (999999)
    nan_logprobs    samples whose log-probabilities are NaN
    error           every task answered with error "internal" (what a worker sends when generation fails)
    future_version  samples claiming a policy version the trainer has not published
    rehello         takes a task, then says hello again (a new session) instead of answering
    credit_flood    grants 1024 credits and never answers (heartbeats keep it alive)
    silence         heartbeats until it is given a task, then sends nothing at all
    garbage         a valid hello and credit, then answers every task with malformed messages (not a map, a
                    truncated samples header, a samples message whose token frame is 4 bytes short)
  Otherwise it behaves: hello, credit once it hears the weight announce (it claims to hold the weights without
  fetching them), one more credit per answer, hello again after "unknown worker".
]==]

local codec = require("ds4.rollout.codec")

local M = {}
M.MODES = { "bad_ids", "nan_logprobs", "error", "future_version", "rehello", "credit_flood", "silence", "garbage" }
local KNOWN = {}
for _, m in ipairs(M.MODES) do KNOWN[m] = true end

local W = {}
W.__index = W

function M.new(mode, id, transport, opts)
    if not KNOWN[mode] then error("bad_worker: unknown mode " .. tostring(mode), 2) end
    local self = setmetatable({ mode = mode, id = id, transport = transport, vocab = opts.vocab,
        n_params = opts.n_params, clock = opts.clock, version = 0, credited = false, tasks = 0, answers = 0,
        last_beat = opts.clock() }, W)
    self:hello()
    return self
end

function W:send(msg, raw) return self.transport:send(codec.encode(msg, raw)) end

function W:hello()
    self.credited = false
    -- as a worker without local files (protocol v2: no vocabulary, parameters or CRCs to match); its vocabulary
    -- for spoiling answers is self.vocab all the same
    self:send({ t = "hello", worker = self.id, policy = 0, max_batch = 8, threads = 1, vocab_size = 0, n_params = 0,
        build = "bad_worker " .. self.mode })
end

-- Well-formed samples for task m (every sample max_new_tokens long, finish "length"), spoiled as the mode says.
function W:samples(m)
    local seq, toks, lps = {}, {}, {}
    local g = m.max_new_tokens
    for i = 1, m.n do
        seq[i] = { prompt_len = m.prompt_len, n_gen = g, finish = codec.FINISH_CODE.length, stop_index = -1,
            n_rows = 0 }
        for j = 1, g do
            toks[#toks + 1] = (m.seed + 7 * i + j) % self.vocab
            lps[#lps + 1] = -1.5
        end
    end
    local policy = self.version
    if self.mode == "bad_ids" then toks[1] = 999999 end
    if self.mode == "nan_logprobs" then for k = 1, #lps do lps[k] = 0 / 0 end end
    if self.mode == "future_version" then policy = self.version + 5 end
    return { t = "samples", task_id = m.task_id, attempt = m.attempt, policy = policy, n = m.n, seq = seq },
        { tokens = toks, logprobs = lps, sample_logprobs = lps }
end

function W:on_task(m)
    self.tasks = self.tasks + 1
    local mode = self.mode
    if mode == "error" then
        self:send(codec.error_msg("internal", "generation failed: out of memory (bad_worker)", "task", m.task_id,
            m.attempt))
        self:send({ t = "credit", n = 1 })
    elseif mode == "bad_ids" or mode == "nan_logprobs" or mode == "future_version" then
        self:send(self:samples(m))
        self:send({ t = "credit", n = 1 })
    elseif mode == "rehello" then
        self:hello()
    elseif mode == "garbage" then
        local frames = codec.encode(self:samples(m))
        self.transport:send({ "\193 garbage" })
        self.transport:send({ frames[1]:sub(1, math.floor(#frames[1] / 2)), frames[2], frames[3], frames[4] })
        frames[2] = frames[2]:sub(1, -5)
        self.transport:send(frames)
    end -- credit_flood, silence: never answer
    self.answers = self.answers + 1
end

function W:step()
    while true do
        local fr = self.transport:recv()
        if not fr then break end
        local m = codec.decode(fr)
        if m and m.t == "weight_announce" then
            self.version = m.version
            if not self.credited then
                self.credited = true
                self:send({ t = "credit", n = self.mode == "credit_flood" and 1024 or 2 })
            end
        elseif m and m.t == "task" then
            self:on_task(m)
        elseif m and m.t == "error" and tostring(m.reason):find("unknown worker", 1, true) then
            self:hello()
        elseif m and m.t == "bye" then
            self.bye = true
        end
    end
    local now = self.clock()
    if not (self.mode == "silence" and self.tasks > 0) and now - self.last_beat >= 1 then
        self.last_beat = now
        self:send({ t = "heartbeat", policy = self.version, active = 0 })
    end
end

return M
