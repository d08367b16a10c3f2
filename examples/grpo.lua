--[[ examples/grpo.lua — GRPO on the task of examples/dapo.lua: the same loop, another algorithm table.

  ds4 run examples/grpo.lua [the options of dapo.lua]

The whole difference from DAPO is this table (ds4.rl presets are plain data; override any field): a
std-normalised group baseline, PPO clip 0.2 on both sides, the sequence-mean of token-means, no dynamic
sampling, no overlong shaping. The preset's k3 KL term needs a reference model; this example runs without one.
]]
local rl = require("ds4.rl")
DS4_EXAMPLE_ALGORITHM = rl.preset("grpo", { kl = rl.NIL })
DS4_EXAMPLE_DEFAULTS = { algorithm = "grpo", out = "runs/grpo" }
dofile(require("ds4").script_dir() .. "/dapo.lua")
