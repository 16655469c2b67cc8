--[[
ncclguard's job_submit.lua: Slurm itself never picks a mixed set of nodes.

Every multi-node job gets a matching-OR constraint over the compatibility classes,
"[nc_1a2b3c4d|nc_99aa00bb]" (in --prefer too, when the job has one: Slurm tries that
first), so that all its nodes carry the same class feature
(slurm-facts.md, "Prevention at scheduling"). The classes come from the file that
`ncclguard features sync` writes (lua cannot ask Slurm for nodes), in preference order:
the partition's largest class first. The PrologSlurmctld gate stays the backstop for
everything this does not cover. docs/scheduling.md has the deployment.

Left alone: jobs that cannot span more than one node (or fewer than [policy] min_nodes),
jobs with ncclguard=off in their comment or --extra (where the gate allows it), jobs in
partitions the gate does not guard, jobs whose constraint or --prefer has a bracket group
of its own (Slurm allows one) or parentheses or a count (a*2) (Slurm rejects them inside
the parentheses the group needs), heterogeneous jobs (each component would choose on its
own), and
every job while the file is missing, unreadable, malformed or not verified since this
slurmctld started (its runtime features may be gone): the gate checks those.

Refused at submit, with a message:
  - a constraint (or --prefer) whose bracket groups name more than 64 features:
    slurmctld's matching-OR bitmaps hold 64 positions, one per term of a bracket group
    (MAX_FEATURES and _valid_features() in src/slurmctld/node_scheduler.c, no bound
    check; slurmctld 22.05 crashed on 79);
  - a job that asks for more nodes than the largest class of its partition holds.

Lua 5.1 (Debian's slurm-wlm links liblua5.1). A site with its own job_submit.lua keeps
this file's functions and calls ncclguard.submit(job_desc) from its slurm_job_submit
and ncclguard.modify(job_desc) from its slurm_job_modify.
]]

local ncclguard = {}

-- Where `ncclguard features sync` writes the classes ([features] classes_file).
ncclguard.CLASSES_FILE = "/var/lib/ncclguard-features/classes"
-- A file not verified for this long is not trusted: the sync daemon is not running.
ncclguard.FRESH_S = 60
ncclguard.MAX_TERMS = 64      -- MAX_FEATURES, src/slurmctld/node_scheduler.c
ncclguard.MAX_CONSTRAINT = 1024  -- Slurm's cap on a job's constraint string
ncclguard.MAX_FILE = 1048576

local NO_VAL = 4294967294
local NO_VAL16 = 65534
-- Set when this script is loaded: by a new slurmctld, or after the script changed. The
-- file is trusted once verified in a later second (os.time() counts whole seconds, and a
-- verification in the same second may have come before a restart).
ncclguard.LOADED_AT = os.time()

local cache = { at = nil, cf = nil, err = nil }

local function words(line)
  local out = {}
  for w in string.gmatch(line, "%S+") do out[#out + 1] = w end
  return out
end

local function valid_feature(f)
  if f == "nc_unknown" then return true end
  local hex = string.match(f, "^nc_([0-9a-f]+)$")
  return hex ~= nil and #hex >= 8 and #hex <= 64
end

local function valid_partition(p)
  return #p >= 1 and #p <= 64 and string.match(p, "^[%w_%.%-]+$") ~= nil
end

-- The file's text -> a table, or nil and why. The same rules as
-- ncclguard/sched/classfile.py's parse(): anything unexpected makes the file unusable.
function ncclguard.parse(data, where)
  local cf = { partitions = {} }
  local n, ended = 0, false
  if string.sub(data, -1) ~= "\n" then return nil, where .. ": cut short" end
  for line in string.gmatch(data, "([^\n]*)\n") do
    n = n + 1
    local w = words(line)
    if n == 1 then
      if line ~= "ncclguard-classes 1" then return nil, where .. ": line 1 is not ncclguard-classes 1" end
    elseif #w > 0 then
      local key = w[1]
      if ended then return nil, where .. ": line " .. n .. ": text after end" end
      if key == "end" and #w == 1 then
        ended = true
      elseif (key == "verified" or key == "min_nodes" or key == "max_alternatives"
              or key == "opt_out") and #w == 2 and string.match(w[2], "^%d+$") and cf[key] == nil then
        cf[key] = tonumber(w[2])
      elseif key == "default" and #w == 2 and valid_partition(w[2]) and cf.default == nil then
        cf.default = w[2]
      elseif key == "guarded" and #w >= 2 and cf.guarded == nil then
        cf.guarded = {}
        if not (#w == 2 and w[2] == "*") then
          cf.guarded_list = {}
          for i = 2, #w do
            if not valid_partition(w[i]) then return nil, where .. ": line " .. n .. ": bad partition" end
            cf.guarded_list[w[i]] = true
          end
        end
      elseif key == "partition" and #w >= 2 then
        local name = w[2]
        if (name ~= "*" and not valid_partition(name)) or cf.partitions[name] then
          return nil, where .. ": line " .. n .. ": bad partition"
        end
        local list = {}
        for i = 3, #w do
          local f, count = string.match(w[i], "^([%w_]+):(%d+)$")
          if not f or not valid_feature(f) then return nil, where .. ": line " .. n .. ": bad class" end
          list[#list + 1] = { feature = f, nodes = tonumber(count) }
        end
        cf.partitions[name] = list
      else
        return nil, where .. ": line " .. n .. ": not understood"
      end
    end
  end
  if not ended then return nil, where .. ": no end line (cut short?)" end
  for _, k in ipairs({ "verified", "min_nodes", "max_alternatives", "opt_out" }) do
    if cf[k] == nil then return nil, where .. ": missing " .. k end
  end
  if cf.guarded == nil then return nil, where .. ": missing guarded" end
  if cf.max_alternatives < 1 or cf.max_alternatives > ncclguard.MAX_TERMS then
    return nil, where .. ": max_alternatives out of range"
  end
  return cf
end

-- The file, read again at most once a second; nil and why when it cannot be used.
function ncclguard.classes(now)
  if cache.at ~= now then
    cache.at, cache.cf, cache.err = now, nil, nil
    local f, err = io.open(ncclguard.CLASSES_FILE, "r")
    if not f then
      cache.err = "cannot open " .. tostring(err)
    else
      local data = f:read(ncclguard.MAX_FILE + 1)
      f:close()
      if data == nil or #data > ncclguard.MAX_FILE then
        cache.err = ncclguard.CLASSES_FILE .. ": empty or too large"
      else
        cache.cf, cache.err = ncclguard.parse(data, ncclguard.CLASSES_FILE)
      end
    end
  end
  local cf = cache.cf
  if cf == nil then return nil, cache.err end
  if cf.verified <= ncclguard.LOADED_AT then
    return nil, "the classes were not verified since this slurmctld started"
  end
  if now - cf.verified > ncclguard.FRESH_S then
    return nil, "the classes were last verified " .. (now - cf.verified) .. " s ago"
  end
  if cf.verified > now + 2 then  -- the clock stepped back: the file's age is unknown
    return nil, "the classes were verified in the future"
  end
  return cf
end

local function is_set(v, none) return v ~= nil and v ~= none end

-- The number of alternatives in a constraint's bracket groups (matching OR), the terms
-- slurmctld gives a position each in its 64-bit maps (_valid_features() in
-- src/slurmctld/node_scheduler.c counts only the terms of a bracket group).
function ncclguard.terms(constraint)
  local count = 0
  for group in string.gmatch(constraint, "%[([^%]]*)%]?") do
    for _ in string.gmatch(group, "[^&|,%(%)]+") do count = count + 1 end
  end
  return count
end

-- nil, or the message for a constraint that could crash slurmctld.
function ncclguard.too_many_terms(constraint)
  if constraint == nil then return nil end
  local count = ncclguard.terms(constraint)
  if count > ncclguard.MAX_TERMS then
    return string.format("ncclguard: a bracket group ([a|b|...]) may name at most %d "
      .. "features (Slurm's limit); this one names %d", ncclguard.MAX_TERMS, count)
  end
  return nil
end

-- Whether the job may span `threshold` nodes or more.
function ncclguard.spans(job_desc, threshold)
  local minn, maxn = job_desc.min_nodes, job_desc.max_nodes
  if is_set(maxn, NO_VAL) and maxn > 0 and maxn < threshold then return false end
  if is_set(minn, NO_VAL) and minn >= threshold then return true end
  if is_set(maxn, NO_VAL) and maxn >= threshold then return true end
  -- no node count: tasks or GPUs per job decide how many nodes Slurm gives
  local tasks, per_node = job_desc.num_tasks, job_desc.ntasks_per_node
  if is_set(tasks, NO_VAL) and tasks >= threshold then
    return not (is_set(per_node, NO_VAL16) and per_node >= tasks)
  end
  local tres = job_desc.tres_per_job
  return tres ~= nil and string.find(tres, "gpu", 1, true) ~= nil
end

local function opted_out(job_desc)
  for _, text in ipairs({ job_desc.comment or "", job_desc.extra or "" }) do
    for w in string.gmatch(string.lower(text), "[^%s,;]+") do
      if w == "ncclguard=off" then return true end
    end
  end
  return false
end

local function guarded(cf, partition)
  if cf.guarded_list == nil then return true end
  if partition == nil then return true end
  for p in string.gmatch(partition, "[^,]+") do
    if cf.guarded_list[p] then return true end
  end
  return false
end

-- The classes for the job's partition: one partition's own list, else every node's.
local function classes_for(cf, partition)
  local name = partition or cf.default
  if name ~= nil and string.find(name, ",", 1, true) == nil and cf.partitions[name] then
    return cf.partitions[name], "partition " .. name
  end
  return cf.partitions["*"] or {}, "the cluster"
end

-- slurm.ERROR (with a message to the user) for a constraint or --prefer that could
-- crash slurmctld, else nil.
local function refuse_crash(job_desc)
  for _, field in ipairs({ "features", "prefer" }) do
    local msg = ncclguard.too_many_terms(job_desc[field])
    if msg then
      slurm.log_user("%s", msg)
      slurm.log_info("ncclguard: rejected a job of uid %s: %s", tostring(job_desc.user_id), msg)
      return slurm.ERROR
    end
  end
  return nil
end

-- A user's expression joined with the class group, or nil where joining is not safe:
-- Slurm rejects nested parentheses and a count (a*2) inside parentheses, and allows one
-- bracket group per job; such jobs are left to the gate.
function ncclguard.combine(user, group)
  if user == nil or user == "" then return group end
  if string.find(user, "[%[%]%(%)%*]") then return nil end
  return "(" .. user .. ")&" .. group
end

-- Decide for one job description: slurm.SUCCESS (maybe with job_desc.features set) or
-- an error code with a message to the user.
function ncclguard.submit(job_desc)
  local refused = refuse_crash(job_desc)
  if refused then return refused end
  if is_set(job_desc.het_job_offset, NO_VAL) then return slurm.SUCCESS end
  local user, prefer = job_desc.features, job_desc.prefer
  if (user ~= nil and string.find(user, "[", 1, true))
     or (prefer ~= nil and string.find(prefer, "[", 1, true)) then
    return slurm.SUCCESS  -- one bracket group per job: theirs
  end
  local now = os.time()
  local cf, why = ncclguard.classes(now)
  if cf == nil then
    slurm.log_debug("ncclguard: no class constraint (%s); the gate checks the job", why)
    return slurm.SUCCESS
  end
  local threshold = math.max(2, cf.min_nodes)
  if not ncclguard.spans(job_desc, threshold) then return slurm.SUCCESS end
  if cf.opt_out == 1 and opted_out(job_desc) then return slurm.SUCCESS end
  local partition = job_desc.partition
  if not guarded(cf, partition) then return slurm.SUCCESS end
  local list, pname = classes_for(cf, partition)
  if #list == 0 then return slurm.SUCCESS end
  local need = 1
  if is_set(job_desc.min_nodes, NO_VAL) and job_desc.min_nodes > 1 then need = job_desc.min_nodes end
  local largest = 0
  local chosen = {}
  for _, c in ipairs(list) do
    if c.nodes > largest then largest = c.nodes end
    if c.nodes >= need and #chosen < cf.max_alternatives then chosen[#chosen + 1] = c.feature end
  end
  if #chosen == 0 then
    local msg = string.format("ncclguard: this job needs %d nodes with one NCCL stack, but the "
      .. "largest such set in %s has %d nodes (ask for at most %d, or see `ncclguard classes`)",
      need, pname, largest, largest)
    slurm.log_user("%s", msg)
    return slurm.ESLURM_INVALID_NODE_COUNT
  end
  -- the group goes into --constraint and, when given, --prefer too: Slurm schedules by
  -- --prefer first, and a preference without the group could pick two classes
  local constraint, preferred
  while #chosen > 0 do
    local group = "[" .. table.concat(chosen, "|") .. "]"
    constraint = ncclguard.combine(user, group)
    preferred = prefer ~= nil and prefer ~= "" and ncclguard.combine(prefer, group) or nil
    if constraint == nil or (prefer ~= nil and prefer ~= "" and preferred == nil) then
      slurm.log_debug("ncclguard: a constraint it cannot join safely; the gate checks the job")
      return slurm.SUCCESS
    end
    if #constraint <= ncclguard.MAX_CONSTRAINT
       and (preferred == nil or #preferred <= ncclguard.MAX_CONSTRAINT) then break end
    table.remove(chosen)
  end
  if #chosen == 0 then return slurm.SUCCESS end
  job_desc.features = constraint
  if preferred ~= nil then job_desc.prefer = preferred end
  slurm.log_info("ncclguard: constraint %s for a job of uid %s", constraint, tostring(job_desc.user_id))
  return slurm.SUCCESS
end

-- An update of a job: the same crash check. A changed constraint loses the class group
-- (the gate still checks the job).
function ncclguard.modify(job_desc)
  return refuse_crash(job_desc) or slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  return ncclguard.submit(job_desc)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return ncclguard.modify(job_desc)
end

slurm.log_info("ncclguard: job_submit.lua loaded, classes from %s", ncclguard.CLASSES_FILE)

return slurm.SUCCESS
