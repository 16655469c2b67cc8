"""The one TOML config shared by inventoryd, the prolog and the CLI.

``load()`` reads ``$NCCLGUARD_CONFIG`` or ``/etc/ncclguard/config.toml`` (a missing
default file means "all defaults"), validates its sections, keys, types and values, and
returns a frozen :class:`Config`. An error names the key, the value and the file.

The names in ``[policy.severity]`` and ``[baseline]`` belong to the policy's rules, which
sit above this module: the programs load the file with ``ncclguard.policy.load_config``,
which checks those names too and fills in each rule's default severity.

This module is on the prolog's hot path: it imports only the standard library.

Over 500 lines: one settings class per section of the file and the one validator of
every key (its type, bounds and choices), so that what a key means, its default and what
is refused are read in one place; splitting the sections would split the validator.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path("/etc/ncclguard/config.toml")
SYSTEM_STATE_DIR = Path("/var/lib/ncclguard")
#: The gate's audit trail, when this directory exists: SlurmUser's to write (the gate
#: runs as SlurmUser; the inventory's directory is the collector's, ``ncclguard``'s).
AUDIT_DIR = Path("/var/log/ncclguard")

SEVERITIES = ("ignore", "warn", "refuse")
#: A heartbeat further than this in the future (seconds) counts as stale: a node whose
#: clock runs ahead would otherwise look fresh long after it died. The collector rejects
#: records signed further ahead (docs/collector.md).
HEARTBEAT_SKEW_S = 30.0
class _Settings:
    """A frozen record of settings: the annotated class attributes are the fields and
    their defaults (a dict default is copied per instance).

    Not a dataclass: the prolog imports this module for every job, and ``dataclasses``
    (with ``inspect``) plus generating the methods of seven classes cost it about a
    third of its start-up.
    """

    def __init__(self, **values: Any) -> None:
        for name in self.field_names():
            value = values.pop(name) if name in values else getattr(type(self), name)
            object.__setattr__(self, name, dict(value) if isinstance(value, dict) else value)
        if values:
            raise TypeError(f"{type(self).__name__}: unknown field(s) {', '.join(values)}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(n for n in cls.__annotations__ if not n.startswith("_"))

    @classmethod
    def field_type(cls, name: str) -> str:
        return str(cls.__annotations__[name])

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed (like ``dataclasses.replace``)."""
        return type(self)(**{**{n: getattr(self, n) for n in self.field_names()}, **changes})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self.field_names()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.field_names())
        return f"{type(self).__name__}({inner})"


class ConfigError(Exception):
    """A config file that cannot be used. The message names file, key and value."""


def default_db_path() -> Path:
    """The inventory's embedded default: the system state dir if it exists, else per user.

    ``/var/lib/ncclguard`` is created by the systemd units (tmpfiles.d). On a fresh
    machine without root the per-user state dir keeps every command working.
    """
    if SYSTEM_STATE_DIR.is_dir():
        return SYSTEM_STATE_DIR / "inventory.db"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ncclguard" / "inventory.db"


def default_audit_path(inventory: InventoryConfig | None = None) -> Path:
    """``/var/log/ncclguard/decisions.jsonl`` when that directory exists (the install
    creates it for SlurmUser), else ``decisions.jsonl`` next to the inventory (one
    machine, tests: the per-user default)."""
    if AUDIT_DIR.is_dir():
        return AUDIT_DIR / "decisions.jsonl"
    return (inventory or InventoryConfig()).db_path().with_name("decisions.jsonl")


def default_state_dir() -> Path:
    """Where the inventory and the spool live by default (see :func:`default_db_path`)."""
    return default_db_path().parent


class InventoryConfig(_Settings):
    db: str = ""  # empty: default_db_path()
    journal_mode: str = "delete"  # the collector uses "wal" whatever this says (local disk)
    busy_timeout_ms: int = 2000
    write_retries: int = 8
    stale_after_s: int = 900  # a heartbeat older than this makes a node stale
    history_days: int = 180  # history rows older than this are deleted (each node keeps
    #                          its newest); 0: keep for ever
    container_days: int = 30  # the enroot hook's container records are kept this long

    def db_path(self) -> Path:
        env = os.environ.get("NCCLGUARD_DB")
        if env:
            return Path(env)
        return Path(self.db) if self.db else default_db_path()


class InventorydConfig(_Settings):
    interval_s: float = 60.0  # time between two collections
    jitter: float = 0.1  # +- share of interval_s, so that 16,000 nodes don't write in step
    heartbeat_s: float = 300.0  # an unchanged fingerprint is still confirmed this often
    nccl_search_paths: tuple[str, ...] = ()  # extra dirs/globs holding libnccl.so*
    plugin_search_paths: tuple[str, ...] = ()  # extra dirs/globs holding NCCL plugins
    ncclgetversion: bool = False  # also dlopen each libnccl in a subprocess to cross-check
    textfile_dir: str = ""  # node_exporter textfile collector dir; empty: off
    cache_dir: str = ""  # per-node cache of file-only results; empty: <state dir>/cache


class SpoolConfig(_Settings):
    """Where nodes publish their signed records, and how they sign them (docs/collector.md)."""

    dir: str = ""  # on the shared filesystem; empty: <state dir>/spool
    munge_socket: str = ""  # this host's munged; empty: libmunge's default
    record_ttl_s: int = 3600  # a record's credential is valid this long (munged caps at 3600)
    max_record_bytes: int = 1048576  # munged's own request limit (MUNGE_MAXIMUM_REQ_LEN)

    def spool_path(self) -> Path:
        env = os.environ.get("NCCLGUARD_SPOOL")
        if env:
            return Path(env)
        return Path(self.dir) if self.dir else default_state_dir() / "spool"


class CollectorConfig(_Settings):
    """The one writer of the inventory, on the controller (docs/collector.md)."""

    publisher: str = "ncclguard"  # the user (name or uid) whose signed records are accepted
    scan_interval_s: float = 2.0  # how often the spool is listed
    batch_max: int = 2000  # records written in one transaction at most
    address_refresh_s: float = 600.0  # how long Slurm's node addresses are trusted
    # node -> its addresses: a static map used instead of Slurm's NodeAddr/NodeHostname
    addresses: dict[str, tuple[str, ...]] = {}  # noqa: RUF012 - copied per instance
    textfile_dir: str = ""  # node_exporter textfile dir for the collector's metrics
    metrics_port: int = 0  # serve the cluster's metrics on this port (0: no HTTP endpoint)
    metrics_address: str = "127.0.0.1"  # ... on this address (loopback: a local Prometheus)
    metrics_cache_s: float = 10.0  # the inventory is read for the metrics at most this often
    metrics_max_connections: int = 64  # open connections to the endpoint at most
    metrics_timeout_s: float = 5.0  # a request must arrive, and its answer be taken, within
    node_quota_bytes: int = 67108864  # one node's record and history at most (0: no bound)
    max_changes_per_hour: int = 30  # one node's accepted changes within an hour (0: no bound)
    min_free_bytes: int = 1073741824  # below this free space the inventory stops growing


class FeaturesConfig(_Settings):
    """Class features in Slurm, and the file job_submit.lua reads (docs/scheduling.md)."""

    # the file the shipped job_submit.lua reads; on the controller's local disk, in a
    # directory only SlurmUser (who runs the sync) and root can write
    classes_file: str = "/var/lib/ncclguard-features/classes"
    interval_s: float = 2.0  # how often the sync daemon looks (one cheap Slurm call)
    verify_s: float = 60.0  # how often it checks Slurm's class features (one grouped sinfo)
    max_alternatives: int = 64  # classes in one job's group, at most (Slurm's limit: 64)
    # a job whose required nodes (-w) span classes: "refuse" it at submit, or leave it to
    # the "gate" (Slurm gives a job its required nodes whatever its constraint)
    required_nodes: str = "refuse"
    # a node whose class changes again within this many seconds of its last change is held
    # without a class until its stack has stayed the same this long (one node cannot make
    # Slurm churn)
    settle_s: float = 60.0
    # a node update Slurm refuses is retried after 2 s, then twice as long each time, up
    # to this (the other nodes' updates go on)
    retry_max_s: float = 300.0
    # a second class feature per node (nc_j...): what the node gives a job that brings
    # its own NCCL (a pip venv, a conda env, a module); a batch job from an environment
    # the collector resolved is offered those classes, not confined by the hosts'
    # libnccl (issue 40, docs/scheduling.md). Off: every node carries one feature.
    own_nccl: bool = False


class PolicyConfig(_Settings):
    partitions: tuple[str, ...] = ()  # guarded partitions; empty: all
    min_nodes: int = 2
    # rule -> "ignore" | "warn" | "refuse"; the rules and their defaults are the policy's
    # (ncclguard.policy.rules), which checks the names (ncclguard.policy.load_config)
    severity: dict[str, str] = {}  # noqa: RUF012 - copied per instance


class GateConfig(_Settings):
    on_error: str = "accept"  # "accept" (fail open) or "refuse" (fail closed)
    deadline_s: float = 5.0  # hard bound on one prolog run, Slurm calls included
    steering: str = "steer"  # "steer", "requeue" or "hold"
    max_refusals: int = 3  # refusals of one job before it is held
    steer_wait_s: float = 30.0  # how long the detached follow-up waits for PENDING
    allow_opt_out: bool = True  # honour ncclguard=off in the job comment / --extra
    audit_log: str = ""  # JSON lines; empty: /var/log/ncclguard/, else next to the inventory
    slurm_bin_dir: str = ""  # where scontrol/squeue live; empty: PATH, then /usr/bin
    slurm_conf: str = ""  # slurm.conf for the Slurm commands; empty: $SLURM_CONF, then Slurm's own
    # one Slurm command run by the admin CLI (ncclguard ...); the gate is bound by
    # deadline_s. A controller of many thousand nodes can take longer than the default
    # to list them just after a large update.
    cli_slurm_timeout_s: float = 15.0
    # what concurrent refusals share (a partition's nodes and classes): computed by one
    # run, read by the others while younger than this (0: each run computes its own)
    shared_max_age_s: float = 10.0
    shared_dir: str = ""  # where; empty: gate-shared/ beside the audit log (SlurmUser's)
    # a batch job's own NCCL (docs/jobs.md): read the environment slurmctld saved at submit
    read_job_env: bool = True
    # slurmctld's StateSaveLocation, where that environment is; empty: slurm.conf's
    state_save_location: str = ""

    def audit_path(self, inventory: InventoryConfig | None = None) -> Path:
        """``audit_log``, else :func:`default_audit_path`, so that the gate (as SlurmUser)
        and the admins' ``ncclguard decisions`` find the same file."""
        if self.audit_log:
            return Path(self.audit_log)
        return default_audit_path(inventory)

    def shared_path(self, inventory: InventoryConfig | None = None) -> Path:
        """``shared_dir``, else ``gate-shared`` beside the audit log: a directory the
        gate (SlurmUser) already writes to, and no one else."""
        if self.shared_dir:
            return Path(self.shared_dir)
        return self.audit_path(inventory).parent / "gate-shared"


class DrainConfig(_Settings):
    max_share: float = 0.10  # never recommend more than this share of a partition
    majority: float = 0.5  # the baseline class must hold more than this share


class DiagnoseConfig(_Settings):
    signature_files: tuple[str, ...] = ()  # extra signature catalogs (TOML)


class ImagesConfig(_Settings):
    """The container image index on the controller (docs/containers.md)."""

    roots: tuple[str, ...] = ()  # directories of shared .sqsh images; empty: no index
    scan_interval_s: float = 300.0  # how often the collector looks for new or changed images
    scan_budget_s: float = 20.0  # image scanning time per collector cycle (the rest: next one)
    timeout_s: float = 30.0  # one image, listing and every file read (and at most what is
    #                          left of scan_budget_s)
    max_read_bytes: int = 3221225472  # streamed out of one image at most (the libnccl a job
    #                                   loads first); also at most 64x the image's size
    max_images: int = 10000  # images in the index at most (a fair share per file owner)
    max_depth: int = 8  # directory levels searched below each root
    unsquashfs: str = ""  # the program; empty: PATH, then /usr/bin/unsquashfs
    tmp_dir: str = ""  # where files are streamed out of an image; empty: the system's


class RegistryConfig(_Settings):
    """Registry images read by the collector (docs/containers.md, "Registry images")."""

    enabled: bool = False  # resolve and read the registry references jobs use
    refs: tuple[str, ...] = ()  # references read whether or not a job used them yet
    #: the registries (host[:port]) whose references a job may make the collector read;
    #: with refs' own registries. A user names any host in --container-image: the
    #: controller contacts only these (docs/containers.md, "Registry images")
    registries: tuple[str, ...] = ()
    platform: str = ""  # os/arch picked from an index; empty: this machine's (linux/amd64)
    credentials: str = ""  # enroot's .credentials (netrc) file; empty: anonymous only
    insecure: tuple[str, ...] = ()  # host:port reached over plain HTTP (loopback tests)
    ca_file: str = ""  # a CA bundle for the registries' TLS; empty: the system's
    #: registry -> the hosts of its bearer-token realms that get credentials (the
    #: registry's own host always does): {"nvcr.io" = ["authn.nvidia.com"]}; another
    #: realm a registry names is asked anonymously
    token_realms: dict[str, tuple[str, ...]] = {}  # noqa: RUF012 - copied per instance
    #: an http:// proxy for every registry (curl's --proxy); empty: HTTPS_PROXY,
    #: HTTP_PROXY of the collector's environment; NO_PROXY applies to both
    proxy: str = ""
    resolve_interval_s: float = 300.0  # how often each reference is resolved again
    max_age_s: float = 3600.0  # the gate judges a tag by a resolution at most this old
    keep_unused_s: float = 30 * 86400.0  # a reference no job used for this long is dropped
    max_refs: int = 1000  # references in the index at most (config ones first)
    timeout_s: float = 1800.0  # one image: resolving, its config and every new layer
    max_layer_bytes: int = 17179869184  # one compressed layer at most (16 GiB)
    max_unpacked_bytes: int = 68719476736  # one layer unpacked at most (and 64x its size)
    max_read_bytes: int = 3221225472  # analysed out of one layer at most (its libnccl first)
    tmp_dir: str = ""  # where a libnccl is streamed to be analysed; empty: the system's

    def allows(self, registry: str, configured: tuple[str, ...] = ()) -> bool:
        """Whether a job's reference on ``registry`` is read: it is in ``registries``, or
        it is the registry of one of ``configured`` (the refs' registries, parsed)."""
        return registry in self.registries or registry in configured


class RuntimeConfig(_Settings):
    """What running jobs loaded (docs/runtime.md, issue 42)."""

    #: the node: where ``ncclguard-inventoryd jobmaps`` writes what the job steps mapped,
    #: and the node daemon reads it for its record; empty: not watched
    loaded_file: str = "/run/ncclguard-jobmaps/loaded.json"
    scan_interval_s: float = 15.0  # the node: how often jobmaps reads the steps' maps
    #: the node: a document older than this is not published (the scanner has stopped)
    max_age_s: float = 120.0
    #: the dev cluster only (several slurmd on one machine): a process is a node's when its
    node_from_env: bool = False  # environment says SLURMD_NODENAME=<node>
    on_mixed: str = "notify"  # the collector: "notify", or "requeue" a mixed job once
    settle_s: float = 60.0  # a node's net taken as chosen this long after it mapped NCCL
    exempt_users: tuple[str, ...] = ()  # never requeued or cancelled (user names or uids)
    exempt_partitions: tuple[str, ...] = ()  # never requeued or cancelled
    keep_days: float = 14.0  # job_loads and mixed_steps kept this long


class CanaryConfig(_Settings):
    """The canary before a changed node takes multi-node jobs (docs/canary.md, issue 43)."""

    enabled: bool = False  # hold changed nodes until their canary passes
    #: the site's test, run as a batch job on the changed nodes and their peers (an
    #: argument list; the job's script runs it with ``exec``), e.g. ``["srun", "--mpi=pmix",
    #: "all_reduce_perf", "-b", "8", "-e", "256M", "-g", "1"]``
    command: tuple[str, ...] = ()
    partition: str = ""  # the canary job's partition (empty: Slurm's default)
    qos: str = ""  # its QOS (empty: the association's default)
    account: str = ""  # its account (empty: the user's default)
    time_limit_s: float = 600.0  # its time limit (Slurm's, rounded up to a minute)
    #: a canary still pending this long (its peers were taken) is cancelled and tried again
    pending_timeout_s: float = 300.0
    settle_s: float = 300.0  # a node's stack must stay the same this long before its canary
    max_running: int = 2  # canary jobs at once, across the cluster
    max_nodes: int = 4  # changed nodes of one class that share a canary
    peers: int = 1  # known-good nodes of the class beside them
    #: where the canary job's output goes (owned by the service's user, not writable by
    #: others, shared with the controller to show the last lines); empty: /dev/null
    output_dir: str = ""
    interval_s: float = 15.0  # the service's pass


class Config(_Settings):
    inventory: InventoryConfig = InventoryConfig()
    inventoryd: InventorydConfig = InventorydConfig()
    spool: SpoolConfig = SpoolConfig()
    collector: CollectorConfig = CollectorConfig()
    features: FeaturesConfig = FeaturesConfig()
    policy: PolicyConfig = PolicyConfig()
    gate: GateConfig = GateConfig()
    drain: DrainConfig = DrainConfig()
    diagnose: DiagnoseConfig = DiagnoseConfig()
    images: ImagesConfig = ImagesConfig()
    registry: RegistryConfig = RegistryConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    canary: CanaryConfig = CanaryConfig()
    baseline: dict[str, str] = {}  # noqa: RUF012 - copied per instance; pinned baseline, e.g. nccl
    source: str = "<defaults>"  # the file this came from


_SECTIONS: dict[str, type] = {
    "inventory": InventoryConfig,
    "inventoryd": InventorydConfig,
    "spool": SpoolConfig,
    "collector": CollectorConfig,
    "features": FeaturesConfig,
    "policy": PolicyConfig,
    "gate": GateConfig,
    "drain": DrainConfig,
    "diagnose": DiagnoseConfig,
    "registry": RegistryConfig,
    "images": ImagesConfig,
    "runtime": RuntimeConfig,
    "canary": CanaryConfig,
}

_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("inventory", "journal_mode"): ("delete", "wal"),
    ("gate", "on_error"): ("accept", "refuse"),
    ("runtime", "on_mixed"): ("notify", "requeue"),
    ("gate", "steering"): ("steer", "requeue", "hold"),
    ("features", "required_nodes"): ("refuse", "gate"),  # sched.classfile.REQUIRED_NODES
}

def config_path() -> Path:
    env = os.environ.get("NCCLGUARD_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG_PATH


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load the config and validate its sections, keys, types and values.
    ``path=None``: ``$NCCLGUARD_CONFIG`` or the default.

    The rule names in ``[policy.severity]`` and the keys of ``[baseline]`` are left to
    the policy: programs call ``ncclguard.policy.load_config``, which checks them too.

    A missing file is an error when it was named explicitly (argument or environment),
    and "all defaults" when it is the default path.
    """
    explicit = path is not None or "NCCLGUARD_CONFIG" in os.environ
    p = Path(path) if path is not None else config_path()
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{p}: config file not found") from None
        return Config()
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    return from_dict(data, source=str(p))


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a parsed TOML document and build a :class:`Config`."""
    kwargs: dict[str, Any] = {"source": source}
    for section, value in data.items():
        if section == "baseline":
            kwargs["baseline"] = _baseline(value, source)
            continue
        cls = _SECTIONS.get(section)
        if cls is None:
            known = ", ".join([*_SECTIONS, "baseline"])
            raise ConfigError(f"{source}: unknown section [{section}] (known: {known})")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {value!r}")
        kwargs[section] = _section(cls, section, value, source)
    return Config(**kwargs)


def _baseline(value: Any, source: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [baseline] must be a table, got {value!r}")
    out: dict[str, str] = {}
    for k, v in value.items():  # the keys are checked by the policy (load_config)
        if not isinstance(v, str | int) or isinstance(v, bool):
            raise ConfigError(f"{source}: baseline.{k} = {v!r}: expected a string")
        out[k] = str(v)
    return out


def _section(
    cls: type[_Settings], section: str, values: dict[str, Any], source: str
) -> Any:
    specs = cls.field_names()
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = f"{source}: {section}.{key} = {value!r}"
        if key not in specs:
            raise ConfigError(f"{source}: {section}.{key}: unknown key (known: {', '.join(specs)})")
        kwargs[key] = _check(section, key, cls.field_type(key), value, where)
    if section == "canary":
        if kwargs.get("enabled") and not kwargs.get("command"):
            raise ConfigError(f"{source}: canary.enabled = true needs canary.command (the "
                              "site's test: docs/canary.md)")
        out = kwargs.get("output_dir", "")
        if out and not out.startswith("/"):
            raise ConfigError(f"{source}: canary.output_dir = {out!r}: expected an absolute "
                              "path (or empty)")
    return cls(**kwargs)


def _check(section: str, key: str, typ: Any, value: Any, where: str) -> Any:
    typ = str(typ)
    if key == "severity":
        return _severity(value, where)
    if key in ("addresses", "token_realms"):
        return _addresses(value, where)
    if typ == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
        return value
    if typ == "int":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}: expected a non-negative integer")
        if key == "min_nodes" and value < 2:
            raise ConfigError(f"{where}: must be at least 2 (one node cannot disagree)")
        if key in ("record_ttl_s", "max_record_bytes", "batch_max", "metrics_max_connections",
                   "max_read_bytes") and value == 0:
            raise ConfigError(f"{where}: must be greater than 0")
        if key == "max_alternatives" and not 1 <= value <= 64:
            raise ConfigError(f"{where}: expected 1 to 64 (past 64 slurmctld crashes)")
        if key == "metrics_port" and value > 65535:
            raise ConfigError(f"{where}: expected a TCP port (1-65535), or 0 for none")
        if section == "canary" and key in ("max_running", "max_nodes", "peers") \
                and not 1 <= value <= 64:
            raise ConfigError(f"{where}: expected 1 to 64")
        if key == "record_ttl_s" and value >= 2**31:
            raise ConfigError(f"{where}: at most {2**31 - 1} (munged caps it at its --max-ttl)")
        return value
    if typ == "float":
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0 \
                or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a non-negative number (finite)")
        if key in ("max_share", "majority", "jitter") and value > 1:
            raise ConfigError(f"{where}: expected a share between 0 and 1")
        if key in ("interval_s", "deadline_s", "scan_interval_s", "verify_s",
                   "metrics_timeout_s", "retry_max_s", "time_limit_s",
                   "cli_slurm_timeout_s") and value == 0:
            raise ConfigError(f"{where}: must be greater than 0")
        return float(value)
    if typ == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string")
        if (section, key) == ("registry", "proxy") and value and not value.startswith(
                "http://"):
            raise ConfigError(f"{where}: expected an http://[user:password@]host:port "
                              "proxy (or empty: the environment's)")
        choices = _CHOICES.get((section, key))
        if choices and value not in choices:
            raise ConfigError(f"{where}: expected one of {', '.join(choices)}")
        return value
    if typ.startswith("tuple[str"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings")
        return tuple(value)
    raise ConfigError(f"{where}: unsupported type {typ}")  # a bug in this module


def _severity(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table of rule = severity")
    out: dict[str, str] = {}
    for rule, sev in value.items():  # the rule names are checked by the policy (load_config)
        if sev not in SEVERITIES:
            raise ConfigError(f"{where}: {rule} = {sev!r}: expected one of {', '.join(SEVERITIES)}")
        out[rule] = sev
    return out


def _addresses(value: Any, where: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table of node = [addresses]")
    out: dict[str, tuple[str, ...]] = {}
    for node, addrs in value.items():
        if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) for a in addrs):
            raise ConfigError(f"{where}: {node} = {addrs!r}: expected a list of addresses")
        out[node] = tuple(addrs)
    return out
