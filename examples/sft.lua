--[[ examples/sft.lua — supervised fine-tuning of a small DeepSeek-V4-architecture model from scratch.

  ds4 run examples/sft.lua [--steps N] [--batch N] [--lr X] [--out DIR] [--seed N] [--quiet]
                           [--save-every K] [--keep-last N] [--resume]

What it does, end to end, with nothing downloaded:
  1. generates a toy chat dataset in Lua (reverse a word, add two numbers, echo an upper-case word) and writes
     it as JSONL (one {"messages": [...]} per line) to DIR/train.jsonl and DIR/heldout.jsonl, then reads the
     files back: the on-disk format is what a real dataset would use;
  2. renders every conversation with the DeepSeek-V4 chat template (chat mode) through the built-in
     byte-level tokenizer; the loss mask trains only what the assistant produces (its answer and EOS);
  3. builds a small model from a Lua config (random initialisation) and trains it with AdamW (linear warm-up,
     cosine decay, clipping), token-mean loss over each batch;
  4. shows a progress bar on a terminal (plain lines otherwise) and appends metrics as JSON lines to
     DIR/metrics.jsonl: step, loss, lr, grad_norm, tokens (trained tokens in the batch), tokens_per_s;
  5. reports the held-out loss before and after training;
  6. with --save-every K, writes DIR/ckpt/step_NNNNNN every K updates (weights, AdamW moments and step counts,
     the held-out loss at the start) and keeps the last --keep-last; --resume continues from the newest
     complete checkpoint. Nothing else is random and batch k is a function of k, so an interrupted and
     resumed run gives bit-identical losses and weights to an uninterrupted one (tests/test_resume.sh).
]]

local ds4 = require("ds4")
local chat = require("ds4.chat")
local json = require("ds4.chat.json")
local ffi = require("ffi")

-- ------------------------------------------------------------------------------------------------ options
local opts = { steps = 150, batch = 16, lr = 3e-3, out = "runs/sft", seed = 1, quiet = false,
    ["save-every"] = 0, ["keep-last"] = 3, resume = false }
do
    local i = 1
    while i <= #arg do
        local k = arg[i]:match("^%-%-(.+)$")
        if not k or opts[k] == nil then
            io.stderr:write("usage: ds4 run examples/sft.lua [--steps N] [--batch N] [--lr X] [--out DIR] [--seed N]"
                .. " [--quiet] [--save-every K] [--keep-last N] [--resume]\n")
            os.exit(2)
        end
        if k == "quiet" or k == "resume" then
            opts[k] = true
        else
            i = i + 1
            opts[k] = type(opts[k]) == "number" and assert(tonumber(arg[i]), "--" .. k .. " needs a number") or arg[i]
        end
        i = i + 1
    end
end
assert(os.execute(("mkdir -p '%s'"):format(opts.out)) == 0 or true)

-- ------------------------------------------------------------------------------------------------ dataset
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

-- ------------------------------------------------------------------------------------------------ tokens
local tok = ds4.tokenizer() -- built-in byte-level tokenizer with the DeepSeek chat special tokens
local template = chat.get("deepseek_v4")
local EOS = tok:special("eos")

-- Every conversation is checked as it is read (ds4.data: types, roles, and that the template renders it with at
-- least one trained token); a bad line stops the run here, naming file:line, not in the middle of training.
local function read_jsonl(path)
    local rows = {}
    for i, row in ipairs(ds4.data.read_jsonl(path, { format = "messages", tokenizer = tok, template = template,
        render_opts = { thinking = false } })) do
        rows[i] = row.messages
    end
    return rows
end

local r = rng(opts.seed)
write_jsonl(opts.out .. "/train.jsonl", 2000, r)
write_jsonl(opts.out .. "/heldout.jsonl", 64, r)
local train, heldout = read_jsonl(opts.out .. "/train.jsonl"), read_jsonl(opts.out .. "/heldout.jsonl")

-- ids and labels of one conversation: labels carry the token where the mask trains it, -100 elsewhere
-- (position t is scored against labels[t + 1], so a label marks the token to be predicted)
local function encode(messages)
    local rr = template:render(tok, messages, { thinking = false })
    local labels = {}
    for i = 1, #rr.ids do labels[i] = rr.mask[i] == 1 and rr.ids[i] or -100 end
    return rr.ids, labels
end

-- a rectangular batch: rows padded at the end with EOS and label -100 (causal attention never looks right,
-- and compression windows are aligned to position 0, so trailing padding changes nothing before it)
local function make_batch(rows)
    local ids, labels, S = {}, {}, 0
    for i, m in ipairs(rows) do
        ids[i], labels[i] = encode(m)
        S = math.max(S, #ids[i])
    end
    local trained = 0
    for i = 1, #rows do
        for t = #ids[i] + 1, S do
            ids[i][t], labels[i][t] = EOS, -100
        end
        for t = 2, S do
            if labels[i][t] ~= -100 then trained = trained + 1 end
        end
    end
    return ids, labels, trained
end

-- ------------------------------------------------------------------------------------------------ model
local model = ds4.new_model({
    vocab_size = tok:vocab_size(), hidden_size = 64, num_hidden_layers = 4,
    num_attention_heads = 4, head_dim = 32, qk_rope_head_dim = 16, q_lora_rank = 32,
    o_groups = 2, o_lora_rank = 32, sliding_window = 16,
    layer_types = { "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention" },
    compress_rates = { compressed_sparse_attention = 4, heavily_compressed_attention = 8 },
    mlp_layer_types = { "hash_moe", "moe", "moe", "moe" },
    index_n_heads = 4, index_head_dim = 32, index_topk = 4,
    n_routed_experts = 8, num_experts_per_tok = 2, moe_intermediate_size = 64,
    hc_mult = 2, num_nextn_predict_layers = 0, initializer_range = 0.05,
    bos_token_id = tok:special("bos"), eos_token_id = EOS,
}, opts.seed)

local function heldout_loss()
    local ids, labels = make_batch(heldout)
    return model:forward(ids, { labels = labels, train = false }).loss
end

local ckroot = opts.out .. "/ckpt"
local start, before = 1, nil
local resume_state
if opts.resume then
    local dir, _, meta, step = ds4.checkpoints.load(ckroot)
    if dir then
        model:free()
        model = ds4.load(dir)
        resume_state = ds4.checkpoints.read_state(dir, "optimizer")
        start, before = step + 1, meta.heldout_before
        print(("resuming from %s (%d updates done)"):format(dir, step))
    else
        print("no checkpoint under " .. ckroot .. ": starting from scratch")
    end
end
before = before or heldout_loss()
local opt = ds4.adamw(model, { lr = opts.lr, betas = { 0.9, 0.95 }, weight_decay = 0.1, clip = 1.0,
    schedule = "cosine", warmup = math.max(1, math.floor(opts.steps / 10)), total = opts.steps,
    min_lr_ratio = 0.1 })
if resume_state then
    local st = resume_state
    opt:load_state({ m = st.m, v = st.v, tensor_steps = st.tensor_steps, step = start - 1 })
end

ffi.cdef("int isatty(int fd);")
local tty = not opts.quiet and ffi.C.isatty(1) == 1
-- one whole, flushed line per step; a write error stops the run. A resumed run drops what it will redo (records
-- past its checkpoint) and a line torn by the crash.
local metrics = ds4.metrics.open(opts.out .. "/metrics.jsonl", { resume_step = opts.resume and start - 1 or nil })
local function now() return os.clock() end -- CPU seconds of this process (all threads)

print(("sft: %s, %d parameters; %d train / %d held-out conversations; %d steps of %d"):format(
    ds4.config_summary(model:config()), model:n_params(), #train, #heldout, opts.steps, opts.batch))
print(("held-out loss before training: %.4f"):format(before))

local wall0 = os.time()
for step = start, opts.steps do
    local rows = {}
    for i = 1, opts.batch do rows[i] = train[((step - 1) * opts.batch + i - 1) % #train + 1] end
    local ids, labels, trained = make_batch(rows)
    local t0 = now()
    model:zero_grad()
    local out = model:forward(ids, { labels = labels })
    model:backward() -- token-mean over this batch's trained tokens
    local st = opt:step()
    local dt = now() - t0
    local tps = (#ids * #ids[1]) / math.max(dt, 1e-9)
    metrics:write({ step = step, loss = out.loss, lr = st.lr, grad_norm = st.grad_norm, tokens = trained,
        tokens_per_s = tps })
    if tty then
        local w = 30
        local done = math.floor(w * step / opts.steps)
        io.write(("\r[%s%s] %d/%d loss %.4f lr %.2e |g| %.3f %.0f tok/s "):format(("#"):rep(done),
            ("."):rep(w - done), step, opts.steps, out.loss, st.lr, st.grad_norm, tps))
        io.flush()
    elseif not opts.quiet and (step % 10 == 0 or step == 1 or step == opts.steps) then
        print(("step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f"):format(step, opts.steps, out.loss,
            st.lr, st.grad_norm, tps))
    end
    if opts["save-every"] > 0 and (step % opts["save-every"] == 0 or step == opts.steps) then
        local os_ = opt:state()
        ds4.checkpoints.save(ckroot, step, model, {
            states = { optimizer = { tensors = { m = os_.m, v = os_.v, tensor_steps = os_.tensor_steps },
                                     meta = { step = os_.step } } },
            meta = { heldout_before = before, seed = opts.seed, batch = opts.batch },
            keep_last = opts["keep-last"] })
    end
end
if tty then io.write("\n") end
metrics:close()

local after = heldout_loss()
print(("held-out loss after training:  %.4f (from %.4f; %d s)"):format(after, before, os.time() - wall0))
print("metrics: " .. opts.out .. "/metrics.jsonl")
if not (after < before) then
    io.stderr:write("sft: the held-out loss did not fall\n")
    os.exit(1)
end
