"""What a node adds to a job's NCCL, release by release: the ``offers`` part, read (issue 39).

The plugin probe records, for every release of
:data:`ncclguard.fingerprint.releases.RELEASES`, the library NCCL of that release opens
for each plugin kind on this node and the ABI it uses there
(``inventoryd/probes/plugins.py``, ``_offers``, written by :func:`pack`: per kind, each
choice of library and ABI with the releases that make it). :func:`signature` turns one
kind of it
into one string that is equal on two nodes exactly when every release gets the same
plugin (its name and ABI) on both::

    "2.18.3: HoldoutNet v6; 2.19.3: HoldoutNet v7; 2.20.5 to 2.32.3: HoldoutNet v8"

A release the string does not name gets no plugin of that kind (``"none"``: none for
any release). A name (or file name) is written with ``%`` and ``;`` escaped (``%25``,
``%3B``), so that no name can end a segment and start another: a plugin's name is read
from its file and may hold ``"; 2.11.4 to 2.18.3: Foo"``, which made a node with no
plugin for those releases read as one that loads Foo there. One longer than any a probe
reads (256 characters) is cut, with a hash of the whole. :func:`differing` names the
releases for which several such strings
disagree; :func:`summary` says in a few words what a string offers (``HoldoutNet
v8..v6``). ``None`` always means *unknown* (an older daemon, the job's own executable, a
file that cannot be read), never *absent*.

Standard library only: the gate's path imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ncclguard.fingerprint.releases import RELEASES

__all__ = ["KINDS", "NONE", "TABLE", "UNKNOWN", "by_kind", "differing", "offered", "pack",
           "parse",
           "read", "release_for",
           "selections", "signature",
           "signature_of", "span", "summary", "unused", "unused_of"]

#: The plugin kinds compared, in the order they are reported.
KINDS = ("net", "tuner", "profiler", "env", "gin", "rma")
NONE = "none"
_ORDER = {r.label: i for i, r in enumerate(RELEASES)}
_SEP, _RANGE = "; ", " to "
#: The longest name kept whole: a probe reads at most 256 bytes of one (``inventoryd.elf``).
MAX_NAME = 256
#: The table a part answers for: its releases, in order (the part's ``table``).
TABLE = " ".join(r.label for r in RELEASES)
#: A choice of ``uses``: unknown (the job's own executable, an unreadable file).
UNKNOWN = "?"
_BY_LABEL = {r.label: r for r in RELEASES}
#: The longest ``uses`` value read: every release once, each with a choice of 20
#: characters (a longer one is not a probe's, and not parsed).
_MAX_USES = len(TABLE) + 24 * len(RELEASES)


def _part(fp: dict) -> tuple[dict | None, list] | None:
    """``(uses, files)`` of a record's part; ``None``: no usable part. A part of another
    table (an older daemon's) has ``uses`` None: unknown for every kind of this one."""
    part = fp.get("offers")
    if not isinstance(part, dict):
        return None
    uses, files = part.get("uses"), part.get("files")
    if not isinstance(uses, dict) or not isinstance(files, list):
        return None
    if _probe_failed(fp):
        return None  # its parts are empty, not absent
    if part.get("table") != TABLE:
        return None, []
    return uses, files


def _probe_failed(fp: dict) -> bool:
    """Whether the plugin probe failed as a whole (an ``errors`` item of it for the whole
    ``plugins`` field)."""
    return any(e.get("field") == "plugins" and e.get("probe") == "plugins"
               for e in fp.get("errors") or () if isinstance(e, dict))


def pack(rows: dict[str, dict[str, list | None]], files: list[dict]) -> dict[str, Any]:
    """The part as a probe writes it, from each release's row ``{kind: [file index, ABI
    or None] | None}`` (None: unknown; a kind left out: no library) and the ``files``
    they index: ``{"table", "files", "uses": {kind: "CHOICE: RELEASE RELEASE...; ..."}}``,
    a choice being ``FILE ABI`` (``0 8``), ``FILE -`` (opened, no ABI in common) or ``?``
    (unknown). One string per kind: a record's values are walked at each heartbeat
    (``ncclguard.spool.check_values``), and a row per release made that walk twice as
    long; a value per choice, still 1.7x for a node with a plugin of every kind
    (docs/perf.md)."""
    uses: dict[str, dict[str, list[str]]] = {}
    for label, row in rows.items():
        for kind, entry in row.items():
            choice = (UNKNOWN if entry is None else
                      f"{entry[0]} {'-' if entry[1] is None else entry[1]}")
            uses.setdefault(kind, {}).setdefault(choice, []).append(label)
    return {"table": TABLE, "files": files,
            "uses": {k: _SEP.join(f"{c}: {' '.join(ls)}" for c, ls in v.items())
                     for k, v in uses.items()}}


def _count(text: str) -> int | None:
    """``text`` as a count of at most 9 ASCII digits (not ``"²"``, not 5,000 digits)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


Opened = dict[str, tuple[int, dict, int | None]]


def _opened(uses: dict | None, files: list, kind: str) -> Opened | None:
    """release -> ``(file index, its file, the ABI it uses or None)`` for each release that
    opens a ``kind`` library on this node (one not named: none); ``None``: unknown for
    some release, or not a value of this part (a release twice, or one that does not load
    ``kind``; more choices than releases). Reads at most the table's worth."""
    value = None if uses is None else uses.get(kind, "")
    if not isinstance(value, str) or len(value) > _MAX_USES:
        return None
    out: Opened = {}
    for segment in value.split(_SEP) if value else ():
        choice, _, labels = segment.partition(": ")
        first, _, second = choice.partition(" ")
        index, abi = _count(first), None if second == "-" else _count(second)
        rec = None if index is None else _file(files, index)
        if index is None or rec is None or (abi is None and second != "-"):
            return None  # unknown ("?"), or not a choice
        for label in labels.split(" "):
            release = _BY_LABEL.get(label)
            if release is None or kind not in release.loads or label in out:
                return None
            out[label] = (index, rec, abi)
    return out


def _file(files: list, index: int) -> dict | None:
    """``files[index]`` when the index is one and the entry an object with a path."""
    if not 0 <= index < len(files):
        return None
    rec = files[index]
    return rec if isinstance(rec, dict) and isinstance(rec.get("path"), str) else None


def _text(text: str) -> str:
    """A name as a signature holds it (module doc): ``%`` and ``;`` escaped, and one longer
    than :data:`MAX_NAME` cut, with a hash of the whole (a crafted record's, never a
    probe's: its signature stays small, and two such names still differ)."""
    if len(text) > MAX_NAME:
        import hashlib  # only here: the gate's usual path never needs it

        whole = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        text = f"{text[:64]}... ({len(text)} characters, sha256 {whole})"
    return text.replace("%", "%25").replace(";", "%3B")


def _name(rec: dict, kind: str) -> str:
    names = rec.get("names")
    names = names if isinstance(names, dict) else {}
    name = names.get(kind) or (names.get("gin") if kind == "rma" else None)
    return _text(name if isinstance(name, str) and name else rec["path"].rsplit("/", 1)[-1])


Selections = dict[str, list[tuple[str, str]] | None]


def read(fp: dict) -> tuple[Selections, dict[str, dict]] | None:
    """``(kind -> its selections, kind -> the first library some release opens for it
    without an ABI in common)`` for every kind (what the node-adds rule reads of each
    record); ``None``: no usable part at all."""
    got = _part(fp)
    if got is None:
        return None
    opened: dict[str, dict] = {}
    return {kind: _selection(*got, kind, opened) for kind in KINDS}, opened


def _selection(uses: dict | None, files: list, kind: str, opened: dict[str, dict]
               ) -> list[tuple[str, str]] | None:
    """One kind of :func:`read` (``opened`` gets its library opened without an ABI in
    common)."""
    by_release = _opened(uses, files, kind)
    if by_release is None:
        return None
    sel: list[tuple[str, str]] = []
    names: dict[int, str] = {}
    for release in RELEASES:
        if kind not in release.loads:
            continue
        got = by_release.get(release.label)
        if got is None:
            sel.append((release.label, NONE))  # no library
            continue
        index, rec, abi = got
        if abi is None:
            sel.append((release.label, NONE))
            opened.setdefault(kind, rec)
            continue
        name = names.get(index)
        if name is None:
            name = names[index] = _name(rec, kind)
        sel.append((release.label, f"{name} v{abi}"))
    return sel


#: :func:`by_kind`'s answers for the parts seen last (most nodes of a cluster send the
#: same part): at most this many, each for a part of at most :data:`_CACHE_PART` bytes.
_CACHE_SIZE = 256
_CACHE_PART = 16 << 10
_cache: dict[str, dict[str, tuple[str | None, str | None]]] = {}


def by_kind(fp: dict) -> dict[str, tuple[str | None, str | None]]:
    """kind -> ``(signature, unused)`` of this record (:func:`signature`, :func:`unused`)
    for every kind: what the node-adds rule and the class values read of each record
    (one home). Remembered for the last parts seen, by their JSON text: a changed record
    from a node whose plugins did not change costs a lookup, not 7 reads of the part
    (``bench/bench_collector.py``, docs/perf.md)."""
    import json

    part = fp.get("offers")
    key = None
    if isinstance(part, dict) and not _probe_failed(fp):
        try:
            key = json.dumps(part, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError):
            key = None
        if key is not None and len(key) > _CACHE_PART:
            key = None
    if key is not None and key in _cache:
        return dict(_cache[key])
    got = read(fp)
    every, opened = got if got is not None else ({}, {})
    out = {kind: (signature_of(every.get(kind)),
                  unused_of(kind, every.get(kind), opened.get(kind))) for kind in KINDS}
    if key is not None:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = out
    return dict(out)


def selections(fp: dict, kind: str) -> list[tuple[str, str]] | None:
    """``[(release, "NAME vN" or "none")]`` for every release of the table that loads
    ``kind`` on this node's record; ``None``: unknown for some release."""
    got = _part(fp)
    return None if got is None else _selection(*got, kind, {})


def span(labels: Sequence[str]) -> str:
    """``"2.18.3 to 2.32.3"`` for consecutive releases of the table, else a list of such
    runs joined with ``", "``."""
    idx = sorted({_ORDER[x] for x in labels if x in _ORDER})
    runs: list[tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return ", ".join(RELEASES[a].label if a == b else
                     f"{RELEASES[a].label}{_RANGE}{RELEASES[b].label}" for a, b in runs)


def signature(fp: dict, kind: str) -> str | None:
    """What ``kind`` gives each release on this node, as one canonical string (module
    doc); ``"none"`` when no release uses a plugin of that kind; ``None``: unknown."""
    return signature_of(selections(fp, kind))


def signature_of(sel: list[tuple[str, str]] | None) -> str | None:
    """:func:`signature` from one kind's :func:`selections`."""
    if sel is None:
        return None
    runs: list[tuple[list[str], str]] = []
    for label, value in sel:
        if runs and runs[-1][1] == value and _ORDER[label] == _ORDER[runs[-1][0][-1]] + 1:
            runs[-1][0].append(label)
        else:
            runs.append(([label], value))
    used = [f"{span(labels)}: {value}" for labels, value in runs if value != NONE]
    return _SEP.join(used) or NONE


def parse(value: str) -> dict[str, str]:
    """release -> ``"NAME vN"`` from a :func:`signature` (a release absent: none).

    A signature has at most one segment, and a segment one run, per release of the
    table: a value is read no further (a stored value is anyone's: a 4 MB one of 200,000
    runs took the gate 7 s, past its deadline, which fails open)."""
    out: dict[str, str] = {}
    if value == NONE:
        return out
    most = len(RELEASES)
    for segment in value.split(_SEP, most)[:most]:
        where, _, used = segment.partition(": ")
        for run in where.split(", ", most)[:most]:
            first, _, last = run.partition(_RANGE)
            a = _ORDER.get(first)
            b = _ORDER.get(last or first)
            if a is None or b is None:
                continue
            for i in range(a, b + 1):
                out[RELEASES[i].label] = used
    return out


def differing(values: Iterable[str]) -> list[str]:
    """The releases of the table for which these :func:`signature` strings disagree."""
    parsed = [parse(v) for v in values]
    return [r.label for r in RELEASES
            if len({p.get(r.label, NONE) for p in parsed}) > 1]


def summary(value: str) -> str:
    """A :func:`signature` in a few words: each plugin name with the ABIs some release
    uses (``HoldoutNet v8..v6``), or ``none``."""
    by_name: dict[str, set[int]] = {}
    for used in parse(value).values():
        name, _, abi = used.rpartition(" v")
        n = _count(abi)
        if n is not None:
            by_name.setdefault(name, set()).add(n)
    if not by_name:
        return NONE
    return ", ".join(f"{name} {_vs(sorted(abis, reverse=True))}"
                     for name, abis in sorted(by_name.items()))


def _vs(abis: list[int]) -> str:
    if len(abis) > 1 and abis == list(range(abis[0], abis[-1] - 1, -1)):
        return f"v{abis[0]}..v{abis[-1]}"
    return ",".join(f"v{a}" for a in abis)


def unused(fp: dict, kind: str) -> str | None:
    """A ``kind`` library that some release opens on this node but none uses (no ABI in
    common with any release of the table): ``"FILE (NAME, offers vN)"``; ``"none"``;
    ``None``: unknown."""
    got = read(fp)
    return None if got is None else unused_of(kind, got[0][kind], got[1].get(kind))


def unused_of(kind: str, sel: list[tuple[str, str]] | None, opened: dict | None
              ) -> str | None:
    """:func:`unused` from that kind's :func:`selections` and the first library opened
    without an ABI in common (:func:`read`)."""
    if sel is None:
        return None
    if opened is None or any(v != NONE for _, v in sel):
        return NONE
    abis = opened.get("abis")
    mine = abis.get(kind) if isinstance(abis, dict) else None
    mine = mine if isinstance(mine, list) else []
    offered = _vs(sorted((a for a in mine if type(a) is int), reverse=True))
    return (f"{_text(opened['path'].rsplit('/', 1)[-1])} ({_name(opened, kind)}, "
            f"offers {offered or 'no ' + kind + ' ABI'})")


def offered(fp: dict, kind: str = "net") -> str | None:
    """What each release's library of ``kind`` on this node *offers* (its name and every
    ABI it exports, not only the one a release uses): ``"2.10.3 to 2.32.3: HoldoutNet|8,7,6"``
    in :func:`signature`'s form (a release not named: no library), ``"none"``, ``None``:
    unknown. What a job's own NCCL, of a release between the table's rows, meets on the
    node (issue 40): the library the nearest row opens, at the highest ABI the job's
    library and it share."""
    from ncclguard.fingerprint.abi import exported

    got = _part(fp)
    by_release = None if got is None else _opened(*got, kind)
    if by_release is None:
        return None
    sel: list[tuple[str, str]] = []
    for release in RELEASES:
        if kind not in release.loads:
            continue
        got_one = by_release.get(release.label)
        if got_one is None:
            sel.append((release.label, NONE))
            continue
        rec = got_one[1]
        abis = exported(rec.get("abis") if isinstance(rec.get("abis"), dict) else {}, kind)
        sel.append((release.label, f"{_name(rec, kind)}|{','.join(map(str, abis))}"))
    return signature_of(sel)


def release_for(version: tuple[int, int, int]) -> str:
    """The row of the table that stands for ``version``: the newest at or below it (the
    oldest for an older one)."""
    label = RELEASES[0].label
    for release in RELEASES:
        if release.version <= version:
            label = release.label
    return label
