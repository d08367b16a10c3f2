-- test_checkpoint.lua — model:save and ds4.checkpoints from Lua: round trips, listing, retention, extra state,
-- crash leftovers and the cleanup of a failed save.
-- Usage: ds4 run tests/lua/test_checkpoint.lua <fixtures_dir>
--
-- References: the model that was saved (its logits must come back bit-identical), transformers' logits in
-- io.safetensors, retention sets written out by hand, and metadata tables written here.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()
local cp = ds4.checkpoints

local shell_quote, make_temp_dir = H.shell_quote, H.make_temp_dir

local function exists(p)
    local f = io.open(p, "rb")
    if f then f:close() return true end
    return false
end

local function bits_equal(a, b)
    if a:numel() ~= b:numel() or a:dtype() ~= b:dtype() then return false end
    for i = 1, a:numel() do
        local x, y = a[i], b[i]
        if x ~= y and not (x ~= x and y ~= y) then return false end
    end
    return true
end

local base = make_temp_dir()
local model = ds4.load(fixtures .. "/tiny_a")
local io_t = ds4.load_tensors(fixtures .. "/tiny_a/io.safetensors")
local ref_logits = model:forward(io_t.input_ids).logits

-- ------------------------------------------------------------------------------------------ model:save
do
    local dir = base .. "/model"
    H.eq(model:save(dir), dir, "model:save returns the directory")
    local m2 = ds4.load(dir)
    local l2 = m2:forward(io_t.input_ids).logits
    H.check(bits_equal(l2, ref_logits), "saved and reloaded model gives bit-identical logits")
    local d, mx = 0, 0
    for i = 1, l2:numel() do
        d = math.max(d, math.abs(l2[i] - io_t.logits[i]))
        mx = math.max(mx, math.abs(io_t.logits[i]))
    end
    H.check(d <= 1e-4 * math.max(1, mx), ("saved model vs transformers: max |diff| %.3g"):format(d))
    H.eq(m2:has_mtp(), true, "MTP weights survive the save")
    m2:free()

    local names = ds4.load_tensors(dir)
    -- spot checks of the save_pretrained spelling (tests/fixtures/tiny_a/names.txt)
    for _, n in ipairs({ "model.embed_tokens.weight", "head.weight", "model.hc_head.hc_fn", "model.norm.weight",
                         "model.layers.0.attn.norm.weight", "model.layers.1.attn.compressor.norm.weight",
                         "mtp.0.attn.kv_norm.weight" }) do
        H.check(names[n] ~= nil, "saved file has " .. n)
    end
    H.eq(names["model.layers.0.ffn.gate.tid2eid"]:dtype(), "I64", "tid2eid is I64")
    H.check(names["model.layers.0.attn.kv_norm.weight"] == nil, "no kv_norm under layers (save_pretrained writes norm)")
    H.eq(ds4.config(dir).num_hidden_layers, 4, "config.json is readable")

    H.raises(function() model:save(dir) end, { "ds4.model:save", "not empty", "overwrite" }, "existing directory")
    model:save(dir, { overwrite = true, dtype = "bf16" })
    names = ds4.load_tensors(dir)
    H.eq(names["model.embed_tokens.weight"]:dtype(), "BF16", "dtype = bf16")
    H.eq(names["model.layers.0.ffn.gate.tid2eid"]:dtype(), "I64", "tid2eid stays I64 in a BF16 save")
    H.raises(function() model:save(dir, { dtyp = "F32" }) end, { "unknown option 'dtyp'" }, "misspelt option")
    H.raises(function() model:save(dir, { dtype = "I8", overwrite = true }) end, { "opts.dtype" }, "bad dtype")
    H.raises(function() model.save(42, dir) end, { "ds4.model:save" }, "bad self")
end

-- ------------------------------------------------------------------------------------------ checkpoints
local root = base .. "/run"
H.eq(cp.latest(root), nil, "latest of a missing root is nil")
H.same(cp.list(root), {}, "list of a missing root is empty")
H.eq(cp.load(root), nil, "load of a missing root is nil")

for step = 10, 60, 10 do
    local path = cp.save(root, step, model, {
        extra = { rng = ds4.tensor({ step, 2, 3 }, "I64") },
        meta = { step = step, lr = 0.001, name = "run \"a\"\n", list = { 1, 2, 3 }, nested = { ok = true, x = {} } },
    })
    H.eq(path, ("%s/step_%06d"):format(root, step), "save returns the step directory")
end
H.same(cp.list(root), { 10, 20, 30, 40, 50, 60 }, "list")
H.eq(cp.latest(root), 60, "latest")
H.eq(cp.path(root, 20), root .. "/step_000020", "path")

do
    local dir, extra, meta, step = cp.load(root)
    H.eq(dir, root .. "/step_000060", "load: newest directory")
    H.eq(step, 60, "load: step")
    H.same(extra.rng:totable(), { 60, 2, 3 }, "load: extra tensors")
    H.eq(meta.step, 60, "meta.step")
    H.eq(meta.lr, 0.001, "meta.lr")
    H.eq(meta.name, "run \"a\"\n", "meta string with quotes and a newline")
    H.same(meta.list, { 1, 2, 3 }, "meta array")
    H.eq(meta.nested.ok, true, "meta nested boolean")
    local m2 = ds4.load(dir)
    H.check(bits_equal(m2:forward(io_t.input_ids).logits, ref_logits), "checkpointed model: identical logits")
    m2:free()
    dir, extra, meta, step = cp.load(root, 30)
    H.eq(step, 30, "load(root, 30)")
    H.eq(meta.step, 30, "load(root, 30) meta")
    H.raises(function() cp.load(root, 35) end, { "ds4.checkpoints.load", "step_000035" }, "load of a missing step")
end

-- retention
do
    local r = cp.prune(root, { keep_last = 2, keep_every = 30, dry_run = true })
    H.same(r.removed, { 10, 20, 40 }, "dry run reports removals")
    H.same(cp.list(root), { 10, 20, 30, 40, 50, 60 }, "dry run removes nothing")
    r = cp.prune(root, { keep_last = 2, keep_every = 30 })
    H.same(r.removed, { 10, 20, 40 }, "prune removed")
    H.eq(r.kept, 3, "prune kept")
    H.same(cp.list(root), { 30, 50, 60 }, "keep_last 2, keep_every 30")
    H.raises(function() cp.prune(root, { keep_last = -1 }) end, { "keep_last" }, "negative keep_last")
    H.raises(function() cp.prune(root, { keep = 1 }) end, { "unknown option 'keep'" }, "misspelt option")
end

-- crash leftovers: an unfinished temporary directory and a truncated file are never listed
do
    local tmp = cp.begin(root, 80)
    H.check(tmp:find("/step_000080.tmp-", 1, true) ~= nil, "begin names the temporary directory: " .. tmp)
    local f = assert(io.open(tmp .. "/half.bin", "wb"))
    f:write(("x"):rep(1000))
    f:close()
    H.same(cp.list(root), { 30, 50, 60 }, "an uncommitted step is not listed")
    local kinds = {}
    for _, e in ipairs(cp.scan(root)) do kinds[e.name:match("^step_%d+") .. (e.name:find("tmp") and "tmp" or "")] = e.kind end
    H.eq(kinds["step_000080tmp"], "active", "scan: our unfinished directory is active")
    H.eq(kinds["step_000060"], "complete", "scan: complete")
    cp.abort(tmp)
    H.check(not exists(tmp .. "/half.bin"), "abort removed the temporary directory")
    H.raises(function() cp.abort(root .. "/step_000060") end, { "refusing" }, "abort refuses a complete checkpoint")

    local victim = root .. "/step_000050/model.safetensors"
    local fh = assert(io.open(victim, "rb"))
    local bytes = fh:read("*a")
    fh:close()
    fh = assert(io.open(victim, "wb"))
    fh:write(bytes:sub(1, math.floor(#bytes / 2)))
    fh:close()
    H.same(cp.list(root), { 30, 60 }, "a truncated checkpoint is not listed")
    local step, why = cp.check(root .. "/step_000050")
    H.eq(step, nil, "check of a truncated checkpoint")
    H.check(why and why:find("truncated", 1, true), "check says why: " .. tostring(why))
    H.eq(cp.check(root .. "/step_000060"), 60, "check of a complete checkpoint")
    H.eq(cp.latest(root), 60, "latest unaffected")
end

-- a failed save leaves nothing behind
do
    H.raises(function() cp.save(root, 70, model, { meta = { f = print } }) end, { "opts.meta.f", "function" },
        "meta with a function")
    H.raises(function() cp.save(root, 70, model, { meta = { 1, nil, 3 } }) end, { "holes" }, "meta array with a hole")
    H.raises(function() cp.save(root, 70, model, { meta = { 1, a = 2 } }) end, { "mixes" }, "mixed keys")
    H.raises(function() cp.save(root, 70, model, { meta = { x = 0 / 0 } }) end, { "JSON cannot hold" }, "NaN in meta")
    H.raises(function() cp.save(root, 70, model, { extra = { a = 1 } }) end, { "expected a ds4.tensor" }, "bad extra")
    H.raises(function() cp.save(root, 70, model, { stats = {} }) end, { "unknown option 'stats'" }, "misspelt option")
    for _, e in ipairs(cp.scan(root)) do
        H.check(e.step ~= 70, "nothing of step 70 is left: " .. e.name)
    end
end

-- named states, and pruning as part of save
do
    cp.save(root, 90, model, { states = { optimizer = { tensors = { m = ds4.tensor({ 0.5, -1 }) }, meta = { beta = 0.9 } } } })
    local dir, extra, meta = cp.load(root)
    H.eq(dir, root .. "/step_000090", "newest is 90")
    H.same(extra, {}, "no extra state: empty table")
    H.same(meta, {}, "no extra meta: empty table")
    local t, m = cp.read_state(dir, "optimizer")
    H.same(t.m:totable(), { 0.5, -1 }, "state tensors")
    H.eq(m.beta, 0.9, "state meta")
    H.eq(cp.read_state(dir, "dataloader"), nil, "absent state is nil")
    H.raises(function() cp.write_state(dir, "model", {}, {}) end, { "state name" }, "reserved state name")
    cp.save(root, 100, model, { keep_last = 1, clean = true })
    H.same(cp.list(root), { 100 }, "save with keep_last = 1 prunes the rest")
    H.check(exists(root .. "/step_000050/COMPLETE"), "the damaged step 50 is left for inspection")
end

model:free()
os.execute("rm -rf " .. shell_quote(base))
H.done("test_checkpoint")
