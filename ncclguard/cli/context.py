"""What every command shares: the context (config, inventory, Slurm, output format), the
node sets a command looks at, and the option types.

The inventory and Slurm are opened on first use, so that a command pays only for what it
reads. Their errors become :func:`~ncclguard.cli.errors.fail` messages naming the file or
the command.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from ncclguard import config as configmod
from ncclguard.cli import output as out
from ncclguard.cli.errors import fail
from ncclguard.hostlist import HostlistError, expand
from ncclguard.text import count, safe
from ncclguard.timeparse import FORMS, parse_time

__all__ = [
    "TIME",
    "Ctx",
    "NodeSet",
    "SlurmUnreachable",
    "expand_hosts",
    "format_options",
    "get_ctx",
    "partitions",
    "resolve_sets",
]


class TimeType(click.ParamType):
    """``--since`` / ``--at``: any form of :func:`ncclguard.timeparse.parse_time`."""

    name = "TIME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            return parse_time(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


TIME = TimeType()
#: The help text's description of a TIME.
TIME_HELP = FORMS


@dataclass
class NodeSet:
    """A set of nodes to look at, and where it came from (said in every output)."""

    name: str
    hosts: list[str]
    source: str  # "slurm" | "--nodes" | "inventory"
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "size": len(self.hosts),
                "note": self.note or None}

    def describe(self) -> str:
        what = {"slurm": "Slurm", "--nodes": "--nodes",
                "inventory": "the whole inventory"}.get(self.source, self.source)
        text = f"node set: {safe(self.name)}, {count(len(self.hosts), 'node')}, from {what}"
        return f"{text} ({safe(self.note)})" if self.note else text


@dataclass
class Ctx:
    config_path: str | None
    db: str | None
    fmt: str = "table"
    wide: bool = False  # --wide: tables and lines as wide as their values
    now: float = field(default_factory=time.time)
    _config: configmod.Config | None = None
    _inventory: Any = None
    _slurm: Any = None
    _slurm_nodes: list[Any] | None = None

    @property
    def config(self) -> configmod.Config:
        if self._config is None:
            from ncclguard.policy import load_config

            try:
                self._config = load_config(self.config_path)
            except configmod.ConfigError as e:
                fail(str(e))
        return self._config

    @property
    def inventory(self) -> Any:
        if self._inventory is None:
            from ncclguard.sched.classes import open_classes
            from ncclguard.store import InventoryError

            try:  # with the config's classes (ncclguard/sched/classes.py)
                self._inventory = open_classes(self.config.policy, self.config.inventory,
                                               self.db)
            except InventoryError as e:
                fail(str(e) + self._whence())
        return self._inventory

    def _whence(self) -> str:
        """Where the inventory's path came from, when no config file was read and no
        --db given (issue 46: the error named a default path, not why it was used)."""
        if self.db is not None or self.config.source != "<defaults>":
            return ""
        return (f" (no config file was read: {configmod.config_path()} does not exist; "
                "this is the default path; give --config FILE, $NCCLGUARD_CONFIG, or "
                "--db FILE)")

    def inv(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an Inventory method; its errors become CLI errors naming the file."""
        from ncclguard.store import InventoryError

        try:
            return getattr(self.inventory, method)(*args, **kwargs)
        except InventoryError as e:
            fail(str(e))
        except ValueError as e:  # nodes(where=...) with an unknown field
            fail(str(e))

    def classes(self, hosts: Any = None) -> Any:
        """The classes of ``hosts`` (every node: None) as Slurm's features name them
        (:class:`ncclguard.sched.classes.ClassView`)."""
        from ncclguard.sched.classes import read_classes
        from ncclguard.store import InventoryError

        try:
            return read_classes(self.inventory, hosts)
        except InventoryError as e:
            fail(str(e))

    def class_names(self) -> dict[str, str]:
        """``{host: class name}`` for every node of the inventory with a readable record."""
        from ncclguard.policy.schedule import feature_names

        keys = self.inv("class_keys")
        names = feature_names(k for k in keys.values() if k is not None)
        return {h: names[k] for h, k in keys.items() if k is not None}

    @property
    def slurm(self) -> Any:
        if self._slurm is None:
            from ncclguard.slurm import Slurm

            self._slurm = Slurm.from_config(self.config.gate,
                                             timeout=self.config.gate.cli_slurm_timeout_s)
        return self._slurm

    def slurm_nodes(self) -> list[Any]:
        """Slurm's nodes through the adapter (once per run). Raises SlurmError."""
        if self._slurm_nodes is None:
            self._slurm_nodes = self.slurm.nodes()
        return self._slurm_nodes

    def writer_note(self) -> str | None:
        """How old the inventory itself is, when the collector has stopped writing it or
        it cannot grow (:func:`ncclguard.policy.freshness.writer_note`), else None."""
        from ncclguard.policy.freshness import writer_note

        written_at, pressure = self.inv("writer_state")
        return writer_note(written_at, pressure, self.now)

    @property
    def width(self) -> int | None:
        """The columns a command's text fits (:data:`out.WIDTH`); None with ``--wide``."""
        return None if self.wide else out.WIDTH

    @property
    def stale_after(self) -> float:
        return float(self.config.inventory.stale_after_s)

    def emit(
        self,
        doc: Any,
        *,
        rows: Sequence[Mapping[str, Any]] | None = None,
        columns: Sequence[out.Column] | None = None,
        text: str | None = None,
        csv_rows: Sequence[Mapping[str, Any]] | None = None,
        csv_columns: Sequence[out.Column] | None = None,
        wrap: bool = True,
    ) -> None:
        """The output in the chosen format. ``wrap=False``: lines that are commands to
        copy (``features sync``'s ``scontrol`` calls) are not broken to fit the width."""
        if self.fmt == "json":
            if callable(doc):
                doc = doc()
            # indented for a person at a terminal, one fast line for a pipe (jq, scripts)
            pretty = bool(getattr(sys.stdout, "isatty", lambda: False)())
            click.echo(out.json_text(doc, pretty=pretty), nl=False)
        elif self.fmt == "csv":
            r = csv_rows if csv_rows is not None else rows
            c = csv_columns if csv_columns is not None else columns
            if r is None or c is None:
                fail("--csv is not available for this command (its output is not rows); "
                     "use --json")
            click.echo(out.csv_text(r, c), nl=False)
        else:
            if text is not None:
                # what a command composed itself: its values went through out.cell or
                # safe(); this catches any terminal sequence that did not. Its tables
                # fit the width already; a longer line is broken at spaces.
                click.echo(out.wrap(safe(text, keep_newlines=True),
                                    self.width if wrap else None), nl=False)
            elif rows is not None and columns is not None:
                click.echo(out.table(rows, columns, self.width), nl=False)


WIDE_HELP = (f"Tables and lines as wide as their values (without it they fit "
             f"{out.WIDTH} columns: cells cut with {out.CUT}, some columns left out).")


def _set_wide(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        c = ctx.find_object(Ctx)
        if c is not None:
            c.wide = True


def format_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` / ``--csv`` / ``--wide`` on each subcommand too (``ncclguard nodes
    --json``)."""
    f = click.option("--wide", is_flag=True, expose_value=False, callback=_set_wide,
                     help=WIDE_HELP)(f)
    f = click.option("--csv", "as_csv", is_flag=True, help="CSV rows (where rows fit).")(f)
    f = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")(f)
    return f


def get_ctx(as_json: bool = False, as_csv: bool = False) -> Ctx:
    c = click.get_current_context().find_object(Ctx)
    if c is None:  # pragma: no cover - only when a command is invoked without the group
        c = Ctx(None, None)
    if as_json and as_csv:
        fail("--json and --csv exclude each other")
    if as_json:
        c.fmt = "json"
    elif as_csv:
        c.fmt = "csv"
    if c.fmt == "csv" and as_json:
        fail("--json and --csv exclude each other")
    return c


def expand_hosts(args: Iterable[str], what: str) -> list[str]:
    hosts: list[str] = []
    for a in args:
        try:
            hosts.extend(expand(a))
        except HostlistError as e:
            fail(f"{what}: {e}")
    return list(dict.fromkeys(hosts))


def partitions(c: Ctx) -> dict[str, list[str]]:
    """Slurm's partitions that hold nodes, and their nodes: one narrow read
    (``Slurm.partitions``: the partitions' compressed node lists, a few hundred bytes at
    16,384 nodes), never the whole node list."""
    from ncclguard.slurm import SlurmError

    try:
        lists = c.slurm.partitions()
        return {p: expand(text) for p, text in lists.items() if text}
    except (SlurmError, HostlistError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        text = lines[-1] if lines else type(e).__name__
        raise SlurmUnreachable(text[:300]) from None


class SlurmUnreachable(Exception):
    pass


def known_partition(c: Ctx, partition: str) -> list[str] | None:
    """The nodes of ``partition`` as Slurm lists them, for a command that judges a node
    set of its own in that partition (``check``); an unknown name is an error, as for
    every command (issue 46: ``check --partition nosuch`` was taken silently). None when
    Slurm cannot be reached: said on stderr, and the name is used as given."""
    try:
        parts = partitions(c)
    except SlurmUnreachable as e:
        click.echo(f"warning: --partition {partition}: not checked, Slurm is not reachable "
                   f"({e})", err=True)
        return None
    return _members_of(parts, partition)


def _members_of(parts: Mapping[str, list[str]], partition: str) -> list[str]:
    """The nodes of ``partition``; an unknown one is the one error every command gives."""
    if partition not in parts:
        known = ", ".join(sorted(parts)) or "none"
        fail(f"--partition {partition}: no such partition in Slurm (known: {known})")
    return parts[partition]


def resolve_sets(c: Ctx, partition: str | None, nodes_opt: str | None,
                 *, all_partitions: bool = False) -> list[NodeSet] | None:
    """The node sets a command looks at; ``None`` means "the whole inventory, no set".

    ``--nodes`` (Slurm is not asked) and ``--partition`` (Slurm is asked) are each a node
    set; both at once is an error (issue 46: ``--partition`` was ignored without a word,
    and one node was judged against itself). With neither, ``all_partitions`` asks Slurm
    for every partition (drain-recommend); otherwise None.
    """
    if nodes_opt is not None and partition is not None:
        fail(f"--nodes and --partition {partition}: give one node set: --nodes HOSTLIST "
             "(judged as given, without Slurm) or --partition P (its nodes, from Slurm)")
    if nodes_opt is not None:
        hosts = expand_hosts([nodes_opt], "--nodes")
        if not hosts:
            fail("--nodes: the hostlist is empty")
        return [NodeSet("--nodes", hosts, "--nodes")]
    if partition is None and not all_partitions:
        return None
    try:
        parts = partitions(c)
    except SlurmUnreachable as e:
        if partition is not None:
            fail(f"--partition {partition}: Slurm is not reachable ({e}); "
                 "give the node set with --nodes HOSTLIST instead")
        return [NodeSet("inventory", c.inv("hosts"), "inventory",
                        note=f"Slurm not reachable: {e}")]
    if partition is not None:
        return [NodeSet(partition, _members_of(parts, partition), "slurm")]
    guarded = c.config.policy.partitions
    names = [p for p in sorted(parts) if not guarded or p in guarded]
    return [NodeSet(p, parts[p], "slurm") for p in names]
