"""The job's own NCCL (issue 40): which libnccl a job's environment makes it load, and the
verdict of that NCCL against what each node adds for it (``ncclguard check --env``).

Real parts: virtualenvs made by ``python -m venv`` with the real ``nvidia-nccl-cu12``
wheels installed by pip (offline, from the wheels the tests cache); a conda-style prefix
holding a real ``libnccl.so.2`` under ``lib/``; a module's directory on
``LD_LIBRARY_PATH``; node trees read by the real daemon's ``collect``, with gcc-built
plugins; the library read by the real ``ncclguard-inventoryd read-nccl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import runner
from helpers.parts import build_plugin, place

from devtools.nodetree import LIBDIR, build_node
from inventoryd.node.fingerprint import collect
from ncclguard.config import InventorydConfig, PolicyConfig
from ncclguard.fingerprint.jobenv import MAX_ENTRIES, locate, wheel_paths
from ncclguard.policy import evaluate_nccl, evaluate_values, node_values
from ncclguard.policy.schedule import class_values
from ncclguard.store import Inventory

NET = f"{LIBDIR}/libnccl-net.so"


def test_a_pip_wheel_in_the_venv_wins_over_ld_library_path(venv, nccl_lib, tmp_path) -> None:
    v = venv("2.18.3")
    lib = v / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages/nvidia/nccl/lib/libnccl.so.2"
    assert lib.is_file()  # where pip put it: the wheel's RECORD
    module = tmp_path / "modules/nccl/2.21.5/lib"
    place(tmp_path, str(module.relative_to(tmp_path) / "libnccl.so.2"), nccl_lib("2.21.5"))
    got = locate({"VIRTUAL_ENV": str(v), "LD_LIBRARY_PATH": f"/nowhere:{module}"},
                 os.path.isfile)
    assert (got.source, got.path) == ("VIRTUAL_ENV", str(lib))
    # the module alone: its directory on LD_LIBRARY_PATH
    got = locate({"LD_LIBRARY_PATH": f"/nowhere:{module}"}, os.path.isfile)
    assert (got.source, got.path) == ("LD_LIBRARY_PATH", str(module / "libnccl.so.2"))
    # LD_PRELOAD before everything
    got = locate({"VIRTUAL_ENV": str(v), "LD_PRELOAD": f"libfoo.so {module}/libnccl.so.2"},
                 os.path.isfile)
    assert (got.source, got.path) == ("LD_PRELOAD", f"{module}/libnccl.so.2")
    # a conda env: its lib/ (conda-forge's nccl), unless pip put the wheel in it
    conda = tmp_path / "conda"
    (conda / "conda-meta").mkdir(parents=True)
    place(conda, "/lib/libnccl.so.2", nccl_lib("2.21.5"))
    got = locate({"CONDA_PREFIX": str(conda), "LD_LIBRARY_PATH": str(module)}, os.path.isfile)
    assert (got.source, got.path) == ("CONDA_PREFIX", str(conda / "lib/libnccl.so.2"))
    assert str(lib).replace(str(v), "X") in [p.replace(str(v), "X") for p in wheel_paths(str(v))]
    got = locate({"PATH": "/usr/bin", "NCCL_NET_PLUGIN": "ofi"}, os.path.isfile)
    assert (got.source, got.path, got.nccl) == ("host", None, {"NCCL_NET_PLUGIN": "ofi"})


def test_hostile_environments_are_bounded_and_named(tmp_path) -> None:
    """A 1 MB value, 10,000 LD_LIBRARY_PATH entries, paths into /proc and /dev, relative
    and dot-dot paths: bounded, each named, and nothing looked at outside the rules."""
    asked: list[str] = []

    def is_file(p: str) -> bool:
        asked.append(p)
        return False

    big = "/x" * (1 << 19)
    got = locate({"VIRTUAL_ENV": big,
                  "LD_LIBRARY_PATH": ":".join(f"/{i}" for i in range(10_000)),
                  "NCCL_NET": "IB\0x"}, is_file)
    # none of the first 256 holds it: not the host's, the rest may (not known)
    assert (got.source, got.path) == ("LD_LIBRARY_PATH", None)
    text = "\n".join(got.problems)
    assert "VIRTUAL_ENV: longer than" in text
    assert "LD_LIBRARY_PATH: 10000 entries, none of the first 256 holds" in text
    assert "NCCL_NET: holds a NUL byte" in text
    assert len(asked) <= MAX_ENTRIES + len(wheel_paths("/")) + 2
    for env in ({"LD_PRELOAD": "/proc/self/fd/0/libnccl.so.2 /x/libnccl.so.2"},
                {"LD_PRELOAD": "libnccl.so.2"}, {"LD_PRELOAD": "/a/../etc/libnccl.so.2"},
                {"CONDA_PREFIX": "/dev/shm"}):
        got = locate(env, is_file)
        assert got.source != "host" and got.path is None, (env, got)
        assert "not an absolute path outside /proc" in "\n".join(got.problems)
    assert not any(p.startswith(("/proc/", "/dev/")) or "/../" in p for p in asked)


def test_read_nccl_reads_a_real_library_and_names_what_it_refuses(venv, tmp_path) -> None:
    lib = next(venv("2.18.3").rglob("libnccl.so.2"))

    def read(path: str) -> tuple[int, dict[str, Any]]:
        r = subprocess.run([sys.executable, "-m", "inventoryd.main", "read-nccl", path],
                           capture_output=True, text=True, timeout=120, check=False)
        return r.returncode, json.loads(r.stdout)

    rc, got = read(str(lib))
    assert rc == 0 and got["version"] == "2.18.3" and got["abis"]["net"] == [6, 5, 4]
    fifo = tmp_path / "libnccl.so.2"
    os.mkfifo(fifo)
    t = time.monotonic()
    rc, got = read(str(fifo))
    assert rc == 1 and got["error"] == f"{fifo}: not a regular file"
    assert time.monotonic() - t < 60  # never blocked on the FIFO
    (tmp_path / "text.so").write_text("not a library")
    rc, got = read(str(tmp_path / "text.so"))
    assert rc == 1 and "not an ELF file" in got["error"]
    rc, got = read("relative/libnccl.so.2")
    assert rc == 1 and "not an absolute path" in got["error"]


# ---- the verdict: the job's NCCL against each node's plugin ---------------------------


@pytest.fixture
def node(tmp_path: Path, nccl_lib: Callable[[str], Path], cache_dir: Path
         ) -> Callable[..., dict[str, Any]]:
    trees = iter(range(1 << 20))

    def make(host: str, plugin: Path | None = None, nccl: str | None = None
             ) -> dict[str, Any]:
        root = build_node(tmp_path / f"{host}-{next(trees)}", hostname=host,
                          libnccl=nccl_lib(nccl) if nccl else None,
                          extra_files={NET: plugin} if plugin else {})
        return dict(collect(str(root), host, InventorydConfig()))

    return make


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("jobplugins")
    return {"v8-v5": build_plugin(base / "a", net_abis=[8, 7, 6, 5], name="SiteNet",
                                  filename="libnccl-net.so"),
            "v8-v6": build_plugin(base / "b", net_abis=[8, 7, 6], name="SiteNet",
                                  filename="libnccl-net.so"),
            "v10-v9": build_plugin(base / "c", net_abis=[10, 9], name="SiteNet",
                                   filename="libnccl-net.so")}


def _inventory(tmp_path: Path, fps: dict[str, dict]) -> Callable[..., Any]:
    db, cfg = tmp_path / "inv.db", tmp_path / "ncclguard.toml"
    cfg.write_text("")
    with Inventory(db, values=class_values(PolicyConfig())) as inv:
        for fp in fps.values():
            inv.upsert(fp, now=time.time())
    return runner(db, cfg)


def test_a_venv_job_is_judged_by_its_nccl_not_the_hosts(node, plugins, venv, tmp_path
                                                        ) -> None:
    """Host libnccl 2.18.3 on c[1-2], 2.21.5 on c[3-4], the same plugin (v8..v5)
    everywhere: a job of the host's NCCL is refused (nccl-version); a pip job whose wheel
    is NCCL 2.23.4 uses the plugin at v8 on every node and is accepted."""
    fps = {f"c{i}": node(f"c{i}", plugins["v8-v5"], "2.18.3" if i < 3 else "2.21.5")
           for i in (1, 2, 3, 4)}
    records = {h: node_values(fp) for h, fp in fps.items()}
    assert evaluate_values(records, PolicyConfig()).decision == "refuse"
    job = {"nccl_version": "2.23.4", "net_abis": [8, 7, 6, 5], "path": "/v/libnccl.so.2",
           "source": "VIRTUAL_ENV"}
    v = evaluate_nccl(records, PolicyConfig(), job)
    assert v.decision == "accept", v.format_text()
    assert "not by the host's libnccl" in v.notes[-1]
    run = _inventory(tmp_path, fps)
    r = run("check", "c[1-4]", "--env", str(venv("2.23.4")))
    assert r.exit_code == 0, r.output
    assert "ncclguard: accept" in r.output
    assert run("check", "c[1-4]").exit_code == 2  # the host's NCCL: refused


def test_a_venv_whose_nccl_cannot_use_one_nodes_plugin_is_refused_naming_it(
        node, plugins, venv, tmp_path) -> None:
    """No system libnccl; the plugin offers v8..v6 on c[1-3] and only v10..v9 on c4. A
    pip job with NCCL 2.18.3 (v6..v4) uses the plugin at v6 on c[1-3] and falls back to
    its own IB on c4: refused, naming c4; with NCCL 2.23.4 (v8..v5) the same."""
    fps = {f"c{i}": node(f"c{i}", plugins["v8-v6"] if i < 4 else plugins["v10-v9"])
           for i in (1, 2, 3, 4)}
    run = _inventory(tmp_path, fps)
    r = run("check", "c[1-4]", "--env", str(venv("2.18.3")), "--json")
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["odd_nodes"] == "c4"
    stack = next(f for f in doc["findings"] if f["rule"] == "job-stack")
    assert "the job's own NCCL 2.18.3 (VIRTUAL_ENV" in stack["message"]
    assert "cannot use the net plugin on some nodes" in stack["message"]
    groups = {g["nodes"]: g["value"] for g in stack["groups"]}
    assert groups["c[1-3]"].endswith("with the node's SiteNet v6")
    assert "cannot use the node's SiteNet (v10..v9" in groups["c4"]
    # the host-stack rules are not the judge: no nccl-version, net-plugin, node-adds
    assert {f["rule"] for f in doc["findings"]} <= {"job-stack"}


def test_a_job_whose_nccl_cannot_be_read_is_judged_for_any_nccl(node, plugins, tmp_path
                                                                ) -> None:
    fps = {f"c{i}": node(f"c{i}", plugins["v8-v6"] if i < 4 else None) for i in (1, 2, 3, 4)}
    records = {h: node_values(fp) for h, fp in fps.items()}
    v = evaluate_nccl(records, PolicyConfig(), None, "/x/libnccl.so.2: not a regular file")
    rules = {f.rule: f.severity for f in v.findings}
    assert v.decision == "refuse" and rules["node-adds"] == "refuse"
    assert rules["job-nccl-unknown"] == "warn" and v.odd_nodes == ["c4"]
    assert "judged by what holds for any NCCL" in v.notes[-1]
    # --env on a directory with no libnccl a job would load: an error that says so
    run = _inventory(tmp_path, fps)
    empty = tmp_path / "empty-venv"
    empty.mkdir()
    (empty / "pyvenv.cfg").write_text("home = /usr/bin\n")
    r = run("check", "c[1-4]", "--env", str(empty))
    assert r.exit_code == 3 and "no libnccl.so.2 there that a job would load" in r.output


def test_the_loading_variables_and_their_key() -> None:
    """What the gate hands on of a job's environment: the variables that decide its
    libnccl and its NCCL settings, bounded; one key for the same variables in any order,
    another when one differs."""
    from ncclguard.fingerprint.jobenv import MAX_VALUE, env_key, loading_vars

    env = {"PATH": "/usr/bin", "VIRTUAL_ENV": "/v", "NCCL_NET": "IB", "LD_PRELOAD": "",
           "LD_LIBRARY_PATH": "x" * (MAX_VALUE + 1), "HOME": "/h"}
    got, problems = loading_vars(env)
    assert got == {"VIRTUAL_ENV": "/v", "NCCL_NET": "IB"}
    assert problems == (f"LD_LIBRARY_PATH: longer than {MAX_VALUE} characters, not read",)
    assert env_key(got) == env_key(dict(reversed(list(got.items()))))
    assert env_key(got) != env_key({**got, "NCCL_NET": "Socket"})
    assert env_key({"VIRTUAL_ENV": "/v\udcff"}) != env_key({"VIRTUAL_ENV": "/v"})
