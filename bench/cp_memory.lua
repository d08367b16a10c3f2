-- cp_memory.lua DIR [B [S [MODE]]] — memory and time of one rank under context parallelism (docs/distributed.md,
-- "Context parallelism"): ds4.load(DIR), ds4.dist.context_parallel(model) on more than one rank (MODE whole: with
-- {whole_attention = true}; query, the default: attention split by query), then one training step
-- (forward with labels, backward, all_reduce_grads) on B sequences of S tokens (defaults 1 x 2048), the whole
-- sequences passed on every rank. One line per rank: the step's wall time, the process's peak and current resident
-- set (VmHWM, VmRSS: /proc/self/status). On one rank the model runs without context parallelism (the one-process
-- figure). bench/cp_memory.sh runs it on 1, 2 and 4 ranks. Measures and prints; never passes or fails.
local ds4 = require("ds4")
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local status = require("proc_status")
local dir, B, S, mode = arg[1], tonumber(arg[2] or 1), tonumber(arg[3] or 2048), arg[4] or "query"
assert(dir and (mode == "query" or mode == "whole"), "usage: cp_memory.lua DIR [B [S [query|whole]]]")
ds4.set_threads(tonumber(os.getenv("DS4_THREADS") or 1)) -- each rank's (default 1: the ranks share a machine)
local r, n = ds4.dist.init()
local model = ds4.load(dir)
if n > 1 then ds4.dist.context_parallel(model, { whole_attention = mode == "whole" }) end
local V = model:config().vocab_size
local ids, labels = ds4.zeros({ B, S }, "I64"), ds4.zeros({ B, S }, "I64")
for i = 1, B * S do
    ids[i] = (i * 7 + 3) % V
    labels[i] = (i * 11 + 5) % V
end
local t0 = ds4.metrics.clock()
model:zero_grad()
local out = model:forward(ids, { labels = labels, logits = false })
model:backward()
ds4.dist.all_reduce_grads(model)
local t1 = ds4.metrics.clock()
print(("cp_memory: rank %d of %d (%s), %d x %d tokens: step %.2f s, loss %.6f; peak RSS %.1f MB, RSS %.1f MB"):format(
    r, n, n > 1 and "attention " .. (mode == "whole" and "whole" or "by query") or "one process", B, S, t1 - t0,
    out.loss, status("VmHWM") / 1e6, status("VmRSS") / 1e6))
