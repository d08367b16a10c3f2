-- test_device.lua — where models compute, from Lua: ds4.load / new_model / random_model options, model:to,
-- model:device, ds4.set_device, ds4.cuda_devices, ds4.profile and model:profile.
-- Usage: ds4 run tests/lua/test_device.lua <fixtures_dir>
--
-- Part 1 runs everywhere: spellings and their errors, the CPU as the default, a failed move that leaves the model
-- usable where it was (on a machine without a GPU: "no CUDA device here" or "no CUDA backend"), the profile.
-- Part 2 runs where ds4.cuda_devices() > 0 (scripts/gpu.sh runs it on a GPU machine; CI has none), each fixture
-- in fp32 and bf16, against the CPU model as the reference:
--   logits: fp32 max |diff| <= 1e-4 * max(1, max |ref|) (test_forward.lua's bound: two fp32 summation orders);
--           bf16 <= 2 e_w + 1e-2 max(1, max |ref|), where e_w is how far the CPU moves when only the weights that
--           the GPU holds in bf16 are rounded to bf16 (measured here, as tests/test_cuda_model.c does): bf16 mode
--           also rounds the GEMMs' activation inputs, an error of the same relative size (2^-9), hence twice;
--           1e-2 covers fp32 accumulation. On these random inputs a rounding can flip a routing choice, so e_w
--           ranges from 0.014 (tiny_hf) to 0.62 (tiny_b); a wrong op would not follow the CPU's own flips.
--   batch invariance, bitwise: a sequence alone == row 0 of a batch with another, == model:step in chunks.
--   generation: greedy ids in fp32 equal the CPU's; the rollout's logprobs equal log-softmax (double, here) of
--           the same device's forward logits within 1e-5 (test_generate.lua's bound).
--   moves: cuda -> cpu gives the CPU's logits bitwise (the host fp32 master copy is untouched); a cache made
--           before a move is refused.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")

local fixtures = H.fixtures()

-- ------------------------------------------------------------------------------------------------ helpers

local function lcg(seed)
    local s = seed
    return function(lo, hi)
        s = (s * 16807) % 2147483647
        return lo + s % (hi - lo)
    end
end

local function random_rows(B, S, V, seed)
    local r, rows = lcg(seed), {}
    for b = 1, B do
        rows[b] = {}
        for s = 1, S do rows[b][s] = r(2, V) end
    end
    return rows
end

local max_diff = H.max_diff

-- Count of elements that are not bitwise equal (NaN never equals).
local function n_diff(a, b, a0, b0, n)
    local c = 0
    for i = 1, n do
        if a[a0 + i] ~= b[b0 + i] then c = c + 1 end
    end
    return c
end

local function log_softmax_at(logits, row0, V, id)
    local m = -math.huge
    for v = 1, V do m = math.max(m, logits[row0 + v]) end
    local s = 0
    for v = 1, V do s = s + math.exp(logits[row0 + v] - m) end
    return logits[row0 + id + 1] - m - math.log(s)
end

-- The CPU model from `dir` with the weights that a bf16 device holds in bf16 (ds4_param_lowp: 2-D fp32 matrices except
-- the mHC mixing "_fn", the position biases ".ape", the router gate and tid2eid) rounded to bf16.
local function cpu_bf16_weights(dir)
    local m = ds4.load(dir)
    local t = m:tensors()
    m:free()
    for k, v in pairs(t) do
        local low = v:ndim() == 2 and v:dtype() == "F32"
        for _, s in ipairs({ "_fn", ".ape", "ffn.gate.weight", "tid2eid" }) do
            if k:sub(-#s) == s then low = false end
        end
        if low then t[k] = v:to("BF16"):to("F32") end
    end
    local tmp = H.make_temp_dir()
    local ok = os.execute("cp " .. H.shell_quote(dir .. "/config.json") .. " " .. H.shell_quote(tmp))
    assert(ok == 0 or ok == true, "cannot copy " .. dir .. "/config.json")
    ds4.save_tensors(tmp .. "/model.safetensors", t)
    local mw = ds4.load(tmp)
    os.execute("rm -r " .. H.shell_quote(tmp))
    return mw
end

-- ------------------------------------------------------------------------------------------------ part 1

H.eq(ds4.device(), "cpu", "default device")
local ncuda = ds4.cuda_devices()
H.check(type(ncuda) == "number" and ncuda >= 0 and ncuda == math.floor(ncuda), "cuda_devices: a count")

H.raises(function() ds4.set_device("tpu") end, { "ds4.set_device", "'tpu'", "cpu, cuda or cuda:N" }, "unknown device")
H.raises(function() ds4.set_device("cuda:x") end, { "index after cuda:" }, "bad index")
H.raises(function() ds4.set_device("cpu", "bf16") end, { "fp32 only" }, "bf16 on the CPU")
H.raises(function() ds4.set_device("cuda", "fp16") end, { "fp32 or bf16" }, "unknown dtype")
H.raises(function() ds4.set_device("cuda:0 bf16", "fp32") end, { "two different dtypes" }, "dtype twice")
H.raises(function() ds4.set_device(3) end, { "device expected as a string" }, "device type")
ds4.set_device("cuda:3", "fp32")
H.eq(ds4.device(), "cuda:3 fp32", "set_device cuda:3 fp32")
ds4.set_device("GPU")
H.eq(ds4.device(), "cuda:0 bf16", "gpu means cuda:0, bf16 by default")
ds4.set_device("cuda:1 FP32")
H.eq(ds4.device(), "cuda:1 fp32", "dtype inside the spelling")
ds4.set_device("cpu")
H.eq(ds4.device(), "cpu", "back to the cpu")

local dir = fixtures .. "/tiny_a"
local cpu = ds4.load(dir)
local dev, dt = cpu:device()
H.eq(dev, "cpu", "a loaded model is on the cpu")
H.eq(dt, "fp32", "cpu dtype")
H.check(cpu:to("cpu") == cpu, "to(cpu) on the cpu returns the model")
H.raises(function() cpu:to("cpu", "bf16") end, { "ds4.model:to", "fp32 only" }, "to cpu bf16")
H.raises(function() cpu:to({}) end, { "names no device" }, "to{}")
H.raises(function() cpu:to("tpu") end, { "'tpu'" }, "to tpu")
H.raises(function() ds4.load(dir, { device = "cuda:x" }) end, { "ds4.load", "index after cuda:" }, "load bad device")
H.raises(function() ds4.load(dir, 5) end, { "ds4.load", "options table expected" }, "load bad options")
H.raises(function() ds4.random_model(dir .. "/config.json", { seed = -1 }) end, { "non-negative integer seed" },
    "random_model seed")
local cfg_table = cpu:config()

local ids = random_rows(2, 37, cfg_table.vocab_size, 7)
local ref = cpu:forward(ids).logits

if ncuda == 0 then
    -- A move that cannot be made says why, and the model stays usable on the CPU.
    local why = { "cuda:0" }
    local err = H.raises(function() cpu:to("cuda") end, why, "to cuda without a GPU")
    H.check(err and (err:find("no CUDA device here", 1, true) or err:find("no CUDA backend", 1, true)),
        "to cuda without a GPU: the reason: " .. tostring(err))
    H.raises(function() ds4.load(dir, { device = "cuda" }) end, { "ds4.load", "cuda:0" }, "load on cuda")
    H.raises(function() ds4.new_model(cfg_table, { device = "cuda", seed = 1 }) end, { "ds4.new_model", "cuda:0" },
        "new_model on cuda")
    H.eq(cpu:device(), "cpu", "still on the cpu")
    local d = max_diff(cpu:forward(ids).logits, ref)
    H.eq(d, 0, "forward after a failed move: same logits")
end

-- The profile: off by default, then per op with the backend named; a reset empties it.
H.eq(ds4.profile(), false, "profile off by default")
H.check(cpu:profile():find("off", 1, true), "profile report when off")
H.eq(ds4.profile(true), false, "profile(true) returns the previous state")
cpu:forward(ids)
local rep = cpu:profile(true)
H.check(rep:find("matmul", 1, true) and rep:find("cpu backend", 1, true), "profile report:\n" .. rep)
H.check(not cpu:profile():find("matmul", 1, true), "profile reset")
H.eq(ds4.profile(false), true, "profile(false)")

-- the CPU's emulation of the bf16 mode: it moves the logits (by about bf16's relative precision, 2^-8, of their size:
-- the tiny_hf fixture is not chaotic), and off again gives fp32's bits
do
    local m = ds4.load(fixtures .. "/tiny_hf")
    local rows = random_rows(2, 17, m:config().vocab_size, 5)
    local ref = m:forward(rows).logits
    H.eq(m:bf16_emulation(), false, "bf16 emulation off by default")
    m:set_bf16_emulation(true)
    local d, mx = max_diff(m:forward(rows).logits, ref)
    H.check(d > 0 and d < 0.05 * math.max(1, mx), ("bf16 emulation moves tiny_hf's logits by %.3g (max %.3g)"):format(d, mx))
    m:set_bf16_emulation(false)
    H.eq(max_diff(m:forward(rows).logits, ref), 0, "emulation off: fp32's bits again")
    -- and its backward (the linear products' and the attention's key gradients' operands rounded): the gradients
    -- within bf16's reach of fp32's (relative Frobenius over all of them 0.008 on this fixture, about two roundings of
    -- 2^-9; the bound 0.05 is far below the O(1) of a wrong term), and the attention's key projections' moved (their
    -- gradients come through the key gradients)
    local function grads_of(emulate)
        m:set_bf16_emulation(emulate)
        m:zero_grad()
        m:forward({ rows[1] }, { labels = rows[1] })
        m:backward()
        return m:grads()
    end
    local g32, g16 = grads_of(false), grads_of(true)
    m:set_bf16_emulation(false)
    local num, den, moved, nkv = 0, 0, 0, 0
    for k, t in pairs(g32) do
        local u = g16[k]
        for i = 1, t:numel() do
            num, den = num + (u[i] - t[i]) ^ 2, den + t[i] ^ 2
        end
        if k:find("self_attn.kv_proj.weight", 1, true) then
            nkv = nkv + 1
            if max_diff(u, t) > 0 then moved = moved + 1 end
        end
    end
    local rel = math.sqrt(num / den)
    H.check(rel > 0 and rel < 0.05, ("bf16 emulation's gradients: relative Frobenius %.3g from fp32's"):format(rel))
    H.check(nkv > 0 and moved == nkv, ("bf16 emulation moved %d of %d key projections' gradients"):format(moved, nkv))
    H.raises(function() m:set_bf16_emulation(1) end, { "set_bf16_emulation", "boolean" }, "emulation: a boolean")
    m:free()
end

-- ------------------------------------------------------------------------------------------------ part 2

if ncuda == 0 then
    print("test_device: no CUDA device here: the GPU part is skipped")
    H.done("test_device")
    return
end

for _, name in ipairs({ "tiny_a", "tiny_b", "tiny_hf" }) do
    local fdir = fixtures .. "/" .. name
    local m_cpu = ds4.load(fdir)
    local cfg = m_cpu:config()
    local V = cfg.vocab_size
    local S = 41
    local rows = random_rows(2, S, V, 11)
    local one = { rows[1] }
    local ref_logits = m_cpu:forward(rows).logits
    -- what bf16 itself moves the logits by: the CPU's emulation of the bf16 mode (weights rounded, every product's
    -- operands rounded where the mode rounds them) against fp32. The GPU's bf16 logits differ from the emulation's by
    -- fp32 summation orders only, so they lie within about that distance of fp32 (the bound below takes twice it);
    -- chaotic models (tiny_a: a SwiGLU clamp and top-3 indexer picks) move by discrete steps there.
    local emu = cpu_bf16_weights(fdir)
    emu:set_bf16_emulation(true)
    H.eq(emu:bf16_emulation(), true, name .. ": bf16 emulation on")
    local emu_logits = emu:forward(rows).logits
    local e_w = max_diff(emu_logits, ref_logits)
    local prompt = { 5, 9, 2, 7, 3, 8, 4 }
    local ref_gen = m_cpu:generate({ prompt }, { max_new_tokens = 12, temperature = 0, ignore_eos = true })[1]
    for _, dtype in ipairs({ "fp32", "bf16" }) do
        local what = name .. " " .. dtype
        local m = ds4.load(fdir, { device = "cuda", dtype = dtype })
        H.raises(function() m:set_bf16_emulation(true) end, { "on the CPU only" }, what .. ": emulation on a GPU")
        local d1, d2 = m:device()
        H.eq(d1, "cuda:0", what .. ": device")
        H.eq(d2, dtype, what .. ": dtype")
        local lg = m:forward(rows).logits
        H.eq(lg:dtype(), "F32", what .. ": host F32 logits")
        local d, mx = max_diff(lg, ref_logits)
        local tol = dtype == "fp32" and 1e-4 * math.max(1, mx) or 2 * e_w + 1e-2 * math.max(1, mx)
        H.check(d <= tol, ("%s: logits max |diff| %.3g > %.3g"):format(what, d, tol))
        print(("test_device: %s logits vs cpu: max |diff| %.3g (bound %.3g; the cpu's bf16 emulation: %.3g%s)"):format(
            what, d, tol, e_w, dtype == "bf16" and (", gpu vs emulation %.3g"):format(max_diff(lg, emu_logits)) or ""))

        -- batch invariance: alone == row 0 of the batch == stepped in chunks
        local alone = m:forward(one).logits
        H.eq(n_diff(alone, lg, 0, 0, S * V), 0, what .. ": alone vs in a batch, elements not bitwise equal")
        local c = m:new_cache(64)
        local at = 0
        for _, k in ipairs({ 5, 1, 3, 17, 15 }) do
            local chunk = {}
            for i = 1, k do chunk[i] = rows[1][at + i] end
            local st = m:step(c, chunk, { logits = "all" }).logits
            H.eq(n_diff(st, alone, 0, at * V, k * V), 0, ("%s: step chunk at %d, not bitwise equal"):format(what, at))
            at = at + k
        end

        -- generation: the rollout's logprobs against a forward over prompt .. generated, on this device
        local g = m:generate({ prompt }, { max_new_tokens = 12, temperature = 0, ignore_eos = true })[1]
        if dtype == "fp32" then H.same(g.ids, ref_gen.ids, what .. ": greedy ids equal the cpu's") end
        local full = {}
        for i, v in ipairs(prompt) do full[i] = v end
        for i, v in ipairs(g.ids) do full[#prompt + i] = v end
        local fl = m:forward({ full }).logits
        local worst = 0
        for i, id in ipairs(g.ids) do
            local lp = log_softmax_at(fl, (#prompt + i - 2) * V, V, id)
            worst = math.max(worst, math.abs(lp - g.logprobs[i]))
            if worst ~= worst then worst = math.huge end
        end
        H.check(worst <= 1e-5, ("%s: generate logprobs vs forward: max |diff| %.3g"):format(what, worst))

        -- profile on the device
        ds4.profile(true)
        m:forward(one)
        local p = m:profile(true)
        H.check(p:find("cuda backend", 1, true) and p:find("matmul", 1, true), what .. ": cuda profile:\n" .. p)
        ds4.profile(false)

        -- back to the CPU: the host master copy is the CPU model's
        local cache = m:new_cache(16)
        H.check(m:to("cpu") == m, what .. ": to(cpu) returns the model")
        H.eq(m:device(), "cpu", what .. ": on the cpu")
        H.eq(n_diff(m:forward(rows).logits, ref_logits, 0, 0, 2 * S * V), 0, what .. ": cpu after the gpu")
        H.raises(function() m:step(cache, { 1, 2 }) end, {}, what .. ": a cache of the old device")
        m:to("cuda", dtype == "fp32" and "bf16" or "fp32")
        local _, back = m:device()
        H.check(back ~= dtype, what .. ": to another dtype")
        m:free()
    end
end

-- new_model / random_model on the device, and the default of ds4.set_device
ds4.set_device("cuda", "fp32")
local m = ds4.random_model(fixtures .. "/tiny_b/config.json", 3)
H.eq(m:device(), "cuda:0", "random_model follows set_device")
local m2 = ds4.new_model(m:config(), { seed = 3, device = "cpu" })
H.eq(m2:device(), "cpu", "an explicit device wins over set_device")
local x = random_rows(1, 9, m:config().vocab_size, 5)
local d = max_diff(m:forward(x).logits, m2:forward(x).logits)
H.check(d <= 1e-4, ("random_model on cuda vs new_model on cpu, same seed: max |diff| %.3g"):format(d))
ds4.set_device("cpu")
H.raises(function() m:to("cuda:" .. ncuda) end, { "cuda:" .. ncuda, "CUDA device" }, "a device that is not there")
H.eq(m:device(), "cuda:0", "still on cuda:0 after the failed move")

H.done("test_device")
