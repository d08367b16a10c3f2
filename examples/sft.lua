--[[ examples/sft.lua — supervised fine-tuning: your dataset and model, or a small model from scratch on a toy set.

  ds4 run examples/sft.lua [--config run.lua] [--data FILE.jsonl] [--eval-data FILE.jsonl] [--model DIR]
                           [--tokenizer FILE|byte] [--chat-template NAME] [--steps N] [--batch N] [--lr X] ...
  ds4 run examples/sft.lua --help                   every option, with its default

What it does, end to end:
  1. data: --data FILE.jsonl, one row per line, checked before anything trains (ds4.data: errors name file:line
     and the field): {"messages": [...]} conversations (system / user / assistant / tool turns, tool calls; the
     shape HF chat datasets use) or {"prompt": ..., "completion": ...} pairs (TRL's format: plain text, or
     conversations); --columns.messages / --columns.prompt / --columns.completion map other field names. The
     held-out rows are --eval-data, or the last --eval rows of --data. Without --data, a toy chat set (reverse a
     word, add two numbers, upper-case a word) is generated and written as JSONL into the run directory, then read
     back like any dataset;
  2. model: --model DIR loads an HF checkpoint with its tokenizer (DIR/tokenizer.json; --tokenizer FILE, or
     "byte" for the built-in byte-level one, overrides it); without --model a small DeepSeek-V4-architecture
     model is built from a Lua config (random initialisation) over the tokenizer's vocabulary;
  3. conversations are rendered with --chat-template (default: the model's, from tokenizer_config.json, else the
     one the tokenizer's special tokens call for); the loss trains only what the assistant produces (plain
     prompt/completion rows: the completion and EOS); rows longer than --max-len tokens are cut there;
  4. AdamW (linear warm-up, cosine decay, clipping), token-mean loss over each batch; batch k holds rows
     (k-1)*batch+1 ... of the training set, cyclically: nothing else is random, so a resumed run is bit-identical;
     --micro-batches M splits each batch into M micro-batches whose gradients accumulate (same update, less memory);
     launched with several ranks (mpirun -np N, srun, or torchrun-style variables: docs/distributed.md) the batch
     is split into N·M micro-batches, rank r taking micro-batches r·M ... r·M + M - 1, the token count and the
     gradients are summed over ranks and every rank takes the same update; rank 0 alone writes the run directory and
     prints. The result is the same bits as one process with --micro-batches N·M; --zero shards the optimizer's
     moments over the ranks (ZeRO-1, the same bits again; each rank sums only its region of the gradients), and its
     checkpoints resume on any number of ranks; the last micro-batch's backward sums the gradients in buckets of
     --bucket-mb MiB while it runs (the same bits; 0: one all-reduce after it);
  5. the run directory (--out DIR, default runs/sft/<start time>, runs/sft/latest links to it; a directory that
     holds a run is never appended to: --resume continues it) gets config.lua (the effective configuration: run it
     again with --config), metrics.jsonl (step, loss, lr, grad_norm, tokens, tokens_per_s; indexer_kl with --indexer-kl), TensorBoard event files
     (tensorboard --logdir runs/sft), metrics.svg, and with --save-every K checkpoints ckpt/step_NNNNNN (weights,
     tokenizer, AdamW moments and step counts; the last --keep-last kept); --resume continues from the newest;
  6. the held-out loss before and after training (on the toy set: exit status 1 when it did not fall), and the
     trained model with its tokenizer in RUN/model (or --save DIR): load it with ds4.load, `ds4 repl --model`, or
     from_pretrained.

--lora RANK (--lora-alpha A, --lora-targets attention,shared,experts) trains LoRA adapters only (docs/lora.md): the
model's weights stay frozen, checkpoints hold the adapters beside them (and --resume restores both), and RUN/model
(or --save) is the adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors) for the --model
checkpoint; a model built here has no directory, so its frozen weights go to RUN/base, named as the adapter's base.
Load the result with ds4.load(BASE, {lora = RUN/model}), or PEFT's PeftModel.from_pretrained.
]]

local ds4 = require("ds4")
local rundir = require("ds4.rundir")
local dp = require("ds4.dp")
local json = require("ds4.chat.json")
local ffi = require("ffi")

-- ------------------------------------------------------------------------------------------------ options
local SPEC = {
    program = "examples/sft.lua",
    summary = "Supervised fine-tuning on a JSONL dataset (or a generated toy set) of a checkpoint or a new model.",
    options = {
        { "data", "", "training data, JSONL: {\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...} rows" },
        { "eval_data", "", "held-out data, same format (default: the last --eval rows of --data)" },
        { "eval", 64, "held-out rows taken from --data when there is no --eval-data" },
        { "columns", {}, "field names of --data: --columns.messages conv (prompt, completion too)", table = true },
        { "model", "", "HF checkpoint directory (default: a new small model)" },
        { "tokenizer", "", "tokenizer.json, or byte (default: the model's, else byte)" },
        { "chat_template", "", "deepseek_v4, chatml, ... (default: the model's)" },
        { "thinking", false, "render conversations in thinking mode" },
        { "max_len", 1024, "rows longer than this many tokens are cut" },
        { "steps", 150, "optimizer updates" },
        { "batch", 16, "rows per update" },
        { "micro_batches", 1, "micro-batches per update on each rank (gradient accumulation)" },
        { "indexer_kl", 0, "weight of the lightning indexer's KL loss (0: off): each update's mean over its rows' real "
            .. "queries, on every rank and micro-batch alike (logged as indexer_kl)" },
        { "zero", false, "with several ranks: ZeRO-1, each keeps and steps its shard of the optimizer (and sums only "
            .. "its region of the gradients: a reduce-scatter)" },
        { "bucket_mb", -1, "with several ranks: the gradients are summed in buckets of this many MiB while the last "
            .. "micro-batch's backward runs (0: one all-reduce after it; -1: 25)" },
        { "lr", 3e-3, "peak learning rate" },
        { "warmup", -1, "warm-up updates (-1: steps / 10)" },
        { "weight_decay", 0.1, "AdamW weight decay" },
        { "min_lr_ratio", 0.1, "cosine decay floor, as a fraction of lr" },
        { "seed", 1, "model initialisation and toy data seed" },
        { "device", "", "where the model computes: cpu, cuda, cuda:N (default: ds4 run --device's, else cpu)" },
        { "dtype", "", "fp32 or bf16 (default: bf16 on CUDA, fp32 on the CPU)" },
        { "out", "", "run directory (default: runs/sft/<start time>)" },
        { "run_id", "", "name of the run under runs/sft (default: the start time)" },
        { "resume", false, "continue the run in --out (or runs/sft/latest) from its newest checkpoint" },
        { "save_every", 0, "checkpoint every K updates (0: none)" },
        { "keep_last", 3, "checkpoints kept" },
        { "save", "", "where the trained model goes (default: RUN/model)" },
        { "lora", 0, "train LoRA adapters of this rank only (0: every weight); docs/lora.md" },
        { "lora_alpha", 0, "LoRA alpha (0: twice the rank)" },
        { "lora_targets", "", "adapted weights, comma-separated (default: attention,shared,experts)" },
        { "tensorboard", true, "write TensorBoard event files" },
        { "quiet", false, "no progress output" },
    },
}
local opts, run = rundir.start(arg, SPEC, "runs/sft") -- RUN/config.lua: the effective configuration; with several
-- ranks (ds4.dp) every rank gets the same run and options, rank 0 alone writes
local ROOT = dp.is_root()
if not ROOT then print = function() end end -- rank 0 reports for the job
-- the models made below compute there (ds4.set_device checks the spelling and that the device exists)
-- data parallel on GPUs: each rank's model on its own GPU (the NCCL communicator's, ds4.dp)
if ds4.dp.device() then opts.device = ds4.dp.device() end
if opts.device ~= "" or opts.dtype ~= "" then
    ds4.set_device(opts.device ~= "" and opts.device or ds4.device():match("^%S+"), opts.dtype ~= "" and opts.dtype or nil)
end
local OUT = run.dir
local function usage_error(msg)
    io.stderr:write("sft.lua: " .. msg .. "\n")
    os.exit(2, true)
end
for _, k in ipairs({ "steps", "batch", "eval", "max_len", "keep_last", "micro_batches" }) do
    if opts[k] ~= math.floor(opts[k]) or opts[k] < 1 then
        usage_error(("--%s must be an integer >= 1, got %s"):format(k:gsub("_", "-"), opts[k]))
    end
end
if opts.save_every ~= math.floor(opts.save_every) or opts.save_every < 0 then
    usage_error("--save-every must be an integer >= 0, got " .. opts.save_every)
end
if not (opts.lr > 0 and opts.lr < math.huge) then usage_error("--lr must be a positive number, got " .. opts.lr) end
if opts.lora ~= math.floor(opts.lora) or opts.lora < 0 then usage_error("--lora must be a rank >= 1 (0: off)") end
if not (opts.indexer_kl >= 0 and opts.indexer_kl < math.huge) then
    usage_error("--indexer-kl must be a finite number >= 0, got " .. opts.indexer_kl)
end
local PARTS = dp.world() * opts.micro_batches -- micro-batches per update, over all ranks
if opts.batch < PARTS then
    usage_error(("--batch %d is smaller than %d micro-batches (%d ranks x --micro-batches %d)"):format(opts.batch,
        PARTS, dp.world(), opts.micro_batches))
end

-- ------------------------------------------------------------------------------------------------ toy dataset
-- The "minimal standard" generator (s <- 16807 s mod 2^31 - 1): the dataset depends only on the seed. Lua
-- numbers are doubles: the product stays below 2^53, so it is exact (a 1103515245 multiplier would round and
-- fall into short cycles); the draw takes the high part (s / m · n), not the poorly mixed s % n.
local function rng(seed)
    local m = 2147483647
    local s = seed % m
    if s == 0 then s = 1 end
    return function(n)
        s = s * 16807 % m
        return math.floor(s / m * n)
    end
end

local WORDS = { "cat", "dog", "tree", "lua", "code", "moe", "token", "graph", "stream", "loss", "rope", "sink" }

local function make_example(r)
    local kind = r(3)
    if kind == 0 then
        local w = WORDS[r(#WORDS) + 1]
        return { { role = "user", content = "reverse " .. w }, { role = "assistant", content = w:reverse() } }
    elseif kind == 1 then
        local a, b = r(50), r(50)
        return { { role = "user", content = ("add %d %d"):format(a, b) }, { role = "assistant", content = tostring(a + b) } }
    end
    local w = WORDS[r(#WORDS) + 1]
    return { { role = "user", content = "upper " .. w }, { role = "assistant", content = w:upper() } }
end

local function write_jsonl(path, n, r)
    local f = assert(io.open(path, "w"))
    for _ = 1, n do f:write(json.encode({ messages = make_example(r) }), "\n") end
    f:close()
end

-- ------------------------------------------------------------------------------------------------ model
local model, tok, template_name
local ckroot = OUT .. "/ckpt"
local resume_dir, resume_step, resume_meta
if run.resumed then
    local d, _, meta, step = ds4.checkpoints.load(ckroot)
    if d then resume_dir, resume_meta, resume_step = d, meta, step end
end
local model_dir = resume_dir or (opts.model ~= "" and opts.model or nil)
if model_dir then -- a LoRA run's checkpoint holds its adapters beside the frozen weights
    local adapter = resume_dir and ds4.fs.exists(resume_dir .. "/adapter_config.json") and resume_dir or nil
    model = ds4.load(model_dir, { lora = adapter })
    tok, template_name = model:tokenizer()
end
if opts.tokenizer ~= "" then
    tok = opts.tokenizer == "byte" and ds4.tokenizer() or ds4.tokenizer(opts.tokenizer)
    template_name = nil
elseif model_dir and not tok then
    usage_error(("%s has no tokenizer.json: pass --tokenizer FILE (or --tokenizer byte for the built-in "
        .. "byte-level one)"):format(model_dir))
end
tok = tok or ds4.tokenizer() -- built-in byte-level tokenizer with the DeepSeek chat special tokens
if opts.chat_template ~= "" then template_name = opts.chat_template end
template_name = template_name or require("ds4.pretrained").template_for(tok)
local okt, template = pcall(function() return template_name and ds4.chat.get(template_name) end)
if not okt then usage_error("--chat-template: " .. tostring(template)) end
if not model then
    model = ds4.new_model(dofile(ds4.script_dir() .. "/small_model.lua")(tok), opts.seed)
end
model:set_tokenizer(tok, { chat_template = template_name }) -- checkpoints and the saved model carry both
if opts.indexer_kl > 0 then -- before adapters are made: with the indexer KL on they cover the indexer too
    local o = model:train_options()
    o.indexer_kl = opts.indexer_kl
    model:set_train_options(o)
end
local lora = model:lora_info()
if lora and lora.rank ~= opts.lora then
    usage_error(("%s holds LoRA adapters of rank %d: resume with --lora %d"):format(resume_dir, lora.rank, lora.rank))
elseif resume_dir and not lora and opts.lora > 0 then
    usage_error(resume_dir .. " holds no LoRA adapters (the run trained every weight): resume without --lora")
elseif opts.lora > 0 and not lora then -- fresh adapters (B = 0: the model is unchanged); only they train from here
    local targets = {}
    for t in opts.lora_targets:gmatch("[^,%s]+") do targets[#targets + 1] = t end
    local ok, e = pcall(model.lora, model, { rank = opts.lora, alpha = opts.lora_alpha > 0 and opts.lora_alpha or nil,
        targets = #targets > 0 and targets or nil, seed = opts.seed })
    if not ok then usage_error("--lora: " .. tostring(e)) end
end
local V = model:config().vocab_size
local EOS = model:config().eos_token_id or tok:special("eos") or 0

-- ------------------------------------------------------------------------------------------------ data
-- Every row is checked and tokenised as it is read (ds4.data): types, roles, that the template renders it and
-- trains at least one token; a bad line stops the run here, naming file:line and the field.
local function read(path)
    local ok, rows = pcall(ds4.data.read_jsonl, path, { format = "auto", tokenizer = tok, template = template,
        render_opts = { thinking = opts.thinking }, columns = next(opts.columns) and opts.columns or nil, eos = EOS })
    if not ok then
        local msg = tostring(rows)
        if not template and msg:find("chat template", 1, true) then
            msg = msg .. " (this tokenizer calls for no template: pass --chat-template NAME)"
        end
        error(msg, 0)
    end
    if rows.format == "prompt_answer" then
        error(("%s: rows are {\"prompt\", \"answer\"} (RL prompts, examples/dapo.lua); SFT trains on {\"messages\": "
            .. "[...]} or {\"prompt\", \"completion\"} rows"):format(path), 0)
    end
    for _, r in ipairs(rows) do
        for _, id in ipairs(r.ids) do
            if id >= V then
                error(("%s:%d: token id %d is outside the model's vocabulary (%d ids): the tokenizer does not fit the "
                    .. "model"):format(path, r.line, id, V), 0)
            end
        end
    end
    return rows
end

local train, heldout
if opts.data == "" then
    local r = rng(opts.seed)
    if ROOT and not (run.resumed and ds4.fs.exists(OUT .. "/train.jsonl")) then -- a resumed run reads its files
        write_jsonl(OUT .. "/train.jsonl", 2000, r)
        write_jsonl(OUT .. "/heldout.jsonl", 64, r)
    end
    dp.barrier() -- the other ranks read what rank 0 wrote (one machine, or a shared file system)
    train, heldout = read(OUT .. "/train.jsonl"), read(OUT .. "/heldout.jsonl")
else
    train = read(opts.data)
    if opts.eval_data ~= "" then
        heldout = read(opts.eval_data)
    else
        if #train <= opts.eval then
            usage_error(("--data %s has %d rows and --eval %d would hold out %s, leaving nothing to train on: pass "
                .. "--eval N with N < %d, or the held-out rows as --eval-data FILE"):format(opts.data, #train,
                opts.eval, opts.eval > #train and "more than all of them" or "all of them", #train))
        end
        heldout = {}
        for _ = 1, opts.eval do table.insert(heldout, 1, table.remove(train)) end
    end
end

-- A rectangular batch: rows cut at --max-len, padded at the end with EOS and label -100 (causal attention never
-- looks right, and compression windows are aligned to position 0, so trailing padding changes nothing before it),
-- and each row's real length (the indexer KL loss leaves the padding out: model:forward's opts.lengths).
local cut = 0
local function make_batch(rows)
    local ids, labels, S, trained, len = {}, {}, 0, 0, {}
    for i, row in ipairs(rows) do
        local n = math.min(#row.ids, opts.max_len)
        if n < #row.ids then cut = cut + 1 end
        local x, l = {}, {}
        for t = 1, n do x[t], l[t] = row.ids[t], row.labels[t] end
        ids[i], labels[i], len[i] = x, l, n
        S = math.max(S, n)
    end
    for i = 1, #rows do
        for t = #ids[i] + 1, S do ids[i][t], labels[i][t] = EOS, -100 end
        for t = 2, S do
            if labels[i][t] ~= -100 then trained = trained + 1 end
        end
    end
    return ids, labels, trained, len
end

-- The held-out loss: token-mean over every held-out row, in batches of --batch rows.
local function heldout_loss()
    local sum, n = 0, 0
    for b = 1, #heldout, opts.batch do
        local rows = {}
        for i = b, math.min(#heldout, b + opts.batch - 1) do rows[#rows + 1] = heldout[i] end
        local ids, labels = make_batch(rows)
        local out = model:forward(ids, { labels = labels, train = false })
        if out.loss then sum, n = sum + out.loss * out.loss_tokens, n + out.loss_tokens end
    end
    return n > 0 and sum / n or 0
end

-- ------------------------------------------------------------------------------------------------ training
local start, before = 1, resume_meta and resume_meta.heldout_before or nil
local opt = ds4.adamw(model, { lr = opts.lr, betas = { 0.9, 0.95 }, weight_decay = opts.weight_decay, clip = 1.0,
    schedule = "cosine", warmup = opts.warmup >= 0 and opts.warmup or math.max(1, math.floor(opts.steps / 10)),
    total = opts.steps, min_lr_ratio = opts.min_lr_ratio })
-- ZeRO-1: each rank keeps the moments of its shard and updates those weights; the weights are gathered after every
-- step, the same bits as the whole optimizer's (docs/distributed.md, "ZeRO-1")
if opts.zero and dp.world() > 1 then ds4.dist.shard_optimizer(opt, { reduce_scatter = dp.reduce_scatter() }) end
if dp.world() > 1 then ds4.dist.bucket_mb(dp.bucket_mb(opts.bucket_mb)) end
if resume_dir then
    local st = ds4.checkpoints.read_state(resume_dir, "optimizer")
    opt:load_state({ m = st.m, v = st.v, tensor_steps = st.tensor_steps, step = resume_step })
    start = resume_step + 1
    print(("resuming from %s (%d updates done)"):format(resume_dir, resume_step))
elseif run.resumed then
    print("no checkpoint under " .. ckroot .. ": starting from scratch")
end
before = before or (ROOT and heldout_loss() or 0)

ffi.cdef("int isatty(int fd);")
local tty = ROOT and not opts.quiet and ffi.C.isatty(1) == 1
-- metrics.jsonl (one whole, flushed line per step; a write error stops the run) and TensorBoard events; a resumed
-- run drops what it will redo (records past its checkpoint) and a line torn by the crash
local log = ROOT and ds4.runlog.open(OUT, { resume_step = resume_dir and start - 1 or nil,
    tensorboard = opts.tensorboard }) or { write = function() end, close = function() end }
local now = ds4.metrics.clock

print(("sft: %s, %d parameters; %d train / %d held-out rows (%s); %d steps of %d; run %s"):format(
    ds4.config_summary(model:config()), model:n_params(), #train, #heldout, opts.data ~= "" and opts.data or
    "toy set", opts.steps, opts.batch, OUT))
lora = model:lora_info()
if lora then
    print(("LoRA rank %d (scale %g): %d adapter values train, the %d weights are frozen"):format(lora.rank, lora.scale,
        lora.numel, model:n_params()))
end
print(("held-out loss before training: %.4f"):format(before))
if not resume_dir then log:write({ step = 0, ["eval/loss"] = before }) end

-- This rank's micro-batches of an update: global micro-batch k (0-based) of PARTS holds the rows share(batch, PARTS,
-- k) of the batch; rank r has k = r·M ... r·M + M - 1 (M = --micro-batches), so the ranks' micro-batches in rank order
-- are one process's micro-batches in order.
local IKL = model:train_options().indexer_kl -- the indexer KL's weight κ (0: off)
local function my_micro_batches(rows)
    local out = {}
    for j = 0, opts.micro_batches - 1 do
        local first, count = dp.share(#rows, PARTS, dp.rank() * opts.micro_batches + j)
        local mb = {}
        for i = first, first + count - 1 do mb[#mb + 1] = rows[i] end
        local ids, labels, trained, len = make_batch(mb)
        out[#out + 1] = { ids = ids, labels = labels, trained = trained, lengths = len,
            queries = IKL > 0 and model:indexer_queries(len) or 0 }
    end
    return out
end

local wall0 = now()
for step = start, opts.steps do
    local rows = {}
    for i = 1, opts.batch do rows[i] = train[((step - 1) * opts.batch + i - 1) % #train + 1] end
    local t0 = now()
    local mbs = my_micro_batches(rows)
    local mine, cells, q = 0, 0, 0
    for _, mb in ipairs(mbs) do mine, cells, q = mine + mb.trained, cells + #mb.ids * #mb.ids[1], q + mb.queries end
    -- token-mean over the global batch: its trained tokens, from every rank; the indexer KL likewise over its real
    -- queries (each part of the loss by its own global count: docs/distributed.md, "Loss normalisation")
    local counts = dp.sum({ mine, q })
    local trained, Q = counts[1], counts[2]
    local scales = IKL > 0 and Q > 0 and { ce = 1 / trained, ikl = IKL / Q } or 1 / trained
    model:zero_grad()
    local lsum, isum = 0, 0 -- Σ loss · tokens and Σ indexer KL · queries over this rank's micro-batches (in order)
    -- the last backward sums the gradients over ranks bucket by bucket as it goes (docs/distributed.md); a rank
    -- without a micro-batch sends its zeros in the same buckets
    if dp.world() > 1 and #mbs == 0 then ds4.dist.overlap_backward(model) end
    for k, mb in ipairs(mbs) do
        local out = model:forward(mb.ids, { labels = mb.labels, logits = false, lengths = mb.lengths }) -- no [B, S, V]
        if out.loss then lsum = lsum + out.loss * out.loss_tokens end
        if out.indexer_loss then isum = isum + out.indexer_loss * out.indexer_queries end
        if dp.world() > 1 and k == #mbs then ds4.dist.overlap_backward(model) end
        model:backward(scales) -- each micro-batch's share of the global mean: one addition per gradient
    end
    if dp.world() > 1 then ds4.dist.all_reduce_grads(model) end -- summed in rank order
    local sums = dp.sum({ lsum, isum })
    local loss = sums[1] / trained
    local st = opt:step()
    local dt = now() - t0
    local tps = dp.sum({ cells })[1] / math.max(dt, 1e-9)
    log:write({ step = step, loss = loss, lr = st.lr, grad_norm = st.grad_norm, tokens = trained,
        tokens_per_s = tps, indexer_kl = IKL > 0 and sums[2] / math.max(Q, 1) or nil })
    if tty then
        local w = 30
        local done = math.floor(w * step / opts.steps)
        io.write(("\r[%s%s] %d/%d loss %.4f lr %.2e |g| %.3f %.0f tok/s "):format(("#"):rep(done),
            ("."):rep(w - done), step, opts.steps, loss, st.lr, st.grad_norm, tps))
        io.flush()
    elseif not opts.quiet and (step % 10 == 0 or step == 1 or step == opts.steps) then
        print(("step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f"):format(step, opts.steps, loss,
            st.lr, st.grad_norm, tps))
    end
    if opts.save_every > 0 and (step % opts.save_every == 0 or step == opts.steps) then
        -- every rank: a sharded optimizer gathers its moments (a whole state, any rank count) and on a GPU the
        -- model's sharded fp32 master, which the save below reads
        local os_ = opt:state()
        if ROOT then ds4.checkpoints.save(ckroot, step, model, {
            states = { optimizer = { tensors = { m = os_.m, v = os_.v, tensor_steps = os_.tensor_steps },
                                     meta = { step = os_.step } } },
            meta = { heldout_before = before, seed = opts.seed, batch = opts.batch },
            keep_last = opts.keep_last }) end
    end
end
if tty then io.write("\n") end
cut = dp.sum({ cut })[1]
-- every rank, before the communicator goes: a GPU model's fp32 master sharded by ZeRO-1 comes back from its owners
if opts.zero and dp.world() > 1 then model:params() end
dp.finalize() -- the ranks are done together; rank 0 alone evaluates, saves and reports
if not ROOT then return end

local after = heldout_loss()
log:write({ step = opts.steps, ["eval/loss"] = after })
log:close()
local save = opts.save ~= "" and opts.save or OUT .. "/model"
if opts.lora > 0 then -- the adapter (PEFT); a base built here is saved beside the run, as the adapter's base
    local base = opts.model
    if base == "" then
        base = OUT .. "/base"
        model:save(base, { overwrite = true })
    end
    model:save_lora(save, { overwrite = true, base = base })
    save = ("%s (LoRA adapter; base %s)"):format(save, base)
else
    model:save(save, { overwrite = true }) -- weights, config.json, tokenizer.json, tokenizer_config.json
end
local plot = require("ds4.plot")
plot.svg(OUT .. "/metrics.svg", plot.read_jsonl(OUT .. "/metrics.jsonl"), { title = "sft: training loss",
    series = { { key = "loss", label = "training loss" }, { key = "eval/loss", label = "held-out loss" } } })
if cut > 0 then print(("%d rows were cut at --max-len %d tokens"):format(cut, opts.max_len)) end
print(("held-out loss after training:  %.4f (from %.4f; %d s)"):format(after, before, now() - wall0))
print(("run: %s (metrics.jsonl, metrics.svg, config.lua%s); model: %s"):format(OUT,
    log.tensorboard and ", TensorBoard events" or "", save))
if not (after < before) then
    io.stderr:write("sft: the held-out loss did not fall\n")
    -- on the built-in toy set that is a failure of the example itself; on a user's data, a finding to report
    if opts.data == "" then os.exit(1, true) end
end
