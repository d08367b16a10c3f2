-- test_zmq.lua — ds4.zmq (lua/zmq_lua.c, rollout/zap.c) and ds4.wire (lua/wire_lua.c) against real sockets:
-- ROUTER/DEALER round trips over inproc and TCP with binary frames, timeouts, would-block sends, option
-- checking, CURVE with the ZAP allow-list (an allowed key gets through, an unknown one is refused and counted),
-- key helpers, and every wire message type encoded, sent, received and decoded.
-- Usage: ds4 run tests/lua/test_zmq.lua <fixtures_dir>
--
-- Sockets and one ZAP handler are deliberately left open at the end: lua_close must close them, stop the handler
-- and terminate the context without hanging (and, in the sanitizer build, without leaking).
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local zmq, wire = ds4.zmq, ds4.wire

local WAIT = 5000 -- ms: generous for a loaded CI machine; only failures wait this long

-- ------------------------------------------------------------------------------------------------ basics

H.check(type(zmq.version()) == "string" and zmq.version():match("^%d+%.%d+%.%d+$") ~= nil, "zmq.version()")
H.eq(type(zmq.has("curve")), "boolean", "zmq.has returns a boolean")
H.raises(function() zmq.socket("BOGUS") end, { "ds4.zmq.socket", "BOGUS" }, "unknown socket type")
H.raises(function() zmq.socket() end, "ds4.zmq.socket", "missing socket type")

do -- options: unknown keys and wrong types are errors, and nothing is applied when one entry is bad
    local s = zmq.socket("DEALER")
    H.eq(s:get("linger"), 0, "sockets start with linger 0")
    H.raises(function() s:set{ bogus = 1 } end, { "ds4.zmq.socket:set", "unknown option 'bogus'" }, "unknown key")
    H.raises(function() s:set{ [1] = 5 } end, "unknown option", "a non-string key")
    H.raises(function() s:set{ linger = "x" } end, "linger must be an integer", "string for an integer")
    H.raises(function() s:set{ linger = 1.5 } end, "linger must be an integer", "fraction for an integer")
    H.raises(function() s:set{ immediate = 2 } end, "immediate must be a boolean", "2 for a boolean")
    H.raises(function() s:set{ immediate = "yes" } end, "immediate must be a boolean", "string for a boolean")
    s:set{ immediate = 1 } -- libzmq's own 1 / 0 are booleans too
    H.eq(s:get("immediate"), true, "immediate = 1")
    s:set{ immediate = 0 }
    H.eq(s:get("immediate"), false, "immediate = 0")
    H.raises(function() s:set{ routing_id = 5 } end, "routing_id must be a string", "number for a string")
    H.raises(function() s:set{ curve_serverkey = "short" } end, "curve_serverkey must be a CURVE key", "bad key")
    H.raises(function() s:set{ last_endpoint = "x" } end, "unknown option", "read-only option")
    H.raises(function() s:set{ heartbeat_ttl = 100000000 } end,
        { "ds4.zmq.socket:set: cannot set heartbeat_ttl = 100000000 (", ")" }, "libzmq refuses a value: its error text")
    H.raises(function() s:set{ linger = 5, bogus = 1 } end, "unknown option 'bogus'", "one bad key")
    H.eq(s:get("linger"), 0, "a rejected set{} applies nothing")
    s:set{ linger = 250, sndhwm = 10, rcvhwm = 20, routing_id = "id-1", immediate = true, maxmsgsize = 1048576,
        heartbeat_ivl = 1000, heartbeat_timeout = 10000, heartbeat_ttl = 10000, reconnect_ivl = 100,
        reconnect_ivl_max = 5000, handshake_ivl = 3000 }
    H.eq(s:get("linger"), 250, "linger")
    H.eq(s:get("sndhwm"), 10, "sndhwm")
    H.eq(s:get("rcvhwm"), 20, "rcvhwm")
    H.eq(s:get("routing_id"), "id-1", "routing_id")
    H.eq(s:get("immediate"), true, "immediate")
    H.eq(s:get("maxmsgsize"), 1048576, "maxmsgsize")
    H.eq(s:type(), "DEALER", "sock:type()")
    H.check(tostring(s):find("ds4.zmq.socket DEALER", 1, true), "tostring: " .. tostring(s))
    H.raises(function() s:get("nope") end, "unknown option nope", "get of an unknown option")
    s:close()
    s:close() -- twice is harmless
    H.check(tostring(s):find("(closed)", 1, true), "tostring of a closed socket")
    H.raises(function() s:send({ "x" }) end, "the socket is closed", "send on a closed socket")
    H.raises(function() s:recv(0) end, "the socket is closed", "recv on a closed socket")
end

-- ------------------------------------------------------------------------------------------------ round trips

local BIN = "\0\1\2\0\255\0"
local BIG = string.rep("\0\255ab", 64 * 1024) -- 256 KiB, zero bytes throughout

local function round_trip(endpoint, label)
    local router = zmq.socket("ROUTER")
    router:set{ router_mandatory = true }
    local ep = router:bind(endpoint)
    local dealer = zmq.socket("DEALER")
    dealer:set{ routing_id = "w-1" }
    dealer:connect(ep)
    H.eq(dealer:send({ "hello", BIN, "" }), true, label .. ": dealer send")
    local got = router:recv(WAIT)
    H.same(got, { "w-1", "hello", BIN, "" }, label .. ": router receives the routing id and every frame")
    H.eq(router:send({ "w-1", "reply", BIG, BIN }), true, label .. ": router send")
    got = dealer:recv(WAIT)
    H.eq(got and #got, 3, label .. ": frames back")
    H.eq(got and got[1], "reply", label .. ": frame 1")
    H.check(got and got[2] == BIG, label .. ": a 256 KiB binary frame arrives intact")
    H.eq(got and got[3], BIN, label .. ": frame 3")
    -- a tensor frame: its raw bytes
    H.eq(dealer:send({ ds4.tensor({ 1, 2, 3 }, "I32") }), true, label .. ": tensor frame")
    got = router:recv(WAIT)
    H.eq(got and got[2], "\1\0\0\0\2\0\0\0\3\0\0\0", label .. ": tensor bytes")
    -- nothing more: a timeout gives nil, and so does a poll of 0 ms
    H.eq(router:recv(50), nil, label .. ": recv times out with nil")
    H.eq(router:recv(0), nil, label .. ": recv(0) polls once")
    H.same(zmq.poll({ router, dealer }, 0), { false, false }, label .. ": poll, nothing readable")
    dealer:send({ "again" })
    local r = zmq.poll({ dealer, router }, WAIT)
    H.same(r, { false, true }, label .. ": poll sees the router readable")
    H.eq(router:events().readable, true, label .. ": events().readable")
    H.eq(dealer:events().writable, true, label .. ": events().writable")
    H.same(router:recv(0), { "w-1", "again" }, label .. ": recv after poll")
    -- would-block sends: an unknown routing id with router_mandatory
    local ok, code, msg = router:send({ "nobody", "x" })
    H.eq(ok, nil, label .. ": send to an unknown peer fails")
    H.eq(code, "EHOSTUNREACH", label .. ": ... with EHOSTUNREACH")
    H.check(type(msg) == "string" and msg:find("ds4.zmq.socket:send", 1, true), label .. ": ... and a message")
    ok, code = router:send({ "nobody", "x" }, { timeout = 20 })
    H.eq(code, "EHOSTUNREACH", label .. ": no waiting for an unreachable peer")
    return router, dealer, ep
end

local r1, d1 = round_trip("inproc://test-zmq-rd", "inproc")
local r2, d2, tcp_ep = round_trip("tcp://127.0.0.1:*", "tcp")
H.check(tcp_ep:match("^tcp://127%.0%.0%.1:%d+$") ~= nil, "bind reports the port: " .. tcp_ep)
r1:close()
d1:close()

do -- EAGAIN: a DEALER with immediate and no connection cannot queue
    local d = zmq.socket("DEALER")
    d:set{ immediate = true }
    local ok, code = d:send({ "x" })
    H.eq(ok, nil, "no peer: send fails")
    H.eq(code, "EAGAIN", "no peer: EAGAIN")
    ok, code = d:send({ "x" }, { timeout = 30 })
    H.eq(code, "EAGAIN", "no peer: EAGAIN after waiting 30 ms")
    H.raises(function() d:send({}) end, "no frames", "empty frame array")
    H.raises(function() d:send({ 5 }) end, "frame 1 is a number", "non-string frame")
    H.raises(function() d:send({ "x" }, { bogus = 1 }) end, "unknown option", "unknown send option")
    H.raises(function() d:recv("x") end, "timeout", "bad timeout")
    H.raises(function() zmq.poll({ d, 5 }, 0) end, "socks[2]", "poll of a non-socket")
    d:close()
end

do -- endpoints
    local s = zmq.socket("PULL")
    H.raises(function() s:bind("nonsense://x") end, { "ds4.zmq.socket:bind", "cannot bind nonsense://x", "(" },
        "bad endpoint: error names it and libzmq's text")
    local ep = s:bind("tcp://127.0.0.1:*")
    H.eq(s:unbind(ep), true, "unbind")
    local p = zmq.socket("PUSH")
    H.eq(p:connect(ep), true, "connect")
    H.eq(p:disconnect(ep), true, "disconnect")
    s:close()
    p:close()
end

-- ------------------------------------------------------------------------------------------------ keys

local has_curve = zmq.has("curve")
if has_curve then
    local pub, sec = zmq.keypair()
    H.eq(#pub, 40, "public key is 40 Z85 characters")
    H.eq(#sec, 40, "secret key is 40 Z85 characters")
    H.eq(zmq.public_from_secret(sec), pub, "public_from_secret(secret) = public")
    local pub2 = zmq.keypair()
    H.check(pub2 ~= pub, "two key pairs differ")
    H.raises(function() zmq.public_from_secret("abc") end, "40 Z85 characters", "short secret")
    H.raises(function() zmq.public_from_secret(string.rep("\"", 40)) end, "40 Z85 characters", "not Z85")
    -- read_key: the first line that is not a comment
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write("# a comment\n\n", sec, "\n")
    f:close()
    H.eq(zmq.read_key(path), sec, "read_key skips comments")
    f = assert(io.open(path, "w"))
    f:write("not a key\n")
    f:close()
    H.raises(function() zmq.read_key(path) end, "holds no CURVE key", "read_key of a file without a key")
    os.remove(path)
else
    io.write("libzmq without CURVE: key and ZAP tests skipped\n")
    H.raises(function() zmq.keypair() end, "no CURVE support", "keypair without CURVE")
end

-- ------------------------------------------------------------------------------------------------ CURVE + ZAP

if has_curve then
    local srv_pub, srv_sec = zmq.keypair()
    local good_pub, good_sec = zmq.keypair()
    local bad_pub, bad_sec = zmq.keypair()
    H.raises(function() zmq.zap{ allow = { "nope" } } end, "opts.allow[1]", "zap: a bad key in allow")
    H.raises(function() zmq.zap{ bogus = true } end, "unknown option", "zap: unknown option")
    local zap = zmq.zap{ allow = { good_pub } }
    H.raises(function() zmq.zap{} end, "already runs", "one handler per context")
    H.eq(zap:running(), true, "handler running")
    H.eq(zap:is_allowed(good_pub), true, "allowed key")
    H.eq(zap:is_allowed(bad_pub), false, "unknown key")

    local server = zmq.socket("ROUTER")
    server:set{ curve_server = true, curve_secretkey = srv_sec, router_mandatory = true }
    local ep = server:bind("tcp://127.0.0.1:*")
    local function client(id, pub, sec)
        local c = zmq.socket("DEALER")
        c:set{ routing_id = id, curve_serverkey = srv_pub, curve_publickey = pub, curve_secretkey = sec }
        c:connect(ep)
        return c
    end
    local good = client("good", good_pub, good_sec)
    H.eq(good:send({ "hi", BIN }), true, "allowed client: send queued")
    H.same(server:recv(WAIT), { "good", "hi", BIN }, "allowed client: message arrives")
    H.eq(server:send({ "good", "welcome" }), true, "server answers the allowed client")
    H.same(good:recv(WAIT), { "welcome" }, "allowed client: answer arrives")

    local bad = client("bad", bad_pub, bad_sec)
    bad:send({ "let me in" })
    H.eq(server:recv(1000), nil, "refused client: no message arrives")
    local st = zap:stats()
    H.eq(st.accepted, 1, "stats.accepted")
    H.eq(st.refused, 1, "stats.refused")
    H.same(st.refused_keys, { bad_pub }, "stats.refused_keys holds the refused key")
    H.eq(st.allowed, 1, "stats.allowed")
    H.check(tostring(zap):find("1 accepted", 1, true), "tostring(handler): " .. tostring(zap))
    bad:close()

    -- the allow-list changes at run time
    H.eq(zap:allow(bad_pub), true, "allow a key")
    H.eq(zap:is_allowed(bad_pub), true, "now allowed")
    local bad2 = client("bad2", bad_pub, bad_sec)
    bad2:send({ "now?" })
    H.same(server:recv(WAIT), { "bad2", "now?" }, "a newly allowed key gets through")
    H.eq(zap:deny(bad_pub), true, "deny removes the key")
    H.eq(zap:deny(bad_pub), false, "deny of an absent key")
    H.same(zap:allowed(), { good_pub }, "allowed() lists the keys")
    H.raises(function() zap:allow("short") end, "40 Z85 characters", "allow of a bad key")
    bad2:close()
    good:close()
    server:close()

    zap:stop()
    zap:stop() -- twice is harmless
    H.eq(zap:running(), false, "stopped")
    H.raises(function() zap:stats() end, "stopped", "stats of a stopped handler")
    -- a new handler can start once the old one is stopped; this one stays running until lua_close
    local zap2 = zmq.zap{ allow = { good_pub }, quiet = true }
    H.eq(zap2:running(), true, "a second handler after stop")
    zap2 = nil
    collectgarbage()
    collectgarbage()
    -- still running although the script dropped it: a CURVE server keeps refusing unknown keys
    local server2 = zmq.socket("ROUTER")
    server2:set{ curve_server = true, curve_secretkey = srv_sec }
    ep = server2:bind("tcp://127.0.0.1:*")
    local bad3 = client("bad3", bad_pub, bad_sec)
    bad3:send({ "x" })
    H.eq(server2:recv(500), nil, "a dropped handler keeps running (the registry holds it)")
    -- server2 and bad3 stay open: lua_close closes them
end

-- ------------------------------------------------------------------------------------------------ wire

local F = function(x) return x end
local MESSAGES = {
    { { t = "hello", worker = "w-1", max_batch = 8, threads = 2, vocab_size = 280, n_params = 123456,
        build = "ds4 test", policy = 3 } },
    { { t = "credit", n = 4 } },
    { { t = "task", task_id = 7, attempt = 1, policy = 2, max_new_tokens = 16, temperature = 0.75, top_k = 5,
        top_p = 0.5, min_p = 0.25, n = 2, seed = "18446744073709551615", stop = { 1, 2 }, ignore_eos = true,
        stop_strings = { "</answer>", "\n\n" }, record_experts = true, record_index = false, stream = 4,
        prompt_len = 3 },
      { prompt = { 5, 0, 7 } } },
    { { t = "samples", task_id = 7, attempt = 1, policy = 2, n = 2, experts_layers = 2, experts_k = 1,
        token_versions = true,
        seq = { { prompt_len = 3, n_gen = 2, finish = 1, stop_index = -1, n_rows = 4 },
                { prompt_len = 3, n_gen = 1, finish = "stop_token", stop_index = 0, n_rows = 3 } } },
      { tokens = { 9, 10, 11 }, logprobs = { -0.5, -1.25, -2 }, sample_logprobs = { -0.25, 0, -1 },
        policy_lag = { 1, 0, 0 }, experts = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13 } } },
    { { t = "weight_announce", version = 3, n_params = 10, bytes = 40, chunk = 16, chunks = 3, dtype = "f32",
        crc = 12345, chat_template = "chatml" },
      { config = '{"vocab_size": 280}', tokenizer = '{"model": {}}', tables = { 3, 1, 0, 2 } } },
    { { t = "weight_request", version = 3, index = 2 } },
    { { t = "weight_chunk", version = 3, index = 2, offset = 32, bytes = 40, chunk = 16,
        weights = "\0\1\2\3\4\5\6\7" } },
    { { t = "heartbeat", policy = 3, active = 1 } },
    { { t = "error", code = "state", reason = "unknown worker: send hello", ref_t = "credit", ref_id = 0,
        ref_n = 0 } },
    { { t = "bye", reason = "shutting down" } },
    { { t = "partial", task_id = 7, attempt = 1, policy = 2, n = 2,
        seq = { { offset = 4, n_gen = 2 }, { offset = 0, n_gen = 0 } } },
      { tokens = { 9, 10 }, logprobs = { -0.5, -1.25 }, sample_logprobs = { -0.25, 0 } } },
    -- protocol 6: a partial message with each token's version (sample 1's tokens of versions 2 and 3)
    { { t = "partial", task_id = 7, attempt = 1, policy = 3, n = 2, token_versions = true,
        seq = { { offset = 4, n_gen = 2 }, { offset = 0, n_gen = 0 } } },
      { tokens = { 9, 10 }, logprobs = { -0.5, -1.25 }, sample_logprobs = { -0.25, 0 }, policy_lag = { 1, 0 } } },
}

-- Golden encodings of MESSAGES through the binding (Lua table -> C struct -> bytes), committed in
-- tests/fixtures/wire_lua_golden.hex (one line of hex per message; WIRE_WRITE_GOLDEN=1 rewrites it after a protocol
-- change): the Lua side of the codec fills every field as before, byte for byte.
do
    local lines = {}
    for _, case in ipairs(MESSAGES) do
        local out = wire.encode(case[1], case[2])
        local hex = {}
        for _, fr in ipairs(out) do hex[#hex + 1] = (fr:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end
        lines[#lines + 1] = case[1].t .. " " .. table.concat(hex, " ")
    end
    local path = H.fixtures() .. "/wire_lua_golden.hex"
    if os.getenv("WIRE_WRITE_GOLDEN") then
        local f = assert(io.open(path, "w"))
        f:write(table.concat(lines, "\n"), "\n")
        f:close()
    end
    local want = {}
    for line in io.lines(path) do want[#want + 1] = line end
    H.eq(#want, #lines, "golden: one line per message")
    for i, line in ipairs(lines) do H.eq(line, want[i], "golden: the encoding of " .. MESSAGES[i][1].t) end
end

do
    local kinds, nk = {}, 0
    for _, case in ipairs(MESSAGES) do
        if not kinds[case[1].t] then kinds[case[1].t], nk = true, nk + 1 end
    end
    H.eq(nk, #wire.types, "a message of every type")
    local router = r2 -- the TCP pair from above
    local dealer = d2
    for _, case in ipairs(MESSAGES) do
        local msg, frames = case[1], case[2]
        local t = msg.t
        local out = wire.encode(msg, frames)
        H.check(type(out) == "table" and type(out[1]) == "string", t .. ": encode gives frame strings")
        H.eq(dealer:send(out), true, t .. ": sent")
        local got = router:recv(WAIT)
        H.eq(got and got[1], "w-1", t .. ": routing id")
        local dec, code, why = wire.decode(got or {}, nil, { first = 2 })
        H.check(dec ~= nil, t .. ": decodes (" .. tostring(code) .. " " .. tostring(why) .. ")")
        if dec then
            H.eq(dec.t, t, t .. ": type")
            H.eq(dec.v, wire.VERSION, t .. ": version")
            -- encode(decode(x)) is x, byte for byte: every field survived the trip
            H.same(wire.encode(dec), out, t .. ": re-encoding the decoded message gives the same frames")
            for k, v in pairs(msg) do
                if type(v) ~= "table" and k ~= "finish" and k ~= "code" then H.eq(dec[k], v, t .. "." .. k) end
            end
            for k, v in pairs(frames or {}) do H.same(dec[k], v, t .. ": frame " .. k) end
        end
    end
    -- a few decoded values in their Lua form
    local dec = wire.decode(wire.encode(MESSAGES[4][1], MESSAGES[4][2]))
    H.eq(dec.seq[2].finish, 3, "samples: finish as its number")
    H.eq(dec.seq[2].finish_reason, "stop_token", "samples: finish_reason")
    H.same(dec.experts, MESSAGES[4][2].experts, "samples: experts frame")
    H.eq(dec.index, nil, "samples: no index frame")
    dec = wire.decode(wire.encode(MESSAGES[9][1]))
    H.eq(dec.code, 32, "error: code number")
    H.eq(dec.code_name, "state", "error: code_name")
    dec = wire.decode(wire.encode(MESSAGES[3][1], MESSAGES[3][2]))
    H.eq(dec.seed, "18446744073709551615", "task: a seed above 2^53 comes back as a decimal string")
    H.same(dec.stop, { 1, 2 }, "task: stop")
    H.same(dec.prompt, { 5, 0, 7 }, "task: prompt frame")
    dec = wire.decode(wire.encode(MESSAGES[3][1], MESSAGES[3][2]), nil, { raw = true })
    H.eq(dec.prompt, "\5\0\0\0\0\0\0\0\7\0\0\0", "opts.raw keeps raw frames as strings")
    -- a LoRA policy's announce: the adapter map's fields flat (lora_*) and the lora_masks frame, both ways
    local lora = { t = "weight_announce", version = 5, n_params = 100, bytes = 40, chunk = 16, crc = 7,
        config = "{}", lora_rank = 4, lora_alpha = 8, lora_rslora = true, lora_base_version = 4,
        lora_base_chunk = 64, lora_base_crc = 0 }
    dec = wire.decode(wire.encode(lora, { lora_masks = { 0x9f, 0xfff } }))
    for _, k in ipairs({ "lora_rank", "lora_alpha", "lora_rslora", "lora_base_version", "lora_base_chunk",
        "lora_base_crc" }) do H.eq(dec[k], lora[k], "LoRA announce: " .. k) end
    H.same(dec.lora_masks, { 0x9f, 0xfff }, "LoRA announce: lora_masks frame")
    H.same(wire.encode(dec), wire.encode(lora, { lora_masks = { 0x9f, 0xfff } }), "LoRA announce: re-encoded")
    lora.lora_rslora = nil
    H.eq(wire.decode(wire.encode(lora, { lora_masks = { 1 } })).lora_rslora, false, "LoRA announce: rslora default")
    dec = wire.decode(wire.encode(MESSAGES[5][1], MESSAGES[5][2]))
    H.eq(dec.lora_rank, nil, "a plain announce has no lora_* fields")
    H.eq(dec.lora_masks, nil, "a plain announce has no lora_masks frame")
    H.raises(function() wire.encode(lora) end, { "weight_announce.lora_masks", "missing" }, "LoRA announce without masks")
    lora.lora_base_version = nil
    H.raises(function() wire.encode(lora, { lora_masks = { 1 } }) end, { "weight_announce.lora_base_version",
        "missing" }, "LoRA announce without its base version")
    H.raises(function() wire.encode({ t = "weight_announce", version = 5, n_params = 10, chunk = 16, crc = 7,
        config = "{}", lora_base_version = 4 }) end, { "weight_announce.lora_rank", "missing" },
        "an adapter field without the rank")
    H.raises(function() wire.encode({ t = "weight_announce", version = 5, n_params = 10, chunk = 16, crc = 7,
        config = "{}" }, { lora_masks = { 1 } }) end, "lora_masks (frame) does not survive",
        "a lora_masks frame in a plain announce")
    -- the chunk CRC is computed when absent
    dec = wire.decode(wire.encode(MESSAGES[7][1]))
    H.eq(dec.crc, wire.crc32("\0\1\2\3\4\5\6\7"), "weight_chunk: crc computed by encode")
    -- frames may sit in msg itself, and prompt_len defaults to the prompt's length
    dec = wire.decode(wire.encode({ t = "task", task_id = 1, policy = 1, max_new_tokens = 4, prompt = { 1, 2 } }))
    H.eq(dec.prompt_len, 2, "task: prompt_len from the prompt")
    H.eq(dec.temperature, 1, "task: temperature default")
    H.eq(dec.n, 1, "task: n default")
    -- tensors as frames
    dec = wire.decode(wire.encode({ t = "task", task_id = 1, policy = 1, max_new_tokens = 4 },
        { prompt = ds4.tensor({ 3, 4, 5 }, "I32") }))
    H.same(dec.prompt, { 3, 4, 5 }, "task: an I32 tensor as the prompt")
    H.raises(function() wire.encode({ t = "task", task_id = 1, policy = 1, max_new_tokens = 4 },
        { prompt = ds4.tensor({ 3, 4, 5 }) }) end, "task.prompt: a tensor of dtype F32", "tensor of the wrong dtype")
end

do -- encode errors name the field
    local base = function() return { t = "task", task_id = 1, policy = 1, max_new_tokens = 4, prompt = { 1 } } end
    local m = base(); m.attempt = -1
    H.raises(function() wire.encode(m) end, { "ds4.wire.encode", "task.attempt" }, "negative attempt")
    m = base(); m.bogus = 1
    H.raises(function() wire.encode(m) end, { "task: unknown field 'bogus'" }, "unknown field")
    m = base(); m.policy = nil
    H.raises(function() wire.encode(m) end, { "task.policy", "missing" }, "missing field")
    m = base(); m.top_p = 2
    H.raises(function() wire.encode(m) end, { "ds4.wire.encode", "top_p" }, "out of range: the codec's check")
    m = base(); m.prompt = { 1.5 }
    H.raises(function() wire.encode(m) end, { "task.prompt", "element 1" }, "non-integer token")
    m = base(); m.prompt = nil
    H.raises(function() wire.encode(m) end, { "task.prompt", "missing raw frame" }, "missing frame")
    H.raises(function() wire.encode(base(), { tokens = {} }) end, "unknown frame tokens", "frame of another type")
    H.raises(function() wire.encode({ t = "nope" }) end, "msg.t must name a message type", "unknown type")
    H.raises(function() wire.encode({ t = "credit", n = 1, v = 1 }) end, "credit.v", "wrong version")
    H.raises(function() wire.encode({ t = "samples", task_id = 1, policy = 1,
        seq = { { prompt_len = 1, n_gen = 1, finish = "bogus" } }, tokens = { 1 }, logprobs = { 0 },
        sample_logprobs = { 0 } }) end, "samples.seq[1].finish", "bad finish name")
    H.raises(function() wire.encode({ t = "error", code = "nope" }) end, "error.code", "bad code name")
end

do -- decode never raises on bad input; it says what is wrong
    local function bad(frames, want_code, what)
        local ok, dec, code, msg = pcall(wire.decode, frames)
        H.check(ok, what .. ": decode raised " .. tostring(dec))
        H.eq(dec, nil, what .. ": nil")
        if want_code then H.eq(code, want_code, what .. ": code") end
        H.check(type(msg) == "string" and #msg > 0, what .. ": a message")
    end
    bad({ "garbage" }, "not_map", "garbage")
    bad({ "" }, nil, "empty header")
    bad({}, "frame", "no frames")
    bad({ "\129\161v\1" }, "version", "version 1") -- {"v": 1}: a peer of protocol version 1
    bad({ "\129\161v\2" }, "version", "version 2") -- {"v": 2}: a peer of protocol version 2 (no stop strings)
    bad({ "\129\161v\3" }, "version", "version 3") -- {"v": 3}: a peer of protocol version 3 (no LoRA policies)
    bad({ "\222\255\255" }, nil, "truncated map")
    local task = wire.encode({ t = "task", task_id = 1, policy = 1, max_new_tokens = 4, prompt = { 1, 2 } })
    bad({ task[1] }, "frame", "task without its frame")
    bad({ task[1], "\1\0\0" }, "frame", "task frame not a multiple of 4")
    local many = {}
    for i = 1, 17 do many[i] = "x" end
    bad(many, "limit", "17 frames")
    local dec, code, msg, ref_t = wire.decode({ task[1], "\1\0\0\0" })
    H.eq(ref_t, "task", "a failed decode still names the type it understood")
    -- limits
    local two = wire.encode(MESSAGES[4][1], MESSAGES[4][2])
    dec, code = wire.decode(two, { max_samples = 1 })
    H.eq(code, "limit", "a lower limit refuses what the defaults accept")
    H.raises(function() wire.decode(two, { max_bogus = 1 }) end, "unknown limit", "unknown limit")
    H.raises(function() wire.decode({ 5 }) end, "frames[1] is a number", "non-string frame: the caller's bug")
    H.eq(wire.default_limits().max_samples, 64, "default_limits")
end

do -- helpers
    H.eq(wire.crc32("123456789"), 0xCBF43926, "crc32 check value")
    H.eq(wire.crc32("6789", wire.crc32("12345")), 0xCBF43926, "crc32 continues from a previous value")
    local frames = wire.error_message("state", "unknown worker: send hello", "credit", 7, 2)
    local dec = wire.decode(frames)
    H.eq(dec.t, "error", "error_message: type")
    H.eq(dec.code, wire.codes.state, "error_message: code")
    H.eq(dec.reason, "unknown worker: send hello", "error_message: reason")
    H.eq(dec.ref_t, "credit", "error_message: ref_t")
    H.eq(dec.ref_id, 7, "error_message: ref_id")
    H.eq(dec.ref_n, 2, "error_message: ref_n")
    dec = wire.decode(wire.error_message("parse", string.rep("x", 1000)))
    H.eq(#dec.reason, 256, "error_message cuts a long reason to 256 bytes")
    H.eq(wire.code_name(33), "stale", "code_name")
    H.eq(wire.VERSION, 6, "wire.VERSION")
end

d2:close() -- r2 stays open for lua_close
H.done("test_zmq")
