--[[ bench_rollout.lua — remote rollouts on this machine: weight-sync MB/s and samples/s of a ds4.rollout.pool with
  `ds4 worker` processes on the loopback, for the ~50M-parameter config of bench/bench_forward.c (random weights).

  build/ds4 run bench/bench_rollout.lua [--workers N] [--worker-threads T] [--tasks T] [--n N] [--prompt P]
                                        [--new-tokens K] [--syncs S] [--endpoint tcp|ipc] [--curve] [--local]
                                        [--quick]
  build/ds4 run bench/bench_rollout.lua --batching [--in-flight 1,8,32] [--worker-threads 2] [--tasks 64]
                                        [--n 1] [--prompt 64] [--new-tokens 32] [--rounds 3] [--local]

  1. the model is built (seed 1) and saved once to a temporary directory, from which each worker starts (the
     hash-routing tables must match); the workers are started as background processes of this script;
  2. weight sync: S times, the parameters change (one element), pool:publish snapshots them (CRC-32 included),
     and pool:sync() waits until every worker has fetched, checked and loaded the new version: MB/s = workers ×
     bytes / (publish + sync seconds); the publish (snapshot + CRC) and the sync times are printed apart;
  3. generation: T tasks (prompts of P random tokens, n samples each, K new tokens, temperature 1, ignore_eos so
     every sequence runs to K) through pool:generate: samples/s and generated tokens/s, median of 3 rounds after a
     warm-up round; --local also times model:generate on the same prompts in this process (2 threads) for
     comparison.
  --batching: worker decode throughput with continuous batching. One `ds4 worker` (--worker-threads, default 2
  here) is started per setting K of --in-flight with `--max-batch K*n --credits K`: K tasks in flight, all of them
  decoding in one batch (K = 1: one task at a time, today's worker before continuous batching, which ran one
  model:generate per task), plus `--max-batch n --credits 2` (one task generating, one queued: that worker's
  default). --tasks tasks of n samples, ignore_eos (every sequence runs --new-tokens): generated tokens/s of
  pool:generate, best and median of --rounds rounds after a warm-up round (the machine may be shared: the best is
  the least disturbed). --local also runs model:batcher{max_seqs = K*n} in this process (no worker, no wire) and
  model:generate one task at a time.
  Prints the machine's core count; record results in bench/RESULTS.md.
]]

local ds4 = require("ds4")
local ffi = require("ffi")
-- Each line as it is printed: with stdout a pipe or a file (a remote shell, `| tee`, a timeout that kills the run),
-- C's full buffering held every line of a run of minutes until exit, and a run cut short printed nothing.
io.stdout:setvbuf("line")
local codec = require("ds4.rollout.codec")

local o = { workers = 2, ["worker-threads"] = 1, tasks = 16, n = 8, prompt = 64, ["new-tokens"] = 32, syncs = 3,
    endpoint = "tcp", curve = false, ["local"] = false, quick = false, batching = false, ["in-flight"] = "1,8,32",
    rounds = 3 }
local given = {}
do
    local i = 1
    while i <= #arg do
        local k = arg[i]:match("^%-%-(.+)$")
        if not k or o[k] == nil then error("bench_rollout.lua: unknown option " .. tostring(arg[i]), 0) end
        if type(o[k]) == "boolean" then
            o[k] = true
        else
            i = i + 1
            o[k] = type(o[k]) == "number" and assert(tonumber(arg[i]), "--" .. k .. " needs a number") or arg[i]
        end
        given[k] = true
        i = i + 1
    end
end
if o.quick then o.tasks, o.n, o["new-tokens"], o.syncs = 4, 4, 8, 1 end
if o.batching then -- its own defaults: 64 single-sample tasks, one 2-thread worker
    if not given.tasks then o.tasks = 64 end
    if not given.n then o.n = 1 end
    if not given["worker-threads"] then o["worker-threads"] = 2 end
    o.workers = 1
end

local CONFIG_50M = {
    model_type = "deepseek_v4", vocab_size = 16000, hidden_size = 512, num_hidden_layers = 8,
    num_attention_heads = 8, num_key_value_heads = 1, head_dim = 128, qk_rope_head_dim = 64,
    partial_rotary_factor = 0.5, q_lora_rank = 256, o_groups = 4, o_lora_rank = 128, sliding_window = 128,
    layer_types = { "sliding_attention", "sliding_attention", "compressed_sparse_attention",
        "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention", "heavily_compressed_attention" },
    compress_rates = { compressed_sparse_attention = 4, heavily_compressed_attention = 32 },
    mlp_layer_types = { "hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe", "moe", "moe" },
    index_n_heads = 8, index_head_dim = 64, index_topk = 64, n_routed_experts = 16, num_experts_per_tok = 2,
    n_shared_experts = 1, moe_intermediate_size = 96, scoring_func = "sqrtsoftplus", routed_scaling_factor = 1.5,
    swiglu_limit = 10.0, hc_mult = 4, hc_sinkhorn_iters = 20, rms_norm_eps = 1e-06, rope_theta = 10000.0,
    compress_rope_theta = 160000.0,
    rope_scaling = { type = "yarn", factor = 16, original_max_position_embeddings = 65536, beta_fast = 32,
        beta_slow = 1 },
    max_position_embeddings = 1048576, num_nextn_predict_layers = 1, initializer_range = 0.02,
}

local function sh(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local DS4 = arg[-2] or "ds4"
local tmp = os.tmpname()
os.remove(tmp)
os.execute("mkdir -p " .. sh(tmp))

ds4.set_threads(2)
local model = ds4.new_model(CONFIG_50M, 1)
local bytes = 4 * model:n_params()
model:save(tmp .. "/model")
local cores = 0
for line in io.lines("/proc/cpuinfo") do if line:match("^processor") then cores = cores + 1 end end
print(("bench_rollout: 50m config, %d parameters (%.1f MB of fp32), %d workers x %d threads, %d cores, %s%s"):format(
    model:n_params(), bytes / 1e6, o.workers, o["worker-threads"], cores, o.endpoint, o.curve and " + CURVE" or ""))

local cfg = { model = model, workers = o.batching and 1 or o.workers, wait_s = 120, quiet = true, max_credit = 256 }
local key_args = ""
if o.endpoint == "ipc" then
    cfg.bind = "ipc://" .. tmp .. "/pool.sock"
else
    cfg.bind = "tcp://127.0.0.1:*"
    if o.curve then
        for _, k in ipairs({ "trainer", "w" }) do os.execute(sh(DS4) .. " keygen --out " .. sh(tmp .. "/" .. k) .. " >/dev/null") end
        cfg.curve = { secret = tmp .. "/trainer.key", public = tmp .. "/trainer.pub", allow = { tmp .. "/w.pub" } }
        key_args = " --key " .. sh(tmp .. "/w.key") .. " --server-key " .. sh(tmp .. "/trainer.pub")
    else
        cfg.insecure = true
        key_args = " --insecure"
    end
end
local pool = ds4.rollout.pool(cfg)

-- ------------------------------------------------------------------------------------------------ batching
local function make_prompts()
    local rng, ps = 12345, {}
    for t = 1, o.tasks do
        local p = {}
        for j = 1, o.prompt do
            rng = (rng * 1103515245 + 12345) % 2147483648
            p[j] = rng % 16000
        end
        ps[t] = p
    end
    return ps
end

local function best_median(times)
    table.sort(times)
    return times[1], times[math.ceil(#times / 2)]
end

-- CPU seconds (user + system, all threads) a process has used so far, from /proc/PID/stat (clock ticks of 1/100 s).
local function cpu_seconds(pid)
    local f = io.open("/proc/" .. pid .. "/stat")
    if not f then return 0 end
    local line = f:read("*l")
    f:close()
    local rest = line:match("%) (.*)$") -- after the command name, which may hold spaces
    local fields = {}
    for w in rest:gmatch("%S+") do fields[#fields + 1] = w end
    return (tonumber(fields[12]) + tonumber(fields[13])) / 100 -- utime, stime (fields 14, 15 of the whole line)
end

if o.batching then
    pool:publish(model) -- version 1 = the saved weights: each worker checks their CRC and loads nothing
    local prompts = make_prompts()
    local gopts = { n = o.n, max_new_tokens = o["new-tokens"], temperature = 1.0, ignore_eos = true, seed = 7 }
    local tokens = o.tasks * o.n * o["new-tokens"]
    local settings = {}
    for k in o["in-flight"]:gmatch("%d+") do
        local kk = tonumber(k)
        settings[#settings + 1] = { name = ("%d in flight"):format(kk), args = ("--max-batch %d --credits %d"):format(
            kk * o.n, kk) }
    end
    settings[#settings + 1] = { name = "one at a time + one queued", args = ("--max-batch %d --credits 2"):format(o.n) }
    print(("batching: %d tasks x %d samples x %d new tokens (prompt %d), one worker of %d threads, best and median "
        .. "of %d rounds"):format(o.tasks, o.n, o["new-tokens"], o.prompt, o["worker-threads"], o.rounds))
    local base
    for i, st in ipairs(settings) do
        local pidf = tmp .. "/batch_pid" .. i
        os.execute(("%s worker --connect %s --model %s --threads %d --id batch%d --quiet %s%s >%s 2>&1 & echo $! >%s"):format(
            sh(DS4), sh(pool.endpoint), sh(tmp .. "/model"), o["worker-threads"], i, st.args, key_args,
            sh(tmp .. "/batch" .. i .. ".log"), sh(pidf)))
        assert(pool:wait(1, 120) == 1, "the worker did not connect")
        pool:sync(120)
        local f = assert(io.open(pidf))
        local wpid = f:read("*l")
        f:close()
        local times, cpus = {}, {}
        for r = 0, o.rounds do
            local a, c = codec.now(), cpu_seconds(wpid)
            local res = pool:generate(prompts, gopts)
            local dt = codec.now() - a
            assert(#res == o.tasks * o.n)
            if r > 0 then times[#times + 1], cpus[#cpus + 1] = dt, cpu_seconds(wpid) - c end
        end
        local best, med = best_median(times)
        local cbest = best_median(cpus)
        base = base or { best, cbest }
        print(("  %-28s (%s): %6.0f tokens/s best, %6.0f median (%.2fx); %6.0f tokens per worker CPU-second "
            .. "(%.2fx)"):format(st.name, st.args, tokens / best, tokens / med, base[1] / best, tokens / cbest,
            base[2] / cbest))
        os.execute("kill -TERM $(cat " .. sh(pidf) .. ") 2>/dev/null")
        local t0 = codec.now()
        while pool:n_workers() > 0 and codec.now() - t0 < 20 do pool:service(100) end
    end
    if o["local"] then
        print("  in process (this process, 2 threads, no worker):")
        local function run_batcher(k)
            local b = model:batcher{ max_seqs = k * o.n }
            local next_t, done = 1, 0
            while next_t <= math.min(k, o.tasks) do b:submit({ prompts[next_t] }, gopts) next_t = next_t + 1 end
            while done < o.tasks do
                b:step()
                while b:take() do
                    done = done + 1
                    if next_t <= o.tasks then b:submit({ prompts[next_t] }, gopts) next_t = next_t + 1 end
                end
            end
            b:free()
        end
        local function timed(fn) -- wall and CPU seconds (os.clock: this process, all threads)
            local times, cpus = {}, {}
            for r = 0, o.rounds do
                local a, c = codec.now(), os.clock()
                fn()
                if r > 0 then times[#times + 1], cpus[#cpus + 1] = codec.now() - a, os.clock() - c end
            end
            local best, med = best_median(times)
            return best, med, (best_median(cpus))
        end
        local best, med, cpu = timed(function() for t = 1, o.tasks do model:generate({ prompts[t] }, gopts) end end)
        local lbase = { best, cpu }
        print(("  %-28s: %6.0f tokens/s best, %6.0f median; %6.0f tokens per CPU-second"):format(
            "model:generate per task", tokens / best, tokens / med, tokens / cpu))
        for k in o["in-flight"]:gmatch("%d+") do
            best, med, cpu = timed(function() run_batcher(tonumber(k)) end)
            print(("  %-28s: %6.0f tokens/s best, %6.0f median (%.2fx); %6.0f tokens per CPU-second (%.2fx)"):format(
                ("batcher, %s in flight"):format(k), tokens / best, tokens / med, lbase[1] / best, tokens / cpu,
                lbase[2] / cpu))
        end
    end
    pool:close()
    os.execute("rm -rf " .. sh(tmp))
    return
end
for i = 1, o.workers do
    os.execute(("%s worker --connect %s --model %s --threads %d --id bench%d --quiet%s >%s 2>&1 & echo $! >>%s"):format(
        sh(DS4), sh(pool.endpoint), sh(tmp .. "/model"), o["worker-threads"], i, key_args,
        sh(tmp .. "/worker" .. i .. ".log"), sh(tmp .. "/pids")))
end
local t0 = codec.now()
local n = pool:wait(o.workers, 120)
assert(n == o.workers, ("only %d of %d workers connected"):format(n, o.workers))
print(("workers connected in %.1f s (each loaded the 50m model from disk)"):format(codec.now() - t0))

-- the first version: the workers' starting weights are the same bytes, so they load nothing (CRC check only)
pool:publish(model)
pool:sync(120)

-- ------------------------------------------------------------------------------------------------ weight sync
local rows = {}
for s = 1, o.syncs do
    local p = model:params()
    ffi.cast("float *", p:data_ptr())[s] = s
    model:set_params(p)
    local a = codec.now()
    local v = pool:publish(model)
    local b = codec.now()
    pool:sync(300)
    local c = codec.now()
    rows[#rows + 1] = { publish = b - a, sync = c - b, total = c - a }
    print(("sync %d: version %d, publish (snapshot + CRC) %.3f s, workers fetched + checked + loaded in %.3f s: "
        .. "%.1f MB/s in all (%d x %.1f MB)"):format(s, v, b - a, c - b, o.workers * bytes / 1e6 / (c - a), o.workers,
        bytes / 1e6))
end
table.sort(rows, function(x, y) return x.total < y.total end)
local med = rows[math.ceil(#rows / 2)]
print(("weight sync median: %.3f s, %.1f MB/s (publish %.3f s, fetch %.3f s)"):format(med.total,
    o.workers * bytes / 1e6 / med.total, med.publish, med.sync))

-- ------------------------------------------------------------------------------------------------ generation
local prompts = make_prompts()
local gopts = { n = o.n, max_new_tokens = o["new-tokens"], temperature = 1.0, ignore_eos = true, seed = 7 }
local function timed(src)
    local times = {}
    local toks
    for r = 0, 3 do
        local a = codec.now()
        local res = src:generate(prompts, gopts)
        local dt = codec.now() - a
        toks = 0
        for _, x in ipairs(res) do toks = toks + #x.ids end
        if r > 0 or o.quick then times[#times + 1] = dt end
        if o.quick then break end
    end
    table.sort(times)
    return times[math.ceil(#times / 2)], times[1], times[#times], toks
end
local samples = o.tasks * o.n
local med_t, lo, hi, toks = timed(pool)
print(("pool:generate: %d tasks x %d samples x %d tokens (prompt %d): %.2f s median (%.2f-%.2f): %.1f samples/s, "
    .. "%.0f tokens/s"):format(o.tasks, o.n, o["new-tokens"], o.prompt, med_t, lo, hi, samples / med_t, toks / med_t))
if o["local"] then
    local l_t, l_lo, l_hi, l_toks = timed(model)
    print(("model:generate in process (2 threads), same prompts: %.2f s median (%.2f-%.2f): %.1f samples/s, "
        .. "%.0f tokens/s"):format(l_t, l_lo, l_hi, samples / l_t, l_toks / l_t))
end
local st = pool:stats()
print(("pool: %d tasks completed, %d re-issued, %d duplicates, %.1f MB of weights served"):format(st.completed,
    st.reissued, st.duplicates, st.bytes_served / 1e6))
pool:close()
os.execute("kill -TERM $(cat " .. sh(tmp .. "/pids") .. ") 2>/dev/null; sleep 1")
os.execute("rm -rf " .. sh(tmp))
