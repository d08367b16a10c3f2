--[[ ds4.plot — line plots of metrics as standalone SVG (no dependencies).

  local plot = require("ds4.plot")
  plot.svg(path, rows, {title = "...", series = {{key = "reward/mean", label = "..."}, ...}, x = "step"})
      rows: array of tables (e.g. the lines of a metrics.jsonl); a row without a series' key adds no point to it.
      All series share one y axis scaled to their joint range (reward and accuracy both live in [0, 1]).
  plot.svg(path, rows, {title = "...", panels = {{title = "loss", series = {...}}, {title = "KL", ...}, ...}})
      one chart per panel, stacked, each with its own y axis (loss, KL and entropy have different scales)
  plot.read_jsonl(path) -> rows
  `ds4 run` a one-liner to plot a finished run:
      ds4 run - <<< 'local p = require("ds4.plot") p.svg("m.svg", p.read_jsonl("runs/dapo/latest/metrics.jsonl"),
                     {series = {{key = "reward/mean"}, {key = "eval/accuracy"}}})'
]]

local json = require("ds4.chat.json")

local M = {}

local COLORS = { "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b" }

function M.read_jsonl(path)
    local rows = {}
    for line in io.lines(path) do
        if line:match("%S") then rows[#rows + 1] = json.decode(line) end
    end
    return rows
end

local function esc(s)
    return (tostring(s):gsub("&", "&amp;"):gsub("<", "&lt;"):gsub(">", "&gt;"))
end

local function nice(v)
    if v == math.floor(v) and math.abs(v) < 1e6 then return ("%d"):format(v) end
    return ("%.3g"):format(v)
end

-- One chart: SVG elements appended to o, its top-left corner at (0, y0), W x H pixels.
local function chart(o, rows, xkey, series, title, W, H, y0)
    local L, R, Tm, B = 60, 20, 40, 80
    local pts, xmin, xmax, ymin, ymax = {}, math.huge, -math.huge, math.huge, -math.huge
    for si, s in ipairs(series) do
        pts[si] = {}
        for _, row in ipairs(rows) do
            local x, y = row[xkey], row[s.key]
            if type(x) == "number" and type(y) == "number" and y == y and y ~= math.huge and y ~= -math.huge then
                pts[si][#pts[si] + 1] = { x, y }
                xmin, xmax = math.min(xmin, x), math.max(xmax, x)
                ymin, ymax = math.min(ymin, y), math.max(ymax, y)
            end
        end
    end
    if xmin > xmax then xmin, xmax, ymin, ymax = 0, 1, 0, 1 end
    if ymin > 0 and ymin < 0.5 * ymax then ymin = 0 end
    if xmax == xmin then xmax = xmin + 1 end
    if ymax == ymin then ymax = ymin + 1 end
    local function px(x) return L + (x - xmin) / (xmax - xmin) * (W - L - R) end
    local function py(y) return y0 + Tm + (1 - (y - ymin) / (ymax - ymin)) * (H - Tm - B) end
    o[#o + 1] = ('<text x="%d" y="%d" font-size="15">%s</text>'):format(L, y0 + 24, esc(title or ""))
    for k = 0, 5 do -- grid and tick labels
        local y = ymin + (ymax - ymin) * k / 5
        o[#o + 1] = ('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>'):format(L, py(y), W - R, py(y))
        o[#o + 1] = ('<text x="%d" y="%.1f" text-anchor="end">%s</text>'):format(L - 6, py(y) + 4, nice(y))
        local x = xmin + (xmax - xmin) * k / 5
        o[#o + 1] = ('<text x="%.1f" y="%d" text-anchor="middle">%s</text>'):format(px(x), y0 + H - B + 16, nice(x))
    end
    o[#o + 1] = ('<text x="%.1f" y="%d" text-anchor="middle">%s</text>'):format((L + W - R) / 2, y0 + H - B + 34,
        esc(xkey))
    for si, s in ipairs(series) do
        local c = s.color or COLORS[(si - 1) % #COLORS + 1]
        local d = {}
        for i, p in ipairs(pts[si]) do d[#d + 1] = ("%s%.1f,%.1f"):format(i == 1 and "M" or "L", px(p[1]), py(p[2])) end
        if #d > 0 then
            o[#o + 1] = ('<path d="%s" fill="none" stroke="%s" stroke-width="1.5"/>'):format(table.concat(d, " "), c)
        end
        if #pts[si] <= 40 then
            for _, p in ipairs(pts[si]) do
                o[#o + 1] = ('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>'):format(px(p[1]), py(p[2]), c)
            end
        end
        local ly, lx = y0 + H - B + 52, L + (si - 1) * 260 -- legend in one row
        o[#o + 1] = ('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>'):format(lx, ly, lx + 24, ly, c)
        o[#o + 1] = ('<text x="%d" y="%d">%s</text>'):format(lx + 30, ly + 4, esc(s.label or s.key))
    end
end

function M.svg(path, rows, opts)
    opts = opts or {}
    local xkey = opts.x or "step"
    local panels = opts.panels or { { title = opts.title, series = opts.series or
        error("ds4.plot.svg: opts.series or opts.panels is required", 2) } }
    local W, H = opts.width or 720, opts.height or 420
    local total = H * #panels
    local o = {}
    o[#o + 1] = ('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
        .. 'font-family="sans-serif" font-size="12">'):format(W, total, W, total)
    o[#o + 1] = ('<rect width="%d" height="%d" fill="white"/>'):format(W, total)
    for i, p in ipairs(panels) do
        if type(p.series) ~= "table" then error(("ds4.plot.svg: panels[%d].series is required"):format(i), 2) end
        chart(o, rows, xkey, p.series, p.title, W, H, (i - 1) * H)
    end
    o[#o + 1] = "</svg>\n"
    local f, err = io.open(path, "w")
    if not f then error("ds4.plot.svg: " .. tostring(err), 2) end
    f:write(table.concat(o, "\n"))
    f:close()
    return path
end

return M
