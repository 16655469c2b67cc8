"""``ncclguard``: the admin CLI over the shared inventory, the gate's policy and Slurm.

The CLI is thin: it parses options, calls the same :class:`~ncclguard.store.Inventory`,
:mod:`prolog.policy` and :class:`~ncclguard.slurm.Slurm` adapter as the daemon and the
gate, and hands plain values to :mod:`ncclguard.output`. Every command prints a table for
people, ``--json`` (and ``--csv`` where rows fit) for scripts.

Exit codes: 0 success; for ``check`` 1 is warn and 2 is refuse; 3 is any error (a bad
option, a missing inventory, an unreachable Slurm), so that a script can tell a refusal
from a failure. Nothing here needs root except ``drain-recommend --apply/--resume``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn

import click

from ncclguard import config as configmod
from ncclguard import output as out
from ncclguard.hostlist import HostlistError, compress, expand

EXIT_ERROR = 3


class CliError(click.ClickException):
    """An error that names what is wrong; exits with :data:`EXIT_ERROR`."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"ncclguard: error: {self.format_message()}", err=True)


def fail(message: str) -> NoReturn:
    raise CliError(message)


class _Group(click.Group):
    """A group whose usage errors exit with 3, not click's 2 (2 is ``check``'s refuse)."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            e.exit_code = EXIT_ERROR
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            e.exit_code = EXIT_ERROR
            raise


# --------------------------------------------------------------------------- time parsing

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_REL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)


def parse_since(text: str, now: float | None = None) -> float:
    """``7d``, ``2h``, ``30m``, ``45s``, ``1w`` (ago), an ISO date or date-time, ``@epoch``.

    An ISO value without a zone is UTC (as every time in the fingerprint is).
    """
    now = time.time() if now is None else now
    m = _REL.match(text)
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2).lower()]
    t = text.strip()
    if t.startswith("@"):
        try:
            return float(t[1:])
        except ValueError:
            pass
    else:
        try:
            dt = datetime.fromisoformat(t)
        except ValueError:
            pass
        else:
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=UTC)
            return dt.timestamp()
    raise click.BadParameter(
        f"{text!r}: expected an age such as 7d, 2h, 30m, 45s or 1w, an ISO date "
        f"(2026-11-30, 2026-11-30T02:00:00Z) or @epoch-seconds"
    )


class SinceType(click.ParamType):
    name = "TIME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_since(str(value))
        except click.BadParameter as e:
            self.fail(e.message, param, ctx)


SINCE = SinceType()


# --------------------------------------------------------------------------- context


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
        what = {"slurm": "Slurm (sinfo)", "--nodes": "--nodes",
                "inventory": "the whole inventory"}.get(self.source, self.source)
        text = f"node set: {self.name}, {len(self.hosts)} nodes, from {what}"
        return f"{text} ({self.note})" if self.note else text


@dataclass
class Ctx:
    config_path: str | None
    db: str | None
    fmt: str = "table"
    now: float = field(default_factory=time.time)
    _config: configmod.Config | None = None
    _inventory: Any = None
    _slurm: Any = None
    _slurm_nodes: list[Any] | None = None

    @property
    def config(self) -> configmod.Config:
        if self._config is None:
            try:
                self._config = configmod.load(self.config_path)
            except configmod.ConfigError as e:
                fail(str(e))
        return self._config

    @property
    def inventory(self) -> Any:
        if self._inventory is None:
            from ncclguard.store import Inventory, InventoryError

            try:
                self._inventory = Inventory(self.db, readonly=True, config=self.config.inventory)
            except InventoryError as e:
                fail(str(e))
        return self._inventory

    def inv(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an Inventory method; its errors become CLI errors naming the file."""
        from ncclguard.store import InventoryError

        try:
            return getattr(self.inventory, method)(*args, **kwargs)
        except InventoryError as e:
            fail(str(e))
        except ValueError as e:  # nodes(where=...) with an unknown field
            fail(str(e))

    @property
    def slurm(self) -> Any:
        if self._slurm is None:
            from ncclguard.slurm import Slurm

            self._slurm = Slurm.from_config(self.config.gate, timeout=15.0)
        return self._slurm

    def slurm_nodes(self) -> list[Any]:
        """``sinfo --json`` through the adapter (once per run). Raises SlurmError."""
        if self._slurm_nodes is None:
            self._slurm_nodes = self.slurm.nodes()
        return self._slurm_nodes

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
    ) -> None:
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
                click.echo(text, nl=False)
            elif rows is not None and columns is not None:
                click.echo(out.table(rows, columns), nl=False)


def _fmt_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` / ``--csv`` on each subcommand too (``ncclguard nodes --json``)."""
    f = click.option("--csv", "as_csv", is_flag=True, help="CSV rows (where rows fit).")(f)
    f = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")(f)
    return f


def _ctx(as_json: bool = False, as_csv: bool = False) -> Ctx:
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


def _expand(args: Iterable[str], what: str) -> list[str]:
    hosts: list[str] = []
    for a in args:
        try:
            hosts.extend(expand(a))
        except HostlistError as e:
            fail(f"{what}: {e}")
    return list(dict.fromkeys(hosts))


def _partitions(c: Ctx) -> dict[str, list[str]]:
    from ncclguard.slurm import SlurmError

    try:
        nodes = c.slurm_nodes()
    except SlurmError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        text = lines[-1] if lines else type(e).__name__
        raise _SlurmUnreachable(text[:300]) from None
    parts: dict[str, list[str]] = {}
    for n in nodes:
        for p in n.partitions:
            parts.setdefault(p, []).append(n.name)
    return parts


class _SlurmUnreachable(Exception):
    pass


def resolve_sets(c: Ctx, partition: str | None, nodes_opt: str | None,
                 *, all_partitions: bool = False) -> list[NodeSet] | None:
    """The node sets a command looks at; ``None`` means "the whole inventory, no set".

    ``--nodes`` wins (Slurm is not asked). ``--partition`` asks Slurm. With neither,
    ``all_partitions`` asks Slurm for every partition (drain-recommend); otherwise None.
    """
    if nodes_opt is not None:
        hosts = _expand([nodes_opt], "--nodes")
        if not hosts:
            fail("--nodes: the hostlist is empty")
        return [NodeSet("--nodes", hosts, "--nodes")]
    if partition is None and not all_partitions:
        return None
    try:
        parts = _partitions(c)
    except _SlurmUnreachable as e:
        if partition is not None:
            fail(f"--partition {partition}: Slurm is not reachable ({e}); "
                 "give the node set with --nodes HOSTLIST instead")
        return [NodeSet("inventory", c.inv("hosts"), "inventory",
                        note=f"Slurm not reachable: {e}")]
    if partition is not None:
        if partition not in parts:
            known = ", ".join(sorted(parts)) or "none"
            fail(f"--partition {partition}: no such partition in Slurm (known: {known})")
        return [NodeSet(partition, parts[partition], "slurm")]
    guarded = c.config.policy.partitions
    names = [p for p in sorted(parts) if not guarded or p in guarded]
    return [NodeSet(p, parts[p], "slurm") for p in names]


# --------------------------------------------------------------------------- the group


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", default=None,
              help="Config file (default: $NCCLGUARD_CONFIG or /etc/ncclguard/config.toml).")
@click.option("--db", metavar="FILE", default=None,
              help="Inventory database (default: $NCCLGUARD_DB, then the config's).")
@click.option("--json", "as_json", is_flag=True, help="JSON output for scripts.")
@click.option("--csv", "as_csv", is_flag=True, help="CSV output (commands whose output is rows).")
@click.version_option(package_name="ncclguard", prog_name="ncclguard")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, db: str | None, as_json: bool,
         as_csv: bool) -> None:
    """Query the NCCL inventory, run the gate's policy, recommend drains."""
    if as_json and as_csv:
        fail("--json and --csv exclude each other")
    ctx.obj = Ctx(config_path, db, fmt="json" if as_json else "csv" if as_csv else "table")


# --------------------------------------------------------------------------- nodes

#: --where FIELD: the names an admin types, and the store column each one filters.
WHERE_ALIASES = {
    "nccl": "nccl_version",
    "nccl_any": "has_nccl",
    "plugin": "net_plugin_name",
    "plugin_path": "net_plugin",
    "abi": "net_abi",
    "transport": "transport",
    "driver": "driver",
    "host": "host",
    "class": "compat_key",
}
_INT_COLUMNS = {"net_abi", "rdma_ports_up", "rdma_ports_total", "error_count"}

NODE_COLUMNS: list[out.Column] = [
    ("host", "HOST"), ("nccl", "NCCL"), ("net_plugin_name", "PLUGIN"), ("net_abi", "ABI"),
    ("transport", "TRANSPORT"), ("rdma", "RDMA UP/TOTAL"), ("driver", "DRIVER"),
    ("heartbeat", "LAST HEARTBEAT"), ("age", "AGE"), ("error_count", "ERRORS"),
    ("status", "STATUS"),
]
NODE_CSV: list[out.Column] = [
    ("host", "host"), ("nccl_version", "nccl_version"), ("nccl_versions", "nccl_versions"),
    ("net_plugin", "net_plugin"), ("net_plugin_name", "net_plugin_name"),
    ("net_abi", "net_abi"), ("transport", "transport"), ("rdma_ports_up", "rdma_ports_up"),
    ("rdma_ports_total", "rdma_ports_total"), ("driver", "driver"),
    ("last_heartbeat", "last_heartbeat"), ("age_s", "age_s"), ("error_count", "error_count"),
    ("compat_key", "compat_key"), ("status", "status"),
]


def parse_where(items: Sequence[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` filters for ``Inventory.nodes``: aliases, ``none``, lists, ints."""
    from ncclguard.store import NODE_COLUMNS as STORE_COLUMNS

    where: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            fail(f"--where {item!r}: expected FIELD=VALUE")
        column = WHERE_ALIASES.get(name, name)
        if column not in STORE_COLUMNS and column != "has_nccl":
            known = ", ".join([*WHERE_ALIASES, *(c for c in STORE_COLUMNS
                                                  if c not in WHERE_ALIASES.values())])
            fail(f"--where {item!r}: unknown field {name!r} (known: {known})")
        values: list[Any] = []
        for v in value.split(","):
            v = v.strip()
            if v.lower() in ("none", "null", "-"):
                values.append(None)
            elif column in _INT_COLUMNS:
                try:
                    values.append(int(v))
                except ValueError:
                    fail(f"--where {item!r}: {name} takes an integer, got {v!r}")
            else:
                values.append(v)
        if column in where:
            prev = where[column]
            values = [*(prev if isinstance(prev, list) else [prev]), *values]
        if None in values and len(values) > 1:
            fail(f"--where {item!r}: 'none' cannot be combined with other values")
        where[column] = values[0] if len(values) == 1 else values
    return where


def _node_row(r: dict[str, Any], now: float, ttl: float) -> dict[str, Any]:
    """The store's row (ours to change) with the derived cells added."""
    hb = r.get("last_heartbeat")
    age = None if hb is None else now - hb
    stale = age is None or age > ttl
    versions = r.get("nccl_versions") or []
    nccl = r.get("nccl_version")
    shown = nccl or "-"
    if len(versions) > 1 or (versions and versions[0] != nccl):
        others = [v for v in versions if v != nccl]
        shown += f" (+{','.join(others)})" if others else ""
    when = out.iso(hb)
    r["last_heartbeat"] = when
    r["age_s"] = None if age is None else round(age, 1)
    r["stale"] = stale
    r["status"] = "stale" if stale else ("errors" if r.get("error_count") else "ok")
    # table-only cells
    r["nccl"] = shown
    r["rdma"] = f"{r.get('rdma_ports_up', 0)}/{r.get('rdma_ports_total', 0)}"
    r["heartbeat"] = when
    r["age"] = out.age(age)
    return r


def _missing_row(host: str) -> dict[str, Any]:
    return {"host": host, "nccl_versions": [], "stale": True, "status": "missing",
            "last_heartbeat": None, "age_s": None, "error_count": None, "nccl": None,
            "rdma": None, "heartbeat": None, "age": None}


@main.command()
@click.option("--partition", "-p", default=None, help="Only nodes of this Slurm partition.")
@click.option("--nodes", "nodes_opt", metavar="HOSTLIST", default=None,
              help="Only these nodes (no Slurm needed).")
@click.option("--where", "-w", "where", multiple=True, metavar="FIELD=VALUE",
              help="Filter (repeatable; VALUE may be a comma list; 'none' matches unset). "
                   "FIELD: nccl, nccl_any, plugin, plugin_path, abi, transport, driver, "
                   "host, class, or a store column.")
@click.option("--stale", is_flag=True, help="Only nodes whose heartbeat is stale or missing.")
@click.option("--errors", is_flag=True, help="Only nodes with probe errors.")
@_fmt_options
def nodes(partition: str | None, nodes_opt: str | None, where: tuple[str, ...], stale: bool,
          errors: bool, as_json: bool, as_csv: bool) -> None:
    """One row per node: NCCL, net plugin and ABI, transport, RDMA ports, driver, heartbeat."""
    c = _ctx(as_json, as_csv)
    filters = parse_where(where)
    sets = resolve_sets(c, partition, nodes_opt)
    rows = c.inv("nodes", filters or None)
    now, ttl = c.now, c.stale_after
    result = [_node_row(r, now, ttl) for r in rows]
    node_set = sets[0] if sets else None
    if node_set is not None:
        members = set(node_set.hosts)
        result = [r for r in result if r["host"] in members]
        if not filters and not errors:
            have = {r["host"] for r in result}
            result += [_missing_row(h) for h in node_set.hosts if h not in have]
            result.sort(key=lambda r: r["host"])
    if stale:
        result = [r for r in result if r["stale"]]
    if errors:
        result = [r for r in result if r.get("error_count")]
    def doc() -> dict[str, Any]:  # built only for --json
        return {
            "node_set": node_set.to_dict() if node_set else None,
            "filters": {"where": filters, "stale": stale, "errors": errors},
            "count": len(result),
            "nodes": [{k: r.get(k) for k, _ in NODE_CSV} | {"stale": r["stale"]}
                      for r in result],
        }

    text = None
    if c.fmt == "table":
        head = f"{node_set.describe()}\n" if node_set else ""
        text = head + out.table(result, NODE_COLUMNS) + f"{len(result)} nodes\n"
    c.emit(doc, rows=result, columns=NODE_COLUMNS, text=text, csv_columns=NODE_CSV)


# --------------------------------------------------------------------------- classes


def baseline_key(classes: Sequence[Any], config: configmod.Config,
                 fresh: Mapping[str, int] | None = None) -> tuple[str | None, str]:
    """(compat_key of the baseline class or None, why) as ``drain-recommend`` decides it."""
    from ncclguard.drain import BASELINE_RULES, _pin_diffs

    pin = dict(config.baseline)
    if pin:
        match = [k for k in classes if not _pin_diffs(
            k.values, pin, dict.fromkeys(BASELINE_RULES.values(), "refuse"))]
        if match:
            return match[0].compat_key, "pinned in [baseline]"
        return None, "pinned in [baseline]: no class matches"
    counts = fresh if fresh is not None else {k.compat_key: len(k.hosts) for k in classes}
    total = sum(counts.values())
    if not total:
        return None, "no nodes"
    top = max(counts, key=lambda k: (counts[k], k))
    share = counts[top] / total
    if share > config.drain.majority:
        return top, f"majority ({share:.0%})"
    return None, (f"no clear majority: the largest class holds {share:.0%} "
                  f"(needs more than {config.drain.majority:.0%})")


CLASS_COLUMNS: list[out.Column] = [
    ("baseline_mark", " "), ("compat_key", "CLASS"), ("count", "NODES"), ("share_pct", "SHARE"),
    ("nccl", "NCCL"), ("net_plugin", "PLUGIN"), ("net_abi", "ABI"), ("transport", "TRANSPORT"),
    ("stale", "STALE"), ("hosts", "HOSTS"),
]
CLASS_CSV: list[out.Column] = [
    ("compat_key", "compat_key"), ("count", "count"), ("share", "share"), ("nccl", "nccl"),
    ("net_plugin", "net_plugin"), ("net_abi", "net_abi"), ("transport", "transport"),
    ("stale", "stale"), ("baseline", "baseline"), ("hosts", "hosts"),
]


@main.command()
@click.option("--partition", "-p", default=None, help="Only nodes of this Slurm partition.")
@click.option("--nodes", "nodes_opt", metavar="HOSTLIST", default=None,
              help="Only these nodes (no Slurm needed).")
@_fmt_options
def classes(partition: str | None, nodes_opt: str | None, as_json: bool, as_csv: bool) -> None:
    """The compatibility classes: defining values, node count and hostlist."""
    c = _ctx(as_json, as_csv)
    sets = resolve_sets(c, partition, nodes_opt)
    node_set = sets[0] if sets else None
    cls = c.inv("classes", node_set.hosts if node_set else None)
    stale = set(c.inv("stale", c.now, c.stale_after))
    total = sum(len(k.hosts) for k in cls)
    fresh = {k.compat_key: sum(1 for h in k.hosts if h not in stale) for k in cls}
    base, why = baseline_key(cls, c.config, fresh)
    rows = []
    for k in cls:
        v = k.values if isinstance(k.values, dict) else {}
        rows.append({
            "compat_key": k.compat_key, "values": v, "count": len(k.hosts),
            "share": round(len(k.hosts) / total, 4) if total else 0.0,
            "share_pct": f"{len(k.hosts) / total:.0%}" if total else "-",
            "nccl": v.get("nccl"), "net_plugin": v.get("net_plugin"),
            "net_abi": v.get("net_abi"), "transport": v.get("transport"),
            "stale": sum(1 for h in k.hosts if h in stale),
            "baseline": k.compat_key == base, "baseline_mark": "*" if k.compat_key == base else "",
            "hosts": compress(k.hosts),
        })
    missing: list[str] = []
    if node_set is not None:
        have = {h for k in cls for h in k.hosts}
        missing = [h for h in node_set.hosts if h not in have]
    doc = {
        "node_set": node_set.to_dict() if node_set else None,
        "total": total,
        "baseline": {"compat_key": base, "why": why},
        "classes": [{k: r[k] for k in ("compat_key", "values", "count", "share", "stale",
                                        "baseline", "hosts")} for r in rows],
        "missing": {"count": len(missing), "hosts": compress(missing) if missing else ""},
    }
    text = None
    if c.fmt == "table":
        lines = [node_set.describe()] if node_set else []
        lines.append(f"{total} nodes in {len(cls)} compatibility classes; baseline: "
                     + (f"{base} ({why})" if base else why))
        text = "\n".join(lines) + "\n" + out.table(rows, CLASS_COLUMNS)
        if missing:
            text += f"not in the inventory: {len(missing)} nodes: {compress(missing)}\n"
    c.emit(doc, rows=rows, columns=CLASS_COLUMNS, text=text, csv_columns=CLASS_CSV)


# --------------------------------------------------------------------------- show


def _load_one(c: Ctx, host: str) -> Any:
    rec = c.inv("load", [host]).get(host)
    if rec is None:
        fail(f"{host}: not in the inventory {c.inventory.path}")
    return rec


def _show_text(rec: Any, now: float, ttl: float) -> str:
    fp = rec.fingerprint
    from ncclguard.fpdiff import derived

    d = derived(fp)
    age = now - rec.last_heartbeat
    parts = [out.section(f"node {rec.host}", out.kv([
        ("class", rec.compat_key),
        ("nccl", d.get("compat.nccl")), ("net plugin", d.get("compat.net_plugin")),
        ("net ABI", d.get("compat.net_abi")), ("transport", d.get("compat.transport")),
        ("last heartbeat", f"{out.iso(rec.last_heartbeat)} ({out.age(age)} ago"
                           + (", STALE)" if age > ttl else ")")),
        ("collected at", out.iso(rec.collected_at)), ("first seen", out.iso(rec.first_seen)),
        ("fingerprint", rec.fp_hash[:16]),
    ]))]
    host = fp.get("host") or {}
    parts.append(out.section("host", out.kv([(k, host.get(k)) for k in
                                             ("kernel", "boot_id", "tool_version")])))
    libs = [{**x, "abi_net": (x.get("abis") or {}).get("net")} for x in fp.get("libnccl") or []]
    parts.append(out.section("libnccl", out.table(libs, [
        ("path", "PATH"), ("version", "VERSION"), ("cuda_version", "CUDA"),
        ("abi_net", "NET ABIS"), ("default", "DEFAULT"), ("origin", "ORIGIN"),
        ("version_error", "ERROR")])))
    plugins = [{**x, "abi": (x.get("abis") or {}).get(x.get("kind"))}
               for x in fp.get("plugins") or []]
    parts.append(out.section("plugins", out.table(plugins, [
        ("kind", "KIND"), ("path", "PATH"), ("name", "NAME"), ("abi", "ABIS"),
        ("default", "DEFAULT"), ("origin", "ORIGIN"), ("error", "ERROR")])))
    net = fp.get("net") or {}
    parts.append(out.section("net (default libnccl x default net plugin)", out.kv(
        [(k, net.get(k)) for k in ("libnccl", "plugin", "effective_net_abi", "reason")])))
    rdma = fp.get("rdma") or {}
    ports = [{"device": dv.get("name"), "fw_ver": dv.get("fw_ver"),
              "hca_type": dv.get("hca_type"), **p}
             for dv in rdma.get("devices") or [] for p in dv.get("ports") or [{}]]
    abi = rdma.get("abi_version") or {}
    ibv = rdma.get("libibverbs") or {}
    parts.append(out.section("rdma", out.kv([
        ("verbs ABI", abi.get("verbs")), ("mad ABI", abi.get("mad")),
        ("libibverbs", f"{ibv.get('path')} {ibv.get('version') or ''}".strip()
         if ibv else None),
        ("providers", rdma.get("providers"))]) + out.table(ports, [
            ("device", "DEVICE"), ("port", "PORT"), ("state", "STATE"),
            ("phys_state", "PHYS"), ("rate", "RATE"), ("link_layer", "LINK"),
            ("fw_ver", "FIRMWARE"), ("hca_type", "HCA")])))
    parts.append(out.section("netifs", out.table(fp.get("netifs") or [], [
        ("name", "NAME"), ("up", "UP"), ("addresses", "ADDRESSES")])))
    conf = fp.get("nccl_conf") or {}
    settings = conf.get("settings") or {}
    parts.append(out.section("nccl.conf", out.kv(
        [("path", conf.get("path")), ("present", conf.get("present"))]
        + [(k, v) for k, v in sorted(settings.items())])))
    gpu = fp.get("gpu") or {}
    parts.append(out.section("gpu", out.kv([(k, gpu.get(k)) for k in
                                            ("driver_version", "count", "models", "peermem")])))
    errs = fp.get("errors") or []
    parts.append(out.section(f"probe errors ({len(errs)})", out.table(errs, [
        ("probe", "PROBE"), ("field", "FIELD"), ("path", "PATH"), ("error", "ERROR")])
        if errs else "  none\n"))
    return "\n".join(parts)


@main.command()
@click.argument("node")
@_fmt_options
def show(node: str, as_json: bool, as_csv: bool) -> None:
    """The whole fingerprint of NODE, readable, with probe errors."""
    c = _ctx(as_json, as_csv)
    if c.fmt == "csv":
        fail("--csv is not available for show (a fingerprint is not rows); use --json")
    rec = _load_one(c, node)
    age = c.now - rec.last_heartbeat
    doc = {
        "host": rec.host, "compat_key": rec.compat_key, "fp_hash": rec.fp_hash,
        "first_seen": out.iso(rec.first_seen), "collected_at": out.iso(rec.collected_at),
        "last_heartbeat": out.iso(rec.last_heartbeat), "age_s": round(age, 1),
        "stale": age > c.stale_after, "errors": rec.fingerprint.get("errors") or [],
        "fingerprint": rec.fingerprint,
    }
    c.emit(doc, text=_show_text(rec, c.now, c.stale_after) if c.fmt == "table" else None)


# --------------------------------------------------------------------------- diff


def _short(v: Any, limit: int = 60) -> str:
    text = out.cell(v) if not isinstance(v, dict) else json.dumps(v, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@main.command()
@click.argument("nodes_args", metavar="NODE NODE... | HOSTLIST", nargs=-1, required=True)
@click.option("--rules-only", is_flag=True, help="Only the differences that a rule looks at.")
@_fmt_options
def diff(nodes_args: tuple[str, ...], rules_only: bool, as_json: bool, as_csv: bool) -> None:
    """The fields that differ, with the rule each difference triggers and its severity."""
    from ncclguard.fpdiff import diff as fpdiff

    c = _ctx(as_json, as_csv)
    hosts = _expand(nodes_args, "NODE")
    if len(hosts) < 2:
        fail(f"diff needs at least two nodes, got {len(hosts)}: {' '.join(nodes_args)}")
    recs = c.inv("load", hosts)
    missing = [h for h in hosts if recs.get(h) is None]
    if missing:
        fail(f"not in the inventory {c.inventory.path}: {compress(missing)}")
    result = fpdiff({h: recs[h].fingerprint for h in hosts}, c.config.policy.severity,
                    include_info=not rules_only)
    doc = {
        "hosts": hosts,
        "worst": result.worst(),
        "differences": [d.to_dict(compress) for d in result.differences],
        "unknown": [d.to_dict(compress) for d in result.unknown],
    }
    flat = [
        {"field": d.field, "value": v, "hosts": compress(list(hs)), "count": len(hs),
         "rule": d.rule, "severity": d.severity}
        for d in result.differences for v, hs in d.values
    ]
    flat_cols: list[out.Column] = [("field", "FIELD"), ("value", "VALUE"), ("hosts", "HOSTS"),
                                   ("rule", "RULE"), ("severity", "SEVERITY")]
    text = None
    if c.fmt == "table":
        if len(hosts) == 2:
            a, b = hosts
            rows = [{"field": d.field, "a": _short(d.value_of(a)), "b": _short(d.value_of(b)),
                     "rule": d.rule, "severity": d.severity} for d in result.differences]
            text = out.table(rows, [("field", "FIELD"), ("a", a), ("b", b), ("rule", "RULE"),
                                    ("severity", "SEVERITY")])
        else:
            text = out.table([{**r, "value": _short(r["value"])} for r in flat], flat_cols)
        if not result.differences:
            text = f"no differences between {compress(hosts)}\n"
        if result.unknown:
            text += "unknown (a probe could not read them; never counted as different):\n"
            text += out.table([{"field": d.field, "hosts": compress(list(d.unknown_on))}
                               for d in result.unknown], [("field", "FIELD"),
                                                          ("hosts", "UNREADABLE ON")])
    csv_cols: list[out.Column] = [("field", "field"), ("value", "value"), ("hosts", "hosts"),
                                  ("count", "count"), ("rule", "rule"),
                                  ("severity", "severity")]
    c.emit(doc, rows=flat, columns=flat_cols, text=text, csv_columns=csv_cols)


# --------------------------------------------------------------------------- check

DECISION_EXIT = {"accept": 0, "warn": 1, "refuse": 2}


@main.command()
@click.argument("hostlist")
@click.option("--partition", "-p", default=None,
              help="Judge as a job in this partition (the guarded-partition setting applies).")
@_fmt_options
def check(hostlist: str, partition: str | None, as_json: bool, as_csv: bool) -> None:
    """The gate's verdict for a hypothetical allocation (exit 0 accept, 1 warn, 2 refuse)."""
    from prolog.policy import evaluate

    c = _ctx(as_json, as_csv)
    if c.fmt == "csv":
        fail("--csv is not available for check (a verdict is not rows); use --json")
    hosts = _expand([hostlist], "HOSTLIST")
    if not hosts:
        fail("HOSTLIST: the hostlist is empty")
    recs = c.inv("load", hosts)
    fps = {h: (r.fingerprint if r is not None else None) for h, r in recs.items()}
    stale = [h for h, r in recs.items()
             if r is not None and c.now - r.last_heartbeat > c.stale_after]
    verdict = evaluate(fps, c.config.policy, stale=stale, partition=partition)
    tie_break = None
    if verdict.odd_tie:  # as the gate: keep the majority class of the partition (or all)
        verdict, tie_break = _tie_break(c, fps, stale, partition, verdict)
    decision = str(verdict.decision)
    doc = verdict.to_dict()
    if tie_break is not None:
        doc["tie_break"] = tie_break
    c.emit(doc, text=verdict.format_text().rstrip("\n") + "\n" if c.fmt == "table" else None)
    ctx = click.get_current_context()
    ctx.exit(DECISION_EXIT.get(decision, EXIT_ERROR))


def _tie_break(c: Ctx, fps: Mapping[str, Any], stale: list[str], partition: str | None,
               verdict: Any) -> tuple[Any, str]:
    """The gate's tie-break for ``check``: prefer the hosts of the majority class of the
    partition's nodes (from Slurm), else of the whole inventory."""
    from prolog.policy import evaluate, majority

    members: list[str] = []
    scope = "the inventory"
    if partition:  # "a,b": the nodes of either, as the gate does
        try:
            parts = _partitions(c)
            members = sorted({h for p in partition.split(",") if p for h in parts.get(p, [])})
        except _SlurmUnreachable:
            pass
        if members:
            scope = f"partition {partition}"
    classes = c.inv("classes", members) if members else c.inv("classes")
    largest = majority([k.hosts for k in classes])
    if not largest:
        return verdict, f"none (no single largest class in {scope})"
    again = evaluate(fps, c.config.policy, stale=stale, partition=partition, prefer=largest)
    return again, f"majority class of {scope} ({len(largest)} nodes)"


# --------------------------------------------------------------------------- history

HISTORY_COLUMNS: list[out.Column] = [
    ("at", "AT"), ("host", "HOST"), ("field", "FIELD"), ("old", "OLD"), ("new", "NEW"),
    ("rule", "RULE"), ("severity", "SEVERITY"),
]


@main.command()
@click.argument("node", required=False)
@click.option("--since", type=SINCE, default=None, metavar="TIME",
              help="Only changes since TIME: 7d, 2h, 30m, an ISO date or date-time.")
@_fmt_options
def history(node: str | None, since: float | None, as_json: bool, as_csv: bool) -> None:
    """The changes of the fingerprint over time (all nodes, or NODE)."""
    from ncclguard.fpdiff import _SKIP, rule_for, severity_for

    c = _ctx(as_json, as_csv)
    if node is not None and c.inv("load", [node]).get(node) is None:
        fail(f"{node}: not in the inventory {c.inventory.path}")
    sev = c.config.policy.severity
    changes = []
    rows = []
    for h in c.inv("history", node, since):
        fields = []
        for d in h["diff"] if isinstance(h["diff"], list) else []:
            name = d.get("field", "")
            if _SKIP.search(name):
                continue
            rule = rule_for(name)
            fields.append({"field": name, "old": d.get("old"), "new": d.get("new"),
                           "rule": rule, "severity": severity_for(rule, sev)})
        change = {"id": h["id"], "host": h["host"], "at": out.iso(h["at"]),
                  "old_hash": h["old_hash"], "new_hash": h["new_hash"],
                  "first": h["old_hash"] is None, "fields": fields}
        changes.append(change)
        if change["first"]:
            rows.append({"at": change["at"], "host": h["host"], "field": "(first seen)",
                         "old": None, "new": (h["new_hash"] or "")[:16], "rule": None,
                         "severity": None})
        for f in fields:
            rows.append({"at": change["at"], "host": h["host"], **f,
                         "old": _short(f["old"]), "new": _short(f["new"])})
    doc = {"host": node, "since": out.iso(since), "changes": changes}
    csv_rows = [{**r} for r in rows]
    text = None
    if c.fmt == "table":
        text = out.table(rows, HISTORY_COLUMNS) if rows else "no changes\n"
    c.emit(doc, rows=rows, columns=HISTORY_COLUMNS, text=text, csv_rows=csv_rows,
           csv_columns=[(k, k) for k, _ in HISTORY_COLUMNS])


# --------------------------------------------------------------------------- decisions

DECISION_COLUMNS: list[out.Column] = [
    ("time", "TIME"), ("job", "JOB"), ("partition", "PARTITION"), ("decision", "DECISION"),
    ("action", "ACTION"), ("nodes", "NODES"), ("summary", "SUMMARY"),
]


def _first(rec: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if rec.get(k) not in (None, ""):
            return rec[k]
    return None


def _decision_row(rec: Mapping[str, Any]) -> dict[str, Any]:
    t = _first(rec, "time", "ts", "at", "timestamp")
    if isinstance(t, int | float):
        t = out.iso(float(t))
    verdict = rec.get("verdict") if isinstance(rec.get("verdict"), Mapping) else {}
    return {
        "time": t,
        "job": _first(rec, "job", "job_id"),
        "partition": _first(rec, "partition"),
        "decision": _first(rec, "decision") or verdict.get("decision"),
        "action": _first(rec, "action"),
        "nodes": _first(rec, "nodes", "nodelist", "hosts"),
        "summary": _first(rec, "summary", "message") or verdict.get("summary"),
    }


@main.command()
@click.option("--job", "job", default=None, metavar="ID", help="Only this job.")
@click.option("--since", type=SINCE, default=None, metavar="TIME",
              help="Only decisions since TIME: 7d, 2h, 30m, an ISO date or date-time.")
@click.option("--refused", is_flag=True, help="Only refusals.")
@click.option("--audit-log", "audit_log", metavar="FILE", default=None,
              help="The audit trail (default: the config's gate.audit_log).")
@_fmt_options
def decisions(job: str | None, since: float | None, refused: bool, audit_log: str | None,
              as_json: bool, as_csv: bool) -> None:
    """The gate's audit trail: one line per decision."""
    from prolog import audit

    c = _ctx(as_json, as_csv)
    if job is not None and not job.isdigit():
        fail(f"--job {job!r}: expected a numeric job id")
    path = audit_log or str(c.config.gate.audit_path(c.config.inventory))
    try:
        records = list(audit.read(path, job=int(job) if job else None, since=since,
                                  refused=refused))
    except FileNotFoundError:
        fail(f"{path}: no audit trail (the gate has not decided anything yet, or "
             "gate.audit_log points elsewhere)")
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read the audit trail: {e}")
    rows = [_decision_row(r) for r in records]
    doc = {"audit_log": path, "count": len(records), "decisions": records}
    text = None
    if c.fmt == "table":
        text = (out.table(rows, DECISION_COLUMNS) if rows else "no decisions\n")
    c.emit(doc, rows=rows, columns=DECISION_COLUMNS, text=text,
           csv_columns=[(k, k) for k, _ in DECISION_COLUMNS])


# --------------------------------------------------------------------------- drains

RECO_COLUMNS: list[out.Column] = [
    ("set", "NODE SET"), ("reason", "REASON"), ("count", "NODES"), ("hosts", "HOSTS"),
]
ACTION_COLUMNS: list[out.Column] = [
    ("action", "ACTION"), ("host", "NODE"), ("reason", "REASON"), ("detail", "DETAIL"),
]


def gather_facts(c: Ctx, hosts: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(facts per host, class values per compat_key) from the inventory's query tables.

    Fingerprints are loaded only where the query columns cannot answer: nodes with probe
    errors (is a port's state unknown?).
    """
    from ncclguard.drain import NodeFacts
    from ncclguard.fpdiff import active_ports

    wanted = set(hosts)
    cls = c.inv("classes", None)  # all of them: cheaper than a 16,000-name filter
    values = {k.compat_key: k.values for k in cls}
    rows = [r for r in c.inv("nodes", None) if r["host"] in wanted]
    with_errors = [r["host"] for r in rows if r.get("error_count")]
    unknown_ports: set[str] = set()
    if with_errors:
        for h, rec in c.inv("load", with_errors).items():
            if rec is not None and active_ports(rec.fingerprint) is None:
                unknown_ports.add(h)
    facts = {
        r["host"]: NodeFacts(
            host=r["host"], compat_key=r["compat_key"], values=values.get(r["compat_key"], {}),
            last_heartbeat=r["last_heartbeat"],
            ports_up=None if r["host"] in unknown_ports else r["rdma_ports_up"],
            ports_total=r["rdma_ports_total"],
        )
        for r in rows
    }
    return facts, values


def make_judge(c: Ctx, facts: Mapping[str, Any], values: Mapping[str, Any]) -> Any:
    """The gate's policy on one node per class; the class values alone if it is missing."""
    from ncclguard import drain

    try:
        import prolog.policy  # noqa: F401
    except ImportError:
        return drain.values_judge(values, c.config)
    reps: dict[str, str] = {}
    for f in facts.values():
        reps.setdefault(f.compat_key, f.host)
    if len(reps) < 2:  # one class: nothing to judge
        return drain.values_judge(values, c.config)
    loaded = c.inv("load", list(reps.values()))
    fps = {k: loaded[h].fingerprint for k, h in reps.items() if loaded.get(h) is not None}
    return drain.policy_judge(fps, c.config)


@main.command("drain-recommend")
@click.option("--partition", "-p", default=None, help="Only this Slurm partition.")
@click.option("--nodes", "nodes_opt", metavar="HOSTLIST", default=None,
              help="Judge this node set instead of Slurm's partitions (no Slurm needed).")
@click.option("--apply", "do_apply", is_flag=True,
              help="Drain the recommended nodes (scontrol; needs Slurm operator rights).")
@click.option("--resume", "do_resume", is_flag=True,
              help="Resume nodes drained by ncclguard whose cause is gone.")
@click.option("--force", is_flag=True,
              help="Recommend (and apply) even above drain.max_share of a node set.")
@_fmt_options
def drain_recommend(partition: str | None, nodes_opt: str | None, do_apply: bool,
                    do_resume: bool, force: bool, as_json: bool, as_csv: bool) -> None:
    """Nodes to drain per partition, grouped by reason; --apply / --resume carry it out."""
    from ncclguard import drain
    from ncclguard.slurm import SlurmError

    c = _ctx(as_json, as_csv)
    sets = resolve_sets(c, partition, nodes_opt, all_partitions=True) or []
    if (do_apply or do_resume) and any(s.source == "inventory" for s in sets):
        fail(f"--apply/--resume need Slurm, and it is not reachable ({sets[0].note})")
    all_hosts = list(dict.fromkeys(h for s in sets for h in s.hosts))
    facts, values = gather_facts(c, all_hosts)
    judge = make_judge(c, facts, values)
    plan = drain.recommend({s.name: s.hosts for s in sets}, facts, judge, c.config,
                           now=c.now, force=force)
    actions: list[drain.Action] = []
    if do_apply or do_resume:
        try:
            snodes = {n.name: n for n in c.slurm_nodes()}
            if do_apply:
                actions += drain.plan_apply(plan, snodes)
            if do_resume:
                actions += drain.plan_resume(plan, snodes, all_hosts)
            drain.execute(actions, c.slurm)
        except SlurmError as e:
            fail(f"Slurm: {e}" + (f" ({e.stderr.strip()})" if e.stderr.strip() else ""))
    by_name = {s.name: s for s in sets}
    doc = {
        "node_sets": [by_name[sp.name].to_dict() | sp.to_dict(compress) for sp in plan.sets],
        "force": force,
        "drain": plan.drains(),
        "applied": do_apply,
        "resumed": do_resume,
        "actions": [a.to_dict() for a in actions],
    }
    rows = [
        {"set": sp.name, "reason": g["reason"], "count": g["count"], "hosts": g["hosts"],
         "kind": g["kind"], "withheld": sp.capped}
        for sp in plan.sets for g in sp.to_dict(compress)["groups"]
    ]
    text = None
    if c.fmt == "table":
        lines = []
        for sp in plan.sets:
            ns = by_name[sp.name]
            lines.append(ns.describe())
            b = sp.baseline
            if b and b.get("compat_key"):
                vals = b.get("values") or {}
                desc = ", ".join(f"{k} {vals.get(k)}" for k in
                                 ("nccl", "net_plugin", "net_abi", "transport"))
                how = "pinned" if b.get("pinned") else f"majority {b.get('share', 0):.0%}"
                lines.append(f"  baseline: class {b['compat_key']} ({how}, {b['count']} "
                             f"nodes): {desc}")
            elif b:
                lines.append(f"  baseline: pinned {b.get('pin')}, no class matches")
            if sp.note:
                lines.append(f"  NOTE: {sp.note}")
            if not sp.recommendations:
                lines.append("  nothing to drain")
            else:
                verb = "WITHHELD (cap)" if sp.capped else "recommend drain"
                sub = [r for r in rows if r["set"] == sp.name]
                lines.append(f"  {verb}: {len(sp.recommendations)} of {len(sp.hosts)} nodes")
                lines.append(out.table(sub, RECO_COLUMNS[1:]).rstrip("\n"))
        if actions:
            lines.append("actions:")
            lines.append(out.table([a.to_dict() for a in actions], ACTION_COLUMNS).rstrip("\n"))
        elif do_apply or do_resume:
            lines.append("actions: none (nothing to do)")
        text = "\n".join(lines) + "\n"
    c.emit(doc, rows=rows, columns=RECO_COLUMNS, text=text,
           csv_columns=[("set", "set"), ("reason", "reason"), ("kind", "kind"),
                        ("count", "count"), ("hosts", "hosts"), ("withheld", "withheld")])


# --------------------------------------------------------------------------- plug-ins

#: Subcommands that live in other packages, imported only when they are run (or listed
#: by --help), so that they cost the other commands nothing: name -> (module, attribute).
LAZY_COMMANDS = {"diagnose": ("ncclguard.diagnose.cli", "diagnose")}  # issue 7


def _lazy_available(name: str) -> bool:
    import importlib.util

    module = LAZY_COMMANDS[name][0]
    parent, _, leaf = module.rpartition(".")
    spec = importlib.util.find_spec(parent.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        return False
    from pathlib import Path

    base = Path(next(iter(spec.submodule_search_locations)))
    rel = Path(*parent.split(".")[1:]) / f"{leaf}.py"
    return (base / rel).is_file()


def _lazy_list(self: click.Group, ctx: click.Context) -> list[str]:
    names = set(click.Group.list_commands(self, ctx))
    names.update(n for n in LAZY_COMMANDS if _lazy_available(n))
    return sorted(names)


def _lazy_get(self: click.Group, ctx: click.Context, name: str) -> click.Command | None:
    cmd = click.Group.get_command(self, ctx, name)
    if cmd is not None or name not in LAZY_COMMANDS or not _lazy_available(name):
        return cmd
    import importlib

    module, attr = LAZY_COMMANDS[name]
    found = getattr(importlib.import_module(module), attr)
    self.add_command(found, name)
    return found


_Group.list_commands = _lazy_list  # type: ignore[method-assign]
_Group.get_command = _lazy_get  # type: ignore[method-assign]


if __name__ == "__main__":  # python -m ncclguard.cli
    main()
