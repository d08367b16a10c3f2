-- cp_memory.lua DIR [B [S [MODE]]] — memory and time of one rank under context parallelism (docs/distributed.md,
-- "Context parallelism"): ds4.load(DIR) (a config .json: ds4.random_model of it, seed 1), ds4.dist.context_parallel(model)
-- on more than one rank (MODE whole: with {whole_attention = true}; query, the default: attention split by query),
-- then one training step (forward with labels, backward, all_reduce_grads) on B sequences of S tokens (defaults
-- 1 x 2048), the whole sequences passed on every rank. One line per rank: the step's wall time, the process's peak
-- and current resident set (VmHWM, VmRSS: /proc/self/status). On one rank the model runs without context parallelism
-- (the one-process figure). bench/cp_memory.sh runs it on 1, 2 and 4 ranks. Measures and prints; never passes or
-- fails.
--
-- CP_DEVICE=cuda (CP_DTYPE bf16, the default, or fp32): each rank's model on its GPU (ds4.dist.init{device =
-- "cuda"}), the second of two steps timed, each step ending with an AdamW step (whose read-back of the step's sums
-- waits for the device); the line then also gives what the model holds on its GPU (model:memory(): weights,
-- gradients, fp32 master, moments, and the tape and the two workspaces its passes planned).
local ds4 = require("ds4")
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local status = require("proc_status")
local dir, B, S, mode = arg[1], tonumber(arg[2] or 1), tonumber(arg[3] or 2048), arg[4] or "query"
assert(dir and (mode == "query" or mode == "whole"), "usage: cp_memory.lua DIR [B [S [query|whole]]]")
local cuda, dtype = os.getenv("CP_DEVICE") == "cuda", os.getenv("CP_DTYPE") or "bf16"
ds4.set_threads(tonumber(os.getenv("DS4_THREADS") or 1)) -- each rank's (default 1: the ranks share a machine)
local r, n = ds4.dist.init(cuda and { device = "cuda" } or nil)
local model = dir:match("%.json$") and ds4.random_model(dir, { seed = 1 }) or ds4.load(dir)
if cuda then model:to(ds4.dist.device(), dtype) end
if n > 1 then ds4.dist.context_parallel(model, { whole_attention = mode == "whole" }) end
local opt = cuda and ds4.adamw(model, { lr = 1e-5 }) or nil
local V = model:config().vocab_size
local ids, labels = ds4.zeros({ B, S }, "I64"), ds4.zeros({ B, S }, "I64")
for i = 1, B * S do
    ids[i] = (i * 7 + 3) % V
    labels[i] = (i * 11 + 5) % V
end
local t0, t1, out
for _ = 1, cuda and 2 or 1 do
    t0 = ds4.metrics.clock()
    model:zero_grad()
    out = model:forward(ids, { labels = labels, logits = false })
    model:backward()
    ds4.dist.all_reduce_grads(model)
    if opt then opt:step() end
    t1 = ds4.metrics.clock()
end
local held = ""
if cuda then
    local m, MiB = model:memory(), 2 ^ 20
    held = ("; on %s: %.0f MiB held (weights and training state %.0f, tape %.0f, workspaces %.0f)"):format(
        ds4.dist.device(), (m.device + m.device_grads + m.device_master + m.device_moments + m.tape + m.workspace
            + m.backward_workspace) / MiB, (m.device + m.device_grads + m.device_master + m.device_moments) / MiB,
        m.tape / MiB, (m.workspace + m.backward_workspace) / MiB)
end
print(("cp_memory: rank %d of %d (%s), %d x %d tokens: step %.2f s, loss %.6f; peak RSS %.1f MB, RSS %.1f MB%s"):format(
    r, n, n > 1 and "attention " .. (mode == "whole" and "whole" or "by query") or "one process", B, S, t1 - t0,
    out.loss, status("VmHWM") / 1e6, status("VmRSS") / 1e6, held))
