--[[ bench_rollout.lua — remote rollouts on this machine: weight-sync MB/s and samples/s of a ds4.rollout.pool with
  `ds4 worker` processes on the loopback, for the ~50M-parameter config of bench/bench_forward.c (random weights).

  build/ds4 run bench/bench_rollout.lua [--workers N] [--worker-threads T] [--tasks T] [--n N] [--prompt P]
                                        [--new-tokens K] [--syncs S] [--endpoint tcp|ipc] [--curve] [--local]
                                        [--quick]

  1. the model is built (seed 1) and saved once to a temporary directory, from which each worker starts (the
     hash-routing tables must match); the workers are started as background processes of this script;
  2. weight sync: S times, the parameters change (one element), pool:publish snapshots them (CRC-32 included),
     and pool:sync() waits until every worker has fetched, checked and loaded the new version: MB/s = workers ×
     bytes / (publish + sync seconds); the publish (snapshot + CRC) and the sync times are printed apart;
  3. generation: T tasks (prompts of P random tokens, n samples each, K new tokens, temperature 1, ignore_eos so
     every sequence runs to K) through pool:generate: samples/s and generated tokens/s, median of 3 rounds after a
     warm-up round; --local also times model:generate on the same prompts in this process (2 threads) for
     comparison.
  Prints the machine's core count; record results in bench/RESULTS.md.
]]

local ds4 = require("ds4")
local ffi = require("ffi")
local codec = require("ds4.rollout.codec")

local o = { workers = 2, ["worker-threads"] = 1, tasks = 16, n = 8, prompt = 64, ["new-tokens"] = 32, syncs = 3,
    endpoint = "tcp", curve = false, ["local"] = false, quick = false }
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
        i = i + 1
    end
end
if o.quick then o.tasks, o.n, o["new-tokens"], o.syncs = 4, 4, 8, 1 end

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

local cfg = { model = model, workers = o.workers, wait_s = 120, quiet = true }
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
local rng = 12345
local prompts = {}
for t = 1, o.tasks do
    local p = {}
    for j = 1, o.prompt do
        rng = (rng * 1103515245 + 12345) % 2147483648
        p[j] = rng % 16000
    end
    prompts[t] = p
end
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
