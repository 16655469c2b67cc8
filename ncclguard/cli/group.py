"""The ``ncclguard`` command group: global options, and each command loaded on first use.

A command's module is imported only when that command runs (or ``--help`` lists it), so
that ``ncclguard nodes`` does not pay for the imports of ``diagnose`` or the policy.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from ncclguard.cli.context import WIDE_HELP, Ctx
from ncclguard.cli.errors import CliError, fail

__all__ = ["COMMANDS", "main"]

#: command -> (module, function): one module per command group.
COMMANDS: dict[str, tuple[str, str]] = {
    "nodes": ("ncclguard.cli.inventory", "nodes"),
    "classes": ("ncclguard.cli.inventory", "classes"),
    "show": ("ncclguard.cli.show", "show"),
    "diff": ("ncclguard.cli.changes", "diff"),
    "history": ("ncclguard.cli.changes", "history"),
    "check": ("ncclguard.cli.check", "check"),
    "decisions": ("ncclguard.cli.decisions", "decisions"),
    "drain-recommend": ("ncclguard.cli.drain", "drain_recommend"),
    "diagnose": ("ncclguard.cli.diagnose", "diagnose"),
    "rejections": ("ncclguard.cli.rejections", "rejections"),
    "features": ("ncclguard.cli.features", "features"),
    "images": ("ncclguard.cli.images", "images"),
    "jobs": ("ncclguard.cli.jobs", "jobs"),
    "canary": ("ncclguard.cli.canary", "canary"),
}


class _Group(click.Group):
    """Commands from :data:`COMMANDS`, imported when needed; usage errors exit with 3, not
    click's 2 (2 is ``check``'s refuse)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command)
        return command

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            raise _usage(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _usage(e) from None


def _usage(e: click.UsageError) -> CliError:
    """A usage error in the project's one error form (``ncclguard: error: ...``, exit 3),
    naming the command, with a hint where a HOSTLIST was given as several arguments
    (issue 46: ``check n1 n2`` got click's "unexpected extra argument")."""
    names = []
    ctx = e.ctx
    while ctx is not None and ctx.parent is not None:  # the program's own name is ours
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    where = " ".join(["ncclguard", *reversed(names)])
    text = f"{where}: {e.format_message()}"
    command = e.ctx.command if e.ctx is not None else None
    if "unexpected extra argument" in text and command is not None and any(
            p.name == "hostlist" for p in command.params):
        text += ("; a HOSTLIST is one argument: n1,n2 or 'n[1-2]' (quoted, so that the "
                 "shell does not expand the brackets)")
    else:
        text += f" (see {where} --help)"
    return CliError(text)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", default=None,
              help="Config file (default: $NCCLGUARD_CONFIG or /etc/ncclguard/config.toml).")
@click.option("--db", metavar="FILE", default=None,
              help="Inventory database (default: $NCCLGUARD_DB, then the config's).")
@click.option("--json", "as_json", is_flag=True, help="JSON output for scripts.")
@click.option("--csv", "as_csv", is_flag=True, help="CSV output (commands whose output is rows).")
@click.option("--wide", is_flag=True, help=WIDE_HELP)
@click.version_option(package_name="ncclguard", prog_name="ncclguard")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, db: str | None, as_json: bool,
         as_csv: bool, wide: bool) -> None:
    """Query the NCCL inventory, run the gate's policy, recommend drains."""
    if as_json and as_csv:
        fail("--json and --csv exclude each other")
    ctx.obj = Ctx(config_path, db, fmt="json" if as_json else "csv" if as_csv else "table",
                  wide=wide)
