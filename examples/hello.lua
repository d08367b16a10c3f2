-- hello.lua — load a checkpoint, run one forward pass, print the loss.
--
--   ds4 run examples/hello.lua [CHECKPOINT_DIR]
--
-- Without an argument it uses the tiny_a test fixture (tests/fixtures/tiny_a next to this directory) and
-- its stored inputs (io.safetensors: input_ids, labels and the loss transformers computed for them).
local ds4 = require("ds4")

local dir = arg[1] or (ds4.script_dir() .. "/../tests/fixtures/tiny_a")
print(("ds4 %s (%s), %s, %d threads"):format(ds4.version, ds4.build_info, ds4.luajit_version, ds4.threads()))

local model = ds4.load(dir)
local cfg = model:config()
print("checkpoint: " .. dir)
print("config:     " .. ds4.config_summary(cfg))
print(("parameters: %d%s"):format(model:n_params(), model:has_mtp() and " (with MTP block)" or ""))

-- Inputs: the checkpoint's io.safetensors when it has one, else a made-up batch of token ids.
local ids, labels, ref_loss
local f = io.open(dir .. "/io.safetensors", "rb")
if f then
    f:close()
    local io_t = ds4.load_tensors(dir .. "/io.safetensors")
    ids, labels = io_t.input_ids, io_t.labels or io_t.input_ids
    ref_loss = io_t.loss and io_t.loss:item()
else
    local row = {}
    for i = 1, 16 do row[i] = (i * 7) % cfg.vocab_size end
    ids = ds4.tensor({ row }, "I64")
    labels = ids
end

local t0 = os.clock()
local out = model:forward(ids, { labels = labels })
local dt = os.clock() - t0
local shape = ids:shape()
print(("forward:    %d x %d tokens -> logits %s in %.3f s CPU time"):format(shape[1], shape[2],
    tostring(out.logits), dt))
print(("loss:       %.7f over %d scored tokens"):format(out.loss or 0 / 0, out.loss_tokens))
if ref_loss then
    local diff = math.abs((out.loss or math.huge) - ref_loss)
    print(("reference:  %.7f (transformers), |diff| = %.3g%s"):format(ref_loss, diff,
        diff <= 1e-5 * math.abs(ref_loss) and "  OK" or "  MISMATCH"))
end
model:free()
