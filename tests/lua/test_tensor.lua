-- test_tensor.lua — the tensor API and safetensors I/O of the ds4 module, against hand-computed values.
-- Usage: ds4 run tests/lua/test_tensor.lua <fixtures_dir>
--
-- References are independent of the code under test: shapes and values written out by hand, IEEE bit
-- patterns worked out by hand (read back through the LuaJIT FFI, not through ds4), and the fixture file
-- decoded by a few lines of Lua + FFI below rather than by ds4's safetensors reader.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local fixtures = H.fixtures()

-- ------------------------------------------------------------------------------------------------ basics
do
    local t = ds4.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    H.same(t:shape(), { 2, 3 }, "shape")
    H.eq(t:dtype(), "F32", "default dtype")
    H.eq(t:numel(), 6, "numel")
    H.eq(t:ndim(), 2, "ndim")
    H.eq(t:nbytes(), 24, "nbytes")
    H.eq(#t, 2, "#t is the first dimension")
    H.eq(tostring(t), "ds4.tensor F32 [2, 3]", "tostring")
    H.eq(t:get(1, 1), 1, "get(1,1)")
    H.eq(t:get(1, 3), 3, "get(1,3)")
    H.eq(t:get(2, 1), 4, "get(2,1)")
    H.eq(t:get(2, 3), 6, "get(2,3)")
    for i = 1, 6 do H.eq(t[i], i, "flat t[" .. i .. "]") end
    H.same(t:totable(), { { 1, 2, 3 }, { 4, 5, 6 } }, "totable")
    H.eq(t:size(1), 2, "size(1)")
    H.eq(t:size(-1), 3, "size(-1)")
    H.check(ds4.is_tensor(t) and not ds4.is_tensor({}) and not ds4.is_tensor(nil), "is_tensor")

    t:set(7.5, 1, 2)
    H.eq(t:get(1, 2), 7.5, "set then get")
    H.eq(t[2], 7.5, "set then flat read")
    t[6] = -1
    H.eq(t:get(2, 3), -1, "flat write then get")
    H.same(t:totable(), { { 1, 7.5, 3 }, { 4, 5, -1 } }, "totable after writes")

    -- 1-D, 3-D, 0-D
    local v = ds4.tensor({ 10, 20, 30 }, "I64")
    H.same(v:shape(), { 3 }, "1-D shape")
    H.eq(v:dtype(), "I64", "I64 dtype")
    H.eq(v[3], 30, "I64 value")
    local c = ds4.tensor({ { { 1, 2 }, { 3, 4 } }, { { 5, 6 }, { 7, 8 } }, { { 9, 10 }, { 11, 12 } } })
    H.same(c:shape(), { 3, 2, 2 }, "3-D shape")
    H.eq(c:get(3, 1, 2), 10, "3-D get: offset (2*2 + 0)*2 + 1 + 1 = 10")
    H.eq(c:get(2, 2, 1), 7, "3-D get(2,2,1)")
    local s = ds4.tensor(3.5)
    H.eq(s:ndim(), 0, "0-d ndim")
    H.eq(s:numel(), 1, "0-d numel")
    H.eq(s:item(), 3.5, "0-d item")
    H.eq(s:totable(), 3.5, "0-d totable is a number")
    H.eq(tostring(s), "ds4.tensor F32 []", "0-d tostring")
    H.eq(ds4.tensor({ 42 }):item(), 42, "1-element item")
    local e = ds4.tensor({})
    H.same(e:shape(), { 0 }, "empty table -> shape [0]")

    local z = ds4.zeros({ 2, 4 }, "bf16")
    H.eq(z:dtype(), "BF16", "zeros dtype (case-insensitive name)")
    H.same(z:shape(), { 2, 4 }, "zeros shape")
    for i = 1, 8 do H.eq(z[i], 0, "zeros value " .. i) end
    H.eq(ds4.zeros({ 2, 0, 3 }):numel(), 0, "zero-size dimension")
    H.eq(ds4.zeros({}):numel(), 1, "zeros({}) is 0-d")

    local r = c:reshape({ 4, 3 })
    H.same(r:shape(), { 4, 3 }, "reshape shape")
    H.same(r:totable(), { { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 }, { 10, 11, 12 } }, "reshape keeps row-major order")
    local cl = c:clone()
    cl:set(100, 1, 1, 1)
    H.eq(c:get(1, 1, 1), 1, "clone is a copy")
end

-- ------------------------------------------------------------------------------------------------ conversions
-- Bit patterns (hand-computed): 1.0 = 0x3F800000, -2.5 = 0xC0200000, 3.140625 = 0x40490000 in F32, so BF16
-- (the top 16 bits, exact for these) is 0x3F80, 0xC020, 0x4049; F16: 1.0 = 0x3C00, -2.5 = 0xC100,
-- 3.140625 = 0x4248 (exponent 16, fraction 0.5703125 * 1024 = 584 = 0x248).
do
    local f = ds4.tensor({ 1.0, -2.5, 3.140625 })
    local f32 = ffi.cast("const uint32_t *", f:data_ptr())
    H.eq(f32[0], 0x3F800000, "F32 bits of 1.0")
    H.eq(f32[1], 0xC0200000, "F32 bits of -2.5")
    H.eq(f32[2], 0x40490000, "F32 bits of 3.140625")

    local b = f:to("BF16")
    H.eq(b:dtype(), "BF16", "to BF16 dtype")
    H.same(b:shape(), { 3 }, "to BF16 shape")
    local b16 = ffi.cast("const uint16_t *", b:data_ptr())
    H.eq(b16[0], 0x3F80, "BF16 bits of 1.0")
    H.eq(b16[1], 0xC020, "BF16 bits of -2.5")
    H.eq(b16[2], 0x4049, "BF16 bits of 3.140625")
    H.same(b:totable(), { 1.0, -2.5, 3.140625 }, "BF16 values read back")
    H.same(b:to("F32"):totable(), { 1.0, -2.5, 3.140625 }, "BF16 -> F32")

    local h = f:to("F16")
    local h16 = ffi.cast("const uint16_t *", h:data_ptr())
    H.eq(h16[0], 0x3C00, "F16 bits of 1.0")
    H.eq(h16[1], 0xC100, "F16 bits of -2.5")
    H.eq(h16[2], 0x4248, "F16 bits of 3.140625")
    H.same(h:to("F32"):totable(), { 1.0, -2.5, 3.140625 }, "F16 -> F32")

    -- BF16 keeps 7 fraction bits: quantum 2^-7 near 1. 1 + 2^-9 (1.001953125) rounds down to 1.0 (0x3F80);
    -- 1 + 0.5*2^-7 is a tie between 0x3F80 (even) and 0x3F81 -> 0x3F80; 1 + 1.5*2^-7 is a tie between 0x3F81
    -- and 0x3F82 (even) -> 0x3F82 = 1.015625; 1 + 0.75*2^-7 rounds up to 0x3F81 = 1.0078125.
    -- pi as F32 is 0x40490FDB: the dropped half 0x0FDB < 0x8000, so BF16 0x4049 = 3.140625.
    local q = ds4.tensor({ 1.001953125, 1.00390625, 1.01171875, 1.005859375, math.pi }):to("BF16")
    local q16 = ffi.cast("const uint16_t *", q:data_ptr())
    H.eq(q16[0], 0x3F80, "BF16 round down")
    H.eq(q16[1], 0x3F80, "BF16 tie to even (down)")
    H.eq(q16[2], 0x3F82, "BF16 tie to even (up)")
    H.eq(q16[3], 0x3F81, "BF16 round up")
    H.eq(q16[4], 0x4049, "BF16 of pi")
    H.same(q:totable(), { 1.0, 1.0, 1.015625, 1.0078125, 3.140625 }, "BF16 rounded values")

    -- BF16 written bit by bit through the FFI, decoded by ds4.
    local w = ds4.zeros({ 3 }, "BF16")
    local w16 = ffi.cast("uint16_t *", w:data_ptr())
    w16[0], w16[1], w16[2] = 0xC020, 0x4049, 0x3F80
    H.same(w:totable(), { -2.5, 3.140625, 1.0 }, "BF16 decode of raw bits")
    H.same(w:to("F32"):totable(), { -2.5, 3.140625, 1.0 }, "BF16 raw bits -> F32")

    -- A BF16 tensor built directly rounds the same way.
    H.eq(ds4.tensor({ 1.01171875 }, "BF16")[1], 1.015625, "ds4.tensor(..., 'BF16') rounds")
    H.eq(ds4.tensor(ds4.tensor({ 1.01171875 }), "BF16")[1], 1.015625, "ds4.tensor(tensor, dtype) converts")

    local i32 = ds4.tensor({ 1, -2, 2147483647 }, "I32")
    local p32 = ffi.cast("const int32_t *", i32:data_ptr())
    H.eq(p32[0], 1, "I32 bits 1")
    H.eq(p32[1], -2, "I32 bits -2")
    H.eq(p32[2], 2147483647, "I32 bits max")
    local i64 = ds4.tensor({ 5, -7 }, "I64")
    local p64 = ffi.cast("const int64_t *", i64:data_ptr())
    H.check(p64[0] == 5LL and p64[1] == -7LL, "I64 bits")
    H.same(i64:to("F32"):totable(), { 5, -7 }, "I64 -> F32")
    H.same(ds4.tensor({ 3, -4 }):to("I64"):totable(), { 3, -4 }, "F32 -> I64")
    H.same(ds4.tensor({ { 1, 0 } }):to("F64"):shape(), { 1, 2 }, "to keeps the shape")
    H.eq(type(i64:data_ptr()), "userdata", "data_ptr is a (light) userdata")
end

-- ------------------------------------------------------------------------------------------------ errors
do
    local t = ds4.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    H.raises(function() return t:get(3, 1) end, { "ds4.tensor:get", "index 1 is 3, outside 1..2", "[2, 3]" },
        "row out of range")
    H.raises(function() return t:get(1, 4) end, { "index 2 is 4, outside 1..3", "[2, 3]" }, "column out of range")
    H.raises(function() return t:get(0, 1) end, { "index 1 is 0" }, "zero index")
    H.raises(function() return t:get(1) end, { "1 indices given for a tensor of shape [2, 3]" }, "too few indices")
    H.raises(function() return t:get(1, 1, 1) end, { "3 indices given" }, "too many indices")
    H.raises(function() return t:get(1.5, 1) end, { "index 1 is 1.5" }, "non-integer index")
    H.raises(function() return t:get("a", 1) end, { "index 1 must be an integer, got string" }, "string index")
    H.raises(function() return t:set(1, 2, 4) end, { "ds4.tensor:set", "index 2 is 4" }, "set out of range")
    H.raises(function() return t:set("x", 1, 1) end, { "ds4.tensor:set", "number expected, got string" },
        "set a string")
    H.raises(function() return t[7] end, { "flat read index 7 outside 1..6", "[2, 3]" }, "flat read past the end")
    H.raises(function() return t[0] end, { "outside 1..6" }, "flat index 0")
    H.raises(function() t[7] = 1 end, { "flat write index 7" }, "flat write past the end")
    H.raises(function() t.foo = 1 end, { "cannot assign field 'foo'" }, "field assignment")
    H.raises(function() return t:item() end, { "ds4.tensor:item", "[2, 3]", "needs exactly one" }, "item of many")
    H.raises(function() return t:reshape({ 4, 2 }) end, { "cannot reshape [2, 3] (6 elements) to [4, 2]" },
        "bad reshape")
    H.raises(function() return t:to("F99") end, { "unknown dtype 'F99'" }, "unknown dtype")
    H.raises(function() return t.get(42, 1) end, { "self must be a ds4.tensor" }, "method on a non-tensor")
    H.eq(t.nosuchmethod, nil, "unknown method name reads nil")

    H.raises(function() return ds4.tensor({ { 1, 2 }, { 3 } }) end,
        { "ds4.tensor: ragged table", "[2] has 1 elements, expected 2" }, "short row")
    H.raises(function() return ds4.tensor({ { 1, 2 }, { 3, 4, 5 } }) end, { "ragged table", "[2] has 3 elements" },
        "long row")
    H.raises(function() return ds4.tensor({ { 1, 2 }, 3 }) end,
        { "ragged table", "element [2] is a number, expected a table of 2 elements" }, "number among rows")
    H.raises(function() return ds4.tensor({ { { 1 }, { 2 } }, { { 3 }, { 4, 5 } } }) end,
        { "ragged table", "[2][2] has 2 elements, expected 1" }, "ragged at depth 3")
    H.raises(function() return ds4.tensor({ 1, { 2 } }) end, { "element [2] is a table, expected a number" },
        "table among numbers")
    H.raises(function() return ds4.tensor({ 1, "x" }) end, { "element [2] is a string, expected a number" },
        "string element")
    H.raises(function() return ds4.tensor("abc") end, { "ds4.tensor: bad argument #1" }, "string argument")
    H.raises(function() return ds4.zeros({ 2, -1 }) end, { "ds4.zeros", "shape[2] must be a non-negative integer" },
        "negative dim")
    H.raises(function() return ds4.zeros(3) end, { "ds4.zeros", "shape table expected, got number" }, "zeros(3)")
    H.raises(function() return ds4.zeros({ 1, 1, 1, 1, 1, 1, 1, 1, 1 }) end, { "9 dimensions" }, "too many dims")
end

-- ------------------------------------------------------------------------------------------------ save / load
local read_file = H.read_file

do
    local path = os.tmpname()
    local a = ds4.tensor({ { 1.5, -2 }, { 3, 4.25 } })
    local b = ds4.tensor({ 1, -2.5, 3.140625 }, "BF16")
    local c = ds4.tensor({ { 9007199254740991, -3 } }, "I64") -- 2^53 - 1: exact in a double
    ds4.save_tensors(path, { a = a, b = b, c = c })
    local back = ds4.load_tensors(path)
    local names = {}
    for k in pairs(back) do names[#names + 1] = k end
    table.sort(names)
    H.same(names, { "a", "b", "c" }, "round trip names")
    H.eq(back.a:dtype(), "F32", "a dtype")
    H.same(back.a:shape(), { 2, 2 }, "a shape")
    H.same(back.a:totable(), { { 1.5, -2 }, { 3, 4.25 } }, "a values")
    H.eq(back.b:dtype(), "BF16", "b dtype")
    H.same(back.b:totable(), { 1, -2.5, 3.140625 }, "b values")
    H.eq(back.c:dtype(), "I64", "c dtype")
    H.same(back.c:totable(), { { 9007199254740991, -3 } }, "c values")

    -- Deterministic bytes: the same tensors inserted in another order give the same file, and the header
    -- lists the names in sorted order.
    local path2 = os.tmpname()
    local tbl = {}
    tbl.c = c
    tbl.a = a
    tbl.b = b
    ds4.save_tensors(path2, tbl)
    local s1, s2 = read_file(path), read_file(path2)
    H.check(#s1 > 8 and s1 == s2, "save_tensors output is independent of table order")
    local ia, ib, ic = s1:find('"a"', 1, true), s1:find('"b"', 1, true), s1:find('"c"', 1, true)
    H.check(ia and ib and ic and ia < ib and ib < ic, "names sorted in the header")

    -- Tensors outlive the file they came from.
    os.remove(path)
    collectgarbage()
    H.eq(back.a:get(2, 2), 4.25, "tensor readable after its file is gone")

    H.raises(function() ds4.save_tensors(path2, { a = a, bad = 1 }) end,
        { "ds4.save_tensors", "value for key 'bad' is a number, expected a ds4.tensor" }, "non-tensor value")
    H.raises(function() ds4.save_tensors(path2, { a, b }) end,
        { "ds4.save_tensors", "key 1 is a number; tensor names must be strings" }, "array table")
    H.raises(function() ds4.save_tensors(path2) end, { "ds4.save_tensors: bad argument #2" }, "missing table")
    H.raises(function() ds4.save_tensors("/nonexistent-dir/x.safetensors", { a = a }) end,
        { "ds4.save_tensors:", "/nonexistent-dir/x.safetensors" }, "unwritable path")
    os.remove(path2)

    H.raises(function() return ds4.load_tensors("/nonexistent/file.safetensors") end,
        { "ds4.load_tensors:", "/nonexistent/file.safetensors" }, "missing file")
    local junk = os.tmpname()
    local f = assert(io.open(junk, "wb"))
    f:write("\255\255\255\255\255\255\255\255not a safetensors file")
    f:close()
    H.raises(function() return ds4.load_tensors(junk) end, { "ds4.load_tensors:" }, "malformed file")
    os.remove(junk)
    H.raises(function() return ds4.load_tensors(42) end, { "ds4.load_tensors: bad argument #1" }, "number path")
end

-- ------------------------------------------------------------------------------------------------ fixture
-- Decode the fixture header and a few values with plain Lua + FFI (independent of ds4's reader).
do
    local path = fixtures .. "/tiny_a/io.safetensors"
    local raw = read_file(path)
    local p = ffi.cast("const uint8_t *", raw)
    local hlen = tonumber(ffi.cast("const uint64_t *", p)[0])
    local header = raw:sub(9, 8 + hlen)
    local function entry(name)
        local body = header:match('"' .. name:gsub("%.", "%%.") .. '"%s*:%s*(%b{})')
        assert(body, "fixture header has no " .. name)
        local dtype = body:match('"dtype"%s*:%s*"([^"]+)"')
        local shape = {}
        for d in body:match('"shape"%s*:%s*(%b[])'):gmatch("%d+") do shape[#shape + 1] = tonumber(d) end
        local o0 = tonumber(body:match('"data_offsets"%s*:%s*%[%s*(%d+)'))
        return dtype, shape, p + 8 + hlen + o0
    end

    local io_t = ds4.load_tensors(path)
    local dt, shape, ptr = entry("input_ids")
    H.eq(io_t.input_ids:dtype(), dt, "input_ids dtype")
    H.eq(dt, "I64", "input_ids is I64")
    H.same(io_t.input_ids:shape(), { 2, 37 }, "input_ids shape")
    H.same(shape, { 2, 37 }, "header shape of input_ids")
    local ids = ffi.cast("const int64_t *", ptr)
    local same = true
    for i = 0, 2 * 37 - 1 do
        if io_t.input_ids[i + 1] ~= tonumber(ids[i]) then same = false end
    end
    H.check(same, "input_ids values match the raw bytes")
    H.same(io_t.labels:shape(), { 2, 37 }, "labels shape")
    H.same(io_t.logits:shape(), { 2, 37, 256 }, "logits shape")
    H.eq(io_t.logits:dtype(), "F32", "logits dtype")
    local _, _, lptr = entry("logits")
    local lg = ffi.cast("const float *", lptr)
    H.eq(io_t.logits:get(1, 1, 1), tonumber(lg[0]), "logits[1][1][1]")
    H.eq(io_t.logits:get(2, 37, 256), tonumber(lg[2 * 37 * 256 - 1]), "logits[2][37][256]")
    H.eq(io_t.logits:get(1, 2, 3), tonumber(lg[256 + 2]), "logits[1][2][3]")
    local _, _, lossp = entry("loss")
    H.same(io_t.loss:shape(), { 1 }, "loss shape")
    H.eq(io_t.loss:item(), tonumber(ffi.cast("const float *", lossp)[0]), "loss value")
    H.same(io_t.mtp_logits:shape(), { 2, 36, 256 }, "mtp_logits shape")
    H.same(io_t["hidden.0"]:shape(), { 2, 37, 4, 64 }, "hidden.0 shape")

    -- A checkpoint directory (sharded, with an index) loads through the same call.
    local w = ds4.load_tensors(fixtures .. "/tiny_b")
    H.same(w["model.embed_tokens.weight"]:shape(), { 192, 48 }, "tiny_b embed shape from the sharded checkpoint")
end

collectgarbage()
H.done("test_tensor")
