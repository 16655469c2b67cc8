"""The one way the tests run the admin CLI (``ncclguard``): in this process, through
click's test runner, with the inventory and the config file it is given."""

from __future__ import annotations

from collections.abc import Mapping
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
