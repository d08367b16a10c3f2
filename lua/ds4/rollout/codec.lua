--[==[ ds4.rollout.codec — what the pool and the worker share: the wire codec (ds4.wire, rollout/protocol.md) behind
  two calls, packing of raw frames, and the protocol's constants.

  codec.encode(msg [, raw]) -> frames     ds4.wire.encode: msg mirrors wire.h's structs ({t = "task", task_id = 7,
                                          ...}); raw: {frame name = string | array | tensor}. Raises on a message
                                          the codec refuses (a bug of the sender, never the peer's fault).
  codec.decode(frames) -> msg | nil, code_name, message, ref_t   never raises on what a peer sent; raw frames
                                          as strings
  codec.raw(msg, name) -> bytes of raw frame `name` of a decoded message (nil when absent)
  codec.pack_i32(array [, n]) / codec.pack_f32(array [, n]) -> bytes;  codec.unpack_i32(bytes [, off, n]) /
  codec.unpack_f32(bytes [, off, n]) -> array (off, n in elements)
  codec.error_msg(code_name, reason [, ref_t, ref_id, ref_n]) -> msg
  codec.FINISH (code -> name), codec.FINISH_CODE (name -> code), codec.CODE (name -> number)
  codec.now() -> monotonic seconds;  codec.crc32(ptr_or_string, len [, crc]) -> CRC-32 (ds4_crc32)
  codec.buffer_crc(ptr, bytes) -> CRC-32 of a weight buffer (in 16 MiB pieces: lengths stay within size_t anywhere)
  codec.same_layout(a, b) -> whether two LoRA layouts ({rank, alpha, rslora, masks}) make the same adapters
]==]

local ffi = require("ffi")
local ds4 = require("ds4")

local M = {}

pcall(ffi.cdef, [[
typedef struct ds4_timespec { long tv_sec; long tv_nsec; } ds4_timespec;
int clock_gettime(int clk, ds4_timespec *tp);
]])
pcall(ffi.cdef, [[uint32_t ds4_crc32(uint32_t crc, const void *data, size_t n);]])
pcall(ffi.cdef, [[int memcmp(const void *a, const void *b, size_t n);]])

local ts = ffi.new("ds4_timespec")
function M.now()
    ffi.C.clock_gettime(1, ts)
    return tonumber(ts.tv_sec) + 1e-9 * tonumber(ts.tv_nsec)
end

-- ds4_crc32 through the FFI (the ds4 program exports its symbols); ds4.wire.crc32 on strings otherwise.
local has_crc = pcall(function() return ffi.C.ds4_crc32 end)
function M.crc32(data, len, crc)
    crc = crc or 0
    if has_crc then
        return tonumber(ffi.C.ds4_crc32(crc, data, len))
    end
    if type(data) ~= "string" then data = ffi.string(data, len) end
    return M.wire().crc32(data, crc)
end

function M.buffer_crc(ptr, bytes)
    local crc, piece = 0, 16 * 1024 * 1024
    for off = 0, bytes - 1, piece do crc = M.crc32(ptr + off, math.min(piece, bytes - off), crc) end
    return crc
end

function M.same_layout(a, b)
    if a.rank ~= b.rank or a.alpha ~= b.alpha or (a.rslora and true or false) ~= (b.rslora and true or false)
        or #a.masks ~= #b.masks then
        return false
    end
    for i, v in ipairs(a.masks) do if b.masks[i] ~= v then return false end end
    return true
end

function M.same_bytes(a, b, len)
    return ffi.C.memcmp(a, b, len) == 0
end

M.FINISH = { "length", "eos", "stop_token", "stop_string", "cancelled" }
M.FINISH_CODE = {}
for i, n in ipairs(M.FINISH) do M.FINISH_CODE[n] = i end

M.CODE = { bad_argument = 1, no_memory = 2, limit = 3, parse = 4, trailing = 5, not_map = 6, version = 7, type = 8,
    missing = 9, key = 10, duplicate = 11, value_type = 12, range = 13, frame = 14, count = 15, crc = 16,
    state = 32, stale = 33, refused = 34, internal = 35 }
M.CODE_NAME = {}
for k, v in pairs(M.CODE) do M.CODE_NAME[v] = k end

local wire
function M.wire()
    if not wire then
        wire = ds4.wire
        if not wire then error("ds4.rollout: this ds4 was built without the wire codec binding (ds4.wire)", 2) end
    end
    return wire
end

function M.encode(msg, raw)
    return M.wire().encode(msg, raw)
end

-- Raw frames come back as strings (opts.raw): the pool and the worker unpack what they need through the FFI.
local DEC_OPTS = { raw = true }
function M.decode(frames, limits)
    local ok, msg, code, why, ref_t = pcall(M.wire().decode, frames, limits, DEC_OPTS)
    if not ok then return nil, "internal", tostring(msg), "" end
    return msg, code, why, ref_t
end

function M.raw(msg, name)
    return msg[name]
end

function M.error_msg(code, reason, ref_t, ref_id, ref_n)
    local m = { t = "error", code = M.CODE[code] or code, reason = tostring(reason or ""):sub(1, 256) }
    if ref_t then m.ref_t = tostring(ref_t):sub(1, 32) end
    if ref_id then m.ref_id = ref_id end
    if ref_n then m.ref_n = ref_n end
    return m
end

-- ------------------------------------------------------------------------------------------------ packing

function M.pack_i32(a, n)
    n = n or #a
    if n == 0 then return "" end
    local buf = ffi.new("int32_t[?]", n)
    for i = 1, n do buf[i - 1] = a[i] end
    return ffi.string(buf, 4 * n)
end

function M.pack_f32(a, n)
    n = n or #a
    if n == 0 then return "" end
    local buf = ffi.new("float[?]", n)
    for i = 1, n do buf[i - 1] = a[i] end
    return ffi.string(buf, 4 * n)
end

local function unpack(ct, s, off, n)
    off = off or 0
    n = n or (#s / 4 - off)
    local out = {}
    if n <= 0 then return out end
    local p = ffi.cast(ct, s) + off
    for i = 1, n do out[i] = tonumber(p[i - 1]) end
    return out
end
function M.unpack_i32(s, off, n) return unpack("const int32_t *", s, off, n) end
function M.unpack_f32(s, off, n) return unpack("const float *", s, off, n) end

-- ------------------------------------------------------------------------------------------------ misc

-- A CURVE key given as 40 Z85 characters, or the path of a `ds4 keygen` file (PREFIX.key: the secret key,
-- PREFIX.pub: the public key).
function M.read_key(v, what)
    if type(v) ~= "string" then error(what .. ": a Z85 key or a key file path expected, got " .. type(v), 0) end
    -- Z85 has '/' and '.' in its alphabet: a 40-character string is a key unless a file of that name exists
    local f = io.open(v, "rb")
    if f then f:close() elseif #v == 40 and not v:find("%s") then return v end
    local ok, key = pcall(ds4.zmq.read_key, v)
    if not ok then error(what .. ": " .. tostring(key), 0) end
    return key
end

-- "tcp://..." needs CURVE or an explicit insecure flag; ipc:// and inproc:// stay on this host.
function M.needs_curve(endpoint)
    return not (endpoint:match("^ipc://") or endpoint:match("^inproc://"))
end

return M
