-- proc_status.lua — status(key): a size line of /proc/self/status in bytes (VmRSS, VmHWM: the process's resident set
-- now and at its peak), for the memory benches (cp_memory.lua, ep_shard_memory.lua, lora_memory.lua). Linux only.
return function(key)
    for line in io.lines("/proc/self/status") do
        local kb = line:match("^" .. key .. ":%s+(%d+)")
        if kb then return tonumber(kb) * 1024 end
    end
end
