--[==[ ds4.rl.resume — RL checkpoints: what ds4.rl.trainer needs to continue a run exactly where it stopped.

  local resume = require("ds4.rl.resume")
  resume.save(root, model, opt, reference, state [, keep_last [, opt_state]]) -> dir
                                                                         root/step_NNNNNN, NNNNNN = opt:steps();
                                                                         opt_state: opt:state() taken already (a
                                                                         sharded optimizer's, which every rank gathers)
  resume.load(root, model, opt, reference) -> state, dir | nil           the newest complete checkpoint

A checkpoint (ds4.checkpoints: committed atomically, checksummed) holds
  the policy                 model.safetensors + config.json, and the tokenizer attached to the model; with LoRA
                             adapters attached, the adapters too (adapter_config.json + adapter_model.safetensors,
                             PEFT's layout) and the optimizer's moments are the adapters'
  optimizer.safetensors      AdamW moments m, v and per-tensor step counts; optimizer.json its update count
  reference.safetensors      the reference model's parameters (a KL term's frozen policy), when there is one: on
                             resume the caller builds the reference from anything of the right architecture (the
                             resumed policy, say) and gets the original one back
  trainer.json               the loop's counters (state): RL step, rollout batches drawn (prompts(k, n) is called
                             with the next k, and generation seeds are a function of k), group ids, failed groups,
                             idle steps, the evaluations so far, and state.user (trainer.run's config.state.save())
Names count completed optimizer updates, as examples/sft.lua's do (with minibatches M, RL step k has done k * M of
them when every step trained). Loading puts the weights into the caller's model with model:set_params (its
hash-routing tables must be the checkpoint's: they are compared), so objects holding the model (a rollout pool)
keep working; the adapters go in with model:set_lora, so the caller attaches adapters of the checkpoint's rank,
scale and targets first (model:lora{...}, as the run that wrote it did; a mismatch is refused, naming it).
]==]

local ds4 = require("ds4")

local M = {}

function M.save(root, model, opt, reference, state, keep_last, opt_state)
    local st = opt_state or opt:state()
    local states = {
        optimizer = { tensors = { m = st.m, v = st.v, tensor_steps = st.tensor_steps }, meta = { step = st.step } },
        trainer = { meta = state },
    }
    if reference then states.reference = { tensors = { params = reference:params() } } end
    return ds4.checkpoints.save(root, opt:steps(), model, { states = states, keep_last = keep_last })
end

local function restore_params(dst, src_params, tables, what)
    if tables and dst:tables_crc() ~= tables then
        error(("trainer.run: resume: the %s's hash-routing tables differ from the checkpoint's (build it with the "
            .. "same config and seed, or load it from the checkpoint)"):format(what), 0)
    end
    dst:set_params(src_params)
end

-- The checkpoint's adapters for the policy's (nil when neither has any), checked before anything is changed: both
-- have adapters, of the same rank, scale and size (set_lora then checks the tensors one by one).
local function saved_lora(dst, saved, dir)
    local mine, theirs = dst:lora_info(), saved:lora_info()
    if not theirs and not mine then return end
    if not mine then
        error(("trainer.run: resume: %s holds LoRA adapters (rank %d) and the policy has none: attach adapters of the "
            .. "same rank and targets (model:lora{...}) before trainer.run"):format(dir, theirs.rank), 0)
    end
    if not theirs then
        error(("trainer.run: resume: the policy has LoRA adapters and %s holds none (it was written by a run that "
            .. "trained every weight)"):format(dir), 0)
    end
    if mine.rank ~= theirs.rank or mine.scale ~= theirs.scale or mine.numel ~= theirs.numel then
        error(("trainer.run: resume: the policy's LoRA adapters (rank %d, scale %g, %d values) differ from %s's (rank "
            .. "%d, scale %g, %d values)"):format(mine.rank, mine.scale, mine.numel, dir, theirs.rank, theirs.scale,
            theirs.numel), 0)
    end
    return saved:lora_tensors()
end

function M.load(root, model, opt, reference)
    local dir, _, _, updates = ds4.checkpoints.load(root)
    if not dir then return nil end
    local saved = ds4.load(dir, { lora = ds4.fs.exists(dir .. "/adapter_config.json") and dir or nil })
    local ok, err = pcall(function()
        local adapters = saved_lora(model, saved, dir)
        restore_params(model, saved:params(), saved:tables_crc(), "policy")
        if adapters then model:set_lora(adapters) end
    end)
    local tables = saved:tables_crc()
    saved:free()
    if not ok then error(err, 0) end
    local o, ometa = ds4.checkpoints.read_state(dir, "optimizer")
    if not o then error("trainer.run: resume: " .. dir .. " has no optimizer state", 0) end
    opt:load_state({ m = o.m, v = o.v, tensor_steps = o.tensor_steps, step = ometa.step or updates })
    local r = ds4.checkpoints.read_state(dir, "reference")
    if reference and not r then
        error("trainer.run: resume: " .. dir .. " holds no reference model, and this run has one", 0)
    end
    if reference then restore_params(reference, r.params, tables, "reference model") end
    local _, state = ds4.checkpoints.read_state(dir, "trainer")
    if not state then error("trainer.run: resume: " .. dir .. " has no trainer state (not an RL checkpoint?)", 0) end
    return state, dir
end

return M
