--[==[ ds4.rollout — remote rollout workers over ZeroMQ (rollout/protocol.md is the wire specification).

  ds4.rollout.pool{...}          the trainer's side: a rollout source with model:generate's interface
                                 (lua/ds4/rollout/pool.lua says every option)
  ds4.rollout.task_seed(seed, p) the seed the pool gives prompt p of a generate call with opts.seed = seed
  ds4.rollout.worker             the worker loop (`ds4 worker` runs ds4.rollout.worker.main(arg))
]==]
local M = {}
function M.pool(cfg) return require("ds4.rollout.pool").new(cfg) end
function M.task_seed(seed, p) return require("ds4.rollout.pool").task_seed(seed, p) end
setmetatable(M, { __index = function(t, k)
    if k == "worker" then
        t.worker = require("ds4.rollout.worker")
        return t.worker
    end
end })
return M
