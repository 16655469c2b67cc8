"""The exit codes of every ``ncclguard`` command, and the one way to fail.

- 0: success (``check``: accept; ``diagnose``: the logs were read);
- 1: ``check``: warn;
- 2: ``check``: refuse;
- 3: any error: a bad option or argument, a missing inventory, an unreadable config,
  log or catalog, an unreachable Slurm. So a script tells a refusal from a failure.
"""

from __future__ import annotations

from typing import Any, NoReturn

import click

from ncclguard.text import safe

__all__ = ["DECISION_EXIT", "EXIT_ERROR", "EXIT_OK", "CliError", "fail"]

EXIT_OK = 0
EXIT_ERROR = 3
#: ``check``'s exit code for each decision.
DECISION_EXIT = {"accept": EXIT_OK, "warn": 1, "refuse": 2}


class CliError(click.ClickException):
    """An error that names what is wrong; exits with :data:`EXIT_ERROR`."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"ncclguard: error: {safe(self.format_message())}", err=True)


def fail(message: str) -> NoReturn:
    raise CliError(message)
