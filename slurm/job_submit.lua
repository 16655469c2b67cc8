--[[
ncclguard's job_submit.lua: Slurm itself picks the nodes of one class for a multi-node job.

Every multi-node job gets a matching-OR constraint over the compatibility classes,
"[nc_1a2b3c4d|nc_99aa00bb]" (in --prefer too, when the job has one: Slurm tries that
first), so that all its nodes carry the same class feature (docs/slurm.md, "Matching
OR"). The classes come from the file that `ncclguard features sync` writes
(lua cannot ask Slurm for nodes), in preference order: the partition's largest class
first. The PrologSlurmctld gate stays the backstop for everything this does not cover.
docs/scheduling.md has the deployment.

This runs inside slurmctld, under its locks, for every submission, so:
  - its work is bounded by what Slurm can use, whatever a user sends: a constraint,
    preference, comment, --extra, partition or GPU request longer than Slurm's own
    1024-character cap (which Slurm checks only after this plugin) is handed back for
    Slurm to refuse, before any scan (a constraint or preference cut to 1025
    characters, which Slurm refuses the same way, faster); a required node list (-w) is
    read only up to MAX_REQ_NODES characters and as many names as the file has nodes;
    the group is sized arithmetically, once;
  - it never turns a constraint Slurm accepts into one Slurm rejects (it joins only
    expressions that stay valid inside parentheses: ncclguard/sched/group.py);
  - every error of its own is trapped: the job goes on without a group, one log line,
    and the gate checks it (from 26.05 an untrapped error would reject the job);
  - it opens only a regular file and never blocks on it, and parses the file again only
    when the classes in it changed, so its cost per submission does not grow with it.

Left alone (the gate checks them): jobs that cannot span more than one node (or fewer
than [policy] min_nodes), jobs with ncclguard=off in their comment or --extra (where the
gate allows it), jobs in partitions the gate does not guard, jobs whose constraint or
--prefer has a bracket group of its own (Slurm allows one), parentheses, a count (a*2)
or a trailing operator, heterogeneous jobs (each component would choose on its own),
-w lists it cannot read, and every job while the file is missing, unreadable, malformed
or not verified since this slurmctld loaded the script (its runtime features may be gone).

Refused at submit, with a message:
  - a constraint (or --prefer) whose bracket groups name more than 64 features:
    slurmctld's matching-OR bitmaps hold 64 positions, one per term of a bracket group
    (MAX_FEATURES and _valid_features() in src/slurmctld/node_scheduler.c, no bound
    check; slurmctld 22.05 crashed on 79);
  - a job that asks for more nodes than the largest class of its partition holds;
  - a job whose required nodes (-w) span classes, or lie in a class too small for it
    (Slurm gives a job its required nodes whatever its constraint), unless the file says
    "required_nodes gate".

Lua 5.1 (Debian's slurm-wlm links liblua5.1). The same decisions in Python:
ncclguard/sched/submit.py; tests/test_lua_submit.py runs one corpus through both. A site
with its own job_submit.lua keeps this file's functions and calls
ncclguard.job_submit(job_desc) from its slurm_job_submit and ncclguard.job_modify(job_desc)
from its slurm_job_modify.

Over 500 lines: Slurm loads one job_submit.lua, and each bound above is code that must run
inside it; the parse rules it shares with Python are tested against ncclguard/sched/
(tests/test_lua_submit.py).
]]

local ncclguard = {}

-- Where `ncclguard features sync` writes the classes ([features] classes_file).
ncclguard.CLASSES_FILE = "/var/lib/ncclguard-features/classes"
-- A file not verified for this long is not trusted: the sync daemon is not running.
ncclguard.FRESH_S = 60
ncclguard.MAX_TERMS = 64        -- MAX_FEATURES, src/slurmctld/node_scheduler.c
ncclguard.MAX_STRING = 1024     -- Slurm's cap (_test_job_desc_fields, job_mgr.c)
ncclguard.MAX_FILE = 1048576    -- ncclguard/sched/classfile.py MAX_BYTES
ncclguard.MAX_MEMBERS = 262144  -- classfile.py MAX_MEMBERS
ncclguard.MAX_REQ_NODES = 65536 -- the longest -w list read
ncclguard.MAGIC = "ncclguard-classes 4"
ncclguard.MAX_IMAGES = 256      -- classfile.py MAX_IMAGES: image lines in the file
ncclguard.MAX_REF = 1024        -- an image key's length (ncclguard/fingerprint/imageref.py)
ncclguard.MAX_IMAGE_VALUE = 4096 -- submit.py MAX_IMAGE_VALUE: the longest --container-image read
ncclguard.MAX_SPANK_ENV = 256   -- submit.py MAX_SPANK_ENV: spank_job_env entries looked at
ncclguard.MAX_ENVS = 256        -- classfile.py MAX_ENVS: env lines in the file
-- ncclguard/fingerprint/jobenv.py MAX_SUBMIT_KEY: the longest key built from a job's
-- environment, and the variables it is built from, in its order (INPUTS)
ncclguard.MAX_ENV_KEY = 4096
ncclguard.ENV_INPUTS = { "LD_PRELOAD", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH" }
-- pyxis's --container-image in spank_job_env (docs/slurm.md)
ncclguard.IMAGE_OPTION = "_SLURM_SPANK_OPTION_pyxis_container_image="
ncclguard.DOCKER_HUB = "registry-1.docker.io"
-- the fields Slurm caps at MAX_STRING after this plugin ran
ncclguard.CAPPED = { "features", "prefer", "comment", "extra", "partition", "tres_per_job" }

local NO_VAL = 4294967294
local NO_VAL16 = 65534
-- Set when this script is loaded: by a new slurmctld, or after the script changed. The
-- file is trusted once verified in a later second (os.time() counts whole seconds, and a
-- verification in the same second may have come before a restart).
ncclguard.LOADED_AT = os.time()

-- The file as last read (at most once a second), and the last body parsed.
local cache = { at = nil, cf = nil, err = nil, body = nil, parsed = nil, perr = nil }

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

-- A class of the second family (what nodes give a job's own NCCL): nc_j and hex digits.
local function valid_adds(f)
  local hex = string.match(f, "^nc_j([0-9a-f]+)$")
  return hex ~= nil and #hex >= 8 and #hex <= 64
end

-- An env line's key as written (classfile.py decode_key): "!" to "~" but "%", and %XX
-- for any other ASCII byte (00 to 7F: a key is ASCII, env_key's bytes are compared as
-- they are); nil for anything else, or longer than 3 x MAX_ENV_KEY.
local function decode_key(word)
  if #word > 3 * ncclguard.MAX_ENV_KEY or string.find(word, "[^!-~]") then return nil end
  local rest = string.gsub(word, "%%[0-7][0-9A-F]", "")
  if string.find(rest, "%", 1, true) then return nil end
  return (string.gsub(word, "%%([0-7][0-9A-F])",
    function(h) return string.char(tonumber(h, 16)) end))
end

-- A line's classes as a set (its words from `from` on), or nil.
local function class_set(w, from, valid)
  local set = {}
  for i = from, #w do
    if not valid(w[i]) then return nil end
    set[w[i]] = true
  end
  return set
end

-- A partition line's classes ("f:count" words from index 3 on), or nil.
local function class_list(w, valid)
  local list = {}
  for i = 3, #w do
    local f, count = string.match(w[i], "^([%w_]+):(%d+)$")
    if not f or not valid(f) or #count > 18 then return nil end
    list[#list + 1] = { feature = f, nodes = tonumber(count) }
  end
  return list
end

local function valid_partition(p)
  return #p >= 1 and #p <= 64 and string.match(p, "^[%w_%.%-]+$") ~= nil
end

local function is_digits(s)
  return #s >= 1 and #s <= 18 and string.match(s, "^%d+$") ~= nil
end

-- The names of a hostlist of comma-separated items, each a name or prefix[ranges]
-- (classfile.expand_members): a table, or nil and why; at most `limit` names.
function ncclguard.expand(list, limit)
  local out, n, pos, len = {}, 0, 1, #list
  if len == 0 then return nil, "empty hostlist" end
  while true do
    local s, e, prefix, ranges = string.find(list, "^([^%[%],%s]*)%[([%d,%-]+)%]", pos)
    if s then
      for r in string.gmatch(ranges .. ",", "([^,]*),") do
        local lo, hi = string.match(r, "^(%d+)%-(%d+)$")
        if not lo then lo = string.match(r, "^(%d+)$"); hi = lo end
        if not lo or #lo > 9 or #hi > 9 then return nil, "not a range: " .. r end
        local a, b = tonumber(lo), tonumber(hi)
        if b < a or n + b - a + 1 > limit then
          return nil, "range " .. r .. ": backwards or more than " .. limit .. " hosts"
        end
        local fmt = "%s%0" .. #lo .. "d"
        for i = a, b do n = n + 1; out[n] = string.format(fmt, prefix, i) end
      end
    else
      s, e = string.find(list, "^[^%[%],%s]+", pos)
      if not s then return nil, "not a list of names and prefix[ranges]" end
      n = n + 1
      if n > limit then return nil, "more than " .. limit .. " hosts" end
      out[n] = string.sub(list, s, e)
    end
    pos = e + 1
    if pos > len then return out end
    if string.sub(list, pos, pos) ~= "," or pos == len then
      return nil, "not a list of names and prefix[ranges]"
    end
    pos = pos + 1
  end
end

-- The file's lines after line 2 -> a table, or nil and why. The same rules as
-- ncclguard/sched/classfile.py's parse(): anything unexpected makes the file unusable.
function ncclguard.parse_body(body, where)
  local cf = { partitions = {}, members = {}, sizes = {}, nodes = 0, images = {}, nimages = 0,
                adds = {}, envs = {}, nenvs = 0 }
  local n, ended, seen = 2, false, {}
  for line in string.gmatch(body, "([^\n]*)\n") do
    n = n + 1
    local w = words(line)
    if #w > 0 then
      local key = w[1]
      if ended then return nil, where .. ": line " .. n .. ": text after end" end
      if key == "end" and #w == 1 then
        ended = true
      elseif (key == "min_nodes" or key == "max_alternatives" or key == "opt_out")
             and #w == 2 and is_digits(w[2]) and cf[key] == nil then
        cf[key] = tonumber(w[2])
      elseif key == "required_nodes" and #w == 2 and (w[2] == "refuse" or w[2] == "gate")
             and cf.required_nodes == nil then
        cf.required_nodes = w[2]
      elseif key == "default" and #w == 2 and valid_partition(w[2]) and cf.default == nil then
        cf.default = w[2]
      elseif key == "guarded" and #w >= 2 and cf.guarded == nil then
        cf.guarded = true
        if not (#w == 2 and w[2] == "*") then
          cf.guarded_list = {}
          for i = 2, #w do
            if not valid_partition(w[i]) then return nil, where .. ": line " .. n .. ": bad partition" end
            cf.guarded_list[w[i]] = true
          end
        end
      elseif (key == "partition" or key == "adds") and #w >= 2 then
        -- a partition's classes, of the host's stack or of the second family
        local lists, valid = cf.partitions, valid_feature
        if key == "adds" then lists, valid = cf.adds, valid_adds end
        local name = w[2]
        if (name ~= "*" and not valid_partition(name)) or lists[name] then
          return nil, where .. ": line " .. n .. ": bad " .. key
        end
        local list = class_list(w, valid)
        if not list then return nil, where .. ": line " .. n .. ": bad class" end
        lists[name] = list
      elseif key == "members" and #w == 3 then
        local f = w[2]
        if not valid_feature(f) or cf.sizes[f] then return nil, where .. ": line " .. n .. ": bad class" end
        local hosts, why = ncclguard.expand(w[3], ncclguard.MAX_MEMBERS - cf.nodes)
        if not hosts then return nil, where .. ": line " .. n .. ": " .. why end
        for _, h in ipairs(hosts) do
          if seen[h] then return nil, where .. ": line " .. n .. ": a host in two classes" end
          seen[h] = true
          cf.members[h] = f
        end
        cf.sizes[f] = #hosts
        cf.nodes = cf.nodes + #hosts
      elseif key == "image" and #w >= 3 then
        local name, expires = w[2], w[3]
        if #name > ncclguard.MAX_REF or string.find(name, "[^!-~]") or cf.images[name]
           or not is_digits(expires) or cf.nimages >= ncclguard.MAX_IMAGES then
          return nil, where .. ": line " .. n .. ": bad image"
        end
        local set = class_set(w, 4, valid_feature)
        if not set then return nil, where .. ": line " .. n .. ": bad class" end
        cf.images[name] = { expires = tonumber(expires), classes = set, count = #w - 3 }
        cf.nimages = cf.nimages + 1
      elseif key == "env" and #w >= 2 then
        local name = decode_key(w[2])
        if name == nil or cf.envs[name] or cf.nenvs >= ncclguard.MAX_ENVS then
          return nil, where .. ": line " .. n .. ": bad env"
        end
        local set = class_set(w, 3, valid_adds)
        if not set then return nil, where .. ": line " .. n .. ": bad class" end
        cf.envs[name] = set
        cf.nenvs = cf.nenvs + 1
      else
        return nil, where .. ": line " .. n .. ": not understood"
      end
    end
  end
  if not ended then return nil, where .. ": no end line (cut short?)" end
  for _, k in ipairs({ "min_nodes", "max_alternatives", "opt_out", "required_nodes", "guarded" }) do
    if cf[k] == nil then return nil, where .. ": missing " .. k end
  end
  if cf.max_alternatives < 1 or cf.max_alternatives > ncclguard.MAX_TERMS then
    return nil, where .. ": max_alternatives out of range"
  end
  return cf
end

-- The file's text -> a table (its body parsed again only when it changed), or nil and why.
function ncclguard.parse(data, where)
  if string.sub(data, -1) ~= "\n" then return nil, where .. ": cut short" end
  local e1 = string.find(data, "\n", 1, true)
  local e2 = string.find(data, "\n", e1 + 1, true)
  if string.sub(data, 1, e1 - 1) ~= ncclguard.MAGIC then
    return nil, where .. ": line 1 is not " .. ncclguard.MAGIC
  end
  local verified = e2 and string.match(string.sub(data, e1 + 1, e2 - 1), "^verified (%d+)$")
  if not verified or #verified > 18 then
    return nil, where .. ": line 2 is not 'verified <seconds>'"
  end
  local body = string.sub(data, e2 + 1)
  if body ~= cache.body then  -- Lua's strings are interned: equal bodies compare at once
    cache.body = body
    cache.parsed, cache.perr = ncclguard.parse_body(body, where)
  end
  if cache.parsed == nil then return nil, cache.perr end
  local cf = {}
  for k, v in pairs(cache.parsed) do cf[k] = v end
  cf.verified = tonumber(verified)
  return cf
end

-- The file's bytes, or nil and why. "r+": opening a FIFO read-write never blocks (Linux),
-- where "r" would wait for a writer inside slurmctld; seeking to the end then tells a
-- regular file (its size) from a FIFO, a socket or a terminal (an error).
local function read_file(path)
  local f, err = io.open(path, "r+")
  if not f then return nil, "cannot open " .. tostring(err) end
  local size = f:seek("end")
  local data
  if size ~= nil and size > 0 and size <= ncclguard.MAX_FILE and f:seek("set", 0) then
    data = f:read(size)
  end
  f:close()
  if size == nil then return nil, path .. ": not a regular file" end
  if size > ncclguard.MAX_FILE then return nil, path .. ": larger than " .. ncclguard.MAX_FILE .. " bytes" end
  if data == nil or #data ~= size then return nil, path .. ": empty or changed while read" end
  return data
end

-- The file, read again at most once a second; nil and why when it cannot be used.
function ncclguard.classes(now)
  if cache.at ~= now then
    -- set first: an error below leaves the file unused for this second
    cache.at, cache.cf, cache.err = now, nil, "the file could not be read"
    local data, err = read_file(ncclguard.CLASSES_FILE)
    if data == nil then
      cache.err = err
    else
      cache.cf, cache.err = ncclguard.parse(data, ncclguard.CLASSES_FILE)
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

-- The job's --container-image as written: its one spank_job_env entry (a table keyed 0 to
-- size-1, docs/slurm.md); nil for none, more than one, or more than MAX_SPANK_ENV entries.
function ncclguard.container_image(job_desc)
  -- the size first: reading spank_job_env makes Slurm build the whole table
  local size = job_desc.spank_job_env_size
  if type(size) ~= "number" or size < 1 or size > ncclguard.MAX_SPANK_ENV then return nil end
  local env = job_desc.spank_job_env
  if type(env) ~= "table" then return nil end
  local opt, found = ncclguard.IMAGE_OPTION, nil
  for i = 0, size - 1 do
    local e = env[i]
    if type(e) == "string" and string.sub(e, 1, #opt) == opt then
      if found ~= nil then return nil end
      found = string.sub(e, #opt + 1)
    end
  end
  return found
end

-- The checks of ncclguard/fingerprint/imageref.py, without regular expressions.
local function valid_component(c)  -- [a-z0-9]+ joined by ".", "_", "__" or dashes
  if not string.find(c, "^[a-z0-9][a-z0-9._%-]*$") or string.find(c, "[._%-]$") then
    return false
  end
  for sep in string.gmatch(c, "[._%-]+") do
    if not (sep == "." or sep == "_" or sep == "__" or string.find(sep, "^%-+$")) then
      return false
    end
  end
  return true
end

local function valid_repo(name)
  for comp in string.gmatch(name .. "/", "([^/]*)/") do
    if not valid_component(comp) then return false end
  end
  return true
end

local function valid_host(h)  -- labels of letters, digits and inner dashes; :port
  local name, port = string.match(h, "^([^:]*):(%d+)$")
  if name == nil then name = h elseif #port > 5 then return false end
  for label in string.gmatch(name .. ".", "([^.]*)%.") do
    if not string.find(label, "^%w$") and not string.find(label, "^%w[%w%-]*%w$") then
      return false
    end
  end
  return true
end

-- A registry reference's key as enroot reads it (imageref.parse(...).key), or nil.
local function registry_key(raw)
  if string.sub(raw, 1, 9) == "docker://" then raw = string.sub(raw, 10) end
  if string.find(raw, "://", 1, true) then return nil end
  local user, registry, image, hub
  local hash = string.find(raw, "#", 1, true)
  if hash then  -- [USER@]REGISTRY#IMAGE
    local head = string.sub(raw, 1, hash - 1)
    image = string.sub(raw, hash + 1)
    local u, rest = string.match(head, "^(.*)@([^@]*)$")
    if u then user, head = u, rest end
    registry, hub = head, false
    if registry == "" then return nil end
  else
    local at = string.find(raw, "@", 1, true)
    if at and string.sub(raw, at + 1, at + 7) ~= "sha256:" then
      user, raw = string.sub(raw, 1, at - 1), string.sub(raw, at + 1)
    end
    local slash = string.find(raw, "/", 1, true)
    local first = slash and string.sub(raw, 1, slash - 1)
    if first and string.find(first, "[.:]") then
      registry, image, hub = first, string.sub(raw, slash + 1), false
    else
      registry, image, hub = ncclguard.DOCKER_HUB, raw, true
    end
  end
  if user ~= nil and (#user < 1 or #user > 128 or not string.find(user, "^[%w._%$%-]+$")) then
    return nil
  end
  if not valid_host(registry) then return nil end
  local name, digest, tag = image, nil, nil
  local at = string.find(image, "@", 1, true)
  if at then
    name, digest = string.sub(image, 1, at - 1), string.sub(image, at + 1)
    if #digest ~= 71 or not string.find(digest, "^sha256:[0-9a-f]+$") then return nil end
  end
  -- the last component (anchored: "[^/]*$" alone would try every start, quadratic)
  if string.find(string.match(name, "^.*/(.*)$") or name, ":", 1, true) then
    name, tag = string.match(name, "^(.*):([^:]*)$")
    if #tag < 1 or #tag > 128 or not string.find(tag, "^[%w_][%w._%-]*$") then return nil end
  end
  if not valid_repo(name) then return nil end
  if hub and not string.find(name, "/", 1, true) then name = "library/" .. name end
  if digest then return registry .. "/" .. name .. "@" .. digest end
  return registry .. "/" .. name .. ":" .. (tag or "latest")
end

-- ASCII white space, spelled out: %s follows slurmctld's locale
local NOT_SPACE = "[^ \t\n\v\f\r]"

-- The key the gate looks the image up by (submit.py image_key): an absolute path as
-- given, or a registry reference's key; nil for anything else.
function ncclguard.image_key(value)
  if type(value) ~= "string" or #value > ncclguard.MAX_IMAGE_VALUE then return nil end
  local i = string.find(value, NOT_SPACE)
  if i == nil then return nil end
  local v = string.sub(value, i, #value - string.find(string.reverse(value), NOT_SPACE) + 1)
  if #v < 1 or #v > ncclguard.MAX_REF or string.find(v, "[^!-~]") then return nil end
  local first = string.sub(v, 1, 1)
  if first == "." then return nil end
  if first == "/" then return v end
  return registry_key(v)
end

-- The number of terms in a constraint's bracket groups (matching OR), the terms
-- slurmctld gives a position each in its 64-bit maps (_valid_features() in
-- src/slurmctld/node_scheduler.c counts only the terms of a bracket group).
-- The key of a batch job's environment (jobenv.py submit_key): NAME=value for each
-- variable of ENV_INPUTS that is set and not empty, joined by NUL; nil when none is, or
-- the key would be longer than MAX_ENV_KEY. `env` is job_desc.environment: each lookup
-- is Slurm's scan of the job's variables in C (_job_env_field), four of them; no value
-- is scanned here (the file's keys are decoded when it is parsed).
function ncclguard.env_key(env)
  local parts, size = {}, -1
  for _, name in ipairs(ncclguard.ENV_INPUTS) do
    local v = env[name]
    if v ~= nil and v ~= "" then
      size = size + #name + #v + 2
      if size > ncclguard.MAX_ENV_KEY then return nil end
      parts[#parts + 1] = name .. "=" .. v
    end
  end
  if #parts == 0 then return nil end
  return table.concat(parts, "\0")
end

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

-- Whether a field is longer than Slurm takes: Slurm refuses the job after this plugin.
-- A constraint or preference that long is cut to MAX_STRING + 1 characters first: Slurm
-- still refuses the job for its length (the same error), but 26.05 no longer spends
-- seconds on the rest of it (docs/perf.md, "job_submit.lua").
local function oversized(job_desc)
  local over = false
  for _, field in ipairs(ncclguard.CAPPED) do
    local v = job_desc[field]
    if type(v) == "string" and #v > ncclguard.MAX_STRING then
      if field == "features" or field == "prefer" then
        job_desc[field] = string.sub(v, 1, ncclguard.MAX_STRING + 1)
      end
      over = true
    end
  end
  return over
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

-- The classes for the job's partition: one partition's own list, else every node's
-- (`lists`: cf.partitions, or cf.adds for the second family).
local function classes_for(cf, partition, lists)
  local name = partition or cf.default
  if name ~= nil and string.find(name, ",", 1, true) == nil and lists[name] then
    return lists[name], "partition " .. name
  end
  return lists["*"] or {}, "the cluster"
end

-- Whether "(user)&[group]" parses wherever `user` alone does (group.py's joinable()):
-- no brackets (one group per job), parentheses (not nested), count (a*2: not inside
-- parentheses) or final operator ("a&" is fine alone, "(a&)" is not).
function ncclguard.joinable(user)
  if user == nil or user == "" then return true end
  return string.find(user, "[%[%]%(%)%*]") == nil and string.find(user, "[&|,]$") == nil
end

local function join(user, group)
  if user == nil or user == "" then return group end
  return "(" .. user .. ")&" .. group
end

local function joined_length(user, group_length)
  if user == nil or user == "" then return group_length end
  return #user + 3 + group_length
end

-- At most 4 hosts of a class, for a message.
local function some(hosts)
  local shown = {}
  for i = 1, math.min(#hosts, 4) do shown[i] = hosts[i] end
  local text = table.concat(shown, ",")
  if #hosts > 4 then text = text .. " and " .. (#hosts - 4) .. " more" end
  return text
end

-- A -w list's hosts, each once, in order: a table, or nil where the lua cannot read it.
local function required_hosts(cf, req)
  if type(req) ~= "string" or req == "" or cf.required_nodes ~= "refuse" then return nil end
  local hosts = ncclguard.expand(req, math.max(cf.nodes, 1))
  if hosts == nil then return nil end
  local out, seen = {}, {}
  for _, h in ipairs(hosts) do
    if not seen[h] then seen[h] = true; out[#out + 1] = h end
  end
  return out
end

-- For a job with required nodes: the one class they are in (from `list`), or nil and the
-- message to refuse the job with, or nil and "gate" where the gate decides.
local function required_class(cf, hosts, list, need, pname)
  local order, by = {}, {}
  for _, h in ipairs(hosts) do
    local f = cf.members[h]
    if f == nil then return nil, "gate" end  -- a node with no class
    if by[f] == nil then by[f] = {}; order[#order + 1] = f end
    local b = by[f]
    b[#b + 1] = h
  end
  if #order > 1 then
    local parts = {}
    for i = 1, math.min(#order, 4) do parts[i] = order[i] .. ": " .. some(by[order[i]]) end
    if #order > 4 then parts[#parts + 1] = "and " .. (#order - 4) .. " more classes" end
    return nil, string.format("ncclguard: the required nodes (-w) have %d different NCCL "
      .. "stacks (%s); ask for nodes of one class (see `ncclguard classes`)",
      #order, table.concat(parts, "; "))
  end
  local f = order[1]
  for _, c in ipairs(list) do
    if c.feature == f then
      if c.nodes >= need then return c end
      return nil, string.format("ncclguard: this job needs %d nodes with one NCCL stack, but "
        .. "its required nodes (-w) are in class %s, which has %d nodes in %s (see "
        .. "`ncclguard classes`)", need, f, c.nodes, pname)
    end
  end
  if cf.sizes[f] < need then
    return nil, string.format("ncclguard: this job needs %d nodes with one NCCL stack, but "
      .. "its required nodes (-w) are in class %s, which has %d nodes (see "
      .. "`ncclguard classes`)", need, f, cf.sizes[f])
  end
  return nil, "gate"  -- not among the partition's classes offered: the gate decides
end

local function reject(code, msg)
  slurm.log_user("%s", msg)
  slurm.log_info("ncclguard: rejected a job: %s", msg)
  return code
end

-- Decide for one job description: slurm.SUCCESS (maybe with job_desc.features set) or
-- an error code with a message to the user.
function ncclguard.submit(job_desc)
  if oversized(job_desc) then return slurm.SUCCESS end  -- Slurm refuses it next
  local req = job_desc.req_nodes
  if type(req) == "string" and #req > ncclguard.MAX_REQ_NODES then return slurm.SUCCESS end
  for _, field in ipairs({ "features", "prefer" }) do
    local msg = ncclguard.too_many_terms(job_desc[field])
    if msg then return reject(slurm.ERROR, msg) end
  end
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
  local has_req = type(req) == "string" and req ~= ""
  if has_req and cf.required_nodes ~= "refuse" then return slurm.SUCCESS end  -- the gate's
  local hosts = required_hosts(cf, req)
  if not (ncclguard.spans(job_desc, threshold) or (hosts ~= nil and #hosts >= threshold)) then
    return slurm.SUCCESS
  end
  if cf.opt_out == 1 and opted_out(job_desc) then return slurm.SUCCESS end
  local partition = job_desc.partition
  if not guarded(cf, partition) then return slurm.SUCCESS end
  local list, pname = classes_for(cf, partition, cf.partitions)
  if #list == 0 then return slurm.SUCCESS end
  local need = 1
  if is_set(job_desc.min_nodes, NO_VAL) and job_desc.min_nodes > 1 then need = job_desc.min_nodes end
  -- a job in a container image the file names: only the classes that run that image
  local stack, see = "with one NCCL stack", "`ncclguard classes`"
  local key = ncclguard.image_key(ncclguard.container_image(job_desc))
  local g = key and cf.images[key]
  if g and (g.expires == 0 or now <= g.expires) then
    -- refused only when it must span nodes: one node loads no net plugin, and the gate
    -- leaves a job on fewer than min_nodes alone
    local must = need >= threshold or (hosts ~= nil and #hosts >= threshold)
    if g.count == 0 and must then
      return reject(slurm.ERROR, string.format("ncclguard: container image %s runs on no "
        .. "class of nodes: its NCCL cannot use the net plugin the nodes give containers, "
        .. "and would fall back to another transport (see `ncclguard check --image %s`)",
        key, key))
    end
    local runnable = {}
    for _, c in ipairs(list) do
      if g.classes[c.feature] then runnable[#runnable + 1] = c end
    end
    if #runnable > 0 then  -- else none of the partition's listed classes: the gate decides
      list = runnable
      stack = "that run image " .. key .. " with one NCCL stack"
      see = "`ncclguard check --image " .. key .. "`"
    end
  elseif key == nil and cf.nenvs > 0 and job_desc.script ~= nil then
    -- a batch job whose environment names a libnccl the collector read (an env line):
    -- the second family's classes that run it, not confined by the hosts' libnccl
    -- (environment is read only for batch jobs: Slurm logs each lookup for others)
    local ek = ncclguard.env_key(job_desc.environment)
    local set = ek and cf.envs[ek]
    -- -w: the file's members are of host classes, which such a job does not load; the
    -- gate judges it by its own NCCL
    if set and has_req then return slurm.SUCCESS end
    if set then
      local alist, aname = classes_for(cf, partition, cf.adds)
      local runnable = {}
      for _, c in ipairs(alist) do
        if set[c.feature] then runnable[#runnable + 1] = c end
      end
      if #runnable > 0 then  -- else the host classes, and the gate decides
        list, pname = runnable, aname
        stack = "that run its own NCCL with one stack"
        see = "`ncclguard check --env`"
      end
    end
  end
  if has_req then
    if hosts == nil then return slurm.SUCCESS end  -- a -w list the lua cannot read
    if #hosts > need then need = #hosts end
    local c, msg = required_class(cf, hosts, list, need, pname)
    if c == nil then
      if msg == "gate" then return slurm.SUCCESS end
      return reject(slurm.ERROR, msg)
    end
    list = { c }
  end
  local largest, chosen = 0, {}
  for _, c in ipairs(list) do
    if c.nodes > largest then largest = c.nodes end
    if c.nodes >= need and #chosen < cf.max_alternatives then chosen[#chosen + 1] = c.feature end
  end
  if #chosen == 0 then
    return reject(slurm.ESLURM_INVALID_NODE_COUNT, string.format(
      "ncclguard: this job needs %d nodes %s, but the largest such set in "
      .. "%s has %d nodes (ask for at most %d, or see %s)",
      need, stack, pname, largest, largest, see))
  end
  local has_prefer = prefer ~= nil and prefer ~= ""
  if not ncclguard.joinable(user) or (has_prefer and not ncclguard.joinable(prefer)) then
    slurm.log_debug("ncclguard: a constraint it cannot join safely; the gate checks the job")
    return slurm.SUCCESS
  end
  -- the group goes into --constraint and, when given, --prefer too: Slurm schedules by
  -- --prefer first, and a preference without the group could pick two classes. As many
  -- classes as keep both within Slurm's cap, counted, not built, one class at a time.
  local longest = #(user or "")
  if has_prefer and #prefer > longest then longest = #prefer end
  local room = ncclguard.MAX_STRING - (longest > 0 and longest + 3 or 0)
  local k, length = 0, 1  -- "[" ... "]": 2 characters, plus 1 per "|"
  for i, f in ipairs(chosen) do
    length = length + #f + 1
    if length > room then break end
    k = i
  end
  if k == 0 then return slurm.SUCCESS end
  local group = "[" .. table.concat(chosen, "|", 1, k) .. "]"
  if has_prefer then job_desc.prefer = join(prefer, group) end
  job_desc.features = join(user, group)
  slurm.log_info("ncclguard: constraint %s for a job of uid %s", job_desc.features,
    tostring(job_desc.user_id))
  return slurm.SUCCESS
end

-- An update of a job: the same crash check. A changed constraint loses the class group
-- (the gate still checks the job).
function ncclguard.modify(job_desc)
  if oversized(job_desc) then return slurm.SUCCESS end  -- Slurm refuses it next
  for _, field in ipairs({ "features", "prefer" }) do
    local msg = ncclguard.too_many_terms(job_desc[field])
    if msg then return reject(slurm.ERROR, msg) end
  end
  return slurm.SUCCESS
end

-- Any error of this script's own: the job goes on without a group, the gate checks it.
local function fail_open(what, err)
  pcall(slurm.log_error, "ncclguard: job_submit.lua %s failed, the job goes on without a "
    .. "class group (the gate checks it): %s", what, tostring(err))
  return slurm.SUCCESS
end

function ncclguard.job_submit(job_desc)
  local ok, rc = pcall(ncclguard.submit, job_desc)
  if ok then return rc end
  return fail_open("submit", rc)
end

function ncclguard.job_modify(job_desc)
  local ok, rc = pcall(ncclguard.modify, job_desc)
  if ok then return rc end
  return fail_open("modify", rc)
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  return ncclguard.job_submit(job_desc)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return ncclguard.job_modify(job_desc)
end

slurm.log_info("ncclguard: job_submit.lua loaded, classes from %s", ncclguard.CLASSES_FILE)

return slurm.SUCCESS
