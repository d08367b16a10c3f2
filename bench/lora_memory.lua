-- lora_memory.lua — memory of the trainable state with and without LoRA on a model (docs/lora.md).
--   build/bench_forward --print-config 50m > /tmp/c50m.json
--   build/ds4 run bench/lora_memory.lua /tmp/c50m.json [RANK]
-- For each mode it builds the model, enables gradients and takes one AdamW step on one short sequence, and prints the
-- bytes of the trainable state (the parameters being trained, their gradients and AdamW's two moments, from the
-- buffer sizes) and the growth of the process's resident set over the frozen model (VmRSS, /proc/self/status).
local ds4 = require("ds4")
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local status = require("proc_status")
local path, rank = arg[1], tonumber(arg[2] or "16")
local function rss() return status("VmRSS") end
local function run(lora)
    collectgarbage()
    local model = ds4.random_model(path, 1)
    local base = rss()
    if lora then model:lora{ rank = rank, alpha = 2 * rank } end
    model:zero_grad()
    local ids = ds4.zeros({ 1, 64 }, "I64")
    for i = 1, 64 do ids[i] = (i * 7) % model:config().vocab_size end
    model:forward(ids, { labels = ids })
    model:backward()
    local opt = ds4.adamw(model, { lr = 1e-4 })
    opt:step()
    local trained = lora and model:lora_info().numel or model:n_params()
    local state = trained * 4 * 4 -- values, gradients, m, v (fp32)
    print(("%-10s params %d, trained %d (%.2f%%): trainable state %.1f MB; resident growth over the frozen model %.1f MB")
        :format(lora and ("LoRA r=" .. rank) or "full", model:n_params(), trained, 100 * trained / model:n_params(),
        state / 1e6, (rss() - base) / 1e6))
    opt:free()
    model:free()
end
run(false)
run(true)
