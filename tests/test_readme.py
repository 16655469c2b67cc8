"""The README's promises, and the install guide's: every command block is run by CI (or
visibly marked as not), the install commands work as written, the README stays short.

A fenced block of commands (```sh) or of a captured session (lines starting with ``$ ``)
must follow an HTML comment that names where CI runs it,
``<!-- ci: tests/<file>.py::<test> -->`` (or a script such as ``.ci/run``), or one that
says why not, ``<!-- not-run-by-ci: why -->``; the latter also needs a visible
"*Not run by CI*" note just above it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.parts import checkout_copy
from helpers.wait import wait_until

from devtools.nodetree import build_node

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
INSTALL = REPO / "docs" / "install.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
MARK = re.compile(r"<!-- (ci|not-run-by-ci): (.+?) -->")


def command_blocks(doc: Path = README) -> list[tuple[int, str, str, str]]:
    """(line number, language, body, the text before it) of each command block."""
    text = doc.read_text()
    out = []
    for m in FENCE.finditer(text):
        lang, body = m[1], m[2]
        if lang == "sh" or any(ln.startswith("$ ") for ln in body.splitlines()):
            out.append((text.count("\n", 0, m.start()) + 1, lang, body, text[: m.start()]))
    return out


def test_readme_has_the_two_commands_first() -> None:
    blocks = [b for b in command_blocks() if b[1] == "sh"]
    assert blocks[0][2].startswith("bash scripts/demo.sh")
    assert blocks[1][2].startswith("bash scripts/test.sh")
    assert "exec make test" in (REPO / ".ci" / "run").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "demo:\n\tbash scripts/demo.sh\n" in makefile
    assert "test:\n\tbash scripts/test.sh\n" in makefile
    assert "demo-stop:\n\tbash scripts/demo.sh stop\n" in makefile


# the documents with command blocks, and how many each has at least
COMMAND_DOCS = {README: 3, INSTALL: 15, REPO / "docs" / "operations.md": 1,
                REPO / "docs" / "perf.md": 1}


def test_the_readme_is_read_in_five_minutes() -> None:
    assert README.read_text().count("\n") < 200


@pytest.mark.parametrize("doc", list(COMMAND_DOCS), ids=lambda p: p.name)
def test_every_command_block_is_run_by_ci_or_says_why_not(doc: Path) -> None:
    """A ``ci:`` marker names a script or a test that exists (``PATH::test``, and for the
    install guide the step in parentheses: ``PATH::test (step)``)."""
    name = doc.relative_to(REPO)
    blocks = command_blocks(doc)
    assert len(blocks) >= COMMAND_DOCS[doc]
    for line, _lang, _body, before in blocks:
        last = before.rstrip("\n").splitlines()[-1]
        m = MARK.fullmatch(last.strip())
        assert m, f"{name}:{line}: a command block without a <!-- ci: ... --> marker"
        kind, what = m[1], m[2]
        if kind == "ci":
            what = re.sub(r" \([a-z-]+\)$", "", what)  # the install guide's step
            path, _, func = what.partition("::")
            target = REPO / path
            assert target.is_file(), f"{name}:{line}: {path} does not exist"
            if func:
                assert re.search(rf"^def {re.escape(func)}\(", target.read_text(), re.M), (
                    f"{name}:{line}: no test {func} in {path}")
        else:
            window = "\n".join(before.splitlines()[-12:])
            assert "*Not run by CI" in window, (
                f"{name}:{line}: not run by CI, but the text does not say so")


# ------------------------------------------------------------------- install, as written


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv}: {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_install_from_checkout_and_wheel(tmp_path: Path) -> None:
    """`pip install <checkout>`, `pip wheel --no-deps -w dist <checkout>`, `pip install
    <wheel>`, then the programs, run from outside any checkout."""
    src = checkout_copy(tmp_path / "checkout")
    venv = tmp_path / "opt-ncclguard"
    base_python = getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"
    _run([base_python, "-m", "venv", str(venv)], tmp_path)
    pip = str(venv / "bin" / "pip")
    _run([pip, "install", "-q", str(src)], tmp_path)
    _run([pip, "wheel", "-q", "--no-deps", "-w", "dist", str(src)], tmp_path)
    wheel = tmp_path / "dist" / "ncclguard-0.1.0-py3-none-any.whl"
    assert wheel.is_file(), sorted(p.name for p in (tmp_path / "dist").iterdir())
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        eps = z.read("ncclguard-0.1.0.dist-info/entry_points.txt").decode()
    for module in ("prolog/gate.py", "prolog/steer.py", "inventoryd/main.py",
                   "ncclguard/cli/group.py", "ncclguard/diagnose/signatures.toml"):
        assert module in names
    for script in ("ncclguard = ncclguard.cli:main", "ncclguard-inventoryd = inventoryd.main:main",
                   "ncclguard-prolog = prolog.gate:run_as_program",
                   "ncclguard-epilog = prolog.epilog:main",
                   "ncclguard-features-hook = inventoryd.controller.features:hook_main"):
        assert script in eps
    assert not any(n.startswith("devtools/") for n in names)  # the dev kit stays out
    _run([pip, "install", "-q", "--force-reinstall", "--no-deps", str(wheel)], tmp_path)
    # what docs/install.md installs from the wheel alone, under the venv's share/: every
    # shipped systemd file, the lua, the enroot hook, the rules, and the documents the
    # units' Documentation= names (for /opt/ncclguard, the venv here)
    share = venv / "share" / "ncclguard"
    shipped = sorted(p.relative_to(REPO / "systemd")
                     for p in (REPO / "systemd").rglob("*") if p.is_file())
    assert shipped and sorted(p.relative_to(share / "systemd")
                              for p in (share / "systemd").rglob("*") if p.is_file()) == shipped
    for f in ("slurm/job_submit.lua", "enroot/hooks.d/90-ncclguard.sh",
              "prometheus/ncclguard.rules.yml", "config.example.toml"):
        assert (share / f).is_file(), f
    for unit in (REPO / "systemd").glob("*.service"):
        docs = [u for ln in unit.read_text().splitlines() if ln.startswith("Documentation=")
                for u in ln.split("=", 1)[1].split()]
        assert docs, unit
        for url in docs:
            assert url.startswith("file:/opt/ncclguard/"), url
            assert (venv / url[len("file:/opt/ncclguard/"):]).is_file(), url

    # the installed programs, away from the checkout
    work = tmp_path / "work"
    work.mkdir()
    db, audit = work / "inventory.db", work / "decisions.jsonl"
    conf = work / "config.toml"
    conf.write_text(f'[inventory]\ndb = "{db}"\n[gate]\naudit_log = "{audit}"\n')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8",
           "NCCLGUARD_CONFIG": str(conf)}
    bindir = venv / "bin"
    out = _run([str(bindir / "ncclguard"), "--version"], work, env).stdout
    assert "0.1.0" in out
    for host in ("n1", "n2"):
        root = build_node(work / "roots" / host, hostname=host)
        _run([str(bindir / "ncclguard-inventoryd"), "once", "--store", "--root", str(root),
              "--hostname", host], work, env)
    out = _run([str(bindir / "ncclguard"), "classes"], work, env).stdout
    assert "2 nodes in 1 class;" in out
    prolog_env = {**env, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
                  "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "debug",
                  "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "1000",
                  "SLURM_JOB_STDOUT": str(work / "out"),
                  "SLURM_SCRIPT_CONTEXT": "prolog_slurmctld"}
    r = subprocess.run([str(bindir / "ncclguard-prolog")], cwd=work, env=prolog_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    records = [json.loads(ln) for ln in audit.read_text().splitlines()]
    assert [(x["job"], x["decision"], x["nodes"]) for x in records] == [(7, "accept", "n[1-2]")]
    epilog_env = {**env, "SLURM_JOB_ID": "7", "SLURM_JOB_EXIT_CODE": "0"}
    r = subprocess.run([str(bindir / "ncclguard-epilog")], cwd=work, env=epilog_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # a job that did not fail: nothing
    # the hook Slurm runs returns at once; its detached sync logs why it gave up (no
    # slurmctld here)
    hook_log = work / "hook.log"
    r = subprocess.run([str(bindir / "ncclguard-features-hook"), "--wait", "0", "--log",
                        str(hook_log)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    wait_until(lambda: "slurmctld did not answer" in (
        hook_log.read_text() if hook_log.exists() else ""), 30,
        "the hook's detached sync to log that slurmctld did not answer", interval=0.1)
    where = _run([str(bindir / "python"), "-c", "import ncclguard; print(ncclguard.__file__)"],
                 work, env).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not a checkout
