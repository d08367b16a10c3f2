-- test_train.lua — training from Lua: model:zero_grad / forward (training) / backward / grads and ds4.adamw.
-- Usage: ds4 run tests/lua/test_train.lua <fixtures_dir>
--
-- 1. The 10-step trajectory of tests/fixtures/tiny_a/train.safetensors (tests/gen_fixtures.py train_fixture:
--    torch AdamW lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 except norms/biases/sinks/mHC base+scale,
--    clip_grad_norm_ 1.0, LambdaLR warm-up 3 then cosine to 0.1 at step 10), driven exactly as the issue's
--    contract: zero_grad, forward with labels, backward, step. Bounds as tests/test_train.c: losses 1e-5
--    relative, pre-clip gradient norms 1e-4 relative, learning rates 1e-15 relative (same double formula).
-- 2. The API surface: grads() is keyed and shaped like the checkpoint file (packed HF experts included);
--    grads({canonical = true}) like the fp32 part of model:tensors(); zero_grad zeroes;
--    grads() holds the backward's gradient (spot-checked against torch autograd in grads.safetensors, and
--    the norm opt:step() reports equals the norm of grads() summed here); errors via pcall with messages;
--    model:memory()'s tape and workspaces.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local fixtures = H.fixtures()
local dir = fixtures .. "/tiny_a"
local io_t = ds4.load_tensors(dir .. "/io.safetensors")
local ids, labels = io_t.input_ids, io_t.labels

local function fixture_opts()
    return { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0, schedule = "cosine",
        warmup = 3, total = 10, min_lr_ratio = 0.1 }
end

local function rel(got, want) return math.abs(got - want) / math.abs(want) end
-- ‖a − r‖ / ‖r‖ over two tensors of equal size (Frobenius norms)
local function rel_frob(a, r)
    local dd, rr = 0, 0
    for i = 1, r:numel() do
        dd = dd + (a[i] - r[i]) ^ 2
        rr = rr + r[i] ^ 2
    end
    return math.sqrt(dd) / math.sqrt(rr)
end

-- Sum of squares of an F32 tensor, in double (through FFI: no per-element binding calls).
local function sumsq(t)
    local p = ffi.cast("const float *", t:data_ptr())
    local s = 0
    for i = 0, t:numel() - 1 do s = s + p[i] * p[i] end
    return s
end

-- ------------------------------------------------------------------------------------------------ trajectory
do
    local ref = ds4.load_tensors(dir .. "/train.safetensors")
    local model = ds4.load(dir)
    local opt = ds4.adamw(model, fixture_opts())
    local worst_loss, worst_norm = 0, 0
    for k = 0, 10 do
        local out
        if k < 10 then
            model:zero_grad()
            out = model:forward(ids, { labels = labels })
        else
            out = model:forward(ids, { labels = labels, train = false })
        end
        local want = ref.loss[k + 1]
        local e = rel(out.loss, want)
        worst_loss = math.max(worst_loss, e)
        H.check(e <= 1e-5, ("loss %d: %.9g vs torch %.9g (rel %.3g)"):format(k, out.loss, want, e))
        if k == 10 then break end
        H.near(opt:lr(), ref.lr[k + 1], 1e-15 * ref.lr[k + 1], "opt:lr() before step " .. k)
        model:backward()
        local st = opt:step()
        e = rel(st.grad_norm, ref.grad_norm[k + 1])
        worst_norm = math.max(worst_norm, e)
        H.check(e <= 1e-4, ("grad norm %d: %.9g vs torch %.9g (rel %.3g)"):format(k, st.grad_norm,
            ref.grad_norm[k + 1], e))
        H.near(st.lr, ref.lr[k + 1], 1e-15 * ref.lr[k + 1], "lr of step " .. k)
        H.eq(st.step, k + 1, "stats.step")
        H.eq(opt:steps(), k + 1, "opt:steps()")
    end
    io.write(("trajectory: losses max rel err %.3g (bound 1e-5), grad norms max rel err %.3g (bound 1e-4)\n")
        :format(worst_loss, worst_norm))
    H.check(tostring(opt):find("ds4.adamw (lr 0.001, cosine schedule, 10 steps done)", 1, true) ~= nil,
        "tostring(opt): " .. tostring(opt))
    model:free()
    -- The optimizer outlives the model object but not its use.
    H.raises(function() return opt:step() end, { "ds4.adamw:step", "model has been freed" }, "step after model:free()")
    H.raises(function() return opt:lr() end, { "model has been freed" }, "lr after model:free()")
    opt:free()
    H.raises(function() return opt:step() end, { "optimizer has been freed" }, "step after opt:free()")
    opt:free() -- twice is harmless
end

-- ------------------------------------------------------------------------------------------------ API surface
do
    local model = ds4.load(dir)
    local opt = ds4.adamw(model, { lr = 1e-3, clip = 1.0 })
    H.raises(function() return model:grads() end, { "ds4.model:grads", "not enabled", "zero_grad" },
        "grads before zero_grad")
    H.raises(function() return opt:step() end, { "ds4.adamw:step", "no gradient buffer" }, "step without gradients")
    H.eq(opt:steps(), 0, "failed step is not counted")
    H.raises(function() return model:backward() end, { "ds4.model:backward", "no training forward" },
        "backward before any forward")
    -- Without gradients enabled, a forward with labels is an inference forward: still nothing to differentiate.
    model:forward(ids, { labels = labels })
    H.raises(function() return model:backward() end, { "no training forward" }, "backward after inference forward")

    model:zero_grad()
    -- grads() is keyed like the checkpoint file itself (tiny_a: save_pretrained spelling plus mtp.*): the
    -- file's own names and shapes are the reference, integer tables excepted
    local file = ds4.load_tensors(dir)
    local gf = model:grads()
    local n_file = 0
    for name, t in pairs(file) do
        if t:dtype() == "I64" then
            H.eq(gf[name], nil, name .. " (an integer table) has no gradient")
        else
            n_file = n_file + 1
            if H.check(gf[name] ~= nil, "grads() lacks the checkpoint's " .. name) then
                H.same(gf[name]:shape(), t:shape(), name .. " gradient shape (file spelling)")
            end
        end
    end
    local n_gf = 0
    for _ in pairs(gf) do n_gf = n_gf + 1 end
    H.eq(n_gf, n_file, "grads() has exactly the checkpoint's fp32 tensors")
    -- {canonical = true}: the names of model:tensors()
    local g = model:grads({ canonical = true })
    local tensors = model:tensors()
    local n_grads, n_f32 = 0, 0
    for name, t in pairs(tensors) do
        if t:dtype() == "F32" then
            n_f32 = n_f32 + 1
            local gt = g[name]
            if H.check(gt ~= nil, "grads() lacks " .. name) then
                H.same(gt:shape(), t:shape(), name .. " gradient shape")
                H.eq(gt:dtype(), "F32", name .. " gradient dtype")
            end
        else
            H.eq(g[name], nil, name .. " (an integer table) has no gradient")
        end
    end
    local nonzero = 0
    for name, t in pairs(g) do
        n_grads = n_grads + 1
        H.check(tensors[name] ~= nil, "grads() has " .. name .. ", which model:tensors() lacks")
        if sumsq(t) ~= 0 then nonzero = nonzero + 1 end
    end
    H.eq(n_grads, n_f32, "grads() count = fp32 tensors of model:tensors()")
    H.eq(nonzero, 0, "zero_grad(): every gradient is zero")

    -- A training forward, then backward: gradients against torch autograd (tiny_a/grads.safetensors holds
    -- "main.<name>" = d(mean CE)/d<name>). Frobenius relative difference within 1e-3, the issue's bound.
    local out = model:forward(ids, { labels = labels })
    H.check(type(out.loss) == "number" and out.loss_tokens > 0, "training forward returns loss and tokens")
    model:backward()
    H.raises(function() return model:backward() end, { "no training forward", "once" }, "second backward")
    g = model:grads({ canonical = true })
    local ref = ds4.load_tensors(dir .. "/grads.safetensors")
    for _, name in ipairs({ "embed.weight", "head.weight", "layers.0.attn.wq_a.weight", "layers.2.ffn.gate.weight",
        "norm.weight", "hc_head_fn" }) do
        local r = ref["main." .. name]
        if H.check(r ~= nil and g[name] ~= nil, name .. " in grads() and the fixture") then
            local d = 0
            local a, b = ffi.cast("const float *", g[name]:data_ptr()), ffi.cast("const float *", r:data_ptr())
            for i = 0, r:numel() - 1 do d = d + (a[i] - b[i]) ^ 2 end
            local e = math.sqrt(d / sumsq(r))
            H.check(e <= 1e-3, ("%s: gradient rel Frobenius diff %.3g vs torch"):format(name, e))
        end
    end
    -- Frozen tensors (the indexer; the router's selection bias) get exactly zero.
    H.eq(sumsq(g["layers.1.attn.indexer.wq_b.weight"]), 0, "indexer gradient is zero")
    H.eq(sumsq(g["layers.2.ffn.gate.bias"]), 0, "router bias gradient is zero")
    -- The pre-clip norm opt:step() reports is the 2-norm of all gradients (frozen ones are zero anyway).
    local total = 0
    for _, t in pairs(g) do total = total + sumsq(t) end
    local st = opt:step()
    H.check(rel(st.grad_norm, math.sqrt(total)) <= 1e-6, ("step norm %.9g vs norm of grads() %.9g"):format(
        st.grad_norm, math.sqrt(total)))
    H.eq(st.step, 1, "first step")
    H.eq(st.lr, 1e-3, "constant schedule lr")

    -- backward(scale): an explicit scale multiplies the gradient; accumulation adds (no zero_grad between).
    model:zero_grad()
    out = model:forward(ids, { labels = labels })
    model:backward(1 / out.loss_tokens)
    local g1 = model:grads({ canonical = true })["layers.0.attn.wkv.weight"]
    out = model:forward(ids, { labels = labels })
    model:backward(2 / out.loss_tokens)
    local g3 = model:grads({ canonical = true })["layers.0.attn.wkv.weight"]
    H.check(math.abs(math.sqrt(sumsq(g3)) / math.sqrt(sumsq(g1)) - 3) <= 1e-5,
        "gradients accumulate: 1x + 2x = 3x the first")
    model:zero_grad()
    H.eq(sumsq(model:grads({ canonical = true })["layers.0.attn.wkv.weight"]), 0, "zero_grad clears accumulated gradients")

    -- opts.zero_grad: a step leaves every gradient zero
    local zopt = ds4.adamw(model, { lr = 1e-3, clip = 1.0, zero_grad = true })
    out = model:forward(ids, { labels = labels })
    model:backward()
    H.check(sumsq(model:grads({ canonical = true })["layers.0.attn.wkv.weight"]) > 0, "a backward before the step")
    zopt:step()
    local left = 0
    for _, t in pairs(model:grads({ canonical = true })) do left = left + sumsq(t) end
    H.eq(left, 0, "adamw{zero_grad = true}: the step leaves every gradient zero")
    H.raises(function() return ds4.adamw(model, { zero_grad = 1 }) end, { "zero_grad" }, "zero_grad must be a boolean")

    -- opts.train
    out = model:forward(ids, { labels = labels, train = false })
    H.raises(function() return model:backward() end, { "no training forward" }, "train = false keeps no activations")
    H.raises(function() return model:forward(ids, { train = true }) end, { "opts.train = true needs opts.labels" },
        "train without labels")
    H.raises(function() return model:forward(ids, { labels = labels, train = 1 }) end,
        { "opts.train must be a boolean" }, "non-boolean train")
    H.raises(function() return model:backward("x") end, { "scale number expected" }, "non-number scale")
    out = model:forward(ids, { labels = labels, train = true })
    H.raises(function() return model:backward(0 / 0) end, { "not finite" }, "NaN scale")
    model:backward()

    -- opts.train = true on a model without gradients enables them.
    local m2 = ds4.load(dir)
    m2:forward(ids, { labels = labels, train = true })
    m2:backward()
    H.check(sumsq(m2:grads({ canonical = true })["head.weight"]) > 0, "train = true enables gradients")
    -- All labels ignored: no default scale.
    local none = ds4.zeros(labels:shape(), "I64")
    for i = 1, none:numel() do none[i] = -100 end
    out = m2:forward(ids, { labels = none, train = true })
    H.eq(out.loss_tokens, 0, "no scored token")
    H.raises(function() return m2:backward() end, { "scored no token", "explicit scale" }, "backward of zero tokens")
    m2:free()

    -- ds4.adamw option errors.
    local function bad(opts, needles, what)
        H.raises(function() return ds4.adamw(model, opts) end, needles, what)
    end
    bad({ lr = 1e-3, weight_dacay = 0.1 }, { "ds4.adamw", "unknown option 'weight_dacay'" }, "misspelt option")
    bad({ [1] = 2 }, { "unknown option 1 (known: lr, betas," }, "positional option")
    bad({ betas = { 0.9 } }, { "opts.betas must be a table of two numbers" }, "one beta")
    bad({ betas = { 0.9, "x" } }, { "opts.betas[2] must be a number" }, "string beta")
    bad({ betas = { 0.9, 1.0 } }, { "ds4.adamw", "betas", "[0, 1)" }, "beta2 = 1")
    bad({ lr = "big" }, { "opts.lr must be a number" }, "string lr")
    bad({ lr = -1 }, { "ds4.adamw", "lr = -1" }, "negative lr")
    bad({ schedule = "step" }, { "opts.schedule must be \"constant\", \"linear\" or \"cosine\", got \"step\"" },
        "unknown schedule")
    bad({ schedule = "cosine", warmup = 5, total = 5 }, { "total_steps (5) must exceed warmup_steps (5)" },
        "cosine without decay steps")
    bad({ warmup = 1.5 }, { "opts.warmup must be an integer" }, "fractional warmup")
    bad({ min_lr_ratio = 2 }, { "min_lr_ratio = 2" }, "min_lr_ratio > 1")
    H.raises(function() return ds4.adamw({}, {}) end, { "ds4.adamw", "ds4.model expected, got table" }, "not a model")
    H.raises(function() return ds4.adamw(model, 5) end, { "options table expected" }, "options not a table")
    H.raises(function() return opt.step(model) end, { "self must be a ds4.adamw" }, "step on a model")

    -- Schedules through the binding: linear warm-up 2, decay to 0 at 6 (values by hand).
    local o2 = ds4.adamw(model, { lr = 4, schedule = "linear", warmup = 2, total = 6 })
    H.eq(o2:lr(), 2, "linear: lr before step 0")
    local lrs = {}
    for _ = 1, 7 do
        model:zero_grad()
        lrs[#lrs + 1] = o2:step().lr
    end
    H.same(lrs, { 2, 4, 4, 3, 2, 1, 0 }, "linear schedule")
    local o3 = ds4.adamw(model) -- torch defaults, constant
    H.eq(o3:lr(), 1e-3, "default lr")

    model:free()
    H.raises(function() return model:zero_grad() end, { "ds4.model:zero_grad", "model has been freed" },
        "zero_grad after free")
    H.raises(function() return model:grads() end, { "model has been freed" }, "grads after free")
    H.raises(function() return model:backward() end, { "model has been freed" }, "backward after free")
end

-- The per-token RL hook: logprobs against an independent log-softmax of the inference logits (in Lua), and
-- backward_logprobs(-1/N) against torch's gradient of the mean loss (grads.safetensors).
do
    local model = ds4.load(dir)
    local logits = model:forward(ids, { train = false }).logits
    model:zero_grad()
    local out = model:forward(ids, { labels = labels })
    local lp, ent = model:logprobs({ entropy = true })
    H.same(lp:shape(), ids:shape(), "logprobs shape")
    local B, S, V = ids:shape()[1], ids:shape()[2], logits:shape()[3]
    local maxd, maxe, n = 0, 0, 0
    local g = ds4.zeros({ B, S })
    for b = 1, B do
        for s = 1, S do
            local mx = -math.huge
            for v = 1, V do mx = math.max(mx, logits:get(b, s, v)) end
            local se, ez = 0, 0
            for v = 1, V do se = se + math.exp(logits:get(b, s, v) - mx) end
            for v = 1, V do
                local z = logits:get(b, s, v) - mx
                ez = ez + math.exp(z) / se * (z - math.log(se))
            end
            maxe = math.max(maxe, math.abs(ent:get(b, s) + ez))
            local y = s < S and labels:get(b, s + 1) or -100
            if y ~= -100 then
                maxd = math.max(maxd, math.abs(lp:get(b, s) - (logits:get(b, s, y + 1) - mx - math.log(se))))
                n = n + 1
            else
                H.eq(lp:get(b, s), 0, "logp is 0 where unscored")
            end
        end
    end
    H.check(maxd < 1e-5 and maxe < 1e-5, string.format("logprobs max|d| %g, entropy max|d| %g", maxd, maxe))
    H.eq(n, out.loss_tokens, "scored positions")
    for b = 1, B do
        for s = 1, S do
            if lp:get(b, s) ~= 0 then g:set(-1 / n, b, s) end
        end
    end
    model:backward_logprobs(g)
    local ref = ds4.load_tensors(dir .. "/grads.safetensors")
    local got = model:grads({ canonical = true })
    for _, name in ipairs({ "embed.weight", "layers.1.attn.wq_b.weight", "layers.2.hc_ffn_fn", "head.weight" }) do
        H.check(rel_frob(got[name], ref["main." .. name]) < 1e-3, "backward_logprobs gradient of " .. name)
    end
    H.raises(function() return model:backward_logprobs(g) end, { "no training forward" }, "consumed")
    model:forward(ids, { labels = labels })
    H.raises(function() return model:backward_logprobs(ds4.zeros({ 3 })) end, { "F32 tensor of 2 x 37" },
        "gradient shape")
    -- the MTP loss as an option: gradients of loss + 0.3·mtp_loss
    model:set_train_options({ mtp_lambda = 0.3 })
    model:zero_grad()
    local o2 = model:forward(ids, { labels = labels })
    model:backward()
    got = model:grads({ canonical = true })
    for _, name in ipairs({ "mtp.0.e_proj.weight", "mtp.0.attn.wq_a.weight", "layers.3.ffn.gate.weight" }) do
        H.check(rel_frob(got[name], ref["mtp." .. name]) < 1e-3, "MTP-loss gradient of " .. name)
    end
    H.check(o2.loss > out.loss, "the loss includes the MTP term")
    H.raises(function() model:set_train_options({ mtp_lambda = "x" }) end, { "ds4.model:set_train_options: opts.mtp_lambda must be a number, got \"x\"" }, "bad option")
    -- the indexer KL loss: reported, and it (only) reaches the indexer
    model:set_train_options({ indexer_kl = 1.0 })
    model:zero_grad()
    local o3 = model:forward(ids, { labels = labels })
    H.check(type(o3.indexer_loss) == "number" and o3.indexer_loss > 0, "indexer_loss reported")
    model:backward()
    local gi = model:grads({ canonical = true })
    H.check(sumsq(gi["layers.1.attn.indexer.wq_b.weight"]) > 0, "the indexer gets a gradient")
    -- per-block recomputation: the same gradients, bit for bit (test_backward.c checks every mode)
    model:set_train_options({ indexer_kl = 1.0, recompute = true })
    model:zero_grad()
    local o4 = model:forward(ids, { labels = labels })
    model:backward()
    local gr = model:grads({ canonical = true })
    H.eq(o4.loss, o3.loss, "recompute: the same loss")
    for _, name in ipairs({ "embed.weight", "layers.1.attn.indexer.wq_b.weight", "layers.2.hc_ffn_fn" }) do
        H.eq(rel_frob(gr[name], gi[name]), 0, "recompute: the same gradient of " .. name)
    end
    H.raises(function() model:set_train_options({ recompute = 1 }) end, { "opts.recompute must be a boolean, got 1" }, "recompute is a boolean")
    model:set_train_options({})
    model:zero_grad()
    H.eq(model:forward(ids, { labels = labels }).indexer_loss, nil, "no indexer_loss without the option")
    model:free()
end

-- HF module names (tiny_hf): grads() returns the packed experts the way the checkpoint stores them; each
-- expert's w1 / w3 rows and down slice match torch's per-expert gradients (grads.safetensors, canonical names).
do
    local hdir = fixtures .. "/tiny_hf"
    local hio = ds4.load_tensors(hdir .. "/io.safetensors")
    local model = ds4.load(hdir)
    model:zero_grad()
    model:forward(hio.input_ids, { labels = hio.labels })
    model:backward()
    local g, ref = model:grads(), ds4.load_tensors(hdir .. "/grads.safetensors")
    local cfg = model:config()
    local E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for l = 0, cfg.num_hidden_layers - 1 do
        local gu = g[("model.layers.%d.mlp.experts.gate_up_proj"):format(l)]
        local dn = g[("model.layers.%d.mlp.experts.down_proj"):format(l)]
        if H.check(gu and dn, "packed expert gradients of layer " .. l) then
            H.same(gu:shape(), { E, 2 * I, D }, "gate_up_proj gradient shape")
            H.same(dn:shape(), { E, D, I }, "down_proj gradient shape")
            local worst = 0
            for e = 0, E - 1 do
                for _, part in ipairs({ { "w1", gu, 0, I * D }, { "w3", gu, I * D, I * D }, { "w2", dn, 0, D * I } }) do
                    local r = ref[("main.layers.%d.ffn.experts.%d.%s.weight"):format(l, e, part[1])]
                    local per = part[2] == gu and 2 * I * D or D * I
                    local dd, rr = 0, 0
                    for k = 1, part[4] do
                        local a = part[2][e * per + part[3] + k]
                        dd = dd + (a - r[k]) ^ 2
                        rr = rr + r[k] ^ 2
                    end
                    worst = math.max(worst, math.sqrt(dd) / math.max(math.sqrt(rr), 1e-7 * math.sqrt(part[4])))
                end
            end
            H.check(worst <= 1e-3, ("layer %d packed expert gradients: worst rel diff %.3g"):format(l, worst))
        end
    end
    H.check(g["model.layers.0.self_attn.q_a_proj.weight"] ~= nil, "HF module names for the other tensors too")
    H.check(model:grads({ canonical = true })["layers.0.attn.wq_a.weight"] ~= nil, "canonical keys on request")
    model:free()
end

-- model:memory()'s pass figures: none before a pass; the tape and both workspaces after a training forward and
-- backward; per-block recomputation and the bf16 mode's bf16 tape inputs each give a fresh model a smaller tape
-- (test_backward.c checks that both keep every bit).
do
    local function tape_of(opts, bf16)
        local model = ds4.load(dir)
        local m0 = model:memory()
        H.eq(m0.tape + m0.workspace + m0.backward_workspace, 0, "no pass memory before a pass")
        if opts then model:set_train_options(opts) end
        if bf16 then model:set_bf16_emulation(true) end
        model:zero_grad()
        model:forward(ids, { labels = labels })
        model:backward()
        local mem = model:memory()
        H.check(mem.tape > 0 and mem.workspace > 0 and mem.backward_workspace > 0,
            ("tape %d, workspace %d, backward workspace %d bytes"):format(mem.tape, mem.workspace,
                mem.backward_workspace))
        model:free()
        return mem.tape
    end
    local plain = tape_of()
    local rec, half = tape_of({ recompute = true }), tape_of(nil, true)
    H.check(rec < plain, ("recomputation: tape %d bytes, %d without"):format(rec, plain))
    H.check(half < plain, ("bf16 mode: tape %d bytes, %d in fp32"):format(half, plain))
end

-- An optimizer keeps its model alive: dropping every other reference and collecting must not free it.
do
    local opt = ds4.adamw(ds4.load(dir), { lr = 1e-3 })
    collectgarbage()
    collectgarbage()
    H.raises(function() return opt:step() end, { "no gradient buffer" }, "model kept alive by the optimizer")
end
collectgarbage()

H.done("test_train.lua")
