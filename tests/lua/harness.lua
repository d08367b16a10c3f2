-- harness.lua — minimal checks for the Lua tests (not itself a test: ctest only runs test_*.lua).
--
-- Every failed check is printed with its location and counted; H.done() prints a summary and exits 1 when
-- anything failed, so ctest sees the failure. A Lua error aborts the test with exit 1 as well.
local H = { checks = 0, failures = 0 }

-- The first frame outside this file: the test line that made the failing check, however deep the helpers.
local function where()
    local level = 2
    while true do
        local info = debug.getinfo(level, "Sl")
        if not info then return "?" end
        if not info.short_src:match("harness%.lua$") then return info.short_src .. ":" .. (info.currentline or 0) end
        level = level + 1
    end
end

local function fail(msg)
    H.failures = H.failures + 1
    io.stderr:write("FAIL ", where(), ": ", msg, "\n")
end

function H.check(cond, msg)
    H.checks = H.checks + 1
    if not cond then fail(msg or "check failed") end
    return cond
end

function H.eq(got, want, what)
    H.checks = H.checks + 1
    if got ~= want then
        fail(("%s: got %s, want %s"):format(what or "value", tostring(got), tostring(want)))
        return false
    end
    return true
end

-- Deep equality of plain Lua values (tables compared element by element).
local function deep_eq(a, b)
    if type(a) ~= type(b) then return false end
    if type(a) ~= "table" then return a == b end
    for k, v in pairs(a) do
        if not deep_eq(v, b[k]) then return false end
    end
    for k in pairs(b) do
        if a[k] == nil then return false end
    end
    return true
end

local function show(v)
    if type(v) ~= "table" then return tostring(v) end
    local parts = {}
    for i = 1, #v do parts[#parts + 1] = show(v[i]) end
    return "{" .. table.concat(parts, ", ") .. "}"
end

function H.same(got, want, what)
    H.checks = H.checks + 1
    if not deep_eq(got, want) then
        fail(("%s: got %s, want %s"):format(what or "value", show(got), show(want)))
        return false
    end
    return true
end

function H.near(got, want, tol, what)
    H.checks = H.checks + 1
    if type(got) ~= "number" or not (math.abs(got - want) <= tol) then
        fail(("%s: got %s, want %s (tolerance %g)"):format(what or "value", tostring(got), tostring(want), tol))
        return false
    end
    return true
end

-- fn must raise, and the message must contain every string in `needles` (plain substring match).
function H.raises(fn, needles, what)
    H.checks = H.checks + 1
    local ok, err = pcall(fn)
    if ok then
        fail((what or "call") .. ": expected an error, none raised")
        return nil
    end
    err = tostring(err)
    if type(needles) == "string" then needles = { needles } end
    for _, s in ipairs(needles or {}) do
        if not err:find(s, 1, true) then
            fail(("%s: error message lacks %q:\n    %s"):format(what or "call", s, err))
            return err
        end
    end
    return err
end

-- True when tensors a and b hold the same bytes (bitwise equality: -0 ~= 0, NaN payloads count).
function H.same_bytes(a, b)
    local ffi = require("ffi")
    pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")
    return a:nbytes() == b:nbytes() and ffi.C.memcmp(a:data_ptr(), b:data_ptr(), a:nbytes()) == 0
end

-- The fixtures directory: arg[1], else tests/fixtures next to this file's directory.
-- The whole file at path, as a string.
function H.read_file(path)
    local f = assert(io.open(path, "rb"))
    local s = f:read("*a")
    f:close()
    return s
end

-- A shell word for path s.
function H.shell_quote(s)
    return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- A fresh empty directory (os.tmpname() reserves a unique name; the directory takes its place).
function H.make_temp_dir()
    local p = os.tmpname()
    os.remove(p)
    local ok = os.execute("mkdir " .. H.shell_quote(p))
    assert(ok == 0 or ok == true, "cannot create temporary directory " .. p)
    return p
end

-- Largest |a[i] - b[i]| (a NaN difference counts as infinite) and largest |b[i]| over two tensors' elements (flat
-- reads through the tensor API).
function H.max_diff(a, b)
    local d, m = 0, 0
    for i = 1, b:numel() do
        local e = math.abs(a[i] - b[i])
        if e ~= e then e = math.huge end
        if e > d then d = e end
        if math.abs(b[i]) > m then m = math.abs(b[i]) end
    end
    return d, m
end

-- Whether two tensors hold the same number of elements, each equal (a NaN never is).
function H.bits_equal(a, b)
    if a:numel() ~= b:numel() then return false end
    for i = 1, a:numel() do
        if a[i] ~= b[i] then return false end
    end
    return true
end

-- Park–Miller generator: r(lo, hi) draws an integer in [lo, hi) (products stay below 2^53, so exact in doubles).
function H.lcg(seed)
    local s = seed
    return function(lo, hi)
        s = (s * 16807) % 2147483647
        return lo + math.floor(s / 2147483647 * (hi - lo))
    end
end

-- n token ids drawn with r in [2, V): 0 and 1 (the fixtures' bos and eos) left out.
function H.random_ids(r, n, V)
    local t = {}
    for i = 1, n do t[i] = r(2, V) end
    return t
end

-- a[i .. j] as a new table
function H.slice(a, i, j)
    local t = {}
    for k = i, j do t[#t + 1] = a[k] end
    return t
end

-- B rows of S token ids in [0, V), the same on every rank and run: the distributed tests' global batch, drawn with
-- the LCG s <- (1103515245 s + 12345) mod 2^31 from `seed` (its products exceed 2^53 and round in doubles, so the
-- sequence is not the integer LCG's; it is fixed all the same, which is all these batches need).
function H.lcg_rows(seed, B, S, V)
    local rows = {}
    for b = 1, B do
        rows[b] = {}
        for s = 1, S do
            seed = (seed * 1103515245 + 12345) % 2147483648
            rows[b][s] = seed % V
        end
    end
    return rows
end

-- The rows [first, first + count) of a 4-row global batch that rank r of n holds in the distributed tests: 1 rank
-- all four, 2 ranks 1 and 3 rows (unequal on purpose), 4 ranks one each.
function H.rank_rows(r, n)
    local split = assert(({ [1] = { 4 }, [2] = { 1, 3 }, [4] = { 1, 1, 1, 1 } })[n], "a batch of 4 rows: 1, 2 or 4 ranks")
    local first = 1
    for k = 1, r do first = first + split[k] end
    return first, split[r + 1]
end

-- The distributed tests' global batch: 4 random rows of S ids < V from an LCG seeded `seed`, and rank r of n's share
-- (H.rank_rows) -> rows (tables), the whole batch and this rank's rows (I64 tensors), its first row and row count.
function H.rank_batch(seed, S, V, r, n)
    local rnd, rows = H.lcg(seed), {}
    for b = 1, 4 do rows[b] = H.random_ids(rnd, S, V) end
    local first, mine = H.rank_rows(r, n)
    return rows, H.batch(rows, 1, 4), H.batch(rows, first, mine), first, mine
end

-- An I64 tensor [count, S] of rows[first .. first + count - 1] (each a table of S token ids).
function H.batch(rows, first, count)
    local t = {}
    for b = first, first + count - 1 do t[#t + 1] = rows[b] end
    return require("ds4").tensor(t, "I64")
end

-- max |a − b|, ‖a − b‖ / ‖b‖ and ‖b‖² over two F32 tensors of equal size (a NaN difference makes the max NaN).
function H.f32_diff(a, b)
    local ffi = require("ffi")
    local pa, pb = ffi.cast("const float *", a:data_ptr()), ffi.cast("const float *", b:data_ptr())
    local mx, dd, bb = 0, 0, 0
    for i = 0, b:numel() - 1 do
        local e = math.abs(pa[i] - pb[i])
        if not (e <= mx) then mx = e end
        dd, bb = dd + e * e, bb + pb[i] * pb[i]
    end
    return mx, math.sqrt(dd) / math.sqrt(bb), bb
end

-- The elements of two F32 tensors, or of two {name = F32 tensor} tables (b's keys), that differ: bit for bit, or with
-- `near` only by more than 1e-5 relative plus 1e-6 of their tensor's largest value (NCCL over more than 2 ranks sums
-- in its own order, and ncclReduce's order is not ncclAllReduce's: the distributed tests' bound for last-bit sums).
function H.count_differ(a, b, near)
    local ffi = require("ffi")
    local count = 0
    local function one(x, y)
        local px, py = ffi.cast("const float *", x:data_ptr()), ffi.cast("const float *", y:data_ptr())
        local big = 0
        if near then for i = 0, y:numel() - 1 do big = math.max(big, math.abs(py[i])) end end
        for i = 0, y:numel() - 1 do
            if near then
                if not (math.abs(px[i] - py[i]) <= 1e-5 * math.abs(py[i]) + 1e-6 * big) then count = count + 1 end
            elseif px[i] ~= py[i] then
                count = count + 1
            end
        end
    end
    if type(b) == "table" then
        for k, t in pairs(b) do one(a[k], t) end
    else
        one(a, b)
    end
    return count
end

-- The RL tests' toy task: token ids read as bytes (id % 256: the text a byte-level decode gives), and a reward that
-- is the parity of the first byte (1 when even), so that groups are mixed (informative) on random weights.
function H.byte_text(ids)
    local t = {}
    for i, v in ipairs(ids) do t[i] = string.char(v % 256) end
    return table.concat(t)
end
function H.parity_reward(text) return (#text > 0 and text:byte(1) % 2 == 0) and 1 or 0 end
-- The RL tests' prompts of given lengths: a trainer's config.prompts whose call k gives n prompts, the i-th of
-- lens[(i - 1) % #lens + 1] ids in [5, 45), deterministic in (k, i) (as an exact resume and several ranks need).
function H.prompts_of_lengths(lens)
    return function(k, n)
        local p = {}
        for i = 1, n do
            p[i] = { prompt = {}, answer = "x" }
            for j = 1, lens[(i - 1) % #lens + 1] do p[i].prompt[j] = 5 + (k * 7 + i * 3 + j) % 40 end
        end
        return p
    end
end

function H.fixtures()
    if arg and arg[1] then return arg[1] end
    local dir = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
    return dir .. "/../fixtures"
end

function H.done(name)
    io.write(("%s: %d checks, %d failures\n"):format(name or "test", H.checks, H.failures))
    io.stdout:flush()
    if H.failures > 0 then os.exit(1) end
end

return H
