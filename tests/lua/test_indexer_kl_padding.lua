-- test_indexer_kl_padding.lua — the indexer KL loss leaves right padding out (model:forward's opts.lengths,
-- ds4_forward_args.lengths), so that a packed micro-batch is normalised by its real queries only.
--
-- tiny_a (two CSA layers, compress rate m = 4: position s has (s + 1) / m causal entries, so queries s >= m - 1
-- have picks) with the indexer KL on. Two rows, one of 23 real positions and one of 13 padded to 23 with random ids.
-- The reference is each row run alone, unpadded:
--   (a) the query count: with lengths 20 + 10 = 30 (the closed form, and model:indexer_queries), each row's own
--       count adding up; without lengths the padding's 10 queries count too (40: what the RL trainer used to get);
--   (b) the loss: the padded batch's indexer_loss is the query-weighted mean of the two rows' (a double sum in
--       another order: rel <= 1e-9);
--   (c) the gradient: the padded batch's backward{ce = 1/N, ikl = κ/Q} against the two rows' backwards
--       accumulated with the same factors: every tensor within rel 2e-5 (fp32 summation order over other row
--       groupings, as tests/lua/test_grad_accum.lua; measured below 1e-6); the same batch without lengths puts
--       the padded queries' KL into the indexer's gradient: rel > 1e-2 on it, so the test tells the two apart;
--   (d) malformed lengths are refused; model:train_options() returns what set_train_options set.
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local ffi = require("ffi")

local model = ds4.load(H.fixtures() .. "/tiny_a")
local KAPPA = 1.0
model:set_train_options({ indexer_kl = KAPPA })
-- DS4_TEST_DEVICE=cuda (a GPU machine): the same on the CUDA backend, fp32 mode (the padded queries' rows of the
-- KL's gradient are zeroed there by the backend's fill)
if os.getenv("DS4_TEST_DEVICE") == "cuda" then model:to("cuda", "fp32") end
local m = model:config().compress_rates.compressed_sparse_attention
H.eq(m, 4, "tiny_a's CSA compress rate (the counts below assume it)")
local S, L2, V = 23, 13, model:config().vocab_size
local rnd = H.lcg(4242)
local r1, r2 = H.random_ids(rnd, S, V), H.random_ids(rnd, S, V) -- r2's positions > L2 are its padding
local function labels_of(ids, len)
    local l = {}
    for s = 1, #ids do l[s] = s <= len and ids[s] or -100 end
    return l
end
local ids = ds4.tensor({ r1, r2 }, "I64")
local labels = ds4.tensor({ labels_of(r1, S), labels_of(r2, L2) }, "I64")
local r2_real = H.slice(r2, 1, L2)

-- (a) counts
local Q = (S - (m - 1)) + (L2 - (m - 1))
H.eq(Q, 30, "closed form")
H.eq(model:indexer_queries({ S, L2 }), Q, "model:indexer_queries")
H.eq(model:indexer_queries({ 2, 0 }), 0, "rows shorter than m have no query with picks")
local out = model:forward(ids, { labels = labels, lengths = { S, L2 }, train = true, logits = false })
H.eq(out.indexer_queries, Q, "a padded forward with lengths counts the real queries only")
local o1 = model:forward(ds4.tensor({ r1 }, "I64"), { labels = ds4.tensor({ labels_of(r1, S) }, "I64"), train = true })
local o2 = model:forward(ds4.tensor({ r2_real }, "I64"), { labels = ds4.tensor({ r2_real }, "I64"), train = true })
H.eq(o1.indexer_queries + o2.indexer_queries, Q, "the rows alone add up to it")
local nolen = model:forward(ids, { labels = labels, train = true, logits = false })
H.eq(nolen.indexer_queries, 2 * (S - (m - 1)), "without lengths every position counts (padding included)")

-- (b) loss: a mean over each row's queries per layer, summed over layers; the batch's is the weighted mean
local want = (o1.indexer_loss * o1.indexer_queries + o2.indexer_loss * o2.indexer_queries) / Q
H.near(out.indexer_loss, want, 1e-9 * want, "the padded batch's indexer loss = the rows' query-weighted mean")
H.check(math.abs(nolen.indexer_loss - want) > 1e-3 * want, ("without lengths the padding's KL enters the loss "
    .. "(%.6g vs %.6g)"):format(nolen.indexer_loss, want))

-- (c) gradients, each part by its global count
local N = (S - 1) + (L2 - 1)
local scales = { ce = 1 / N, ikl = KAPPA / Q }
local function copy(g)
    local c = {}
    for k, t in pairs(g) do c[k] = t:clone() end
    return c
end
local function rel(a, b) -- ‖a − b‖ / ‖b‖; max |a − b| where b is all zero (a NaN never passes: NaN > bound is false)
    local mx, r, bb = H.f32_diff(a, b)
    return bb > 0 and r or mx
end
model:zero_grad()
model:forward(ds4.tensor({ r1 }, "I64"), { labels = ds4.tensor({ labels_of(r1, S) }, "I64") })
model:backward(scales)
model:forward(ds4.tensor({ r2_real }, "I64"), { labels = ds4.tensor({ r2_real }, "I64") })
model:backward(scales)
local ref = copy(model:grads({ canonical = true }))
model:zero_grad()
local p = model:forward(ids, { labels = labels, lengths = { S, L2 } })
H.eq(p.loss_tokens, N, "scored tokens")
model:backward(scales)
local got = copy(model:grads({ canonical = true }))
local worst, idx_norm = 0, 0
for name, g in pairs(ref) do
    local r = rel(got[name], g)
    if r > worst then worst = r end
    if name:find("%.attn%.indexer%.") then idx_norm = idx_norm + select(3, H.f32_diff(g, g)) end
    H.check(r <= 2e-5, ("%s: padded batch with lengths vs the rows alone: rel %.3g"):format(name, r))
end
H.check(idx_norm > 0, "the indexer gets a gradient")
model:zero_grad()
model:forward(ids, { labels = labels })
model:backward(scales)
local IDX = "layers.1.attn.indexer.wq_b.weight"
local r_nolen = rel(model:grads({ canonical = true })[IDX], ref[IDX])
H.check(r_nolen > 1e-2, ("without lengths the padded queries reach the indexer's gradient (rel %.3g)"):format(r_nolen))
print(("indexer KL padding: Q %d (without lengths %d), worst gradient rel %.3g, without lengths %.3g on %s"):format(
    Q, nolen.indexer_queries, worst, r_nolen, IDX))

-- (d) refusals and the options' getter
H.raises(function() model:forward(ids, { lengths = { S } }) end, { "opts.lengths", "expected 2" }, "too few lengths")
H.raises(function() model:forward(ids, { lengths = { S, S + 1 } }) end, { "opts.lengths[2]", "[0, seq]" },
    "a length past S")
H.raises(function() model:forward(ids, { lengths = { -1, S } }) end, { "opts.lengths[1]" }, "a negative length")
H.raises(function() model:indexer_queries(3) end, { "indexer_queries", "table" }, "not a table")
model:set_train_options({ indexer_kl = 0.5, mtp_lambda = 0.25, head_chunk = 8, recompute = true })
local o = model:train_options()
H.same({ o.indexer_kl, o.mtp_lambda, o.router_bias_gamma, o.head_chunk, o.recompute }, { 0.5, 0.25, 0, 8, true },
    "train_options() returns the options set")
H.done("test_indexer_kl_padding")
