--[[ ds4.rl.util — the small helpers the ds4.rl modules share. ]]

local M = {}

-- fail(fn, msg [, level]) raising "ds4.rl.<module>.<fn>: msg" at the caller `level` frames up.
function M.failer(module)
    local prefix = "ds4.rl." .. module .. "."
    return function(fn, msg, level)
        error(prefix .. fn .. ": " .. msg, (level or 1) + 1)
    end
end

-- The mask weight of token t (1 when the sample has no mask).
function M.mask_at(s, t)
    local m = s.mask
    if m == nil then return 1 end
    return m[t]
end

return M
