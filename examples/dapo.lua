--[[ examples/dapo.lua — DAPO on a verifiable task, end to end on a CPU, with nothing downloaded; or on your data
and model.

  ds4 run examples/dapo.lua [--config run.lua] [--data FILE.jsonl] [--model DIR] [--steps N] [--OPTION VALUE ...]
  ds4 run examples/dapo.lua --help                  every option, with its default

  1. data: --data FILE.jsonl, {"prompt": ..., "answer": ...} per line (checked before anything trains: errors
     name file:line and the field); the prompt is text, or a chat conversation ([{"role": "user", "content":
     ...}], TRL's conversational format) rendered with the chat template (--chat-template, default the model's;
     the generation prompt appended, --thinking for thinking mode); --columns.answer reward_model.ground_truth
     (or --columns verl) reads verl's layout. Held out: --eval-data, or the last --eval rows of --data. Without
     --data, generated problems (--task add: "a+b=", a up to three digits, b one digit; --task mul: "a*b=", a up to
     four digits, b one digit from 2 to 9; the answer in \boxed{}) are written as JSONL to RUN/eval.jsonl and RUN/train.jsonl (no training
     problem repeats a held-out one) and read back;
  2. model: without --model, a new DeepSeek-V4-architecture model (--arch small: examples/small_model.lua, ~0.6 M
     parameters; --arch gpu: examples/gpu_model.lua, ~220 M) over the built-in byte-level tokenizer; with
     --model DIR, an HF checkpoint and its tokenizer (DIR/tokenizer.json; --tokenizer FILE, or byte, overrides it);
  3. SFT warm-up (--sft-steps, default 150 for the built-in model, 0 with --model) to partial accuracy;
  4. greedy accuracy on the held-out problems (--eval, default 200) before RL;
  5. RL with the algorithm table below (DAPO: clip-higher 0.2 / 0.28, dynamic sampling, token-level loss,
     soft overlong punishment) through ds4.rl.trainer; --algorithm NAME picks another preset, and dotted options
     change any field (--algorithm.loss.eps_high 0.3, or algorithm = {name = "grpo", ...} in a config file);
  6. greedy accuracy after RL. The run directory (--out DIR, default runs/dapo/<start time>; runs/dapo/latest
     links to the newest) holds config.lua (the effective configuration: --config it to run again), metrics.jsonl
     and TensorBoard event files (`tensorboard --logdir runs/dapo`), completions.jsonl (--log-completions N: a
     few sampled completions every N steps), metrics.svg (reward and accuracy, loss, KL, entropy) and, with
     --save-every K, checkpoints ckpt/step_NNNNNN (policy and tokenizer, optimizer, data position, counters);
     --resume continues the run in --out (or runs/dapo/latest) from its newest checkpoint, bitwise as if it had
     not stopped. --save DIR2 writes the trained model and its tokenizer as an HF checkpoint. Launched as several
     ranks (docs/distributed.md), --zero shards the optimizer over them (ZeRO-1: the same bits), and its checkpoints
     resume on any number of ranks.
  examples/grpo.lua and examples/gspo.lua run this file with another default algorithm.

  Rollouts come from the policy itself by default. --workers ENDPOINT switches them to remote workers (`ds4 worker`
  processes, lua/ds4/rollout/): the trainer binds a pool there after the SFT warm-up, saves the warmed-up model to
  RUN/worker_model (a worker may start from it, or from nothing: the weight announcement carries the config, the
  tokenizer and the hash-routing tables), prints the command that starts a worker (its --max-batch a worker's share
  of one rollout batch, prompts x n / n-workers, at least 32), and publishes every optimizer
  step's weights to the workers (with --lora the adapters only, over the saved base: docs/lora.md). tcp:// needs CURVE
  keys (`ds4 keygen --out PREFIX`: --curve PREFIX for the trainer, --allow the workers' .pub files) or --insecure;
  ipc:// stays on this host. With several ranks rank 0 alone binds the pool and hands the others their share of
  each batch's results. --max-staleness 0 makes every rollout use the newest weights (default 1: one step
  behind at most, corrected by the importance ratio against the recomputed log-probs). --async K overlaps generation
  with training: the workers generate the next K steps' rollouts, under weights at most K versions old, while the
  trainer trains (docs/rl.md, "Asynchronous RL"; --async 0 is the synchronous loop with --max-staleness 0; add
  --algorithm.tis.mode truncate, or a config file's algorithm.tis = rl.tis_default, for the importance correction).
]]

local ds4 = require("ds4")
local rl = require("ds4.rl")
local trainer = require("ds4.rl.trainer")
local task = dofile(ds4.script_dir() .. "/arith_task.lua")

-- ------------------------------------------------------------------------------------------------ options
local EX = DS4_EXAMPLE_DEFAULTS or {} -- set by grpo.lua / gspo.lua: {algorithm = name, root = "runs/NAME"}
local SPEC = {
    program = arg and arg[0] or "examples/dapo.lua",
    summary = "RL (DAPO by default) with a verifiable reward, on a JSONL dataset of prompts and answers.",
    options = {
        { "data", "", "training prompts, JSONL {\"prompt\": text or conversation, \"answer\": ...}" },
        { "eval_data", "", "held-out prompts, same format (default: the last --eval rows of --data)" },
        { "eval", 200, "held-out problems" },
        { "eval_every", 40, "held-out accuracy every N RL steps" },
        { "task", "add", "the generated problems without --data: add (a+b=, a < 1000, b < 10) or mul (a*b=, a < 10000, 2 <= b < 10)" },
        { "columns", {}, "field names of --data (--columns.answer reward_model.ground_truth), or verl", table = true },
        { "chat_template", "", "template for conversational prompts (default: the model's)" },
        { "thinking", false, "render conversational prompts in thinking mode" },
        { "model", "", "HF checkpoint directory (default: a new model of --arch)" },
        { "arch", "small", "the new model without --model: small (~0.6 M parameters), gpu (~220 M), or a Lua file" },
        { "tokenizer", "", "tokenizer.json, or byte (default: the model's, else byte)" },
        { "sft_steps", -1, "SFT warm-up steps (-1: 150 for the built-in model, 0 with --model)" },
        { "sft_batch", 64, "SFT warm-up batch" },
        { "sft_lr", 3e-3, "SFT warm-up learning rate" },
        { "algorithm", EX.algorithm or "dapo", "dapo, grpo, gspo, dr_grpo, cispo; dotted fields override the preset",
            table = true },
        { "steps", 120, "RL steps" },
        { "prompts", 32, "prompts per step" },
        { "n", 8, "samples per prompt" },
        { "max_new_tokens", 20, "response budget" },
        { "minibatches", 2, "optimizer updates per step" },
        { "micro_batches", 1, "micro-batches per update on each rank (gradient accumulation)" },
        { "zero", false, "with several ranks: ZeRO-1, each keeps and steps its shard of the optimizer (and sums only "
            .. "its region of the gradients: a reduce-scatter)" },
        { "bucket_mb", -1, "with several ranks: the gradients are summed in buckets of this many MiB while the last "
            .. "micro-batch's backward runs (0: one all-reduce after it; -1: 25)" },
        { "lr", 3e-4, "learning rate" },
        { "lora", 0, "train LoRA adapters of this rank only (0: train every weight); docs/lora.md" },
        { "lora_alpha", 0, "LoRA alpha (0: twice the rank)" },
        { "seed", 1, "seed of the data, the model and the rollouts" },
        { "device", "", "where the model computes: cpu, cuda, cuda:N (default: ds4 run --device's, else cpu)" },
        { "threads", 0, "the trainer's CPU threads (0: one per physical core, at most 16; fewer leaves cores to rollout workers beside it)" },
        { "dtype", "", "fp32 or bf16 (default: bf16 on CUDA, fp32 on the CPU)" },
        { "routing_replay", false, "train with the experts the rollouts used" },
        { "indexer_kl", 0, "weight of the lightning indexer's KL loss in RL (0: off): each update's mean over its "
            .. "samples' real queries, on every rank and micro-batch alike (logged as indexer_kl)" },
        { "out", "", "run directory (default: " .. (EX.root or "runs/dapo") .. "/<start time>)" },
        { "run_id", "", "name of the run under the default root (default: the start time)" },
        { "resume", false, "continue the run in --out (or the latest) from its newest checkpoint" },
        { "save_every", 0, "checkpoint every K RL steps (0: none)" },
        { "keep_last", 3, "checkpoints kept" },
        { "log_completions", 20, "a table of sampled completions every N steps (0: none)" },
        { "tensorboard", true, "write TensorBoard event files" },
        { "save", "", "write the trained model (and tokenizer) here" },
        { "quiet", false, "no progress output" },
        { "workers", "", "remote rollout workers: the endpoint to bind (tcp://0.0.0.0:5555, ipc:///tmp/x)" },
        { "n_workers", 0, "wait for this many workers before the first step" },
        { "max_staleness", 1, "policy versions a rollout may lag behind" },
        { "async", -1, "asynchronous RL: rollouts run up to K steps ahead, under weights at most K versions old, while "
            .. "the trainer trains (-1: synchronous)" },
        { "curve", "", "the trainer's CURVE key prefix (PREFIX.key, PREFIX.pub)" },
        { "allow", "", "the workers' public keys, comma-separated .pub files" },
        { "insecure", false, "plain TCP without CURVE" },
    },
}
local opts, run = ds4.rundir.start(arg, SPEC, EX.root or "runs/dapo") -- with several ranks (ds4.dp): the same
-- run and options on every rank; rank 0 alone writes and prints
local ROOT = ds4.dp.is_root()
if not ROOT then print = function() end end
-- the models made below compute there (ds4.set_device checks the spelling and that the device exists)
-- data parallel on GPUs: each rank's model on its own GPU (the NCCL communicator's, ds4.dp)
if ds4.dp.device() then opts.device = ds4.dp.device() end
if opts.threads ~= 0 then ds4.set_threads(opts.threads) end -- before any model exists
if opts.device ~= "" or opts.dtype ~= "" then
    ds4.set_device(opts.device ~= "" and opts.device or ds4.device():match("^%S+"), opts.dtype ~= "" and opts.dtype or nil)
end
local OUT = run.dir
-- Option values that would only fail later, deep inside a run: refused now, naming the option.
local function usage_error(msg)
    io.stderr:write("dapo.lua: " .. msg .. "\n")
    os.exit(2, true) -- close the state: the model and tokenizer are freed (no leak reports under LeakSanitizer)
end
for _, k in ipairs({ "steps", "eval", "eval_every", "prompts", "n", "max_new_tokens", "minibatches", "micro_batches", "sft_batch", "n_workers",
    "max_staleness", "seed", "save_every", "keep_last", "log_completions" }) do
    local v, lo = opts[k], (k == "eval" or k == "eval_every" or k == "prompts" or k == "n" or k == "max_new_tokens" or k == "minibatches" or k == "micro_batches"
        or k == "sft_batch" or k == "keep_last") and 1 or 0
    if v ~= math.floor(v) or v < lo then
        usage_error(("--%s must be an integer >= %d, got %s"):format(k:gsub("_", "-"), lo, v))
    end
end
if not (opts.indexer_kl >= 0 and opts.indexer_kl < math.huge) then
    usage_error("--indexer-kl must be a finite number >= 0, got " .. opts.indexer_kl)
end
if opts.async ~= math.floor(opts.async) or opts.async < -1 then
    usage_error("--async must be an integer >= 0 (or -1: synchronous), got " .. opts.async)
end
if opts.sft_steps ~= math.floor(opts.sft_steps) or opts.sft_steps < -1 then
    usage_error("--sft-steps must be an integer >= 0, got " .. opts.sft_steps)
end
for _, k in ipairs({ "lr", "sft_lr" }) do
    if not (opts[k] > 0 and opts[k] < math.huge) then
        usage_error(("--%s must be a positive number, got %s"):format(k:gsub("_", "-"), opts[k]))
    end
end
if not task.kinds[opts.task] then usage_error(("--task must be add or mul, got '%s'"):format(opts.task)) end

-- ------------------------------------------------------------------------------------------------ algorithm
-- The algorithm is data: a preset, with this example's settings (DAPO's soft overlong punishment scaled to this
-- task's response budget: the paper's 20480 / 4096 are for long proofs; no reference model here, so no KL), then
-- the user's fields (--algorithm.loss.eps_high 0.3, or a table in a config file).
local M = opts.max_new_tokens
local EXAMPLE = {
    dapo = { overlong = { soft = { max_len = M, cache = math.max(1, math.floor(M / 4)), factor = 1.0 } },
        agg = "token_mean" },
    grpo = { kl = rl.NIL },
    dr_grpo = { agg = { max_len = M } },
}
-- the fields a preset has, and those a spec may add: a misspelt field is an error, not a silent no-op
local FIELDS = { name = 1, adv = 1, loss = 1, agg = 1, kl = 1, entropy_coef = 1, dynamic_sampling = 1, overlong = 1,
    tis = 1, refs = 1 }
local LOSS_FIELDS = { kind = 1, eps_low = 1, eps_high = 1, clip_c = 1 }
local function algorithm_of(a)
    local name, user = a, {}
    if type(a) == "table" then
        name = a.name or EX.algorithm or "dapo"
        for k, v in pairs(a) do if k ~= "name" then user[k] = v end end
    end
    if not rl.algorithms[name] then
        local names = {}
        for k in pairs(rl.algorithms) do names[#names + 1] = k end
        table.sort(names)
        usage_error(("--algorithm: unknown algorithm '%s' (%s)"):format(tostring(name), table.concat(names, ", ")))
    end
    for k, v in pairs(user) do
        if not FIELDS[k] then usage_error(("--algorithm.%s: no such field of an algorithm"):format(tostring(k))) end
        if k == "loss" and type(v) == "table" then
            for lk in pairs(v) do
                if not LOSS_FIELDS[lk] then
                    usage_error(("--algorithm.loss.%s: no such field (kind, eps_low, eps_high, clip_c)"):format(lk))
                end
            end
        end
    end
    return rl.merge(rl.preset(name, EXAMPLE[name]), user), name
end
local algo, algo_name = algorithm_of(opts.algorithm)

-- ------------------------------------------------------------------------------------------------ model
local tok, template_name, model
if opts.model ~= "" then
    model = ds4.load(opts.model)
    tok, template_name = model:tokenizer()
    if opts.tokenizer == "" and not tok then
        usage_error(("%s has no tokenizer.json: pass --tokenizer FILE (or --tokenizer byte for the built-in "
            .. "byte-level one)"):format(opts.model))
    end
end
if opts.tokenizer ~= "" then
    tok = opts.tokenizer == "byte" and ds4.tokenizer() or ds4.tokenizer(opts.tokenizer)
    template_name = nil
end
tok = tok or ds4.tokenizer()
if not model then
    local okc, cfg = pcall(task.model_config, tok, opts.arch)
    if not okc then usage_error("--arch: " .. tostring(cfg)) end
    model = ds4.new_model(cfg, opts.seed)
end
if opts.chat_template ~= "" then template_name = opts.chat_template end
template_name = template_name or require("ds4.pretrained").template_for(tok)
model:set_tokenizer(tok, { chat_template = template_name }) -- checkpoints and --save carry both
if opts.sft_steps < 0 then opts.sft_steps = opts.model ~= "" and 0 or 150 end
local okt, template = pcall(function() return template_name and ds4.chat.get(template_name) end)
if not okt then usage_error("--chat-template: " .. tostring(template)) end

-- ------------------------------------------------------------------------------------------------ data
local train_path, eval_path = opts.data, opts.eval_data
if train_path == "" then
    -- held-out problems first; no training problem repeats one of them
    train_path, eval_path = OUT .. "/train.jsonl", OUT .. "/eval.jsonl"
    if ROOT then
        local held = task.write_jsonl(eval_path, opts.eval, task.rng(opts.seed + 7919), nil, opts.task)
        task.write_jsonl(train_path, 20000, task.rng(opts.seed), held, opts.task)
    end
    ds4.dp.barrier() -- the other ranks read what rank 0 wrote (one machine, or a shared file system)
end
local read_opts = { template = template, thinking = opts.thinking,
    columns = (type(opts.columns) == "string" or next(opts.columns)) and opts.columns or nil }
local train = task.read_jsonl(train_path, tok, read_opts)
local heldout
if eval_path ~= "" then
    heldout = task.read_jsonl(eval_path, tok, read_opts)
else -- a user's single file: hold out its last --eval samples, and train on the rest
    if #train < 2 then
        usage_error(("--data %s has %d problem: nothing can be held out of it; give the held-out problems as "
            .. "--eval-data FILE"):format(train_path, #train))
    elseif opts.eval >= #train then
        usage_error(("--data %s has %d problems and --eval %d would hold out %s, leaving nothing to train on: pass "
            .. "--eval N with N < %d (for example --eval %d), or the held-out problems as --eval-data FILE"):format(
            train_path, #train, opts.eval, opts.eval > #train and "more than all of them" or "all of them", #train,
            math.max(1, math.floor(#train / 5))))
    end
    heldout = {}
    for _ = 1, opts.eval do heldout[#heldout + 1] = table.remove(train) end
end
while #heldout > opts.eval do table.remove(heldout) end
local V = model:config().vocab_size
for _, set in ipairs({ train, heldout }) do
    for _, s in ipairs(set) do
        for _, id in ipairs(s.prompt) do
            if id >= V then
                usage_error(("a prompt (%q) has token %d, outside the model's vocabulary (%d ids): the tokenizer does "
                    .. "not fit the model"):format(s.text:sub(1, 40), id, V))
            end
        end
    end
end
-- a chat turn ends at the template's end-of-turn token: <|im_end|> for chatml (EOS, which ends a deepseek_v4 turn,
-- stops every generation anyway)
local stop
for _, id in ipairs(template_name and ds4.chat.end_of_turn(tok, template_name) or {}) do
    if id ~= model:config().eos_token_id then stop = stop or {}; stop[#stop + 1] = id end
end

local function decode(ids)
    local t = {}
    for i, v in ipairs(ids) do t[i] = v end
    return tok:decode(t)
end

-- ------------------------------------------------------------------------------------------------ warm-up
local resuming = opts.resume and ds4.checkpoints.latest(OUT .. "/ckpt") ~= nil
print(("%s: %s, %d parameters; %d train / %d held-out problems; %s; run %s"):format(algo_name,
    ds4.config_summary(model:config()), model:n_params(), #train, #heldout, opts.model ~= "" and opts.model
    or "built-in model", OUT))
local wall0 = ds4.metrics.clock()
if opts.lora ~= math.floor(opts.lora) or opts.lora < 0 then usage_error("--lora must be a rank >= 1 (0: off)") end
if opts.sft_steps > 0 and not resuming then -- a resumed run's checkpoint holds the warmed-up (and trained) policy
    local acc0 = trainer.evaluate(model, { samples = heldout, correct = task.correct }, decode, M, stop)
    print(("greedy accuracy before SFT: %.1f%%"):format(100 * acc0))
    task.sft(model, tok, train, { steps = opts.sft_steps, batch = opts.sft_batch, lr = opts.sft_lr, progress = not opts.quiet })
end

-- ------------------------------------------------------------------------------------------------ RL
local function shell_word(s)
    if s:find("^[%w%./:_=,@+-]+$") then return s end
    return "'" .. s:gsub("'", "'\\''") .. "'"
end
local source -- nil: model:generate in this process
-- with several ranks (ds4.dp) rank 0 alone binds the pool; the trainer hands the other ranks its results
if opts.workers ~= "" and ROOT then
    local curve
    if opts.curve ~= "" then
        local allow = {}
        for f in opts.allow:gmatch("[^,]+") do allow[#allow + 1] = f end
        curve = { secret = opts.curve .. ".key", public = opts.curve .. ".pub", allow = allow }
    end
    local wdir = OUT .. "/worker_model"
    model:save(wdir, { overwrite = true }) -- the workers' starting point (its tables; weights come over the wire)
    source = ds4.rollout.pool{ bind = opts.workers, model = model, workers = opts.n_workers,
        max_staleness = opts.max_staleness, curve = curve, insecure = opts.insecure, quiet = opts.quiet }
    -- a command line to paste on a worker machine: this ds4, the endpoint with this host's name where it was bound
    -- to every interface, and for CURVE each allowed worker's own key pair (A.pub's secret is A.key)
    local ep = source.endpoint:gsub("^tcp://0%.0%.0%.0:", "tcp://" .. ds4.fs.hostname() .. ":"):gsub("^tcp://%*:",
        "tcp://" .. ds4.fs.hostname() .. ":")
    local exe = (arg and arg[-2]) or "ds4"
    -- --max-batch: a worker's share of one rollout batch decodes in one step (its default, 32, splits it into several
    -- decode passes: with two 2-thread workers the synchronous run's rollouts took 1.2-1.3x longer, bench/RESULTS.md)
    local share = math.ceil(opts.prompts * opts.n / math.max(1, opts.n_workers))
    local cmd = ("%s worker --connect %s --model %s --max-batch %d"):format(shell_word(exe), shell_word(ep),
        shell_word(wdir), math.max(32, share))
    if curve then
        for _, pub in ipairs(curve.allow) do
            print(("start a worker: %s --key %s --server-key %s"):format(cmd, shell_word((pub:gsub("%.pub$", ""))
                .. ".key"), shell_word(curve.public)))
        end
    else
        print(("start a worker: %s%s"):format(cmd, opts.insecure and " --insecure" or ""))
    end
    io.stdout:flush() -- the command is wanted now, also when stdout is a file
end
if opts.indexer_kl > 0 then -- before the adapters are made: with the indexer KL on they cover the indexer too
    local o = model:train_options()
    o.indexer_kl = opts.indexer_kl
    model:set_train_options(o)
end
if opts.lora > 0 then -- after the warm-up: RL trains the adapters only (the warmed-up weights stay frozen)
    model:lora{ rank = opts.lora, alpha = opts.lora_alpha > 0 and opts.lora_alpha or 2 * opts.lora, seed = opts.seed }
    local li = model:lora_info()
    print(("LoRA rank %d (scale %g): %d trainable adapter values, %d frozen weights"):format(li.rank, li.scale,
        li.numel, model:n_params()))
end
local r, rstate = task.rng(opts.seed + 104729) -- one stream of training problems; its state is checkpointed
local result = trainer.run{
    model = model,
    algorithm = algo,
    prompts = function(_, n) -- a fresh draw of n training problems each call
        local out = {}
        for i = 1, n do out[i] = train[r(#train) + 1] end
        return out
    end,
    state = { save = function() return { rng = rstate.s } end, load = function(t) rstate.s = t.rng end },
    reward = task.reward,
    decode = decode,
    eval = { samples = heldout, correct = task.correct, every = opts.eval_every, max_new_tokens = M },
    rollout = { n = opts.n, prompts_per_step = opts.prompts, max_new_tokens = M, temperature = 1.0, source = source,
        stop = stop },
    optim = { lr = opts.lr, betas = { 0.9, 0.99 }, weight_decay = 0.0, clip = 1.0 },
    steps = opts.steps,
    minibatches = opts.minibatches,
    micro_batches = opts.micro_batches,
    zero = opts.zero,
    bucket_mb = opts.bucket_mb,
    routing_replay = opts.routing_replay,
    indexer_kl = opts.indexer_kl > 0 and opts.indexer_kl or nil,
    out = OUT,
    seed = opts.seed,
    progress = not opts.quiet,
    checkpoint = { every = opts.save_every, keep_last = opts.keep_last, resume = opts.resume },
    log_completions = { every = opts.log_completions, n = 4 },
    tensorboard = opts.tensorboard,
    async = opts.async >= 0 and { max_staleness = opts.async } or nil,
}

if source then
    local st = source:stats()
    local last = st.syncs[#st.syncs] or { bytes = 0 }
    print(("workers: %d tasks completed, %d re-issued, %d duplicates dropped, %d failed; %d policy versions, %.1f MB "
        .. "of weights served; %.3f MB per version (%s)"):format(st.completed, st.reissued, st.duplicates, st.failed,
        st.version, st.bytes_served / 1e6, last.bytes / 1e6, opts.lora > 0 and "the LoRA adapters" or "the weights"))
    source:close()
end
ds4.dp.finalize() -- the ranks are done together; rank 0 alone saves and reports
if not ROOT then return end
local before, after = result.eval_before, result.eval_after
print(("greedy accuracy on %d held-out problems: %.1f%% after SFT -> %.1f%% after %s (%+.1f points); %d s in all")
    :format(#heldout, 100 * before, 100 * after, algo_name, 100 * (after - before), ds4.metrics.clock() - wall0))
if opts.save ~= "" and opts.lora > 0 then
    model:save_lora(opts.save, { overwrite = true, base = opts.model ~= "" and opts.model or nil }) -- PEFT's layout
    print("LoRA adapter saved to " .. opts.save)
elseif opts.save ~= "" then
    model:save(opts.save, { overwrite = true }) -- config.json + model.safetensors (save_pretrained names) + tokenizer
    print("model saved to " .. opts.save)
end
local plot = require("ds4.plot")
plot.svg(OUT .. "/metrics.svg", result.history, { panels = {
    { title = algo_name .. ": reward and held-out accuracy", series = {
        { key = "reward/mean", label = "reward (mean over rollouts)" },
        { key = "eval/accuracy", label = "greedy held-out accuracy" } } },
    { title = "policy loss", series = { { key = "loss", label = "loss" } } },
    { title = "KL", series = { { key = "kl", label = "kl (old -> new policy, or to the reference)" } } },
    { title = "entropy", series = { { key = "entropy", label = "entropy (nats per token)" } } },
} })
print(("run: %s (config.lua, metrics.jsonl, metrics.svg%s)"):format(OUT,
    ds4.tensorboard.available() and opts.tensorboard and ", TensorBoard events" or ""))
