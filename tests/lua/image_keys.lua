--[[ job_submit.lua's image key outside slurmctld, for tests/test_lua_submit.py.

    lua5.1 tests/lua/image_keys.lua SCRIPT VALUES

VALUES holds one --container-image value a line, hex-encoded; each line printed is the key
ncclguard.image_key gives it, hex-encoded, or "-" for none.
]]

local script, values = arg[1], arg[2]
slurm = { SUCCESS = 0, ERROR = -1 }
for _, f in ipairs({ "log_user", "log_info", "log_debug", "log_error" }) do
  slurm[f] = function() end
end
assert(loadfile(script))()
local _, ng = debug.getupvalue(slurm_job_submit, 1)

for line in io.lines(values) do
  local value = string.gsub(line, "%x%x", function(h) return string.char(tonumber(h, 16)) end)
  local key = ng.image_key(value)
  if key == nil then
    io.write("-\n")
  else
    io.write((string.gsub(key, ".", function(c) return string.format("%02x", string.byte(c)) end)), "\n")
  end
end
