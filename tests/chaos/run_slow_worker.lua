-- run_slow_worker.lua — an honest `ds4 worker` (ds4.rollout.worker, the same loop) that is `factor` times slower: after
-- each decode step of its continuous batcher it sleeps (factor - 1) times what the step took, so its tokens per
-- second are 1/factor of an equal worker's while it still reads the trainer and sends heartbeats between steps. Not
-- itself a test: tests/chaos/test_async_faults.sh starts it.
--   ds4 run tests/chaos/run_slow_worker.lua ENDPOINT ID FIXTURES_DIR FACTOR
local ds4 = require("ds4")
local ffi = require("ffi")
local codec = require("ds4.rollout.codec")
local worker = require("ds4.rollout.worker")

local ep, id, fix, factor = arg[1], arg[2], arg[3], tonumber(arg[4] or 10)
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
ds4.set_threads(1)
-- one task at a time (credits 1): the test's other workers must take the rest
local w = worker.new{ connect = ep, model = ds4.load(fix .. "/tiny_a"), id = id, silence_s = 2, give_up_s = 600,
    verbose = true, credits = 1 }
local decode, busy, slept = w.decode, 0, 0
function w:decode()
    local t0 = codec.now()
    decode(self)
    local dt = codec.now() - t0
    busy = busy + dt
    local ms = math.floor((factor - 1) * dt * 1000 + 0.5)
    if ms > 0 then
        ffi.C.poll(nil, 0, ms)
        slept = slept + ms / 1000
    end
end
local status = w:run()
io.stderr:write(("slow worker %s: decoding %.3f s, slept %.3f s\n"):format(id, busy, slept))
os.exit(status)
