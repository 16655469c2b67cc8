--[[ Runs slurm/job_submit.lua outside slurmctld, for tests/test_lua_submit.py.

    lua5.1 tests/lua/driver.lua SCRIPT CASES

CASES is a Lua file returning a list of cases: { file = PATH, now = SECONDS,
loaded = SECONDS, job = { job_desc fields }, modify = BOOL }. Each case loads SCRIPT
afresh (its cache and its LOADED_AT too) with a stub `slurm` table and a stub clock,
points it at the case's file (the `ncclguard` table is the first upvalue of the
script's slurm_job_submit), and prints one line: the case's number, then, hex-encoded
and tab-separated, the return code's name, job_desc.features, job_desc.prefer, the
message to the user, the error logged, and why the file was not used ("" when it was).
]]

local script, cases_path = arg[1], arg[2]
local chunk = assert(loadfile(script))
local cases = assert(loadfile(cases_path))()
local CLOCK = 0
os.time = function() return CLOCK end

local function hex(s)
  if s == nil then return "-" end
  return (string.gsub(tostring(s), ".", function(c) return string.format("%02x", string.byte(c)) end))
end

for i, case in ipairs(cases) do
  local out = { user = nil, err = nil }
  slurm = {
    SUCCESS = 0, ERROR = -1, ESLURM_INVALID_NODE_COUNT = 2006,
    log_user = function(fmt, ...) out.user = string.format(fmt, ...) end,
    log_info = function() end,
    log_debug = function() end,
    log_error = function(fmt, ...) out.err = string.format(fmt, ...) end,
  }
  CLOCK = case.loaded
  chunk()
  local name, ng = debug.getupvalue(slurm_job_submit, 1)
  assert(name == "ncclguard", "the script's slurm_job_submit no longer starts with ncclguard")
  ng.CLASSES_FILE = case.file
  CLOCK = case.now
  if case.inject then ng[case.inject] = function() error("injected error") end end
  local job = case.job
  local rc
  if case.modify then rc = slurm_job_modify(job, nil, nil, 0)
  else rc = slurm_job_submit(job, nil, 0) end
  local names = { [0] = "SUCCESS", [-1] = "ERROR", [2006] = "ESLURM_INVALID_NODE_COUNT" }
  local ok, cf, why = pcall(ng.classes, case.now)
  if not ok then cf, why = nil, "error: " .. tostring(cf) end
  io.write(i, "\t", hex(names[rc] or rc), "\t", hex(job.features), "\t", hex(job.prefer), "\t",
    hex(out.user), "\t", hex(out.err), "\t", hex(cf and "" or why), "\n")
end
