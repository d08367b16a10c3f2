--[[ examples/gspo.lua — GSPO on the task of examples/dapo.lua: the same loop, another algorithm table.

  ds4 run examples/gspo.lua [the options of dapo.lua]

GSPO clips a sequence-level ratio (the geometric mean of the token ratios) in a narrow band and averages per
sequence; everything else is the loop of dapo.lua.
]]
local rl = require("ds4.rl")
DS4_EXAMPLE_ALGORITHM = rl.preset("gspo", { loss = { kind = "gspo", eps_low = 3e-4, eps_high = 4e-4 } })
DS4_EXAMPLE_DEFAULTS = { algorithm = "gspo", out = "runs/gspo" }
dofile(require("ds4").script_dir() .. "/dapo.lua")
