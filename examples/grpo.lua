--[[ examples/grpo.lua — GRPO on the task of examples/dapo.lua: the same loop, another algorithm table.

  ds4 run examples/grpo.lua [the options of dapo.lua]

The whole difference from DAPO is the algorithm (ds4.rl presets are plain data; --algorithm.FIELD overrides any
field): a std-normalised group baseline, PPO clip 0.2 on both sides, the sequence-mean of token-means, no dynamic
sampling, no overlong shaping. The preset's k3 KL term needs a reference model; this example runs without one
(dapo.lua's table for grpo sets kl = nil). Runs go to runs/grpo.
]]
DS4_EXAMPLE_DEFAULTS = { algorithm = "grpo", root = "runs/grpo" }
dofile(require("ds4").script_dir() .. "/dapo.lua")
