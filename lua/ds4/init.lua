--[[ ds4 — the Lua interface of the ds4 engine (DeepSeek-V4-architecture models).

  local ds4 = require("ds4")

Tensors (host memory, dense, row-major; indices are 1-based)
  ds4.tensor(values [, dtype])     nested table of numbers (rectangular), a number (0-d) or a tensor (converted
                                   copy) -> tensor; dtype default "F32" ("F32","BF16","F16","F64","I64","I32",
                                   "I16","I8","U8","BOOL","F8_E4M3","F8_E5M2","F8_E8M0"; case-insensitive)
  ds4.zeros(shape [, dtype])       shape = {d1, d2, ...}
  ds4.is_tensor(x)                 true when x is a ds4 tensor
  t:shape()  t:dtype()  t:numel()  t:ndim()  t:nbytes()
  t:get(i1, i2, ...)               element at 1-based indices (one per dimension; bounds-checked)
  t:set(v, i1, i2, ...)            store v, rounded to the tensor's dtype
  t[i]  t[i] = v                   flat (row-major) 1-based element access
  t:item()                         the value of a one-element tensor
  t:totable()                      nested Lua tables (a number for a 0-d tensor)
  t:to(dtype)  t:clone()           converted / identical copy
  t:reshape(shape)                 copy with a new shape of the same element count
  t:size(d)                        shape[d]; negative d counts from the end
  t:data_ptr()                     lightuserdata to the data, for LuaJIT FFI (valid while t is alive)
  tostring(t)                      "ds4.tensor F32 [2, 37, 256]"
  #t                               first dimension (0 for a 0-d tensor)

Safetensors
  ds4.load_tensors(path)           {name = tensor} from a .safetensors file or a checkpoint directory
                                   (copies: the tensors outlive the file)
  ds4.save_tensors(path, tbl)      write {name = tensor}, names sorted (deterministic bytes)

Models
  ds4.load(dir [, opts])           model from an HF checkpoint directory (config.json + safetensors);
                                   opts = {device = "cpu" | "cuda" | "cuda:N", dtype = "bf16" | "fp32"}
                                   (default: ds4.set_device's; on CUDA the dtype defaults to bf16); a
                                   dir/tokenizer.json (+ tokenizer_config.json) is loaded and attached to it
  model:tokenizer()                -> the attached tokenizer and its chat template name (nil when none)
  model:set_tokenizer(tok [, {chat_template = name, config = table}])  attach one (nil detaches) -> model
  ds4.random_model(config [, seed | opts]) model with random weights (HF initialisation) from a config path;
                                   opts = {seed = n, device = ..., dtype = ...}
  ds4.new_model(cfg [, seed | opts]) the same from a Lua table of config.json fields (e.g. for training from
                                   scratch: {vocab_size = 280, hidden_size = 64, ...}; absent fields take the
                                   V4-Flash defaults, legacy spellings are folded as for config.json)
  model:to(device [, dtype])       move the model ("cpu", "cuda", "cuda:N"; also model:to{device=, dtype=}):
                                   weights copied in the working dtype, the host fp32 parameters stay the master
                                   copy; forward, generate, step run there; tensors handed back are host
                                   tensors; caches made before belong to the old device -> model
  model:device()                   -> "cpu" | "cuda:N", "fp32" | "bf16"
  model:profile([reset])           the per-op profile (ds4.profile(true) first): time, calls, bytes per op,
                                   sorted by time (CUDA events on the GPU, wall time on the CPU)
  ds4.config(path)                 config table of a config.json / checkpoint directory (no weights read)
  model:forward(ids [, opts])      ids: integer tensor [B, S] (I64/I32/... or floats holding integers) or a
                                   table of equal-length rows; opts.labels (same forms, -100 = ignore),
                                   opts.mtp = true (MTP logits; the model must have MTP weights),
                                   opts.replay = {experts = I32 [B, S, L, K], index = I32 [B, S, n_csa, topk]}
                                   (routing replay: use these experts / indexer picks instead of selecting; a row
                                   whose first value is -1 routes itself; from model:generate's records),
                                   opts.hidden = true (per-layer residual streams), opts.logits = false (skip).
                                   -> {logits = F32 [B, S, V], loss = number|nil, loss_tokens = n,
                                       mtp_logits = F32 [B, S-1, V], mtp_loss = number|nil, mtp_loss_tokens,
                                       hidden = F32 [L, B, S, hc_mult, hidden_size]}
                                   loss is nil when there are no labels or no scored token; a scored loss
                                   is always a number, NaN included (then backward refuses that forward).
  model:config()                   config table: every field; layer_types / mlp_layer_types as strings,
                                   rope_parameters = {main = {...}, compress = {...}}, compress_rates
  model:n_params()  model:has_mtp()
  model:tensors()                  {official name = tensor}: copies of the parameters
  model:params()                   F32 tensor [n_params]: a copy of the flat fp32 parameter buffer (lua/params_lua.c)
  model:set_params(src)            replace every parameter from an F32 tensor of n_params elements or a string of
                                   4 n_params little-endian bytes (one memcpy; gradients and optimizer state kept;
                                   raises inside an on_token callback of this model's generation) -> model
  model:tables_crc()               CRC-32 of the non-fp32 tensors (hash-routing tid2eid tables): equal parameters
                                   give equal outputs only if these agree too
  model:tables() / model:set_tables(bytes)  those tables as int32 bytes (tensor order) / replace them (ids checked)
  model:config_json()              the canonical config JSON (what a rollout worker builds its model from)
  model:free()                     release now (later calls raise "model has been freed")
  ds4.is_model(x)
  ds4.config_summary(cfg)          one-line description of a config table

Tokenizer (HF tokenizer.json byte-level BPE; equals HF tokenizers' encode(text, add_special_tokens=False))
  ds4.tokenizer([path])            tokenizer.json -> tokenizer; no path: the built-in byte-level tokenizer
  ds4.tokenizer_from_json(text)    the same from tokenizer.json's text (tok:to_json()'s inverse)
                                   (ids 0..255 = bytes, DeepSeek chat special tokens from 256)
  tok:encode(text [, {bos = true}]) -> Lua array of ids; no BOS unless bos = true (error if the tokenizer has
                                   no <｜begin▁of▁sentence｜>). Invalid UTF-8 is encoded by its bytes.
  tok:decode(ids [, {skip_special = true}])  Lua array or integer tensor of ids -> string (the exact bytes)
  tok:vocab_size()                 largest id + 1
  tok:token_to_id(s)  tok:id_to_token(id)    vocabulary strings (byte-level form, e.g. "Ġthe"); nil if absent
  tok:special(name)                id of a DeepSeek special token by name, nil if absent: "bos", "eos", "user",
                                   "assistant", "think", "end_think", "latest_reminder", "dsml", "pad", "tool_*", ...
  tok:is_special(id)               true for special added tokens (what skip_special drops)
  tok:to_json()                    the tokenizer.json text it was loaded from (the built-in one's: generated)
  ds4.special_tokens()             {name = token text} of those names
  ds4.is_tokenizer(x)

Training (lua/train_lua.c)
  model:zero_grad()                enable gradients (first call) and set them to zero
  model:forward(ids, {labels = l}) on a model with gradients enabled: a training forward that keeps the
                                   activations for backward; opts.train = false forces inference, true enables
                                   gradients itself; opts.lengths = {real length of each row}: the right padding
                                   takes no part in the indexer KL loss (its value, count and gradient)
  model:indexer_queries(lengths)   the indexer KL's query count of rows of these real lengths (what such a forward
                                   reports as indexer_queries), for backward{ikl = kappa / Q} over micro-batches
  model:train_options()            the options set_train_options last set (a table it takes back)
  model:backward([scale])          add the gradient of scale * (sum of per-token CE) of the last training forward;
                                   scale defaults to 1 / loss_tokens (gradient of out.loss); once per forward
  model:grads()                    {official name = F32 tensor}: copies of the gradients (fp32 parameters)
  model:logprobs([{entropy = true}]) -> logp F32 [B, S] (, entropy [B, S]) of the last training forward:
                                   logp[b][s] = log p(labels[b][s + 1] | ids[b][1..s]), the log-probability of the
                                   NEXT position's label, 0 where that label is -100 (the last column is always
                                   0); does not consume the forward
  model:backward_logprobs(g)       g: F32 [B, S] laid out as logp, g[b][s] = dLoss/dlogp[b][s] of the loss being
                                   MINIMISED: adds sum g * dlogp/dtheta to the gradients (the SFT mean loss is
                                   g = -1/N on every scored position; a policy-gradient loss -A logp is g = -A);
                                   consumes the forward, as backward does. ds4.rl.trainer's config.loss returns g
  ds4.adamw(model [, opts])        AdamW as torch.optim.AdamW (+ clip_grad_norm_, LR schedule); opts: lr (1e-3),
                                   betas ({0.9, 0.999}), eps (1e-8), weight_decay (0.01; not on norms, biases,
                                   sinks, mHC base/scale), clip (off), schedule ("constant"|"linear"|"cosine"),
                                   warmup (linear warm-up steps), total (end of the decay), min_lr_ratio (0),
                                   zero_grad (false; true: opt:step() leaves the gradients zero, as
                                   model:zero_grad() would, in the update's own pass on a GPU)
  opt:step()                       clip, update -> {lr = ..., grad_norm = (before clipping), step = updates done};
                                   raises, changing nothing (parameters, moments, gradients, step count), when the
                                   gradient norm or the updated parameters would not be finite, and inside an
                                   on_token callback of the model's generation
  opt:lr()  opt:steps()  opt:free() the next update's lr, updates done, release now (keeps the model alive)

Saving and checkpoints (lua/save_lua.c; layout and guarantees: core/include/ds4_ckpt.h)
  model:save(dir [, opts])         config.json + model.safetensors under the names transformers' save_pretrained
                                   writes (from_pretrained loads it); written in a sibling and renamed into place.
                                   opts.dtype = "F32" (exact, default) | "BF16" | "F16"; opts.overwrite = true
                                   replaces an existing dir that holds only checkpoint files. -> dir. A model with
                                   a NaN or infinite weight is refused (here and by checkpoints.save).
                                   The attached tokenizer is written with the weights (tokenizer.json,
                                   tokenizer_config.json: lua/ds4/pretrained.lua); opts.tokenizer = tok | false,
                                   opts.chat_template = name override it; opts.files = {name = text}: more *.json
  ds4.checkpoints.save(root, step, model [, opts])  -> root/step_NNNNNN (step = completed updates), committed
                                   atomically with a checksummed COMPLETE marker. opts.extra = {name = tensor},
                                   opts.meta = {JSON-able table}, opts.states = {name = {tensors = ..., meta = ...}},
                                   opts.dtype, opts.tokenizer / chat_template / files as model:save;
                                   opts.keep_last / keep_every / clean: prune afterwards. The commit
                                   removes crash leftovers no running writer can own (ds4_ckpt.h). A model with
                                   LoRA adapters: its adapters too (adapter_config.json, adapter_model.safetensors)
  ds4.checkpoints.load(root [, step]) -> dir, extra, meta, step of the newest (or given) complete checkpoint
                                   (nil when there is none); ds4.load(dir) loads its model (ds4.load(dir, {lora =
                                   dir}) with its adapters, when it has adapter_config.json)
  ds4.checkpoints.list(root)       complete steps, ascending (every file's size and CRC-32 verified)
  ds4.checkpoints.latest(root)     newest complete step, or nil
  ds4.checkpoints.prune(root, {keep_last = K, keep_every = M, clean = false, dry_run = false})
                                   -> {removed = {steps}, kept, cleaned, left}; never removes the newest complete
                                   checkpoint, an incomplete one, or a live writer's temporary directory
  ds4.checkpoints.scan(root)       {{name, step, kind = "complete"|"incomplete"|"active"|"stale", pid, reason}}
  ds4.checkpoints.check(dir [, {sizes_only = true}])  -> step, or nil + why
  ds4.checkpoints.begin(root, step) -> tmp dir;  .commit(root, step, tmp) -> final dir;  .abort(tmp)
  ds4.checkpoints.write_state(dir, name, tensors, meta)  .read_state(dir, name) -> tensors, meta (nil if absent)
  ds4.checkpoints.path(root, step) "root/step_NNNNNN"

Generation (lua/gen_lua.c; C contract: core/include/ds4_gen.h)
  model:generate(prompts [, opts]) prompts: array of prompts, each a Lua array of token ids or a 1-D integer
                                   tensor [S] (or one integer tensor [B, S] of B prompts); a flat array of numbers
                                   is an error (wrap it: {ids}). opts (unknown keys are errors):
                                   max_new_tokens (64), temperature (1.0; 0 = greedy), top_k (0 = off), top_p
                                   (1.0 = off), min_p (0.0 = off), n (1: samples per prompt, sharing its prefill),
                                   seed (0), stop = {id or string, ...} (strings need opts.tokenizer, a
                                   ds4.tokenizer that decodes the output), ignore_eos (false), record_experts
                                   (false), record_index (false), max_batch (0 = all sequences per decode step),
                                   prefill_chunk (0 = 2048), prompt_base (0: these prompts' index offset in the
                                   random streams — a share of a larger batch passes its first prompt's index
                                   there to draw what the whole batch would), on_token = function(i, id, logprob) called as each
                                   token is sampled (i = result index; returning false cancels the whole
                                   generation; an error in it cancels, then is re-raised by generate)
                                   -> res[(p-1)*n + s] = {ids = {generated ids, prompt excluded; a final eos /
                                   stop token kept}, logprobs = {log p_model(id | prefix), temperature 1},
                                   sample_logprobs = {log-prob under the distribution sampled from; 0 greedy},
                                   finish_reason = "length"|"eos"|"stop_token"|"stop_string"|"cancelled",
                                   stop = the matched stop id or string (else nil), prompt_index = p,
                                   sample_index = s, prompt_len, experts = I32 [prompt_len + #ids - 1, L, K]
                                   (record_experts), index_picks = I32 [prompt_len + #ids - 1, n_csa, index_topk]
                                   (record_index; -1 padded)}; res.stats = {prefill_tokens, decode_tokens,
                                   prefill_seconds, decode_seconds, prefill_tokens_per_s, decode_tokens_per_s}.
                                   Samples depend only on (seed, prompt, sample index, step), not on batching.
                                   Ctrl-C in the ds4 host cancels a running generation. While it runs, on_token
                                   must not use the same model (forward, step, generate, free, training raise).
  model:new_cache(max_len)         ds4.cache: one sequence's decoding state for up to max_len positions (keeps
                                   its model alive); c:len(), c:capacity(), c:bytes(), c:reset(),
                                   c:copy_from(other) (same model), c:free(), tostring(c)
  model:step(caches, ids [, opts]) append ids[i] (non-empty id array or 1-D integer tensor) to caches[i] (distinct
                                   caches of this model), all in one batch; model:step(c, ids) for one cache.
                                   opts.logits = "last" (default: F32 [#caches, V], each sequence's last token)
                                   | "all" (F32 [N, V], every new token, sequence after sequence) | "none";
                                   opts.experts = true: I32 [N, L, K]; opts.index = true: I32 [N, n_csa, topk]
                                   -> {logits, experts, index_picks}. Any chunking gives the full forward's rows.
  model:batcher{max_seqs = 32, prefill_chunk = 0}
                                   ds4.batcher: continuous batching. b:submit(prompts [, opts]) -> tag (opts: those
                                   of generate but max_batch, prefill_chunk, on_token); b:step() runs every admitted
                                   sequence once (up to max_seqs at once; a task's prompt joins when its n samples
                                   fit, in submission order) and retires finished tasks; b:take() -> tag, res (as
                                   generate's) | tag, nil, message (ended by a failed step) | nil; b:cancel(tag),
                                   b:stats() -> {queued, running, finished, seqs, free_seqs, steps, prefill_tokens,
                                   decode_tokens}, b:free(). A task's res equals model:generate(prompts, opts)
                                   alone, bit for bit, whatever else runs in the batcher. Do not change the model's
                                   parameters while tasks are admitted.
  ds4.sample(logits, params, u)    one draw (ds4_sample): logits = tensor of V values or array of numbers,
                                   params = {temperature = 1, top_k = 0, top_p = 1, min_p = 0} (nil: those),
                                   u in [0, 1) (may be omitted when temperature = 0) -> id (0-based),
                                   lp_model (log-softmax at temperature 1), lp_sample (under the filtered
                                   distribution; 0 greedy)
  ds4.sample_uniform(seed, stream, step)  the counter-based uniform draw in [0, 1) generation uses
  ds4.is_cache(x)

Engine
  ds4.set_threads(n)               CPU threads (0 = one per physical core, at most 16); before loading models (or after freeing them)
  ds4.threads()                    the engine's thread count (creates the engine)
  ds4.set_device(device [, dtype]) where models made from now on compute (`ds4 run|repl|worker --device`)
  ds4.device()                     that default: "cpu" or "cuda:N bf16"
  ds4.cuda_devices()               usable CUDA devices (0 without a GPU, a driver or a CUDA build)
  ds4.profile([on])                switch the per-op profile of every model on/off -> the previous state
                                   (environment DS4_PROFILE=1: on, printed to stderr when a model is freed)

Chat templates (lua/ds4/chat/: loaded on first use of ds4.chat; same as require("ds4.chat"))
  ds4.chat.get(name)               template: "deepseek_v4" (official DeepSeek-V4 format), "chatml", or registered
  tmpl:render(tok, messages, opts) -> {ids, mask, text, segments}; mask[i] = 1 on trained (model-produced) tokens
  tmpl:check_prefix(tok, before, after, opts [, opts_after])  true, or false + why (append-only check)
  ds4.chat.register(name, {segments = fn} or {render = fn})   ds4.chat.list()   ds4.chat.builder(tok)

Datasets, runs and metrics (pure Lua, loaded on first use; each file's header has the details)
  ds4.data.read_jsonl(path, {format = "auto" | "prompt_answer" | "messages" | "prompt_completion", tokenizer,
                                   template, thinking, columns = {field = "dotted.path"} | "verl", eos})  -> rows,
                                   every row checked (types, empty prompts, NaN answers, renderable conversations)
                                   and, with a tokenizer, tokenised (ids; SFT rows also labels); errors name
                                   file:line and the field. ds4.data.parse_jsonl(text, name, opts) on a string
  ds4.metrics.open(path [, {resume_step = k}])  -> JSONL writer: w:write(record) writes one whole line, flushed,
                                   errors raised; resume drops a torn last line and records past step k.
                                   ds4.metrics.clock() (monotonic seconds), ds4.metrics.wall() (epoch seconds)
  ds4.options.parse(arg, spec [, {base = file}])  options from defaults, a Lua config file (--config) and the
                                   command line (--name V, --name=V, dotted fields of table options);
                                   ds4.options.write(path, opts, spec) the effective configuration
  ds4.rundir.open{root, out, id, resume}  a run's own directory (root/<start time>, root/latest);
                                   ds4.rundir.start(arg, spec, root) -> opts, run: parse, open, write config.lua
  ds4.runlog.open(dir [, {resume_step, tensorboard = true}])  -> log: log:write(row) (metrics.jsonl and
                                   TensorBoard scalars), log:table(step, name, header, rows), log:close()
  ds4.tensorboard.open(dir) -> w: w:scalars(step, {tag = x}), w:text(step, tag, text | rows), w:close();
                                   ds4.tensorboard.available() (built with protobuf-c); ds4.tb: the raw records
  ds4.fs                           mkdir_p, exists, is_dir, write_atomic, symlink, readlink (through the FFI)
  ds4.dp                           data parallelism for scripts: init (when launched with several ranks), share
                                   of a batch, sum / max / min of metrics over ranks, is_root (docs/distributed.md)

Rewards (lua/ds4/reward/, pure Lua: ds4.reward = require("ds4.reward"), loaded on first use; API in its init.lua)
  reward.math_reward(resp, sample) {score = 1/0, info = {extracted, reference, reason}} vs sample.answer;
                                   extract_boxed / extract_last_number / extract_answer / normalize / math_equal
                                   (what counts as equal: the TABLE atop lua/ds4/reward/math.lua)
  reward.exact_match  reward.format_reward  reward.length_penalty (DAPO soft overlong)  reward.combine
  reward.evaluate(fn, resp, sample) -> score, info, err   never raises: errors / NaN / bad results -> err
  reward.evaluate_batch(fn, responses, samples) -> scores (nil where failed), infos, errors {{index, message}}

RL algorithms (lua/ds4/rl/, pure Lua: ds4.rl = require("ds4.rl"); formulas and citations atop each file;
the loop: require("ds4.rl.trainer").run{...}, with checkpoints, resume, metrics and a user loss)
  rl.advantage   group_mean / leave_one_out / dr_grpo / reinforce_pp / gae / compute(samples, spec)
  rl.loss        compute(samples, spec, {denom, num_seqs}) -> {loss, grads (dLoss/dlogp per token), metrics}:
                 ppo_clip (eps_low / eps_high, dual clip), gspo, cispo; aggregation named explicitly; KL k1/k2/k3
                 in the loss or in the reward; entropy bonus
  rl.correction  rollout/train mismatch: truncated / masked IS, token or sequence level; mismatch metrics
  rl.filter      DAPO dynamic sampling (keep_groups, fill_batch), overlong filtering, soft overlong punishment
  rl.algorithms  presets (data): grpo, dapo, dr_grpo, gspo, cispo, reinforce_pp, rloo; rl.preset(name, overrides)

ZeroMQ (lua/zmq_lua.c; one context per Lua state, made on first use, terminated at exit after every socket)
  ds4.zmq.socket(type)             "ROUTER" | "DEALER" | "PUSH" | "PULL" | "PAIR" | "REQ" | "REP" (| "PUB" | "SUB");
                                   made with linger 0 (set it before close to flush)
  sock:set{opt = value, ...}       linger, sndhwm, rcvhwm, routing_id, heartbeat_ivl, heartbeat_timeout,
                                   heartbeat_ttl, reconnect_ivl, reconnect_ivl_max, handshake_ivl, connect_timeout,
                                   tcp_keepalive (ms / counts: integers), maxmsgsize (bytes), router_mandatory,
                                   router_handover, immediate, ipv6, curve_server (booleans, or 1 / 0), curve_publickey,
                                   curve_secretkey, curve_serverkey (40-character Z85 keys), zap_domain, subscribe,
                                   unsubscribe (strings). Unknown keys and wrong types raise; every entry is checked
                                   before any is applied. -> sock
  sock:get(name)                   an option's value (also "last_endpoint")
  sock:bind(ep) -> endpoint        the bound endpoint: "tcp://127.0.0.1:*" reports the port
  sock:connect(ep)  sock:disconnect(ep)  sock:unbind(ep)
  sock:send(frames [, {timeout = ms}])  frames: array of strings or tensors (their bytes), one multipart message
                                   -> true | nil, "EAGAIN" | "EHOSTUNREACH" | other errno name, message. Never
                                   blocks (ZMQ_DONTWAIT) unless opts.timeout: then waits up to that long while the
                                   send would block (EAGAIN)
  sock:recv([timeout_ms])          -> array of frame strings, or nil when nothing came in time; 0 = poll once;
                                   nil (or -1) = wait forever
  ds4.zmq.poll(socks, timeout_ms)  -> array of booleans (readable); timeout as for recv
                                   Waits wake every 100 ms: Ctrl-C (the host's interrupt flag) raises
                                   "<function>: interrupted".
  sock:events() -> {readable, writable}   sock:type()   sock:close([linger_ms])   tostring(sock)
  ds4.zmq.keypair() -> public, secret     Z85 CURVE keys (raises when libzmq has no CURVE)
  ds4.zmq.public_from_secret(secret) -> public
  ds4.zmq.read_key(path) -> z85    the key in a `ds4 keygen` file (PREFIX.key or PREFIX.pub): the first line that
                                   is not a # comment
  ds4.zmq.has(capability) -> bool  ds4.zmq.version() -> "4.3.4"
  ds4.zmq.zap{allow = {public_z85, ...}, quiet = false} -> handler: authenticates CURVE clients of every CURVE
                                   server socket of the state (rollout/zap.c: a thread answering ZAP requests):
                                   listed keys get 200 (user id = the key), others 400, counted, remembered (the
                                   last 64 distinct keys) and logged "ds4 zap: refused CURVE key <z85> from <addr>".
                                   Start it BEFORE a CURVE server binds. One per state; it keeps running when the
                                   script drops it (until handler:stop() or exit). After stop, CURVE servers accept
                                   any client key again (libzmq's behaviour without a handler).
  handler:allow(key)  handler:deny(key) -> was_there  handler:is_allowed(key)  handler:allowed() -> keys
  handler:stats() -> {accepted = n, refused = n, refused_keys = {z85, ...}, allowed = n}
  handler:stop()  handler:running()

Rollout wire codec (lua/wire_lua.c; rollout/protocol.md; the C API: rollout/wire.h)
  ds4.wire.encode(msg [, frames]) -> array of frame strings (header, raw frames), ready for sock:send. msg.t is
                                   the type; the other keys mirror that type's struct in wire.h:
    hello           worker, max_batch, threads, vocab_size, n_params (both 0: no model), config_crc (0),
                    tables_crc (0), build (""), policy (0)
    credit          n
    task            task_id, attempt (0), policy, max_new_tokens, temperature (1), top_k (0), top_p (1),
                    min_p (0), n (1), seed (0; a number, or a decimal string above 2^53), stop ({}),
                    ignore_eos, record_experts, record_index (false), stream (0: no partial messages; N: one
                    every N new tokens, protocol 5), prompt_len (#prompt); frame prompt (i32)
    samples         task_id, attempt (0), policy, n (#seq), seq = {{prompt_len, n_gen, finish (1..5 or "length",
                    "eos", "stop_token", "stop_string", "cancelled"), stop_index (-1), n_rows (0)}, ...},
                    experts_layers, experts_k, index_layers, index_topk (0 = no such frame), token_versions
                    (false; protocol 5); frames tokens (i32), logprobs, sample_logprobs (f32), policy_lag (i32, when
                    token_versions: policy - each token's version), experts, index (i32, when their shape is set)
    partial         task_id, attempt (0), policy, n (#seq), seq = {{offset, n_gen}, ...}, token_versions (false;
                    protocol 6); frames tokens (i32), logprobs, sample_logprobs (f32), policy_lag (i32, when
                    token_versions): a running task's newest tokens (protocol 5)
    weight_announce version, n_params, bytes (4 n_params), chunk, chunks (ceil(bytes / chunk)), dtype ("f32"), crc,
                    chat_template (""), config_crc, tokenizer_crc, tables_crc (each its frame's CRC); frames config,
                    tokenizer (strings of bytes; tokenizer "" when none), tables (i32); a LoRA policy (protocol 4):
                    lora_rank, lora_alpha, lora_rslora, lora_base_version, lora_base_chunk, lora_base_crc and frame
                    lora_masks (i32, per layer), bytes then the adapters' (4 x their count)
    weight_request  version, index
    weight_chunk    version, index, offset (index chunk), bytes, chunk, crc (computed when absent); frame weights
    heartbeat       policy, active (0)
    error           code (a number or a name: "state", ...), reason (""), ref_t (""), ref_id (0), ref_n (0)
    bye             reason ("")
                                   (defaults in parentheses; a field without one is required). Raw frames come from
                                   `frames` or from msg, by their protocol names: a Lua array of numbers, a string
                                   of little-endian bytes, or an I32 / F32 tensor. Errors name the field
                                   ("ds4.wire.encode: task.attempt: ..."); the codec's own validation (ranges,
                                   cross-field rules) raises with its message.
  ds4.wire.decode(frames [, limits, opts]) -> msg (the fields above plus v; samples' seq entries also carry
                                   finish_reason, error messages code_name; raw frames as Lua arrays, weights as a
                                   string) | nil, code_name, message, ref_t for a malformed message: it never raises
                                   on the peer's bytes (only for the caller's mistakes). limits: overrides of
                                   ds4.wire.default_limits(); opts.raw = true keeps raw frames as strings;
                                   opts.first = 2 skips a ROUTER's routing-id frame. encode(decode(x)) = x.
  ds4.wire.error_message(code, reason, ref_t [, ref_id, ref_n]) -> frames of an error message (reason cut to 256
                                   bytes)
  ds4.wire.crc32(s [, crc])        CRC-32 (IEEE) of a string or a tensor's bytes, continuing from crc
  ds4.wire.codes = {name = number}  ds4.wire.code_name(n)  ds4.wire.types  ds4.wire.VERSION (5)

Remote rollouts (lua/ds4/rollout/: pool.lua and worker.lua say everything; rollout/README.md, protocol.md)
  ds4.rollout.pool{bind, model, curve = {secret, public, allow} | insecure = true, workers = 0,
                   max_staleness = 1, stale = "requeue" | "accept_with_version", lease_s = 60, dead_s = 10, ...}
                                   -> pool, a rollout source: pool:generate(prompts, opts) has model:generate's
                                   interface and results (+ policy_version, task, attempt, worker per result;
                                   res.failed); prompt p is one task with seed ds4.rollout.task_seed(opts.seed, p)
  pool:publish(model) -> version   snapshot the parameters as a new policy version (unchanged: same version);
                                   trainer.run calls it after every step when rollout.source has it
  pool:submit(prompts, opts) -> b  pool:poll()  pool:ready(b)  pool:collect(b)  pool:cancel(b)  pool:progress(b)
                                   batches in flight; opts.min_policy = V (every sample of version >= V), opts.stream
                                   = N (each task's tokens streamed every N: cfg.on_partial, pool:progress)
  pool:stats()  pool:sync([timeout_s])  pool:wait(n [, timeout_s])  pool:service([timeout_ms])  pool:close()
  pool.endpoint  pool.version
  ds4.rollout.task_seed(seed, p)   the seed of prompt p of a generate call with opts.seed = seed
  ds4.rollout.worker.run{connect, model, id, curve | insecure, max_batch, credits, partial_rollouts}
                                   -> exit status (`ds4 worker`; partial_rollouts: new weights go in under running
                                   sequences, each token's version in the answer)

Misc
  ds4.version  ds4.build_info  ds4.luajit_version
  ds4.script_dir()                 directory of the running script (arg[0]), "." if unknown

Errors are Lua errors whose message starts with the function name ("ds4.load: ...") followed by the
engine's message (stage, operation, shapes). Use pcall to handle them. An options table is checked key by key:
a misspelt key is refused ("ds4.adamw: unknown option 'weight_dacay' (known: lr, betas, ...)"), and so is a
value of the wrong type or range ("ds4.sample: opts.top_p must be a number in (0, 1] (1: off), got 0").
]]

local core = require("ds4.core")

local M = {}
for k, v in pairs(core) do
    M[k] = v
end
M.tokenizer_from_json = core.tokenizer_from_json
M.tokenizer = core.tokenizer  -- lua/tokenizer_lua.c (copied above with the rest of ds4.core; named for the reader)

local type, tostring, error = type, tostring, error

-- ------------------------------------------------------------------------------------------------ tensors

function core.tensor_methods.size(t, d)
    local shape = t:shape()
    if type(d) ~= "number" or d ~= math.floor(d) then
        error("ds4.tensor:size: bad argument #1 (integer dimension expected, got " .. type(d) .. ")", 2)
    end
    local n = #shape
    local i = d < 0 and n + 1 + d or d
    if i < 1 or i > n then
        error(("ds4.tensor:size: dimension %d out of range for a %d-dimensional tensor"):format(d, n), 2)
    end
    return shape[i]
end

-- ------------------------------------------------------------------------------------------------ models

local model_mt = debug.getregistry()["ds4.model"]

function M.is_model(x)
    return type(x) == "userdata" and getmetatable(x) == model_mt
end

local function count(list, value)
    local n = 0
    for _, v in ipairs(list) do
        if v == value then n = n + 1 end
    end
    return n
end

function M.config_summary(cfg)
    if type(cfg) ~= "table" then
        error("ds4.config_summary: bad argument #1 (config table expected, got " .. type(cfg) .. ")", 2)
    end
    local lt = cfg.layer_types or {}
    return ("%d layers (%d sliding, %d CSA, %d HCA; %d hash-routed), hidden %d, %d heads x %d, vocab %d, "
        .. "%d routed experts (top %d) + %d shared, hc_mult %d, MTP layers %d"):format(
        cfg.num_hidden_layers, count(lt, "sliding_attention"), count(lt, "compressed_sparse_attention"),
        count(lt, "heavily_compressed_attention"), count(cfg.mlp_layer_types or {}, "hash_moe"),
        cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size, cfg.n_routed_experts,
        cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.hc_mult, cfg.num_nextn_predict_layers)
end

function M.new_model(cfg, seed_or_opts)
    if type(cfg) ~= "table" then
        error("ds4.new_model: bad argument #1 (config table expected, got " .. type(cfg) .. ")", 2)
    end
    return core.random_model_json(require("ds4.chat.json").encode(cfg), seed_or_opts)
end

-- ------------------------------------------------------------------------------------------------ tokenizers

-- A model's tokenizer and chat template travel with it (ds4.pretrained): ds4.load attaches what the directory
-- holds, model:save and ds4.checkpoints.save write it back. Weak keys: the record goes when the model does.
local attached = setmetatable({}, { __mode = "k" })
local pretrained = require("ds4.pretrained")
local model_methods = core.model_methods

function model_methods.set_tokenizer(m, tok, opts)
    if not M.is_model(m) then error("ds4.model:set_tokenizer: self must be a ds4.model", 2) end
    if tok ~= nil and not core.is_tokenizer(tok) then
        error("ds4.model:set_tokenizer: bad argument #1 (ds4.tokenizer or nil expected, got " .. type(tok) .. ")", 2)
    end
    if opts ~= nil and type(opts) ~= "table" then
        error("ds4.model:set_tokenizer: opts must be a table {chat_template = name, config = table}", 2)
    end
    opts = opts or {}
    if opts.chat_template ~= nil and type(opts.chat_template) ~= "string" then
        error("ds4.model:set_tokenizer: opts.chat_template must be a template name", 2)
    end
    attached[m] = tok and { tokenizer = tok, chat_template = opts.chat_template or pretrained.template_for(tok, opts.config),
        config = opts.config } or nil
    return m
end

-- -> tokenizer, chat template name (nil, nil when none is attached)
function model_methods.tokenizer(m)
    local a = attached[m]
    if not a then return nil end
    return a.tokenizer, a.chat_template
end

-- opts.files for a save: the attached tokenizer's files (opts.tokenizer = false: none; a ds4.tokenizer: that one),
-- under the caller's own opts.files.
local function with_tokenizer_files(m, opts, fname)
    if opts ~= nil and type(opts) ~= "table" then return opts end -- the C function names the bad argument
    local o = {}
    for k, v in pairs(opts or {}) do if k ~= "tokenizer" and k ~= "chat_template" then o[k] = v end end
    local tok, a = opts and opts.tokenizer, attached[m]
    if tok ~= nil and tok ~= false and not core.is_tokenizer(tok) then
        error(fname .. ": opts.tokenizer must be a ds4.tokenizer or false, got " .. type(tok), 3)
    end
    if tok == false or (tok == nil and not a) then return o end
    local files = pretrained.files(tok or a.tokenizer, { chat_template = opts and opts.chat_template
        or (not tok and a.chat_template) or nil, config = not tok and a.config or nil })
    if o.files ~= nil and type(o.files) ~= "table" then
        error(fname .. ": opts.files must be a table {name = text}, got " .. type(o.files), 3)
    end
    for k, v in pairs(o.files or {}) do files[k] = v end
    o.files = files
    return o
end

local core_save = model_methods.save
function model_methods.save(m, dir, opts)
    return core_save(m, dir, with_tokenizer_files(m, opts, "ds4.model:save"))
end

local core_ckpt_save = core.checkpoints.save
function M.checkpoints.save(root, step, m, opts)
    return core_ckpt_save(root, step, m, with_tokenizer_files(m, opts, "ds4.checkpoints.save"))
end

-- ds4.load(dir, ...) also reads dir/tokenizer.json (+ tokenizer_config.json) when present and attaches it.
function M.load(dir, ...)
    local m = core.load(dir, ...)
    if type(dir) == "string" then
        local ok, tok, info = pcall(pretrained.read, dir)
        if not ok then error("ds4.load: " .. tostring(tok), 2) end
        if tok then model_methods.set_tokenizer(m, tok, info) end
    end
    return m
end

-- ------------------------------------------------------------------------------------------------ misc

function M.script_dir()
    local script = _G.arg and _G.arg[0]
    if type(script) ~= "string" or script == "-" then return "." end
    return script:match("^(.*)/[^/]*$") or "."
end

-- pure-Lua parts load on first use: ds4.chat, ds4.reward, ds4.rl, ds4.rollout, ds4.data, ds4.metrics, and the run
-- tooling: ds4.options, ds4.rundir, ds4.runlog, ds4.tensorboard, ds4.fs, ds4.dp
local LAZY = { chat = "ds4.chat", reward = "ds4.reward", rl = "ds4.rl", rollout = "ds4.rollout", data = "ds4.data",
    metrics = "ds4.metrics", options = "ds4.options", rundir = "ds4.rundir", runlog = "ds4.runlog",
    tensorboard = "ds4.tensorboard", fs = "ds4.fs", dp = "ds4.dp" }
setmetatable(M, { __lazy = LAZY, __index = function(t, k) -- __lazy: the names, for the REPL's Tab completion
    if LAZY[k] then
        t[k] = require(LAZY[k])
        return t[k]
    end
end })

return M
