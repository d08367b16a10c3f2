--[[ examples/dapo.lua — DAPO on a verifiable task, end to end on a CPU, with nothing downloaded.

  ds4 run examples/dapo.lua [--steps N] [--sft-steps N] [--model DIR] [--tokenizer FILE] [--data FILE.jsonl]
                            [--eval-data FILE.jsonl] [--eval N] [--out DIR] [--seed N] [--lr X] [--prompts N]
                            [--n N] [--max-new-tokens N] [--minibatches N] [--algorithm dapo|grpo|gspo|...]
                            [--routing-replay] [--sft-batch N] [--save DIR] [--quiet]
                            [--workers ENDPOINT] [--n-workers N] [--max-staleness S]
                            [--curve PREFIX --allow A.pub,B.pub | --insecure]

  1. data: without --data, writes addition problems ("a+b=", a up to three digits, b one digit, answer in \boxed{}) as JSONL to
     DIR/eval.jsonl and DIR/train.jsonl (no training problem repeats a held-out one) and reads them back — the format a user's own dataset uses
     ({"prompt": ..., "answer": ...} per line);
  2. model: without --model, builds a small DeepSeek-V4-architecture model from a Lua config
     (examples/arith_task.lua) and the built-in byte-level tokenizer; with --model DIR, loads an HF checkpoint
     (and DIR/tokenizer.json, or --tokenizer);
  3. SFT warm-up (--sft-steps, default 150 for the built-in model, 0 with --model) to partial accuracy;
  4. greedy accuracy on the held-out problems (--eval, default 200) before RL;
  5. RL with the algorithm table below (DAPO: clip-higher 0.2 / 0.28, dynamic sampling, token-level loss,
     soft overlong punishment) through ds4.rl.trainer — metrics as JSON lines in DIR/metrics.jsonl, progress on
     the terminal;
  6. greedy accuracy after RL, and DIR/metrics.svg, a plot of reward and accuracy; --save DIR2 writes the trained
     model as an HF checkpoint (load it with --model DIR2 --tokenizer byte, or ds4.load / from_pretrained).
  examples/grpo.lua and examples/gspo.lua run this file with another algorithm table.

  Rollouts come from the policy itself by default. The ROLLOUT table below switches them to remote workers
  (`ds4 worker` processes, lua/ds4/rollout/): --workers ENDPOINT fills it in. The trainer then binds a pool there
  after the SFT warm-up, saves the warmed-up model to DIR/worker_model (start the workers from it: it carries the
  hash-routing tables the weight sync does not), and publishes every optimizer step's weights to the workers:
    ds4 worker --connect ENDPOINT --model DIR/worker_model [--insecure | --key W.key --server-key PREFIX.pub]
  tcp:// needs CURVE keys (`ds4 keygen --out PREFIX`: --curve PREFIX for the trainer, --allow the workers' .pub
  files) or --insecure; ipc:// stays on this host. --max-staleness 0 makes every rollout use the newest weights
  (default 1: one step behind at most, corrected by the importance ratio against the recomputed log-probs).
]]

local ds4 = require("ds4")
local rl = require("ds4.rl")
local trainer = require("ds4.rl.trainer")
local task = dofile(ds4.script_dir() .. "/arith_task.lua")

-- ------------------------------------------------------------------------------------------------ options
local defaults = { steps = 120, ["sft-steps"] = -1, model = "", tokenizer = "", data = "", ["eval-data"] = "",
    eval = 200, out = "runs/dapo", seed = 1, lr = 3e-4, prompts = 32, n = 8, ["max-new-tokens"] = 20,
    minibatches = 2, algorithm = "dapo", ["routing-replay"] = false, ["sft-batch"] = 64, save = "", quiet = false,
    workers = "", ["n-workers"] = 0, ["max-staleness"] = 1, curve = "", allow = "", insecure = false }
local opts = {}
for k, v in pairs(defaults) do opts[k] = v end
for k, v in pairs(DS4_EXAMPLE_DEFAULTS or {}) do opts[k] = v end -- set by grpo.lua / gspo.lua
do
    local i = 1
    while i <= #arg do
        local k = arg[i]:match("^%-%-(.+)$")
        if not k or defaults[k] == nil then
            io.stderr:write("dapo.lua: unknown option " .. tostring(arg[i]) .. "\nusage: ds4 run examples/dapo.lua "
                .. "[--steps N] [--sft-steps N] [--model DIR] [--tokenizer FILE] [--data FILE.jsonl] [--eval-data "
                .. "FILE.jsonl] [--eval N] [--out DIR] [--seed N] [--lr X] [--prompts N] [--n N] [--max-new-tokens N] "
                .. "[--minibatches N] [--algorithm NAME] [--routing-replay] [--sft-batch N] [--save DIR] [--quiet] "
                .. "[--workers ENDPOINT [--n-workers N] [--max-staleness S] [--curve PREFIX --allow A.pub,B.pub | "
                .. "--insecure]]\n")
            os.exit(2)
        end
        if k == "quiet" or k == "routing-replay" or k == "insecure" then
            opts[k] = true
        else
            i = i + 1
            if arg[i] == nil then
                io.stderr:write("dapo.lua: --" .. k .. " needs a value\n")
                os.exit(2)
            end
            if type(defaults[k]) == "number" then
                opts[k] = tonumber(arg[i]) or error("--" .. k .. " needs a number, got " .. arg[i], 0)
            else
                opts[k] = arg[i]
            end
        end
        i = i + 1
    end
end
-- Option values that would only fail later, deep inside a run: refused now, naming the option.
local function usage_error(msg)
    io.stderr:write("dapo.lua: " .. msg .. "\n")
    os.exit(2, true) -- close the state: the model and tokenizer are freed (no leak reports under LeakSanitizer)
end
for _, k in ipairs({ "steps", "eval", "prompts", "n", "max-new-tokens", "minibatches", "sft-batch", "n-workers",
    "max-staleness", "seed" }) do
    local v, lo = opts[k], (k == "eval" or k == "prompts" or k == "n" or k == "max-new-tokens" or k == "minibatches"
        or k == "sft-batch") and 1 or 0
    if v ~= math.floor(v) or v < lo then usage_error(("--%s must be an integer >= %d, got %s"):format(k, lo, v)) end
end
if opts["sft-steps"] ~= math.floor(opts["sft-steps"]) or opts["sft-steps"] < -1 then
    usage_error("--sft-steps must be an integer >= 0, got " .. opts["sft-steps"])
end
if not (opts.lr > 0 and opts.lr < math.huge) then usage_error("--lr must be a positive number, got " .. opts.lr) end
os.execute(("mkdir -p '%s'"):format(opts.out))

-- Where rollouts come from: nil workers = the policy itself, in this process; an endpoint = remote `ds4 worker`
-- processes behind a ds4.rollout.pool bound there. Changing this one table is the whole switch.
local ROLLOUT = {
    workers = opts.workers ~= "" and opts.workers or nil, -- e.g. "tcp://0.0.0.0:5555", "ipc:///tmp/dapo.sock"
    expect = opts["n-workers"],                             -- wait for this many workers before the first step
    max_staleness = opts["max-staleness"],
    curve = nil,                                            -- {secret, public, allow = {...}} (key files or Z85)
    insecure = opts.insecure,                               -- plain TCP without CURVE
}
if opts.curve ~= "" then
    local allow = {}
    for f in opts.allow:gmatch("[^,]+") do allow[#allow + 1] = f end
    ROLLOUT.curve = { secret = opts.curve .. ".key", public = opts.curve .. ".pub", allow = allow }
end

-- ------------------------------------------------------------------------------------------------ model
local tok, model
if opts.model ~= "" then
    model = ds4.load(opts.model)
    local tpath = opts.tokenizer ~= "" and opts.tokenizer or (opts.model .. "/tokenizer.json")
    tok = tpath == "byte" and ds4.tokenizer() or ds4.tokenizer(tpath) -- "byte": the built-in byte-level one
else
    tok = (opts.tokenizer ~= "" and opts.tokenizer ~= "byte") and ds4.tokenizer(opts.tokenizer) or ds4.tokenizer()
    model = ds4.new_model(task.model_config(tok), opts.seed)
end
if opts["sft-steps"] < 0 then opts["sft-steps"] = opts.model ~= "" and 0 or 150 end

-- ------------------------------------------------------------------------------------------------ data
local train_path, eval_path = opts.data, opts["eval-data"]
if train_path == "" then
    -- held-out problems first; no training problem repeats one of them
    train_path, eval_path = opts.out .. "/train.jsonl", opts.out .. "/eval.jsonl"
    local held = task.write_jsonl(eval_path, opts.eval, task.rng(opts.seed + 7919))
    task.write_jsonl(train_path, 20000, task.rng(opts.seed), held)
end
local train = task.read_jsonl(train_path, tok)
local heldout
if eval_path ~= "" then
    heldout = task.read_jsonl(eval_path, tok)
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

-- ------------------------------------------------------------------------------------------------ algorithm
-- The algorithm is data: this table is the whole difference between DAPO, GRPO and GSPO runs. DAPO's soft
-- overlong punishment is scaled to this task's response budget (the paper's 20480 / 4096 are for long proofs).
local M = opts["max-new-tokens"]
local algorithms = {
    dapo = rl.preset("dapo", { overlong = { soft = { max_len = M, cache = math.max(1, math.floor(M / 4)), factor = 1.0 } },
                               agg = "token_mean" }),
    grpo = rl.preset("grpo", { kl = rl.NIL }), -- no reference model in this example (KL coefficient 0)
    gspo = rl.preset("gspo"),
    dr_grpo = rl.preset("dr_grpo", { agg = { max_len = M } }),
    cispo = rl.preset("cispo"),
}
local algo = DS4_EXAMPLE_ALGORITHM or algorithms[opts.algorithm] or error("unknown --algorithm " .. opts.algorithm, 0)

local function decode(ids)
    local t = {}
    for i, v in ipairs(ids) do t[i] = v end
    return tok:decode(t)
end
local eval = { samples = heldout, correct = task.correct, max_new_tokens = M }

print(("%s: %s, %d parameters; %d train / %d held-out problems; %s"):format(opts.algorithm,
    ds4.config_summary(model:config()), model:n_params(), #train, #heldout, opts.model ~= "" and opts.model
    or "built-in model"))
local wall0 = os.time()
if opts["sft-steps"] > 0 then
    local acc0 = trainer.evaluate(model, eval, decode, M)
    print(("greedy accuracy before SFT: %.1f%%"):format(100 * acc0))
    task.sft(model, tok, train, { steps = opts["sft-steps"], batch = opts["sft-batch"], lr = 3e-3,
        progress = not opts.quiet })
end

-- ------------------------------------------------------------------------------------------------ RL
local source -- nil: model:generate in this process
if ROLLOUT.workers then
    local wdir = opts.out .. "/worker_model"
    model:save(wdir, { overwrite = true }) -- the workers' starting point (its tables; weights come over the wire)
    source = ds4.rollout.pool{ bind = ROLLOUT.workers, model = model, workers = ROLLOUT.expect,
        max_staleness = ROLLOUT.max_staleness, curve = ROLLOUT.curve, insecure = ROLLOUT.insecure,
        quiet = opts.quiet }
    print(("rollouts: remote workers on %s; start them with: ds4 worker --connect %s --model %s%s"):format(
        source.endpoint, source.endpoint, wdir, ROLLOUT.curve and " --key W.key --server-key " .. opts.curve .. ".pub"
        or (ROLLOUT.insecure and " --insecure" or "")))
end
local k0 = 0
local r = task.rng(opts.seed + 104729)
local result = trainer.run{
    model = model,
    algorithm = algo,
    prompts = function(_, n) -- a fresh draw of n training problems each call
        local out = {}
        for i = 1, n do out[i] = train[r(#train) + 1] end
        k0 = k0 + n
        return out
    end,
    reward = task.reward,
    decode = decode,
    eval = { samples = heldout, correct = task.correct, every = 40, max_new_tokens = M },
    rollout = { n = opts.n, prompts_per_step = opts.prompts, max_new_tokens = M, temperature = 1.0, source = source },
    optim = { lr = opts.lr, betas = { 0.9, 0.99 }, weight_decay = 0.0, clip = 1.0 },
    steps = opts.steps,
    minibatches = opts.minibatches,
    routing_replay = opts["routing-replay"],
    out = opts.out,
    seed = opts.seed,
    progress = not opts.quiet,
}

if source then
    local st = source:stats()
    print(("workers: %d tasks completed, %d re-issued, %d duplicates dropped, %d failed; %d policy versions, %.1f MB "
        .. "of weights served"):format(st.completed, st.reissued, st.duplicates, st.failed, st.version,
        st.bytes_served / 1e6))
    source:close()
end
local before, after = result.eval_before, result.eval_after
print(("greedy accuracy on %d held-out problems: %.1f%% after SFT -> %.1f%% after %s (%+.1f points); %d s in all")
    :format(#heldout, 100 * before, 100 * after, opts.algorithm, 100 * (after - before), os.time() - wall0))
if opts.save ~= "" then
    model:save(opts.save, { overwrite = true }) -- config.json + model.safetensors (save_pretrained names)
    print("model saved to " .. opts.save)
end
local plot = require("ds4.plot")
plot.svg(opts.out .. "/metrics.svg", result.history, {
    title = opts.algorithm .. ": reward and held-out accuracy",
    series = { { key = "reward/mean", label = "reward (mean over rollouts)" },
               { key = "eval/accuracy", label = "greedy held-out accuracy" } } })
print("metrics: " .. opts.out .. "/metrics.jsonl, plot: " .. opts.out .. "/metrics.svg")
