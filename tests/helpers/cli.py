"""The one way the tests run the admin CLI (``ncclguard``): in this process, through
click's test runner, with the inventory and the config file it is given."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from click.testing import CliRunner, Result

from ncclguard.cli import main


def run_cli(*args: str, db: Path | str | None = None, config: Path | str | None = None,
            env: Mapping[str, str | None] | None = None) -> Result:
    """``ncclguard [--db DB] [--config CONFIG] ARGS...``; ``env`` is set (None: unset)
    while it runs. The result's ``exit_code``, ``stdout``, ``stderr`` and ``output``."""
    opts = [*(("--db", str(db)) if db is not None else ()),
            *(("--config", str(config)) if config is not None else ())]
    return CliRunner().invoke(main, [*opts, *args], env=env)


#: A bound runner: ``run(*args)`` with a test module's own inventory and config.
Run = Callable[..., Result]


def runner(db: Path | str, config: Path | str) -> Run:
    """``run(*args)``: :func:`run_cli` with this inventory and config."""
    def invoke(*args: str) -> Result:
        return run_cli(*args, db=db, config=config)

    return invoke


def ok(r: Result, code: int = 0) -> Result:
    """``r``, once its exit code is ``code`` (the output in the failure's message)."""
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    return r


def stderr_on_a_terminal(argv: list[str], marker: str, *, cwd: Path | str | None = None,
                         timeout: float = 120.0) -> tuple[str, float | None]:
    """Run ``argv`` with its stderr on a pseudo-terminal (stdout to /dev/null), as an admin
    at a terminal sees it: ``(what it wrote to the terminal, the seconds until ``marker``
    first appeared, or None)``. The progress lines' test (``ncclguard.progress``)."""
    import os
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=slave, cwd=cwd)
    os.close(slave)
    seen, first = b"", None
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the other end closed: the program ended
                break
            if not chunk:
                break
            seen += chunk
            if first is None and marker.encode() in seen:
                first = time.monotonic() - t0
        elif p.poll() is not None:
            break
    p.wait(timeout=timeout)
    os.close(master)
    return seen.decode("utf-8", "replace"), first


def js(r: Result) -> dict:
    """A command's JSON output, after :func:`ok`."""
    return json.loads(ok(r).stdout)


def table_rows(text: str) -> dict[str, list[str]]:
    """Table body lines keyed by their first cell, cells split on runs of spaces."""
    rows = {}
    for line in text.splitlines()[1:]:
        cells = [c for c in line.split("  ") if c.strip()]
        if cells:
            rows[cells[0].strip()] = [c.strip() for c in cells]
    return rows
