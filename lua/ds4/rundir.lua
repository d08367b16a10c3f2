--[==[ ds4.rundir — where a run writes: its own directory, never a new run appended onto an old one.

  local rundir = require("ds4.rundir")
  local run = rundir.open{root = "runs/dapo", out = opts.out, id = opts.run_id, resume = opts.resume,
                          program = "dapo.lua"}
  -- run.dir (created), run.id, run.resumed (true when resume was asked and the directory holds a run)

  out given:    run.dir = out. A directory that already holds a run (metrics.jsonl or config.lua) is refused
                unless resume is set ("... holds a run already: --resume continues it, or choose another --out").
  out empty:    run.dir = root/ID, ID = id or the start time (20250131-142501, "-2", "-3", ... when taken), and
                root/latest becomes a symbolic link to ID. With resume and no id, the run root/latest points to
                is continued.
  local opts, run = rundir.start(arg, spec, "runs/dapo")
                -- what the examples do: ds4.options.parse (spec must have out, run_id and resume options), open
                -- the run directory (a usage error: message and exit status 2), parse again over the run's
                -- config.lua when resuming (the command line still wins), and write the effective configuration
                -- to RUN/config.lua. Launched with several ranks (ds4.dp), rank 0 does all of that and the
                -- others get the same run (directory, id, resumed) and options
A run directory holds (the scripts' choice): config.lua (the effective configuration, ds4.options.write),
metrics.jsonl, events.out.tfevents.* (TensorBoard), completions.jsonl, metrics.svg, ckpt/step_NNNNNN.
]==]

local fs = require("ds4.fs")

local M = {}

local RUN_FILES = { "metrics.jsonl", "config.lua" }

local function holds_run(dir)
    for _, f in ipairs(RUN_FILES) do
        if fs.exists(dir .. "/" .. f) then return f end
    end
end

function M.open(o)
    local who = o.program or "ds4.rundir.open"
    local function refuse(msg) error(who .. ": " .. msg, 0) end
    local dir, id = o.out, o.id
    if dir == nil or dir == "" then
        if not o.root or o.root == "" then refuse("no run directory: give out or root") end
        if o.resume and (not id or id == "") then
            id = fs.readlink(o.root .. "/latest")
            if not id then
                refuse(("--resume: %s/latest does not exist: there is no run to continue under %s (give --out DIR "
                    .. "or --run-id ID)"):format(o.root, o.root))
            end
        end
        if not id or id == "" then
            local base = os.date("%Y%m%d-%H%M%S")
            id = base
            local k = 1
            while fs.exists(o.root .. "/" .. id) do
                k = k + 1
                id = ("%s-%d"):format(base, k)
            end
        end
        if id:find("/") or id == "." or id == ".." or id == "latest" then
            refuse(("a run id is a plain name (no '/', not '.', '..' or 'latest'), got '%s'"):format(id))
        end
        dir = o.root .. "/" .. id
    end
    local existing = fs.is_dir(dir) and holds_run(dir)
    if existing and not o.resume then
        refuse(("%s holds a run already (%s): --resume continues it, or choose another --out / --run-id"):format(
            dir, existing))
    end
    fs.mkdir_p(dir)
    if o.out == nil or o.out == "" then fs.symlink(id, o.root .. "/latest") end
    return { dir = dir, id = id or dir:match("([^/]+)/*$"), resumed = (o.resume and existing) and true or false }
end

function M.start(argv, spec, root)
    local options = require("ds4.options")
    local dp = require("ds4.dp")
    local opts = options.parse(argv, spec)
    -- launched with several ranks: they meet here (NCCL too when the script's --device is a GPU); rank 0 opens the
    -- run directory, the others learn it
    dp.init(type(opts.device) == "string" and opts.device or nil)
    local ok, run = true, nil
    if dp.is_root() then
        ok, run = pcall(M.open, { root = root, out = opts.out, id = opts.run_id, resume = opts.resume,
            program = spec.program })
    end
    if ok and dp.is_root() then
        local saved = run.dir .. "/config.lua"
        if run.resumed and fs.exists(saved) then opts = options.parse(argv, spec, { base = saved }) end
        options.write(saved, opts, spec)
    end
    -- rank 0 tells the others: "1\nDIR\nID\nRESUMED", or "0\nMESSAGE" (then every rank exits with status 2)
    local word = dp.is_root() and (ok and ("1\n%s\n%s\n%s"):format(run.dir, run.id, tostring(run.resumed))
        or ("0\n" .. tostring(run))) or ""
    word = dp.broadcast_string(word)
    if word:sub(1, 1) == "0" then
        if dp.is_root() then io.stderr:write(word:sub(3), "\n") end
        os.exit(2, true)
    end
    if not dp.is_root() then
        local dir, id, resumed = word:match("^1\n(.*)\n([^\n]*)\n([^\n]*)$")
        run = { dir = dir, id = id, resumed = resumed == "true" }
        if run.resumed then opts = options.parse(argv, spec, { base = run.dir .. "/config.lua" }) end
    end
    return opts, run
end

return M
