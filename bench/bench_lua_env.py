"""What reading a batch job's environment costs job_submit.lua per submission (issue 40;
docs/perf.md, "job_submit.lua: a job's own NCCL").

The shipped slurm/job_submit.lua in ``lua5.1`` (a stub ``slurm`` table, as
tests/lua/driver.lua). Two files of classes: ``without`` env lines (``[features] own_nccl``
off: the lua reads no environment, what every batch job paid before) and ``with`` them at
the worst case the sync writes (64 classes of each family offered, 256 ``env`` lines of
32 classes each). Each round, in a new random order, ``--calls`` submissions of each
kind, timed with ``os.clock`` (CPU time of the one Lua process):

- ``off``: an ``sbatch -N2`` from a venv (60 variables), the file ``without``: the baseline;
- ``plain``: an ``sbatch -N2`` with no VIRTUAL_ENV, CONDA_PREFIX, LD_LIBRARY_PATH or
  LD_PRELOAD (60 variables), the file ``with``: four lookups, no key;
- ``known``: from a venv whose env line narrows the group to 32 classes of the second family;
- ``unknown``: from a venv the file does not name (15 lookups and a key, no line);
- ``long``: an LD_LIBRARY_PATH of 4,000 characters with spaces (the longest keyed: each
  escaped);
- ``big``: 5,000 variables, the venv's last: here each lookup scans the entries in Lua, as
  Slurm's ``_job_env_field`` does in C (the other kinds look a name up in a table: Slurm's
  own scan of 60 entries is not the lua's cost).

Printed: the median time per call of each kind and its ratio to ``off``; and what one
parse of the ``with`` file's body costs. Never asserts a time.

    .venv/bin/python bench/bench_lua_env.py [--rounds 15] [--calls 2000]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from ncclguard.fingerprint.jobenv import submit_key  # noqa: E402
from ncclguard.policy.schedule import ClassCount  # noqa: E402
from ncclguard.sched import classfile  # noqa: E402

KINDS = ("off", "plain", "known", "unknown", "long", "big")
VENV = "/home/alice/venvs/torch-2.5"
LONG = " ".join(f"/sw/lib{i:04d}/lib" for i in range(235))[:4000]

DRIVER = r"""
local script, with_file, without_file = arg[1], arg[2], arg[3]
local rounds, calls, seed = tonumber(arg[4]), tonumber(arg[5]), tonumber(arg[6])
local VENV, LONG = arg[7], arg[8]
slurm = { SUCCESS = 0, ERROR = -1, ESLURM_INVALID_NODE_COUNT = 2006 }
for _, f in ipairs({ "log_user", "log_info", "log_debug", "log_error" }) do
  slurm[f] = function() end
end
local NOW = 1800000000
local CLOCK = NOW - 100
os.time = function() return CLOCK end
assert(loadfile(script))()
local _, ng = debug.getupvalue(slurm_job_submit, 1)
CLOCK = NOW
-- the lua reads its file at most once a second: a second later on each switch of file
local function use(path)
  ng.CLASSES_FILE = path
  CLOCK = (CLOCK == NOW) and NOW + 1 or NOW
end
local function common(n)
  local t = {}
  for i = 1, n do t[#t + 1] = "VAR" .. i .. "=/usr/share/value/" .. i end
  return t
end
-- job_desc.environment: looked up by name through __index, as Slurm's proxy table
local function by_name(entries)
  local t = {}
  for _, e in ipairs(entries) do
    local k, v = string.match(e, "^([^=]*)=(.*)$")
    if t[k] == nil then t[k] = v end
  end
  return setmetatable({}, { __index = function(_, name) return t[name] end })
end
local function scanned(entries)  -- the C scan, in Lua: each lookup walks the entries
  return setmetatable({}, { __index = function(_, name)
    local p = name .. "="
    for _, e in ipairs(entries) do
      if string.sub(e, 1, #p) == p then return string.sub(e, #p + 1) end
    end
  end })
end
local venv, plain, other, long = common(59), common(60), common(59), common(59)
venv[#venv + 1] = "VIRTUAL_ENV=" .. VENV
other[#other + 1] = "VIRTUAL_ENV=/home/bob/venv"
long[#long + 1] = "LD_LIBRARY_PATH=" .. LONG
local big = common(4999)
big[#big + 1] = "VIRTUAL_ENV=" .. VENV
local kinds = {
  off = { without_file, by_name(venv) }, plain = { with_file, by_name(plain) },
  known = { with_file, by_name(venv) }, unknown = { with_file, by_name(other) },
  long = { with_file, by_name(long) }, big = { with_file, scanned(big) },
}
local names = { "off", "plain", "known", "unknown", "long", "big" }
local function job(kind)
  return { min_nodes = 2, script = "#!/bin/sh\nsrun train.py\n", environment = kinds[kind][2] }
end
for _, k in ipairs(names) do
  use(kinds[k][1])
  local j = job(k)
  local rc = slurm_job_submit(j, nil, 0)
  io.write("check\t", k, "\t", rc, "\t", tostring(j.features and #j.features), "\t",
    tostring(j.features and string.find(j.features, "nc_j", 1, true) ~= nil), "\n")
end
local f = assert(io.open(with_file))
local data = f:read("*a")
f:close()
local body = string.sub(data, string.find(data, "\n", string.find(data, "\n") + 1) + 1)
local t0 = os.clock()
for _ = 1, 20 do assert(ng.parse_body(body, "bench")) end
io.write("parse\t", #data, "\t", (os.clock() - t0) / 20, "\n")
math.randomseed(seed)
for r = 1, rounds do
  for i = #names, 2, -1 do local k = math.random(i); names[i], names[k] = names[k], names[i] end
  for _, k in ipairs(names) do
    use(kinds[k][1])
    slurm_job_submit(job(k), nil, 0)  -- the file read and parsed outside the timing
    local jobs = {}
    for i = 1, calls do jobs[i] = job(k) end
    local t0 = os.clock()
    for i = 1, calls do slurm_job_submit(jobs[i], nil, 0) end
    io.write("time\t", k, "\t", (os.clock() - t0) / calls, "\n")
  end
end
"""


def class_files(d: Path) -> tuple[Path, Path]:
    host = [f"nc_{i:08x}" for i in range(1, 65)]
    adds = [f"nc_j{i:08x}" for i in range(1, 65)]
    base = classfile.ClassFile(verified=1_800_000_000 - 1,
                               partitions={"*": tuple(ClassCount(f, 8) for f in host)})
    keys = [submit_key({"VIRTUAL_ENV": VENV})] + [
        submit_key({"VIRTUAL_ENV": f"/home/u{i:03d}/venv", "NCCL_NET": "IB"})
        for i in range(1, 256)]
    cf = classfile.ClassFile(**{**base.__dict__,
                                "adds": {"*": tuple(ClassCount(f, 8) for f in adds)},
                                "envs": {k: tuple(adds[i % 2::2]) for i, k in enumerate(keys)
                                         if k is not None}})
    data = classfile.render(cf)
    assert data.count(b"\nenv ") == 256, "the worst case did not fit the file"
    (d / "with").write_bytes(data)
    (d / "without").write_bytes(classfile.render(base))
    return d / "with", d / "without"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=40)
    args = ap.parse_args()
    lua = shutil.which("lua5.1")
    if lua is None:
        print("lua5.1 is not installed (apt-get install lua5.1)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        with_file, without_file = class_files(d)
        (d / "driver.lua").write_text(DRIVER)
        r = subprocess.run([lua, str(d / "driver.lua"), str(REPO / "slurm" / "job_submit.lua"),
                            str(with_file), str(without_file), str(args.rounds),
                            str(args.calls), str(args.seed), VENV, LONG],
                           capture_output=True, text=True, check=True)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for line in r.stdout.splitlines():
        tag, kind, *rest = line.split("\t")
        if tag == "check":
            print(f"{kind:8s} rc {rest[0]}, constraint of {rest[1]} characters, "
                  f"second family: {rest[2]}")
        elif tag == "parse":
            print(f"one parse of the file's body ({kind} bytes): {float(rest[0]) * 1e3:.1f} ms")
        else:
            times[kind].append(float(rest[0]))
    base = statistics.median(times["off"])
    print(f"\n{args.rounds} rounds of {args.calls} calls, interleaved; median per call")
    for kind in KINDS:
        med = statistics.median(times[kind])
        print(f"{kind:8s} {med * 1e6:8.1f} us  {med / base:5.2f}x off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
