--[==[ ds4.options — one run configuration: defaults, a Lua config file, command-line overrides; the effective
configuration written back as a config file.

  local options = require("ds4.options")
  local spec = {
      program = "examples/dapo.lua", summary = "one line on what the script does",
      options = {                                   -- name, default (its type is the option's), help
          { "steps", 120, "RL steps" },
          { "lr", 3e-4, "learning rate" },
          { "data", "", "training data, JSONL" },
          { "quiet", false, "no progress output" },  -- a boolean: --quiet, --quiet=false
          { "algorithm", "dapo", "preset name or table", table = true },  -- may be a table: dotted overrides
      },
  }
  local opts = options.parse(arg, spec [, {base = "RUN/config.lua"}])
  options.write(path, opts, spec)               -- the effective configuration, loadable with --config

Sources, later ones winning: the defaults; opts.base (the saved configuration of a run being resumed); the file
given with --config FILE; the command line, left to right. Names use "_" (sft_steps); on the command line "-"
works too (--sft-steps). Spellings: --name VALUE and --name=VALUE; a boolean is --name (true) or --name=false.
A config file is Lua: either `return {steps = 200, lr = 1e-4, algorithm = {name = "dapo", loss = {eps_high =
0.28}}}` or plain assignments (`steps = 200`); it runs with only tonumber, tostring, math, string, table, ipairs,
pairs and os.getenv in reach.
Options with table = true take a table in a config file, and dotted names on the command line set a field inside
it: --algorithm.loss.eps_high 0.28 (a string value becomes {name = value} first). Such values are read as a
number when they are one, true / false as booleans, else as strings. --columns.answer reward_model.ground_truth
builds {answer = "reward_model.ground_truth"}.
Errors — an unknown option (with the closest known name), a value of the wrong type, a config file that does not
load — print "PROGRAM: ..." and the usage to stderr and exit with status 2; --help prints the usage and exits 0.
]==]

local M = {}

-- A usage error: the message, a pointer to --help, exit status 2 (the Lua state closed: no leak reports).
local function die(spec, msg)
    io.stderr:write(("%s: %s\n(%s --help lists the options)\n"):format(spec.program, msg, spec.program))
    os.exit(2, true)
end

-- Levenshtein distance, for "did you mean".
local function distance(a, b)
    local prev = {}
    for j = 0, #b do prev[j] = j end
    for i = 1, #a do
        local cur = { [0] = i }
        for j = 1, #b do
            local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
            cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
        end
        prev = cur
    end
    return prev[#b]
end

local function closest(spec, name)
    local best, bd = nil, 3
    for _, o in ipairs(spec.options) do
        local d = distance(name, o[1])
        if d < bd then best, bd = o[1], d end
    end
    return best and (" (did you mean --%s?)"):format(best:gsub("_", "-")) or ""
end

local function find(spec, name)
    for _, o in ipairs(spec.options) do
        if o[1] == name then return o end
    end
end

local function deep_copy(v)
    if type(v) ~= "table" then return v end
    local o = {}
    for k, x in pairs(v) do o[k] = deep_copy(x) end
    return o
end

-- A command-line value for option o: the type of its default.
local function convert(spec, o, text, where)
    local def = o[2]
    if type(def) == "number" then
        local n = tonumber(text)
        if not n then die(spec, ("%s needs a number, got '%s'"):format(where, text)) end
        return n
    elseif type(def) == "boolean" then
        if text == "true" or text == "1" then return true end
        if text == "false" or text == "0" then return false end
        die(spec, ("%s is true or false, got '%s'"):format(where, text))
    end
    return text
end

-- A value inside a table option: a number when it is one, true / false, else the string.
local function scalar(text)
    if text == "true" then return true end
    if text == "false" then return false end
    return tonumber(text) or text
end

-- Check one value from a config file against option o.
local function check_value(spec, o, v, where)
    local def = o[2]
    if o.table and (type(v) == "table" or type(v) == "string") then return deep_copy(v) end
    if type(v) ~= type(def) then
        die(spec, ("%s must be a %s%s, got %s"):format(where, type(def), o.table and " or a table" or "",
            type(v) == "string" and ("'" .. v .. "'") or type(v)))
    end
    return v
end

-- Apply a table of values (from a config file) onto opts.
local function apply_table(spec, opts, t, source)
    local names = {}
    for k in pairs(t) do names[#names + 1] = k end
    table.sort(names, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(names) do
        if type(k) ~= "string" then die(spec, ("%s: option names are strings, got a %s key"):format(source, type(k))) end
        local name = k:gsub("-", "_")
        local o = find(spec, name)
        if not o then die(spec, ("%s: unknown option '%s'%s"):format(source, k, closest(spec, name))) end
        opts[name] = check_value(spec, o, t[k], ("%s: %s"):format(source, k))
    end
end

-- Run a config file: its returned table, or the globals it assigned.
local function load_config(spec, path)
    local f, err = io.open(path, "rb")
    if not f then die(spec, ("--config: cannot open %s"):format(tostring(err))) end
    local text = f:read("*a")
    f:close()
    local env = { tonumber = tonumber, tostring = tostring, math = math, string = string, table = table,
        ipairs = ipairs, pairs = pairs, os = { getenv = os.getenv } }
    local given = {}
    setmetatable(given, { __index = env })
    local chunk, cerr = loadstring(text, "@" .. path)
    if not chunk then die(spec, ("--config %s: %s"):format(path, cerr)) end
    setfenv(chunk, given)
    local ok, r = pcall(chunk)
    if not ok then die(spec, ("--config %s: %s"):format(path, tostring(r))) end
    if r ~= nil and type(r) ~= "table" then
        die(spec, ("--config %s: the file returns a %s; return a table of options, or assign them"):format(path,
            type(r)))
    end
    return r or given
end

-- Set opts[path...] = value for a dotted name ("algorithm.loss.eps_high").
local function set_dotted(spec, opts, o, parts, value, where)
    local root = opts[o[1]]
    if type(root) == "string" then
        root = root ~= "" and { name = root } or {}
    elseif type(root) ~= "table" then
        root = {}
    end
    opts[o[1]] = root
    local t = root
    for i = 2, #parts - 1 do
        if type(t[parts[i]]) ~= "table" then
            if t[parts[i]] ~= nil and t[parts[i]] ~= false then
                die(spec, ("%s: %s is a %s, not a table"):format(where, table.concat(parts, ".", 1, i),
                    type(t[parts[i]])))
            end
            t[parts[i]] = {}
        end
        t = t[parts[i]]
    end
    t[parts[#parts]] = value
end

function M.usage(spec)
    local lines = { ("usage: ds4 run %s [--config FILE.lua] [--OPTION VALUE ...]"):format(spec.program) }
    if spec.summary then lines[#lines + 1] = spec.summary end
    lines[#lines + 1] = ""
    for _, o in ipairs(spec.options) do
        local def = o[2]
        local shown = type(def) == "boolean" and "" or (type(def) == "string" and (def == "" and " TEXT" or
            (" " .. def)) or (" " .. tostring(def)))
        lines[#lines + 1] = ("  --%-22s %s"):format(o[1]:gsub("_", "-") .. shown, o[3] or "")
    end
    lines[#lines + 1] = "  --config FILE.lua        options from a Lua file (a table); the command line overrides it"
    lines[#lines + 1] = "Names take - or _; --name=VALUE works too; table options take dotted fields (--algorithm.loss.eps_high 0.28)."
    return table.concat(lines, "\n")
end

function M.parse(argv, spec, popts)
    popts = popts or {}
    local opts = {}
    for _, o in ipairs(spec.options) do opts[o[1]] = deep_copy(o[2]) end
    -- the configuration files first (base, then --config), the command line over them
    if popts.base then apply_table(spec, opts, load_config(spec, popts.base), popts.base) end
    local cli = {}
    local i = 1
    while i <= #argv do
        local a = argv[i]
        if a == "-h" or a == "--help" then
            print(M.usage(spec))
            os.exit(0, true)
        end
        local name, value = a:match("^%-%-([^=]+)=(.*)$")
        if not name then name = a:match("^%-%-(.+)$") end
        if not name then die(spec, ("unexpected argument '%s' (options start with --)"):format(a)) end
        name = name:gsub("-", "_")
        if name == "config" then
            if not value then
                i = i + 1
                value = argv[i]
            end
            if not value or value == "" then die(spec, "--config needs a file") end
            apply_table(spec, opts, load_config(spec, value), value)
        else
            local parts = {}
            for p in name:gmatch("[^.]+") do parts[#parts + 1] = p end
            local o = find(spec, parts[1] or "")
            if not o then die(spec, ("unknown option '%s'%s"):format(a, closest(spec, parts[1] or ""))) end
            if #parts > 1 and not o.table then die(spec, ("--%s takes no dotted fields"):format(parts[1])) end
            if value == nil and type(o[2]) == "boolean" and #parts == 1 then
                value = "true"
            elseif value == nil then
                i = i + 1
                value = argv[i]
                if value == nil then die(spec, ("--%s needs a value"):format(name:gsub("_", "-"))) end
            end
            cli[#cli + 1] = { o = o, parts = parts, value = value, where = "--" .. name:gsub("_", "-") }
        end
        i = i + 1
    end
    for _, c in ipairs(cli) do
        if #c.parts > 1 then
            set_dotted(spec, opts, c.o, c.parts, scalar(c.value), c.where)
        else
            opts[c.o[1]] = convert(spec, c.o, c.value, c.where)
        end
    end
    return opts
end

-- Lua source for a value (tables with sorted keys; numbers that read back exactly).
local function source(v, indent)
    local t = type(v)
    if t == "string" then return ("%q"):format(v) end
    if t == "number" then
        if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(v) end
        if v ~= v or v == math.huge or v == -math.huge then return v ~= v and "0/0" or (v > 0 and "math.huge" or "-math.huge") end
        return require("ds4.chat.json").float_repr(v) -- the shortest text that reads back as v
    end
    if t == "boolean" then return tostring(v) end
    if t ~= "table" then return "nil --[[ " .. t .. " ]]" end
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b)
        if type(a) == type(b) then return a < b end
        return type(a) == "number"
    end)
    if #keys == 0 then return "{}" end
    local pad = ("    "):rep(indent + 1)
    local out = { "{" }
    for _, k in ipairs(keys) do
        local key = type(k) == "string" and k:match("^[%a_][%w_]*$") and k or ("[" .. source(k, 0) .. "]")
        out[#out + 1] = ("%s%s = %s,"):format(pad, key, source(v[k], indent + 1))
    end
    out[#out + 1] = ("    "):rep(indent) .. "}"
    return table.concat(out, "\n")
end

function M.write(path, opts, spec)
    local lines = { ("-- The effective configuration of %s, written when the run started (%s)."):format(spec.program,
        os.date("!%Y-%m-%d %H:%M:%S UTC")), ("-- Run it again: ds4 run %s --config %s"):format(spec.program, path),
        "return {" }
    for _, o in ipairs(spec.options) do
        lines[#lines + 1] = ("    %s = %s,"):format(o[1], source(opts[o[1]], 1))
    end
    lines[#lines + 1] = "}\n"
    require("ds4.fs").write_atomic(path, table.concat(lines, "\n"))
    return path
end

return M
