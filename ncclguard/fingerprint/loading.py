"""Which library NCCL opens for each plugin kind, release by release: the loading rules.

One table, :data:`ROWS`, keyed by the first release each change holds for; every row
cites the NVIDIA/nccl tag (or commit) and the source files it was read from, and the
strings of the real ``libnccl.so.2`` of the nvidia-nccl wheels agree with it
(``tests/test_loading_rules.py``, ``python -m devtools.ncclwheels sweep``).
docs/fingerprint.md ("Loading rules by release") shows the same table.
:func:`rules_for` folds the rows up to a release into :class:`Rules`;
:func:`own_names` turns a value of ``NCCL_<KIND>_PLUGIN`` into the names NCCL ``dlopen``s.
The plugin probe (``inventoryd/probes/plugins.py``) decides which plugin is in force from
these alone; which ABI a library speaks comes from its strings and symbols
(:mod:`ncclguard.fingerprint.abi`), not from here.

A release newer than the newest row is read with the newest row's rules, one older than
the oldest row with the oldest's, and a library whose version is unknown with the
newest's: :attr:`Rules.caveat` says which, and the probe writes it into the reasons of
the fingerprint's ``net`` and ``effective`` parts. Nothing is guessed silently.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

__all__ = [
    "EXECUTABLE", "PREFIXES", "ROWS", "Kind", "Row", "Rules", "Version", "net_plugin_names",
    "own_names", "parse_version", "rules_for",
]

Version = tuple[int, int, int]

#: ``src/plugin/plugin_open.cc`` (v2.30.7-1), ``pluginPrefix[]``: ``libnccl-<kind>``.
PREFIXES = {"net": "libnccl-net", "gin": "libnccl-gin", "rma": "libnccl-rma",
            "tuner": "libnccl-tuner", "profiler": "libnccl-profiler", "env": "libnccl-env"}

#: The name that stands for the job's own executable: ``dlopen(NULL)`` (a value that is a
#: prefix of ``STATIC_PLUGIN``, from 2.22.3) or ``dlopen("")`` (an empty
#: ``NCCL_TUNER_PLUGIN`` in 2.19 and 2.20; glibc gives the main program for both). What it
#: exports is the job's business: the node cannot know.
EXECUTABLE = ""
STATIC_PLUGIN = "STATIC_PLUGIN"
MAX_NAME = 255  # MAX_STR_LEN: a list item needs strlen + 1 <= 255 (net.cc, gin.cc, rma.cc)

# How one value of NCCL_<KIND>_PLUGIN becomes the names dlopen'ed (X: the value or item)
PREFIXED = "prefixed"            # libnccl-<kind>-X.so only
GIVEN = "given"                  # X as given only
BOTH = "given, prefixed"         # X, then libnccl-<kind>-X.so
LIB_OR_PREFIXED = "lib*.so as given, else prefixed"  # 2.27.3 (a lib*.so of 7+ chars)
BOTH_UNLESS = "given, prefixed unless a path or lib*.so"  # 2.27.5 on

# An empty value (set, but to ""): the default name, nothing (an empty list), the job's
# executable (dlopen(""))
EMPTY_DEFAULT, EMPTY_NONE, EMPTY_EXECUTABLE = "default", "none", "executable"
# The value "none" (any case): off for the kind (no fallback either), or an empty list
# (the fallbacks are still tried)
OFF_KIND, OFF_LIST = "kind", "list"
# Libraries a kind falls back to when none of its own opens (or, for lists, is usable)
NET = "net"              # the net plugin's library, as loaded (only one with a net ABI)
NET_NAMES = "net-names"  # NCCL_NET_PLUGIN's names (or libnccl-net.so), opened anew
# A library of its own that opens without a known ABI: no plugin of the kind at all, or
# on to the next candidate
STOP, NEXT = "stop", "next"


@dataclass(frozen=True)
class Kind:
    """How NCCL finds the library of one plugin kind (one release's rules)."""

    var: str | None = None        #: the variable naming the library; None: none is read
    default: str | None = None    #: opened when the variable is unset; None: nothing
    names: str = PREFIXED         #: how a value becomes names (the constants above)
    empty: str = EMPTY_DEFAULT    #: what an empty value means
    listed: int = 0               #: >0: a comma-separated list of at most this many items
    off: str | None = None        #: what the value ``none`` means; None: a name like any
    own: bool = True              #: opens a library of its own (False: its fallbacks only)
    fallbacks: tuple[str, ...] = ()
    unusable: str = STOP          #: an own library opening without a known ABI
    external: bool = True         #: False: NCCL uses no external plugin of this kind
    note: str = ""                #: what the reasons say about this rule


@dataclass(frozen=True)
class Row:
    """The changes to the loading rules that one release brings, and their evidence."""

    release: Version
    source: str                                  #: tag: files (NVIDIA/nccl)
    kinds: dict[str, dict[str, Any] | Kind] = field(default_factory=dict)
    static: bool | None = None                   #: STATIC_PLUGIN means dlopen(NULL)
    opener: str | None = None                    #: "per kind" or "plugin_open.cc"

    @property
    def label(self) -> str:
        return ".".join(map(str, self.release))


def _r(release: str, source: str, static: bool | None = None, opener: str | None = None,
       every: dict[str, Any] | None = None, **kinds: dict[str, Any] | Kind) -> Row:
    a, b, c = (int(x) for x in release.split("."))
    return Row((a, b, c), source, {**({"*": every} if every else {}), **kinds}, static, opener)


#: Releases read at a commit rather than a tag (the fetched NVIDIA/nccl has no tag past
#: v2.30.7-1): the commit whose ``makefiles/version.mk`` says that release.
V2_31_2 = "889806836097808572f87a2019eefd01f27aae68"
V2_32_3 = "12df1a11afad322be5a204a2db890161cbf8131d"

#: The loading rules, oldest first. A row states what changes from that release on; the
#: rules of a release are all rows up to it (:func:`rules_for`). Each row was read in
#: NVIDIA/nccl at the tag named (``git show <tag>:<file>``), or for 2.31.2 and 2.32.3 at
#: the commit named, and checked against the strings of the wheels' ``libnccl.so.2``
#: (docs/fingerprint.md, "Loading rules by release"). ``"*"`` changes every kind known at
#: that row; a row may change no field (2.31.2: what it changes, the table cannot show).
ROWS: tuple[Row, ...] = (
    _r("2.10.3", "v2.10.3-1: src/init.cc (dlopen(\"libnccl-net.so\"), no variable)",
       opener="per kind", static=False,
       net=Kind(default="libnccl-net.so")),
    _r("2.11.4", "v2.11.4-1: src/init.cc; v2.13.4-1 to v2.20.5-1: src/net.cc "
       "(libnccl-net-%s.so of NCCL_NET_PLUGIN)",
       net={"var": "NCCL_NET_PLUGIN"}),
    _r("2.19.1", "v2.19.1-1, v2.20.5-1: src/misc/tuner.cc (dlopen(getenv(\"NCCL_TUNER_PLUGIN\")) "
       "only: no default name, no other library)",
       tuner=Kind(var="NCCL_TUNER_PLUGIN", names=GIVEN, empty=EMPTY_EXECUTABLE)),
    _r("2.21.5", "v2.21.5-1: src/net.cc (the value as given, then libnccl-net-%s.so), "
       "src/misc/tuner.cc (libnccl-tuner.so, libnccl-tuner-%s.so, then NCCL_NET_PLUGIN's "
       "names opened anew)",
       net={"names": BOTH},
       tuner={"default": "libnccl-tuner.so", "names": BOTH, "empty": EMPTY_DEFAULT,
              "fallbacks": (NET_NAMES,)}),
    _r("2.22.3", "v2.22.3-1: src/net.cc, src/misc/tuner.cc (tryOpenLib: a prefix of "
       "STATIC_PLUGIN opens dlopen(NULL))", static=True),
    _r("2.23.4", "v2.23.4-1 to v2.25.1-1: src/misc/profiler.cc (NCCL_PROFILER_PLUGIN tried "
       "as given, twice; default libnccl-profiler.so)",
       profiler=Kind(var="NCCL_PROFILER_PLUGIN", default="libnccl-profiler.so", names=GIVEN)),
    _r("2.26.2", "v2.26.2-1: src/plugin/plugin_open.cc (one opener for every kind), "
       "src/plugin/tuner.cc (ncclGetNetPluginLib: the net plugin's library, as loaded), "
       "src/plugin/profiler.cc (no fallback)", opener="plugin_open.cc",
       profiler={"names": BOTH}, tuner={"fallbacks": (NET,)}),
    _r("2.27.3", "v2.27.3-1: src/plugin/net.cc (NCCL_NET_PLUGIN a list: strtok_r on \",\", "
       "at most NCCL_NET_MAX_PLUGINS - 2 = 14 items; set but empty: no item), "
       "src/plugin/plugin_open.cc (a lib*.so name as given only, any other only as "
       "libnccl-<kind>-NAME.so)",
       every={"names": LIB_OR_PREFIXED}, net={"listed": 14, "empty": EMPTY_NONE}),
    _r("2.27.5", "v2.27.5-1: src/plugin/plugin_open.cc (as given, then prefixed unless the "
       "name has a / or is lib*.so)", every={"names": BOTH_UNLESS}),
    _r("2.28.3", "v2.28.3-1: src/plugin/net.cc (none: an empty list), src/plugin/tuner.cc, "
       "src/plugin/profiler.cc (none disables; the profiler falls back to the net "
       "plugin's library)",
       net={"off": OFF_LIST}, tuner={"off": OFF_KIND},
       profiler={"off": OFF_KIND, "fallbacks": (NET,)}),
    _r("2.28.7", "v2.28.7-1: src/plugin/env.cc (getenv(\"NCCL_ENV_PLUGIN\") after initEnv(), "
       "which has set /etc/nccl.conf into the environment: src/misc/param.cc), "
       "src/plugin/net.cc, src/plugin/net/net_v11.cc (ncclGinPlugin_v11 from the net "
       "plugin's library only)",
       env=Kind(var="NCCL_ENV_PLUGIN", default="libnccl-env.so", names=BOTH_UNLESS,
                off=OFF_KIND),
       gin=Kind(own=False, names=BOTH_UNLESS, fallbacks=(NET,), unusable=NEXT)),
    _r("2.29.7", "v2.29.7-1: src/plugin/gin.cc (NCCL_GIN_PLUGIN, a list of at most "
       "NCCL_GIN_MAX_PLUGINS - 1 = 15; none or empty: no item; default libnccl-gin.so; "
       "then the net plugin's library)",
       gin={"var": "NCCL_GIN_PLUGIN", "default": "libnccl-gin.so", "own": True,
            "listed": 15, "empty": EMPTY_NONE, "off": OFF_LIST}),
    _r("2.30.3", "v2.30.3-1, v2.30.4-1: src/plugin/gin.cc, src/plugin/gin/gin_v13.cc (the "
       "GIN library's ncclRmaPlugin_v13 is looked up, but its state never leaves "
       "LoadReady: no external RMA is initialized)",
       rma=Kind(own=False, names=BOTH_UNLESS, external=False,
                note="it looks up ncclRmaPlugin_v13 in the GIN library but never "
                     "initializes an external RMA plugin (src/plugin/gin.cc v2.30.4-1); "
                     "there is no libnccl-rma.so nor NCCL_RMA_PLUGIN")),
    _r("2.30.7", "v2.30.7-1: src/plugin/rma.cc (NCCL_RMA_PLUGIN, a list of at most 13; "
       "default libnccl-rma.so; then the net plugin's library: GIN's library is listed "
       "first but is never open yet, as src/init.cc calls ncclRmaInit before ncclGinInit), "
       "src/plugin/rma/rma_v13.cc (ncclGinPlugin_v13 as RMA v13), src/plugin/gin.cc "
       "(lists of at most NCCL_GIN_MAX_PLUGINS - 3 = 13)",
       gin={"listed": 13},
       rma=Kind(var="NCCL_RMA_PLUGIN", default="libnccl-rma.so", names=BOTH_UNLESS,
                listed=13, empty=EMPTY_NONE, off=OFF_LIST, fallbacks=(NET,), unusable=NEXT)),
    _r("2.31.2", f"v2.31.2-1 (commit {V2_31_2}): src/plugin/rma.cc (looks for "
       "ncclRmaPlugin_v15..v13; the same list of at most 13, default and order as 2.30.7), "
       "src/plugin/rma/rma_v13.cc (ncclGinPlugin_v13 still serves as RMA v13), "
       "src/plugin/gin.cc (the same list of at most 13, default libnccl-gin.so, then the "
       "net plugin's library; new: every usable library of a GIN type not taken yet "
       "becomes a backend, no longer only the first, and the default backend is chosen "
       "by type at run time), src/plugin/profiler.cc (ncclProfiler_v7..v1, same names "
       "and fallback), src/init.cc (ncclRmaInit still before ncclGinInit); the wheel's "
       "strings agree"),
    _r("2.32.3", f"v2.32.3-1 (commit {V2_32_3}): src/plugin/rma.cc "
       "(ncclRmaPlugin_v16..v13; NCCL_RMA_NUM_RESERVED_PLUGINS 4: a list of at most "
       "NCCL_RMA_MAX_PLUGINS - 4 = 12, src/include/plugin/nccl_rma.h; then GIN's library, "
       "still never open then, the net plugin's, internal IB and a new internal Socket "
       "RMA), src/plugin/tuner.cc, src/plugin/env.cc (the same loading as 2.30.7); "
       "gin.cc, net.cc, profiler.cc, plugin_open.cc and init.cc have no copy at that "
       "commit in the store read, so they are taken as at v2.31.2-1, and the wheel's "
       "strings agree",
       rma={"listed": 12}),
)


@dataclass(frozen=True)
class Rules:
    """The loading rules of one release: the rows up to it, folded."""

    row: str                    #: the newest row applied
    kinds: dict[str, Kind]      #: the kinds that release loads (net always)
    static: bool                #: a prefix of STATIC_PLUGIN opens the job's executable
    opener: str                 #: "per kind" (up to 2.25) or "plugin_open.cc" (2.26 on)
    caveat: str | None = None   #: why these rules are not the release's own


OLDEST, NEWEST = ROWS[0].release, ROWS[-1].release


def _label(v: Version) -> str:
    return ".".join(map(str, v))


@lru_cache(maxsize=64)
def rules_for(version: Version | None) -> Rules:
    """The rules of ``version`` (``None``: unknown, read with the newest row's)."""
    v = NEWEST if version is None else max(version, OLDEST)
    kinds: dict[str, Kind] = {}
    static, opener, row = False, "per kind", ROWS[0].label
    for r in ROWS:
        if r.release > v:
            break
        row = r.label
        static = r.static if r.static is not None else static
        opener = r.opener or opener
        for kind, change in r.kinds.items():
            targets = list(kinds) if kind == "*" else [kind]
            for k in targets:
                kinds[k] = change if isinstance(change, Kind) else replace(kinds[k], **change)
    caveat = None
    if version is None:
        caveat = (f"the default libnccl's version is unknown: its plugins are read with the "
                  f"loading rules of the newest release in the table ({_label(NEWEST)})")
    elif version > NEWEST:
        caveat = (f"libnccl {_label(version)} is newer than the newest release in the "
                  f"loading-rules table ({_label(NEWEST)}): read with that release's rules")
    elif version < OLDEST:
        caveat = (f"libnccl {_label(version)} is older than the oldest release in the "
                  f"loading-rules table ({_label(OLDEST)}): read with that release's rules")
    return Rules(row, kinds, static, opener, caveat)


def parse_version(text: Any) -> Version | None:
    """``"2.21.5"`` -> ``(2, 21, 5)``; ``None`` for anything else."""
    try:
        a, b, c = (int(x) for x in str(text).split("."))
    except ValueError:
        return None
    return (a, b, c)


def _static(name: str) -> bool:
    """``strncasecmp(name, "STATIC_PLUGIN", strlen(name)) == 0`` for a non-empty name."""
    return 0 < len(name) <= len(STATIC_PLUGIN) and name.isascii() and (
        name.upper() == STATIC_PLUGIN[: len(name)])


def expand(kind: str, name: str, scheme: str, static: bool = False) -> list[str]:
    """The names tried, in order, for one item ``name`` of ``NCCL_<KIND>_PLUGIN``."""
    prefixed = f"{PREFIXES[kind]}-{name}.so"
    given = EXECUTABLE if static and _static(name) else name
    lib_so = name.startswith("lib") and name.endswith(".so")
    if scheme == PREFIXED:
        return [prefixed]
    if scheme == GIVEN:
        return [given]
    if scheme == LIB_OR_PREFIXED:
        return [given] if lib_so and len(name) >= len("libX.so") else [prefixed]
    if scheme == BOTH_UNLESS and ("/" in name or lib_so):
        return [given]
    return [given, prefixed]


def own_names(kind: str, value: str | None, rules: Rules) -> list[list[str]] | None:
    """The names NCCL ``dlopen``s for ``kind``'s own library, as groups tried in order.

    ``value``: ``NCCL_<KIND>_PLUGIN`` (``None``: unset). Each group is one candidate (its
    names tried in order, the first that opens is it); a list gives one group per item.
    ``[]``: no library of its own to try (nothing named, an empty list, or a kind that
    has only fallbacks); ``None``: the value ``none`` turns the kind off altogether.
    :data:`EXECUTABLE` in a group: NCCL opens the job's own executable.
    """
    k = rules.kinds[kind]
    if not k.own:
        return []
    if k.var is None or value is None:
        return [[k.default]] if k.default else []
    if k.off and value.lower() == "none":
        return None if k.off == OFF_KIND else []
    if value == "":
        if k.empty == EMPTY_EXECUTABLE:
            return [[EXECUTABLE]]
        if k.empty == EMPTY_DEFAULT and k.default:
            return [[k.default]]
        return []
    if k.listed:
        items = [x for x in value.split(",") if x and len(x.encode()) < MAX_NAME][: k.listed]
    else:
        items = [value]
    return [expand(kind, x, k.names, rules.static) for x in items]


def net_plugin_names(value: str | None, version: Version | None) -> list[list[str]]:
    """The names NCCL ``dlopen``s for its net plugin (:func:`own_names` of ``net``)."""
    return own_names("net", value, rules_for(version)) or []
