-- lora_publish.lua — bytes a rollout pool moves per policy version, with and without LoRA (docs/lora.md, rollout
-- protocol 4): the pool publishes the model twice (the second time after a change of what trains) and this prints
-- what each version holds, which is what every worker fetches for it (rollout/protocol.md §7.6). No worker runs: the
-- pool's transport here goes nowhere.
--   build/ds4 run bench/lora_publish.lua [small | gpu | CONFIG.json] [RANK]
--   (build/bench_forward --print-config 50m > /tmp/c50m.json: the ~50M-parameter bench config)
local ds4 = require("ds4")
local poolmod = require("ds4.rollout.pool")
local which, rank = arg[1] or "small", tonumber(arg[2] or "16")

local function build()
    if which == "small" or which == "gpu" then -- examples/dapo.lua's built-in models (--arch)
        local task = dofile(ds4.script_dir() .. "/../examples/arith_task.lua")
        return ds4.new_model(task.model_config(ds4.tokenizer(), which), 1)
    end
    return ds4.random_model(which, 1)
end

local function nowhere()
    return { recv = function() return nil end, send = function() return true end, close = function() end }
end

local function run(lora)
    local model = build()
    if lora then model:lora{ rank = rank, alpha = 2 * rank } end
    local pool = poolmod.new{ model = model, transport = nowhere(), quiet = true, log = function() end }
    pool:publish(model)
    -- a training step's worth of change in what trains
    if lora then
        local a = model:lora_params()
        for i = 1, a:numel(), 97 do a[i] = a[i] + 1e-3 end
        model:set_lora_params(a)
    else
        local p = model:params()
        for i = 1, p:numel(), 97 do p[i] = p[i] + 1e-3 end
        model:set_params(p)
    end
    pool:publish(model)
    local s = pool:stats().syncs
    local first, second = s[1], s[#s]
    print(("%-14s %d parameters%s: first publish %.2f MB (base %.2f MB + %.3f MB), each later publish %.3f MB")
        :format(lora and ("LoRA r=" .. rank) or "full", model:n_params(), lora and (", %d adapter values"):format(
        model:lora_info().numel) or "", (first.bytes + first.base_bytes) / 1e6, first.base_bytes / 1e6,
        first.bytes / 1e6, second.bytes / 1e6))
    pool:close()
    model:free()
end
print("model: " .. which)
run(false)
run(true)
