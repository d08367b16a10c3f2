-- test_options.lua — the options tables of the C binding (lua/opts_lua.c): every function refuses an unknown key,
-- a value of the wrong type and an out-of-range value with one message format that names the function and the key:
--   "<fname>: unknown option '<key>' (known: <keys>)"
--   "<fname>: opts.<key> must be <what is accepted>, got <the value>"
--   "<fname>: bad argument #<n> (options table expected, got <type>)"
-- checked on functions of several binding files (generate and sample, save and checkpoints, the tokenizer, the
-- optimizer and training options, LoRA, load, dist init, the wire decoder, ZeroMQ), and the values at the edges of
-- each range accepted. The reference is the format above, written out here in full for each case.
-- Usage: ds4 run tests/lua/test_options.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()

-- fn must raise a message that is exactly `msg`, after the script position ("file:line: ") where there is one (the
-- Lua wrappers of model:forward and model:set_train_options raise without it).
local function refuses(fn, msg, what)
    local err = H.raises(fn, nil, what)
    if err then
        local where = err:sub(1, -#msg - 1)
        H.check(err:sub(-#msg) == msg and (where == "" or where:match("^[^\n]*:%d+: $") ~= nil),
            ("%s: the message is not '<where>: %s':\n    %s"):format(what, msg, err))
    end
end

local function accepts(fn, what)
    local ok, err = pcall(fn)
    H.check(ok, what .. ": refused: " .. tostring(err))
end

local model = ds4.load(fixtures .. "/tiny_a")
local tok = ds4.tokenizer(fixtures .. "/tokenizer/deepseek.json")
local tmp = H.make_temp_dir()

-- ------------------------------------------------------------------------------------------ unknown keys
local GEN_KNOWN = "max_new_tokens, temperature, top_k, top_p, min_p, n, seed, stop, tokenizer, ignore_eos, "
    .. "record_experts, record_index, max_batch, prefill_chunk, on_token, prompt_base"
refuses(function() model:generate({ { 1 } }, { max_tokens = 3 }) end,
    "ds4.model:generate: unknown option 'max_tokens' (known: " .. GEN_KNOWN .. ")", "generate: misspelt key")
refuses(function() model:generate({ { 1 } }, { 5 }) end,
    "ds4.model:generate: unknown option 1 (known: " .. GEN_KNOWN .. ")", "generate: a positional value")
refuses(function() model:generate({ { 1 } }, { [{}] = 1 }) end,
    "ds4.model:generate: unknown option a table key (known: " .. GEN_KNOWN .. ")", "generate: a table key")
refuses(function() model:forward(ds4.tensor({ { 1, 2 } }, "I64"), { label = true }) end,
    "ds4.model:forward: unknown option 'label' (known: labels, mtp, hidden, logits, train, replay, lengths)", "forward")
refuses(function() ds4.sample({ 0, 1 }, { temp = 1 }, 0.5) end,
    "ds4.sample: unknown option 'temp' (known: temperature, top_k, top_p, min_p)", "sample")
refuses(function() model:save(tmp .. "/m", { dtyp = "F32" }) end,
    "ds4.model:save: unknown option 'dtyp' (known: dtype, overwrite, files, expand_quantised)", "save")
refuses(function() ds4.checkpoints.prune(tmp, { keep = 1 }) end,
    "ds4.checkpoints.prune: unknown option 'keep' (known: keep_last, keep_every, clean, dry_run)", "prune")
refuses(function() tok:encode("x", { bso = true }) end, "tokenizer:encode: unknown option 'bso' (known: bos)",
    "encode")
refuses(function() ds4.adamw(model, { weight_dacay = 0.1 }) end,
    "ds4.adamw: unknown option 'weight_dacay' (known: lr, betas, eps, weight_decay, clip, schedule, warmup, total, "
        .. "min_lr_ratio, zero_grad)", "adamw")
refuses(function() model:set_train_options({ mtp_lamda = 0.1 }) end,
    "ds4.model:set_train_options: unknown option 'mtp_lamda' (known: mtp_lambda, router_bias_gamma, indexer_kl, "
        .. "head_chunk, recompute)", "set_train_options")
refuses(function() ds4.load(fixtures .. "/tiny_a", { fp4 = true }) end,
    "ds4.load: unknown option 'fp4' (known: device, dtype, lora, fp4_experts, expert_shard)", "load")
refuses(function() ds4.dist.init({ tmeout = 5 }) end,
    "ds4.dist.init: unknown option 'tmeout' (known: device, timeout, bucket_mb)", "dist init")
refuses(function() ds4.wire.decode({}, nil, { frist = 2 }) end,
    "ds4.wire.decode: unknown option 'frist' (known: raw, first)", "wire decode")
refuses(function() ds4.zmq.zap({ quite = true }) end, "ds4.zmq.zap: unknown option 'quite' (known: allow, quiet)",
    "zap")

-- ------------------------------------------------------------------------------------------ wrong types
refuses(function() model:generate({ { 1 } }, 5) end,
    "ds4.model:generate: bad argument #2 (options table expected, got number)", "generate: options not a table")
refuses(function() ds4.checkpoints.save(tmp, 1, model, "x") end,
    "ds4.checkpoints.save: bad argument #4 (options table expected, got string)", "checkpoints.save: not a table")
refuses(function() tok:decode({ 1 }, true) end,
    "tokenizer:decode: bad argument #2 (options table expected, got boolean)", "decode: options not a table")
refuses(function() model:generate({ { 1 } }, { ignore_eos = 1 }) end,
    "ds4.model:generate: opts.ignore_eos must be a boolean, got 1", "generate: number for a boolean")
refuses(function() model:forward(ds4.tensor({ { 1, 2 } }, "I64"), { mtp = "yes" }) end,
    "ds4.model:forward: opts.mtp must be a boolean, got \"yes\"", "forward: string for a boolean")
refuses(function() model:save(tmp .. "/m", { overwrite = "yes" }) end,
    "ds4.model:save: opts.overwrite must be a boolean, got \"yes\"", "save: string for a boolean")
refuses(function() tok:decode({ 1 }, { skip_special = 0 }) end,
    "tokenizer:decode: opts.skip_special must be a boolean, got 0", "decode: number for a boolean")
refuses(function() ds4.adamw(model, { lr = "big" }) end, "ds4.adamw: opts.lr must be a number, got \"big\"",
    "adamw: string for a number")
refuses(function() ds4.adamw(model, { warmup = {} }) end, "ds4.adamw: opts.warmup must be an integer, got a table",
    "adamw: table for an integer")
refuses(function() model:lora({ rank = 4, rslora = "no" }) end, "ds4.model:lora: opts.rslora must be a boolean, "
    .. "got \"no\"", "lora: string for a boolean")
refuses(function() ds4.dist.init({ device = 5 }) end, "ds4.dist.init: opts.device must be a string, got 5",
    "dist init: number for a string")
refuses(function() ds4.wire.decode({}, nil, { raw = 1 }) end, "ds4.wire.decode: opts.raw must be a boolean, got 1",
    "wire decode: number for a boolean")

-- ------------------------------------------------------------------------------------------ out of range
refuses(function() model:generate({ { 1 } }, { max_new_tokens = 0 }) end,
    "ds4.model:generate: opts.max_new_tokens must be a positive integer, got 0", "generate: max_new_tokens 0")
refuses(function() model:generate({ { 1 } }, { n = 1.5 }) end,
    "ds4.model:generate: opts.n must be a positive integer (samples per prompt), got 1.5", "generate: n 1.5")
refuses(function() ds4.sample({ 0, 1 }, { top_p = 0 }, 0.5) end,
    "ds4.sample: opts.top_p must be a number in (0, 1] (1: off), got 0", "sample: top_p 0 (the open bound)")
local err = H.raises(function() ds4.sample({ 0, 1 }, { top_p = 0 / 0 }, 0.5) end,
    { "ds4.sample: opts.top_p must be a number in (0, 1] (1: off), got " }, "sample: top_p NaN")
H.check(err == nil or err:match("got %-?nan$") ~= nil, "sample: top_p NaN is shown as nan: " .. tostring(err))
refuses(function() ds4.sample({ 0, 1 }, { min_p = 1.5 }, 0.5) end,
    "ds4.sample: opts.min_p must be a number in [0, 1] (0: off), got 1.5", "sample: min_p 1.5")
refuses(function() model:batcher({ max_seqs = 0 }) end,
    "ds4.model:batcher: opts.max_seqs must be an integer in [1, 2^20], got 0", "batcher: max_seqs 0")
refuses(function() ds4.checkpoints.prune(tmp, { keep_last = -1 }) end,
    "ds4.checkpoints.prune: opts.keep_last must be a non-negative integer, got -1", "prune: keep_last -1")
refuses(function() ds4.adamw(model, { total = 2.5 }) end, "ds4.adamw: opts.total must be an integer, got 2.5",
    "adamw: fractional total")
refuses(function() model:set_train_options({ head_chunk = -1 }) end,
    "ds4.model:set_train_options: opts.head_chunk must be an integer in [0, 1e9] (0: the default), got -1",
    "set_train_options: head_chunk -1")
refuses(function() model:lora({ rank = 0 }) end, "ds4.model:lora: opts.rank must be an integer in [1, 65536], got 0",
    "lora: rank 0")
refuses(function() model:lora({ rank = 4, seed = -1 }) end, "ds4.model:lora: opts.seed must be an integer >= 0, got -1",
    "lora: seed -1")
refuses(function() ds4.dist.init({ timeout = 0 }) end,
    "ds4.dist.init: opts.timeout must be a positive number of seconds, got 0", "dist init: timeout 0")
refuses(function() ds4.dist.init({ bucket_mb = -1 }) end,
    "ds4.dist.init: opts.bucket_mb must be a number of MiB >= 0 (0: one reduction after the backward), got -1",
    "dist init: bucket_mb -1")
refuses(function() ds4.wire.decode({}, nil, { first = 0 }) end,
    "ds4.wire.decode: opts.first must be a positive integer, got 0", "wire decode: first 0")

-- ------------------------------------------------------------------------------------------ accepted at the edges
-- The least positive double is inside (0, 1]: an open bound at 0 must not refuse it.
accepts(function() ds4.sample({ 0, 1 }, { top_p = 5e-324 }, 0.5) end, "sample: top_p = the least positive double")
accepts(function() ds4.sample({ 0, 1 }, { top_p = 1, min_p = 0, top_k = 0, temperature = 0 }) end,
    "sample: every bound's closed end")
accepts(function() ds4.sample({ 0, 1 }, {}, 0.5) end, "sample: an empty options table")
accepts(function() ds4.sample({ 0, 1 }, nil, 0.5) end, "sample: no options table")
accepts(function() model:batcher({ max_seqs = 2 ^ 20, prefill_chunk = 0 }):free() end, "batcher: max_seqs 2^20")
accepts(function() ds4.checkpoints.prune(tmp, { keep_last = 0, dry_run = true }) end, "prune: keep_last 0")
H.same(tok:decode({ 1 }, { skip_special = false }), tok:decode({ 1 }), "decode: skip_special = false is the default")
-- dist init with every option given at an accepted value: a world of one (no launcher)
local r, n = ds4.dist.init({ timeout = 5, bucket_mb = 0, device = "cpu" })
H.check(r == 0 and n == 1, "dist init with options: a world of one")
refuses(function() ds4.dist.shard_optimizer(ds4.adamw(model), { reduce_scatter = "yes" }) end,
    "ds4.dist.shard_optimizer: opts.reduce_scatter must be a boolean, got \"yes\"", "shard_optimizer: string")
ds4.dist.finalize()

model:free()
os.execute("rm -rf " .. H.shell_quote(tmp))
H.done("test_options.lua")
