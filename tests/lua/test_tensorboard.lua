-- test_tensorboard.lua — TensorBoard event records (lua/tb_lua.c via protobuf-c, lua/ds4/tensorboard.lua,
-- lua/ds4/runlog.lua), checked against independent references:
--   (a) CRC-32C test vectors (RFC 3720 appendix B.4: "123456789" -> e3069283, 32 zero bytes -> 8a9136aa);
--   (b) the records equal, byte for byte, what TensorBoard's own writer produced for the same events
--       (tests/fixtures/tensorboard/events.bin, made by tests/gen_tb_fixture.py): the file_version record,
--       scalars, a text table and a text string;
--   (c) ds4.runlog writes metrics.jsonl, an events file whose records frame correctly (lengths and CRCs re-checked
--       here from the bytes), and completions.jsonl; bad arguments raise naming the function.
-- Skipped (exit 0 with a note) on a build without protobuf-c. TensorBoard's reader itself loads a run's files in
-- tests/test_tensorboard.sh (skipped where python3 + tensorboard are not installed).
-- Usage: ds4 run tests/lua/test_tensorboard.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local bit = require("bit")

local ok, why = ds4.tensorboard.available()
if not ok then
    print("test_tensorboard: skipped: " .. why)
    os.exit(0)
end
local tb = ds4.tb

-- (a)
H.eq(tb.crc32c("123456789"), 0xe3069283, "CRC-32C of 123456789")
H.eq(tb.crc32c(("\0"):rep(32)), 0x8a9136aa, "CRC-32C of 32 zero bytes")
H.eq(tb.crc32c(""), 0, "CRC-32C of nothing")

-- (b)
local want = H.read_file(H.fixtures() .. "/tensorboard/events.bin")
local got = tb.file_version(1700000000.5)
    .. tb.scalars(1700000001.25, 7, { loss = 0.25, ["reward/mean"] = -1.5, a = 3 })
    .. tb.text(1700000002.0, 9, "completions", { { "prompt", "completion" }, { "1+1=", "\\boxed{2}" } })
    .. tb.text(1700000003.0, 10, "notes", "hello *world*")
H.eq(#got, #want, "as many bytes as TensorBoard's writer")
H.check(got == want, "the same bytes as TensorBoard's writer (tests/gen_tb_fixture.py)")

-- (c) the records of a file, re-framed from the bytes: each {len, data}; the CRCs checked against tb.crc32c
local function u32(s, i) return s:byte(i) + s:byte(i + 1) * 256 + s:byte(i + 2) * 65536 + s:byte(i + 3) * 16777216 end
local function masked(c)
    c = bit.tobit(c)
    return (bit.tobit(bit.bor(bit.rshift(c, 15), bit.lshift(c, 17)) + 0xa282ead8) % 2 ^ 32)
end
local function records(bytes)
    local out, i = {}, 1
    while i <= #bytes do
        local len = u32(bytes, i) + u32(bytes, i + 4) * 2 ^ 32
        H.eq(u32(bytes, i + 8), masked(tb.crc32c(bytes:sub(i, i + 7))), "length CRC of record " .. (#out + 1))
        local data = bytes:sub(i + 12, i + 11 + len)
        H.eq(u32(bytes, i + 12 + len), masked(tb.crc32c(data)), "data CRC of record " .. (#out + 1))
        out[#out + 1] = data
        i = i + 16 + len
    end
    return out
end
H.eq(#records(want), 4, "the reframing reads TensorBoard's own file")

local dir = H.make_temp_dir()
local log = ds4.runlog.open(dir, { tensorboard = true })
H.check(log.tensorboard and log.tensorboard:find("/events%.out%.tfevents%."), "an events file named for TensorBoard")
log:write({ step = 1, loss = 0.5, ["reward/mean"] = 0.25, note = "not a number" })
log:write({ step = 2, loss = 0.4 })
log:table(2, "completions", { "prompt", "completion", "reward" }, { { "1+1=", "2\nline | pipe", "1" } })
log:close()
local recs = records(H.read_file(log.tensorboard))
H.eq(#recs, 4, "file_version, two scalar events, one table")
H.check(recs[1]:find("brain.Event:2", 1, true), "the first record is the file version")
H.check(recs[2]:find("reward/mean", 1, true) and not recs[2]:find("note", 1, true), "numbers only become scalars")
H.check(recs[4]:find("line \\| pipe", 1, true), "table cells keep one line, pipes escaped for markdown")
local m = require("ds4.plot").read_jsonl(dir .. "/metrics.jsonl")
H.eq(#m, 2, "metrics.jsonl has both rows")
local c = require("ds4.plot").read_jsonl(dir .. "/completions.jsonl")
H.eq(c[1].completion, "2\nline | pipe", "completions.jsonl keeps the text as it was")
H.eq(c[1].step, 2, "and the step")

H.raises(function() tb.scalars(1, 1.5, {}) end, { "ds4.tb.scalars", "integer step" }, "a fractional step")
H.raises(function() tb.scalars(1, 1, { x = "y" }) end, { "ds4.tb.scalars", "tag = number" }, "a string value")
H.raises(function() tb.text(1, 1, "t", { { "a" }, { "b", "c" } }) end, { "ds4.tb.text", "equal, non-empty rows" },
    "ragged rows")
H.raises(function() tb.text(1, 1, "t", { { 5 } }) end, { "ds4.tb.text", "rows[1][1] must be a string" }, "a number cell")
H.raises(function() tb.file_version(0 / 0) end, { "ds4.tb.file_version", "wall time" }, "a NaN wall time")

os.execute("rm -rf " .. H.shell_quote(dir))
H.done("test_tensorboard")
