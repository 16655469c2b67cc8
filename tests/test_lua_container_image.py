"""What job_submit.lua can see of pyxis's ``--container-image`` at submit, on the real
Slurm of this machine (issue 30, "prevention for image jobs"; docs/slurm.md).

A real slurmctld whose plugstack loads the pyxis stub (a SPANK plugin named ``pyxis``
registering pyxis's options, compiled against libslurm-dev's ``spank.h``:
devtools/images.py) and whose ``job_submit.lua`` is a probe: for each submission it writes
one JSON line of what Slurm's lua API shows (``job_desc.spank_job_env`` read both by index
from 0 and with ``ipairs``, ``spank_job_env_size``, ``environment`` looked up by name, the
script's lines that contain "container", ``argv``, ``comment``, ``admin_comment``, Slurm's
own ``container``). The tests assert what each release does, so that a release that does
otherwise fails here, naming itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.parts import pyxis_plugstack
from helpers.slurm import require_slurm

from devtools.devcluster import DevCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

IMG = "nvcr.io#nvidia/pytorch:25.01-py3"  # a registry reference, in pyxis's syntax
MOUNTS = "/scratch:/scratch"
OPT = "_SLURM_SPANK_OPTION_pyxis_container_image"  # Slurm's name for the option's value
OPT_MOUNTS = "_SLURM_SPANK_OPTION_pyxis_container_mounts"

#: Names the probe looks up in ``job_desc.environment`` (a table that can only be indexed
#: by name: Slurm's ``__index`` looks the name up in the job's environment).
ENV_NAMES = (OPT, f"SLURM_SPANK_{OPT}", f"SPANK_{OPT}", "PYXIS_CONTAINER_IMAGE")

PROBE_LUA = r"""
-- A probe, not ncclguard's job_submit.lua: records what the lua API shows of a job's
-- SPANK options at submit, one JSON line per submission, and accepts every job.
local OUT = @OUT@
local ENV_NAMES = @ENV_NAMES@

local function jstr(s)
    if s == nil then return "null" end
    s = tostring(s):gsub('[%c"\\]', function(c)
        return string.format("\\u%04x", string.byte(c)) end)
    return '"' .. s .. '"'
end

local function jlist(t)
    local parts = {}
    for _, v in ipairs(t) do parts[#parts + 1] = v end
    return "[" .. table.concat(parts, ",") .. "]"
end

-- a table Slurm built with keys 0..n-1: its entries in key order, as JSON strings
local function by_key(t)
    if t == nil then return "null" end
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
    local out = {}
    for _, k in ipairs(keys) do out[#out + 1] = jstr(tostring(k)) .. ":" .. jstr(t[k]) end
    return "{" .. table.concat(out, ",") .. "}"
end

local function probe(j)
    local f = {}
    f[#f + 1] = '"name":' .. jstr(j.name)
    local size = j.spank_job_env_size
    f[#f + 1] = '"spank_job_env_size":' .. tostring(size)
    local env = j.spank_job_env
    f[#f + 1] = '"spank_job_env_type":' .. jstr(type(env))
    if env ~= nil then
        local idx = {}
        for i = 0, (size or 0) - 1 do idx[#idx + 1] = jstr(env[i]) end
        f[#f + 1] = '"spank_job_env":' .. jlist(idx)
        local ip = {}
        for _, v in ipairs(env) do ip[#ip + 1] = jstr(v) end
        f[#f + 1] = '"spank_job_env_ipairs":' .. jlist(ip)
        f[#f + 1] = '"spank_job_env_keys":' .. by_key(env)
    end
    f[#f + 1] = '"batch":' .. tostring(j.script ~= nil)
    local e = j.environment
    f[#f + 1] = '"environment_type":' .. jstr(type(e))
    if e ~= nil then
        local got = {}
        for _, n in ipairs(ENV_NAMES) do got[#got + 1] = jstr(n) .. ":" .. jstr(e[n]) end
        f[#f + 1] = '"environment":{' .. table.concat(got, ",") .. "}"
    end
    local lines = {}
    if j.script ~= nil then
        for line in string.gmatch(j.script, "[^\n]+") do
            if string.find(line, "container", 1, true) then lines[#lines + 1] = jstr(line) end
        end
    end
    f[#f + 1] = '"script_lines":' .. jlist(lines)
    f[#f + 1] = '"argv":' .. by_key(j.argv)
    f[#f + 1] = '"comment":' .. jstr(j.comment)
    f[#f + 1] = '"admin_comment":' .. jstr(j.admin_comment)
    f[#f + 1] = '"container":' .. jstr(j.container)
    return "{" .. table.concat(f, ",") .. "}"
end

function slurm_job_submit(job_desc, part_list, submit_uid)
    local ok, line = pcall(probe, job_desc)
    if not ok then line = '{"name":' .. jstr(job_desc.name) .. ',"error":' .. jstr(line) .. "}" end
    local out = io.open(OUT, "a")
    if out then
        out:write(line, "\n")
        out:close()
    end
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

return slurm.SUCCESS
"""


def _lua_list(names: tuple[str, ...]) -> str:
    return "{" + ", ".join(json.dumps(n) for n in names) + "}"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevCluster, Path]]:
    require_slurm()
    root = tmp_path_factory.mktemp("luaprobe")
    plugstack = pyxis_plugstack(root)
    out = root / "probe.jsonl"
    lua = root / "probe.lua"
    lua.write_text(PROBE_LUA.replace("@OUT@", json.dumps(str(out)))
                   .replace("@ENV_NAMES@", _lua_list(ENV_NAMES)))
    with DevCluster(root / "cluster", nodes=2, prolog=False, job_submit_lua=lua,
                    extra_conf=f"PlugStackConfig={plugstack}") as c:
        yield c, out


def _release(c: DevCluster) -> tuple[str, tuple[int, int]]:
    text = c.run(["sbatch", "--version"]).stdout.strip()  # "slurm-wlm 22.05.8", "slurm 24.11.5"
    m = re.search(r"(\d+)\.(\d+)\.\d+", text)
    assert m, text
    return m.group(0), (int(m.group(1)), int(m.group(2)))


def _seen(out: Path, name: str) -> dict[str, Any]:
    recs = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
    mine = [r for r in recs if r.get("name") == name]
    assert len(mine) == 1, (name, recs)
    assert "error" not in mine[0], mine[0]
    return mine[0]


def _script(c: DevCluster, name: str, body: str) -> Path:
    path = c.root / "tmp" / f"{name}.sh"
    path.write_text(body)
    return path


def _check(c: DevCluster, out: Path, name: str, want: dict[str, Any]) -> None:
    release, _ = _release(c)
    seen = _seen(out, name)
    got = {k: seen.get(k) for k in want}
    assert got == want, f"Slurm {release}, {name}: the lua saw {got}"


def _image_only(value: str | None, size: int | None = None) -> dict[str, Any]:
    """What the probe shows of a job whose SPANK options are ``--container-image=value``
    only (None: no SPANK option at all)."""
    if value is None:
        return {"spank_job_env_size": 0, "spank_job_env_type": "nil"}
    entry = f"{OPT}={value}"
    return {"spank_job_env_size": 1, "spank_job_env_type": "table",
            "spank_job_env": [entry], "spank_job_env_keys": {"0": entry},
            "spank_job_env_ipairs": []}  # Slurm numbers the entries from 0


def _batch_env(value: str | None) -> dict[str, Any]:
    """``job_desc.environment`` of a batch job: sbatch sets each SPANK job-environment
    entry in the job's environment twice, as itself and behind ``SLURM_SPANK_``."""
    return {OPT: value, f"SLURM_SPANK_{OPT}": value, f"SPANK_{OPT}": None,
            "PYXIS_CONTAINER_IMAGE": None}


def test_sbatch_option_is_in_spank_job_env_at_submit(probe: tuple[DevCluster, Path]) -> None:
    c, out = probe
    job = c.sbatch(["-J", "p-sbatch", f"--container-image={IMG}",
                    f"--container-mounts={MOUNTS}", "--wrap", "true"])
    _check(c, out, "p-sbatch", {
        "spank_job_env_size": 2,
        "spank_job_env_type": "table",
        "spank_job_env": [f"{OPT}={IMG}", f"{OPT_MOUNTS}={MOUNTS}"],
        # Slurm numbers the entries from 0: ipairs misses the first one
        "spank_job_env_ipairs": [f"{OPT_MOUNTS}={MOUNTS}"],
        "spank_job_env_keys": {"0": f"{OPT}={IMG}", "1": f"{OPT_MOUNTS}={MOUNTS}"},
        "batch": True,
        "environment_type": "table",
        "environment": _batch_env(IMG),
        "script_lines": [],
        "argv": None,
        "comment": None, "admin_comment": None, "container": None,
    })
    assert c.wait_job(job, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"


def test_no_spank_option_no_spank_job_env(probe: tuple[DevCluster, Path]) -> None:
    c, out = probe
    c.sbatch(["-J", "p-none", "--wrap", "true"])
    _check(c, out, "p-none", {**_image_only(None), "environment": _batch_env(None),
                              "script_lines": []})


def test_sbatch_directive_quoted_is_in_spank_job_env(probe: tuple[DevCluster, Path]) -> None:
    c, out = probe
    line = f'#SBATCH --container-image="{IMG}"'
    c.sbatch(["-J", "p-directive", str(_script(c, "directive", f"#!/bin/sh\n{line}\ntrue\n"))])
    _check(c, out, "p-directive", {**_image_only(IMG), "environment": _batch_env(IMG),
                                   "script_lines": [line]})


def test_sbatch_directive_unquoted_registry_ref_is_cut_at_its_hash(
        probe: tuple[DevCluster, Path]) -> None:
    """sbatch reads an unescaped ``#`` in an ``#SBATCH`` line as the start of a comment
    (``get_argument()``, src/sbatch/opt.c): pyxis gets ``nvcr.io``, the script says more."""
    c, out = probe
    line = f"#SBATCH --container-image={IMG}"
    c.sbatch(["-J", "p-hash", str(_script(c, "hash", f"#!/bin/sh\n{line}\ntrue\n"))])
    cut = IMG.split("#", 1)[0]
    _check(c, out, "p-hash", {**_image_only(cut), "environment": _batch_env(cut),
                              "script_lines": [line]})


def test_an_image_set_per_step_is_only_in_the_script(probe: tuple[DevCluster, Path]) -> None:
    c, out = probe
    line = f"srun --container-image='{IMG}' true"
    c.sbatch(["-J", "p-step", str(_script(c, "step", f"#!/bin/sh\n{line}\n"))])
    _check(c, out, "p-step", {**_image_only(None), "environment": _batch_env(None),
                              "script_lines": [line]})


def test_the_option_set_from_the_environment(probe: tuple[DevCluster, Path]) -> None:
    """``SLURM_SPANK_<option's variable>`` sets a SPANK option
    (``spank_process_env_options()``, src/common/plugstack.c, spank.c from 24.11), and
    sbatch puts that very variable in a batch job's environment (``_set_spank_env()``,
    src/sbatch/sbatch.c): an sbatch inside a container job inherits its image (below)."""
    c, out = probe
    c.run(["sbatch", "-J", "p-env", "--wrap", "true"], env={f"SLURM_SPANK_{OPT}": IMG})
    _check(c, out, "p-env", {**_image_only(IMG), "environment": _batch_env(IMG)})


@pytest.mark.parametrize("cmd", ["srun", "salloc"])
def test_interactive_option_is_in_spank_job_env(probe: tuple[DevCluster, Path], cmd: str) -> None:
    c, out = probe
    r = c.run([cmd, "-J", f"p-{cmd}", "-N1", f"--container-image={IMG}", "true"], check=False,
              timeout=60)
    assert r.returncode == 0, r.stderr
    _check(c, out, f"p-{cmd}", {**_image_only(IMG), "batch": False, "script_lines": [],
                                "environment_type": "table", "environment": {
                                    n: None for n in ENV_NAMES}})


def test_an_sbatch_inside_an_image_job_inherits_its_image(probe: tuple[DevCluster, Path]) -> None:
    """The variable of the case above, from a batch job's own environment: a job that a
    container job submits is a container job too, unless it says otherwise."""
    c, out = probe
    outer = c.sbatch(["-J", "p-outer", f"--container-image={IMG}",
                      "--wrap", "sbatch -J p-inner --wrap true"])
    assert c.wait_job(outer, {"COMPLETED", "FAILED"}, 60) == "COMPLETED"
    _check(c, out, "p-inner", {**_image_only(IMG), "environment": _batch_env(IMG)})
