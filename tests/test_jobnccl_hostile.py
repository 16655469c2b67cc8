"""Issue 40's boundary driven by a hostile job environment / job directory (review).

Each test fails on 12061b6: the read-nccl subprocess imported ``inventoryd`` from the
caller's working directory, a library that grows after its size check was read to its
new end, ``//proc`` and ``/./dev`` passed the path rule, a plugin name holding ``"; "``
rewrote what a node offers, and odd job dicts crashed ``evaluate_nccl``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.jobenv import locate
from ncclguard.fingerprint.offers import offered, pack
from ncclguard.fingerprint.releases import RELEASES
from ncclguard.policy import evaluate_nccl
from ncclguard.policy.rules import container, jobnccl

ELF = shutil.which("true") or "/bin/true"


def _venv(base: Path) -> Path:
    (base / "pyvenv.cfg").parent.mkdir(parents=True, exist_ok=True)
    (base / "pyvenv.cfg").write_text("home = /usr/bin\n")
    lib = base / "lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
    lib.parent.mkdir(parents=True)
    shutil.copyfile(ELF, lib)
    return base


def test_read_nccl_does_not_import_inventoryd_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An admin runs ``ncclguard check --env .`` inside a user's directory (or from a
    shared cwd such as /tmp): ``python -m inventoryd.main`` puts the cwd first on
    sys.path, so the user's ``inventoryd/main.py`` ran as the admin and forged the
    library's version and ABIs."""
    from ncclguard.cli.check import _job_nccl

    cwd = tmp_path / "user"
    (cwd / "inventoryd").mkdir(parents=True)
    marker = tmp_path / "ran-as-admin"
    (cwd / "inventoryd/__init__.py").write_text("")
    (cwd / "inventoryd/main.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "print('{\"error\": null, \"version\": \"2.23.4\", \"abis\": {\"net\": [8]}}')\n")
    env = _venv(cwd / "venv")
    monkeypatch.chdir(cwd)
    job, why = _job_nccl(str(env))
    assert not marker.exists(), "the user's inventoryd/main.py ran"
    assert job is None and why and "no NCCL version banner" in why


def test_a_library_that_grows_after_its_size_check_is_read_no_further(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner extends the file (``truncate -s 1T``, instant, sparse) right after the
    size check (inotify IN_ACCESS on the 4-byte magic read tells when): the scan read to
    the new end, past MAX_LIBRARY_BYTES (measured: 4.2 GB in 10 s, one core, of a 1 TiB
    extension; only check's 120 s timeout stopped it)."""
    import inventoryd.nodefs as nodefs
    from inventoryd.controller.jobnccl import read

    lib = tmp_path / "libnccl.so.2"
    shutil.copyfile(ELF, lib)
    size = lib.stat().st_size
    real = nodefs.library_unreadable

    def then_grow(f):  # type: ignore[no-untyped-def]
        got = real(f)
        os.truncate(lib, size + (64 << 20))
        return got

    monkeypatch.setattr(nodefs, "library_unreadable", then_grow)
    got = read(str(lib))
    assert got["size"] == size, f"read {got['size']} bytes of a file checked at {size}"


@pytest.mark.parametrize("env", [
    {"LD_PRELOAD": "//proc/self/cwd/libnccl.so.2"},
    {"LD_PRELOAD": "/./dev/shm/libnccl.so.2"},
    {"LD_LIBRARY_PATH": "//proc/self/root/tmp:/./sys/x:///dev/shm"},
    {"VIRTUAL_ENV": "//proc/self/cwd"},
    {"CONDA_PREFIX": "/./dev/shm"},
    {"CONDA_PREFIX": "/proc"},
])
def test_proc_sys_dev_spelled_otherwise_are_not_looked_at(env: dict[str, str]) -> None:
    asked: list[str] = []

    def is_file(p: str) -> bool:
        asked.append(p)
        return False

    got = locate(env, is_file)
    into = [p for p in asked
            if os.path.normpath("/" + p.lstrip("/")).startswith(("/proc/", "/sys/", "/dev/"))]
    assert into == [], into
    # not the host's either: what such a path leads to (the job's working directory
    # through /proc/self/cwd) is not known (test_ownnccl_hostile.py)
    assert got.source != "host" and got.path is None and got.problems


def _node(name: str, abis: list[int]) -> dict:
    """A node record whose one net plugin (struct name ``name``) offers ``abis``."""
    fp = {"offers": pack({r.label: {"net": [0, None]} for r in RELEASES},
                         [{"path": "/usr/lib/libnccl-net.so", "names": {"net": name},
                           "abis": {"net": abis}}])}
    return {"job": {"net": offered(fp, "net")}, "container": {"internal": "IB"}}


def test_a_plugin_name_with_the_offers_separator_does_not_rewrite_what_it_offers() -> None:
    """A plugin whose struct name is ``"SiteNet|8,7,6; 9.9.9: X"`` and which exports only
    v10 and v9 was read as offering v8..v6 to every release: a 2.18.3 job (v6..v4)
    mixed with nodes where it really falls back was accepted (it hangs)."""
    records = {f"c{i}": _node("SiteNet", [8, 7, 6]) for i in (1, 2, 3)}
    records["c4"] = _node("SiteNet|8,7,6; 9.9.9: X", [10, 9])
    job = {"nccl_version": "2.18.3", "net_abis": [6, 5, 4], "plugin": None}
    found, odd, _ = container.check_stack("/v/libnccl.so.2", job,
                                          jobnccl.job_records(records, "2.18.3"), "refuse",
                                          rule=jobnccl.STACK)
    assert found and odd == ["c4"]


@pytest.mark.parametrize("job", [
    {"nccl_version": "2.18.3", "net_abis": 8},
    {"nccl_version": "2.18.3", "net_abis": True},
    {"nccl_version": "2.18.3", "net_abis": 7.0},
    ["2.18.3"],
])
def test_odd_job_dicts_are_unknown_not_a_crash(job: object) -> None:
    v = evaluate_nccl({"c1": None, "c2": None}, PolicyConfig(), job)  # type: ignore[arg-type]
    assert v.decision == "warn"
    assert any(f.rule == jobnccl.UNKNOWN for f in v.findings)
