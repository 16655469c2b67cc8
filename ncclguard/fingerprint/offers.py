"""What a node adds to a job's NCCL, release by release: the ``offers`` part, read (issue 39).

The plugin probe records, for every release of
:data:`ncclguard.fingerprint.releases.RELEASES`, the library NCCL of that release opens
for each plugin kind on this node and the ABI it uses there
(``inventoryd/probes/plugins.py``, ``_offers``). :func:`signature` turns one kind of it
into one string that is equal on two nodes exactly when every release gets the same
plugin (its name and ABI) on both::

    "2.18.3: HoldoutNet v6; 2.19.3: HoldoutNet v7; 2.20.5 to 2.32.3: HoldoutNet v8"

A release the string does not name gets no plugin of that kind (``"none"``: none for
any release). :func:`differing` names the releases for which several such strings
disagree; :func:`summary` says in a few words what a string offers (``HoldoutNet
v8..v6``). ``None`` always means *unknown* (an older daemon, the job's own executable, a
file that cannot be read), never *absent*.

Standard library only: the gate's path imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ncclguard.fingerprint.releases import RELEASES

__all__ = ["KINDS", "NONE", "differing", "parse", "signature", "span", "summary", "unused"]

#: The plugin kinds compared, in the order they are reported.
KINDS = ("net", "tuner", "profiler", "env", "gin", "rma")
NONE = "none"
_ORDER = {r.label: i for i, r in enumerate(RELEASES)}
_SEP, _RANGE = "; ", " to "


def _part(fp: dict) -> tuple[dict, dict] | None:
    part = fp.get("offers")
    if not isinstance(part, dict):
        return None
    releases, files = part.get("releases"), part.get("files")
    if not isinstance(releases, dict) or not isinstance(files, dict):
        return None
    if any(e.get("field") == "plugins" and e.get("probe") == "plugins"
           for e in fp.get("errors") or () if isinstance(e, dict)):
        return None  # the plugin probe failed as a whole: its parts are empty, not absent
    return releases, files


def _name(files: dict, path: str, kind: str) -> str:
    rec = files.get(path)
    names = rec.get("names") if isinstance(rec, dict) else None
    names = names if isinstance(names, dict) else {}
    name = names.get(kind) or (names.get("gin") if kind == "rma" else None)
    return str(name) if isinstance(name, str) and name else path.rsplit("/", 1)[-1]


def selections(fp: dict, kind: str) -> list[tuple[str, str]] | None:
    """``[(release, "NAME vN" or "none")]`` for every release of the table that loads
    ``kind`` on this node's record; ``None``: unknown for some release."""
    got = _part(fp)
    if got is None:
        return None
    releases, files = got
    out: list[tuple[str, str]] = []
    for release in RELEASES:
        row = releases.get(release.label)
        if not isinstance(row, dict):
            return None  # a record of another table: not the answer for this release
        if kind not in row:
            continue  # this release loads no such plugin
        entry = row[kind]
        if entry is None or not isinstance(entry, list):
            return None
        if not entry:
            out.append((release.label, NONE))
            continue
        path, abi = [*entry, None, None][:2]
        if not isinstance(path, str):
            return None
        out.append((release.label, NONE if type(abi) is not int else
                    f"{_name(files, path, kind)} v{abi}"))
    return out


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
    sel = selections(fp, kind)
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
    """release -> ``"NAME vN"`` from a :func:`signature` (a release absent: none)."""
    out: dict[str, str] = {}
    if value == NONE:
        return out
    for segment in value.split(_SEP):
        where, _, used = segment.partition(": ")
        for run in where.split(", "):
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
        if abi.isdigit():
            by_name.setdefault(name, set()).add(int(abi))
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
    got = _part(fp)
    sel = selections(fp, kind)
    if got is None or sel is None:
        return None
    releases, files = got
    used = {v for _, v in sel if v != NONE}
    if used:
        return NONE
    for release in RELEASES:
        entry = (releases.get(release.label) or {}).get(kind)
        if isinstance(entry, list) and entry and isinstance(entry[0], str):
            rec: Any = files.get(entry[0])
            abis = rec.get("abis") if isinstance(rec, dict) else None
            mine = abis.get(kind) if isinstance(abis, dict) else None
            offered = _vs(sorted((a for a in mine or () if type(a) is int), reverse=True))
            return (f"{entry[0].rsplit('/', 1)[-1]} ({_name(files, entry[0], kind)}, "
                    f"offers {offered or 'no ' + kind + ' ABI'})")
    return NONE
