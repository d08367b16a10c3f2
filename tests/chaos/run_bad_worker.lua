-- run_bad_worker.lua — one tests/chaos/bad_worker.lua over ZeroMQ (a DEALER on the trainer's endpoint), until the
-- trainer says bye or `seconds` pass. Not itself a test: tests/chaos/test_bad_workers.sh starts it.
--   ds4 run tests/chaos/run_bad_worker.lua ENDPOINT MODE ID FIXTURES_DIR [SECONDS]
local dir = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = dir .. "/?.lua;" .. package.path
local ds4 = require("ds4")
local ffi = require("ffi")
local codec = require("ds4.rollout.codec")
local bad = require("bad_worker")

local ep, mode, id, fix, seconds = arg[1], arg[2], arg[3], arg[4], tonumber(arg[5] or 120)
local model = ds4.load(fix .. "/tiny_a") -- for the vocabulary and parameter count its hello must match
local s = ds4.zmq.socket("DEALER")
s:set{ routing_id = id, linger = 0, sndhwm = 1000, rcvhwm = 1000 }
s:connect(ep)
local transport = {
    send = function(_, frames) return s:send(frames, { timeout = 1000 }) end,
    recv = function() return s:recv(0) end,
}
local w = bad.new(mode, id, transport, { vocab = model:config().vocab_size, n_params = model:n_params(),
    clock = codec.now })
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
local t0 = codec.now()
while not w.bye and codec.now() - t0 < seconds do
    w:step()
    ffi.C.poll(nil, 0, 10)
end
print(("bad worker %s (%s): %d tasks taken"):format(id, mode, w.tasks))
s:close()
