-- test_names.lua — a checkpoint written with the official release tensor names loads and computes the same
-- logits as the save_pretrained spelling of the fixture; a checkpoint with a missing and an unexpected
-- tensor is rejected with both names in the message.
-- Usage: ds4 run tests/lua/test_names.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()
local src = fixtures .. "/tiny_a"

-- save_pretrained spelling -> official release spelling, written out by hand (the loader's own name tables
-- are what is under test, so they are not used here). Top-level tensors:
local TOP = {
    ["model.embed_tokens.weight"] = "embed.weight",
    ["model.norm.weight"] = "norm.weight",
    ["model.hc_head.hc_fn"] = "hc_head_fn",
    ["model.hc_head.hc_base"] = "hc_head_base",
    ["model.hc_head.hc_scale"] = "hc_head_scale",
    ["head.weight"] = "head.weight",
}
-- Per layer: strip "model."; save_pretrained writes the attention's kv_norm as attn.norm.weight. Everything
-- else (attn.wq_a, attn.compressor.*, ffn.experts.*, hc_attn_*, mtp.*) is already the official name.
local function official(name)
    if TOP[name] then return TOP[name] end
    local n = name:gsub("^model%.", "")
    n = n:gsub("^(layers%.%d+%.attn)%.norm%.weight$", "%1.kv_norm.weight")
    return n
end

local read_file = H.read_file

local function write_file(path, s)
    local f = assert(io.open(path, "wb"))
    f:write(s)
    f:close()
end

local shell_quote, make_temp_dir = H.shell_quote, H.make_temp_dir

local function write_checkpoint(dir, tensors)
    write_file(dir .. "/config.json", read_file(src .. "/config.json"))
    ds4.save_tensors(dir .. "/model.safetensors", tensors)
end

local function remove_checkpoint(dir)
    os.remove(dir .. "/model.safetensors")
    os.remove(dir .. "/config.json")
    os.remove(dir)
end

local max_diff = H.max_diff

local weights = ds4.load_tensors(src .. "/model.safetensors")
local io_t = ds4.load_tensors(src .. "/io.safetensors")

local renamed, count, kv_norms = {}, 0, 0
for name, t in pairs(weights) do
    local o = official(name)
    H.check(renamed[o] == nil, "two tensors map to " .. o)
    renamed[o] = t
    count = count + 1
    if o:match("^layers%.%d+%.attn%.kv_norm%.weight$") then kv_norms = kv_norms + 1 end
    H.check(not o:find("^model%."), "no model. prefix left: " .. o)
end
H.eq(kv_norms, 4, "one attention kv_norm per layer of tiny_a")
for _, o in pairs(TOP) do H.check(renamed[o] ~= nil, "official top-level tensor present: " .. o) end

-- The official-name checkpoint computes the fixture's logits (same tolerance as test_forward.lua: the issue's
-- acceptance bound 1e-4 * max(1, max |logit|) for fp32 with a different summation order).
do
    local dir = make_temp_dir()
    write_checkpoint(dir, renamed)
    local ok, model = pcall(ds4.load, dir)
    H.check(ok, "official names load: " .. tostring(model))
    if ok then
        local r = model:forward(io_t.input_ids, { labels = io_t.labels, mtp = true })
        H.same(r.logits:shape(), io_t.logits:shape(), "logits shape")
        local d, m = max_diff(r.logits, io_t.logits)
        H.check(d <= 1e-4 * math.max(1, m), ("official names: max |dlogit| %.3g (max |ref| %.3g)"):format(d, m))
        local dm, mm = max_diff(r.mtp_logits, io_t.mtp_logits)
        H.check(dm <= 1e-4 * math.max(1, mm), ("official names: max |dmtp_logit| %.3g"):format(dm))
        local ref = io_t.loss:item()
        H.check(r.loss and math.abs(r.loss - ref) <= 1e-5 * math.abs(ref),
            ("official names: loss %s vs %.9g"):format(tostring(r.loss), ref))
        model:free()
    end
    remove_checkpoint(dir)
end

-- One tensor missing and one unexpected: the error names both.
do
    local broken = {}
    for k, v in pairs(renamed) do broken[k] = v end
    local missing = "layers.1.attn.q_norm.weight"
    local extra = "layers.1.attn.bogus_extra.weight"
    H.check(broken[missing] ~= nil, "the tensor to remove exists")
    broken[missing] = nil
    broken[extra] = ds4.zeros({ 4 })
    local dir = make_temp_dir()
    write_checkpoint(dir, broken)
    H.raises(function() return ds4.load(dir) end, { "ds4.load:", missing, extra }, "missing + unexpected tensor")
    remove_checkpoint(dir)
end

-- The save_pretrained spelling with the same two defects: same diagnosis.
do
    local broken = {}
    for k, v in pairs(weights) do broken[k] = v end
    broken["model.layers.2.ffn.gate.bias"] = nil
    broken["model.layers.2.ffn.gate.unknown"] = ds4.zeros({ 8 })
    local dir = make_temp_dir()
    write_checkpoint(dir, broken)
    H.raises(function() return ds4.load(dir) end, { "ds4.load:", "layers.2.ffn.gate.bias", "layers.2.ffn.gate.unknown" },
        "save_pretrained spelling: missing + unexpected tensor")
    remove_checkpoint(dir)
end

H.check(count > 200, "tiny_a has its ~260 tensors (" .. count .. ")")
collectgarbage()
H.done("test_names")
