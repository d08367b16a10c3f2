--[[ ds4.fs — the few file-system operations the run tooling needs, through LuaJIT's FFI (POSIX calls, no shell).

  local fs = require("ds4.fs")
  fs.mkdir_p(path)              create path and its missing parents (mode 0755); raises "ds4.fs.mkdir_p: ..."
                                naming the component that failed (a file in the way, no permission)
  fs.is_dir(path) -> bool       fs.exists(path) -> bool
  fs.write_atomic(path, text)   write path.tmp-PID, then rename it over path: readers see the old file or the
                                new one, never half of it; raises on a failed write
  fs.read(path) -> text | nil, why
  fs.symlink(target, path)      replace path by a symbolic link to target (through a temporary link + rename)
  fs.readlink(path) -> target | nil
  fs.pid() -> the process id    fs.hostname() -> the host name

os.execute("mkdir -p ...") would hand a path to the shell (quotes in a run name break it) and report failure only
as an exit status; these name the path and errno.
]]

local ffi = require("ffi")

-- one declaration per cdef: a name another module declared already fails alone, not the whole block
for _, decl in ipairs({
    "int mkdir(const char *path, unsigned int mode);",
    "int rename(const char *from, const char *to);",
    "int unlink(const char *path);",
    "int symlink(const char *target, const char *path);",
    "long readlink(const char *path, char *buf, unsigned long size);",
    "void *opendir(const char *name);",
    "int closedir(void *dir);",
    "int access(const char *path, int mode);",
    "char *strerror(int errnum);",
    "int getpid(void);",
    "int gethostname(char *name, unsigned long len);",
}) do pcall(ffi.cdef, decl) end

local C = ffi.C
local M = {}

local EEXIST = 17

local function why() return ffi.string(C.strerror(ffi.errno())) end

function M.is_dir(path)
    local d = C.opendir(path)
    if d == nil then return false end
    C.closedir(d)
    return true
end

function M.exists(path)
    return C.access(path, 0) == 0 or M.readlink(path) ~= nil
end

function M.mkdir_p(path)
    if type(path) ~= "string" or path == "" then
        error("ds4.fs.mkdir_p: path must be a non-empty string, got " .. tostring(path), 2)
    end
    local prefix = path:sub(1, 1) == "/" and "/" or ""
    for part in path:gmatch("[^/]+") do
        prefix = prefix .. part
        if C.mkdir(prefix, tonumber("755", 8)) ~= 0 then
            local e = ffi.errno()
            if e ~= EEXIST then error(("ds4.fs.mkdir_p: mkdir %s: %s"):format(prefix, why()), 2) end
            if not M.is_dir(prefix) then
                error(("ds4.fs.mkdir_p: %s exists and is not a directory (creating %s)"):format(prefix, path), 2)
            end
        end
        prefix = prefix .. "/"
    end
    return path
end

function M.pid() return C.getpid() end

function M.hostname()
    local buf = ffi.new("char[256]")
    if C.gethostname(buf, 255) ~= 0 then return "localhost" end
    return ffi.string(buf)
end

function M.write_atomic(path, text)
    local tmp = ("%s.tmp-%d"):format(path, M.pid())
    local f, err = io.open(tmp, "wb")
    if not f then error("ds4.fs.write_atomic: " .. tostring(err), 2) end
    local ok, werr = f:write(text)
    local cok, cerr = f:close()
    if not ok or not cok then
        os.remove(tmp)
        error(("ds4.fs.write_atomic: write %s: %s"):format(tmp, tostring(werr or cerr)), 2)
    end
    if C.rename(tmp, path) ~= 0 then
        local msg = why()
        os.remove(tmp)
        error(("ds4.fs.write_atomic: rename %s to %s: %s"):format(tmp, path, msg), 2)
    end
    return path
end

function M.read(path)
    local f, err = io.open(path, "rb")
    if not f then return nil, err end
    local text, rerr = f:read("*a")
    f:close()
    if not text then return nil, ("read %s: %s"):format(path, tostring(rerr)) end
    return text
end

function M.readlink(path)
    local buf = ffi.new("char[4096]")
    local n = C.readlink(path, buf, 4096)
    if n < 0 or n >= 4096 then return nil end
    return ffi.string(buf, n)
end

function M.symlink(target, path)
    local tmp = ("%s.tmp-%d"):format(path, M.pid())
    C.unlink(tmp)
    if C.symlink(target, tmp) ~= 0 then
        error(("ds4.fs.symlink: %s -> %s: %s"):format(tmp, target, why()), 2)
    end
    if C.rename(tmp, path) ~= 0 then
        local msg = why()
        C.unlink(tmp)
        error(("ds4.fs.symlink: rename %s to %s: %s"):format(tmp, path, msg), 2)
    end
    return path
end

return M
