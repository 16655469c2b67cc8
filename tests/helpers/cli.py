"""The one way the tests run the admin CLI (``ncclguard``): in this process, through
click's test runner, with the inventory and the config file it is given."""

from __future__ import annotations

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
