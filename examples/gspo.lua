--[[ examples/gspo.lua — GSPO on the task of examples/dapo.lua: the same loop, another algorithm table.

  ds4 run examples/gspo.lua [the options of dapo.lua]

GSPO clips a sequence-level ratio (the geometric mean of the token ratios) in a narrow band (3e-4 / 4e-4) and
averages per sequence; everything else is the loop of dapo.lua. Runs go to runs/gspo.
]]
DS4_EXAMPLE_DEFAULTS = { algorithm = "gspo", root = "runs/gspo" }
dofile(require("ds4").script_dir() .. "/dapo.lua")
