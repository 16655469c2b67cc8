"""What reading a job's container image costs job_submit.lua per submission
(docs/perf.md, "job_submit.lua: image jobs").

The shipped slurm/job_submit.lua in ``lua5.1`` (a stub ``slurm`` table, as
tests/lua/driver.lua), its file of classes at the worst case the sync writes: 64 classes
offered, 256 ``image`` lines each naming 32 of them. Each round, in a new random order,
``--calls`` submissions of each kind, timed with ``os.clock`` (CPU time of the one Lua
process, so that the VM's other work counts less):

- ``plain``: ``sbatch -N2`` with no image (the baseline: what every job paid before);
- ``image``: the same with ``--container-image=nvcr.io#nvidia/pytorch:25.01-py3``, whose
  line names 32 classes (the group is narrowed to them);
- ``unknown``: an image the file does not name;
- ``long``: a hostile value of 4,096 bytes (the longest read: spaces around a reference);
- ``slashes``: a valid reference of 1,024 characters whose last component is short
  (``a`` x 1,022 + ``/b``: an unanchored ``[^/]*$`` tried every start, found by review);
- ``many``: 256 ``spank_job_env`` entries (the most read), the image the last of them.

Printed: the median time per call of each kind over the rounds, and its ratio to
``plain``; and what one parse of that file's body costs (the lua parses it again when
the body changes). Never asserts a time.

    .venv/bin/python bench/bench_lua_images.py [--rounds 15] [--calls 2000]
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

from ncclguard.policy.schedule import ClassCount  # noqa: E402
from ncclguard.sched import classfile  # noqa: E402

KINDS = ("plain", "image", "unknown", "long", "slashes", "many")

DRIVER = r"""
local script, classes = arg[1], arg[2]
local rounds, calls, seed = tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5])
slurm = { SUCCESS = 0, ERROR = -1, ESLURM_INVALID_NODE_COUNT = 2006 }
for _, f in ipairs({ "log_user", "log_info", "log_debug", "log_error" }) do
  slurm[f] = function() end
end
local NOW = 1800000000
os.time = function() return NOW - 100 end
assert(loadfile(script))()
local _, ng = debug.getupvalue(slurm_job_submit, 1)
ng.CLASSES_FILE = classes
os.time = function() return NOW end
local OPT = "_SLURM_SPANK_OPTION_pyxis_container_image="
local MOUNTS = "_SLURM_SPANK_OPTION_pyxis_container_mounts=/scratch:/scratch"
local function env(list)
  local t = {}
  for i, v in ipairs(list) do t[i - 1] = v end
  return t, #list
end
local many = {}
for i = 1, 255 do many[i] = MOUNTS end
many[256] = OPT .. "nvcr.io#nvidia/pytorch:25.01-py3"
local long = OPT .. string.rep(" ", 2030) .. "nvcr.io#nvidia/pytorch:25.01-py3"
  .. string.rep(" ", 2033)
local kinds = {
  plain = {},
  image = { OPT .. "nvcr.io#nvidia/pytorch:25.01-py3" },
  unknown = { OPT .. "nvcr.io#nvidia/other:1" },
  long = { long },
  slashes = { OPT .. string.rep("a", 1022) .. "/b" },
  many = many,
}
local names = { "plain", "image", "unknown", "long", "slashes", "many" }
local function job(kind)
  local j = { min_nodes = 2 }
  if #kinds[kind] > 0 then j.spank_job_env, j.spank_job_env_size = env(kinds[kind]) end
  return j
end
-- one check of each outcome first
for _, k in ipairs(names) do
  local j = job(k)
  local rc = slurm_job_submit(j, nil, 0)
  io.write("check\t", k, "\t", rc, "\t", tostring(j.features and #j.features), "\n")
end
-- what a change of the file's body costs: one parse of it, inside slurmctld
local f = assert(io.open(classes))
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
    local jobs = {}
    for i = 1, calls do jobs[i] = job(k) end
    local t0 = os.clock()
    for i = 1, calls do slurm_job_submit(jobs[i], nil, 0) end
    io.write("time\t", k, "\t", (os.clock() - t0) / calls, "\n")
  end
end
"""


def classes_file(path: Path) -> None:
    features = [f"nc_{i:08x}" for i in range(1, 65)]
    cf = classfile.ClassFile(
        verified=1_800_000_000 - 1,
        partitions={"*": tuple(ClassCount(f, 8) for f in features)},
        images={("nvcr.io/nvidia/pytorch:25.01-py3" if i == 0 else f"/images/{i:03d}.sqsh"):
                classfile.ImageGroup(0, tuple(features[i % 2::2])) for i in range(256)})
    data = classfile.render(cf)
    assert data.count(b"\nimage ") == 256, "the worst case did not fit the file"
    path.write_bytes(data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=30)
    args = ap.parse_args()
    lua = shutil.which("lua5.1")
    if lua is None:
        print("lua5.1 is not installed (apt-get install lua5.1)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        classes_file(d / "classes")
        (d / "driver.lua").write_text(DRIVER)
        r = subprocess.run([lua, str(d / "driver.lua"), str(REPO / "slurm" / "job_submit.lua"),
                            str(d / "classes"), str(args.rounds), str(args.calls),
                            str(args.seed)], capture_output=True, text=True, check=True)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for line in r.stdout.splitlines():
        tag, kind, *rest = line.split("\t")
        if tag == "check":
            print(f"{kind:8s} rc {rest[0]}, constraint of {rest[1]} characters")
        elif tag == "parse":
            print(f"one parse of the file's body ({kind} bytes): {float(rest[0]) * 1e3:.1f} ms")
        else:
            times[kind].append(float(rest[0]))
    base = statistics.median(times["plain"])
    print(f"\n{args.rounds} rounds of {args.calls} calls, interleaved; median per call")
    for kind in KINDS:
        med = statistics.median(times[kind])
        print(f"{kind:8s} {med * 1e6:8.1f} us  {med / base:5.2f}x plain")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
