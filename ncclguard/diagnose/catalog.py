"""The signature catalog: load, validate, merge.

The built-in catalog is ``signatures.toml`` next to this module (package data).
Admins add files through ``[diagnose] signature_files`` in the config: an entry
whose id already exists replaces it, ``disabled = true`` removes it, and any
other entry is added. Every error names the file, the entry and the cause.

Over 500 lines: loading, validating and merging the catalog share the checks each
entry passes (its fields, its patterns' cost and literals); one home for what a
signature may be, used by the built-in file and every admin's file alike.
"""

from __future__ import annotations

import os
import re
import string
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from importlib import resources
from pathlib import Path
from typing import Any

from ncclguard.policy.rules import BY_NAME

BUILTIN = "signatures.toml"
KINDS = ("line", "differs")
SCOPES = ("any", "nccl")
LEVELS = ("INFO", "WARN", "TRACE")
ODD = ("printers", "none")
VERDICTS = ("stack", "not-stack", "neutral")
_UNNAME = re.compile(r"\(\?P<\w+>")
_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_REQUIRED_TEXT = ("title", "meaning", "cause", "fix")
_KNOWN = {
    "id", "title", "kind", "scope", "level", "patterns", "weight", "odd",
    "meaning", "cause", "fix", "confirm", "rules", "disabled", "family", "verdict",
    "corroborate", "between", "alike", "source",
}  # fmt: skip
SOURCE_PROJECTS = ("nccl", "pytorch", "aws-ofi-nccl", "nccl-rdma-sharp-plugins", "rdma-core")
# "frame": the record's format is a function's name in the source, and its output a
# debugger's stack frame of it (gdb, pstack, py-spy --native): a hang's only trace
SOURCE_LEVELS = ("WARN", "INFO", "TRACE", "none", "frame")
_SOURCE_KEYS = {"project", "file", "format", "level", "releases", "args", "other_args"}


MAX_VALUE = 200  # characters of a rendered value kept (summaries, --json, the Epilog's record)


class CatalogError(Exception):
    """A catalog that cannot be used. The message names the file, the entry and the cause."""


@dataclass(frozen=True)
class Pattern:
    regex: re.Pattern[bytes]
    value: str | None  # template over the named groups; None: evidence only
    text: str  # the regex as written
    weak: bool = False  # a host's weak value is dropped when it also has a strong one
    needles: tuple[bytes, ...] | None = None  # one of these is in every match; None: unknown
    # one of these is in every *line* a match is on (what a block is searched for): the
    # needles; for a pattern anchored at the start of an NCCL INFO message, the needles
    # of "NCCL INFO " and the pattern; for a WARN (TRACE) pattern "NCCL WARN" ("NCCL
    # TRACE"): one pass over a block finds every such line (the scanner finds the
    # messages that PyTorch repeats after "Last error:" by that literal)
    line_needles: tuple[bytes, ...] | None = None
    # the only NCCL level whose lines it is tried on (its own or its signature's);
    # None: any line its signature's scope admits
    level: str | None = None
    # other literal sets of which every match holds one (the pattern's other runs of
    # literal text): a block may be searched for one of these instead of line_needles
    options: tuple[tuple[bytes, ...], ...] = ()

    def all_needles(self) -> tuple[tuple[bytes, ...], ...]:
        """line_needles and the other literal sets a line it matches on holds."""
        return (self.line_needles or (), *self.options)

    def render(self, m: re.Match[bytes]) -> str | None:
        if self.value is None:
            return None
        groups = {k: (v or b"").decode("utf-8", "replace") for k, v in m.groupdict().items()}
        out = self.value.format(**groups)
        # a value is a word or a name ("IB", "ib0 10.1.0.0/16"): a group of 64 KiB is cut
        return out if len(out) <= MAX_VALUE else out[: MAX_VALUE - 3] + "..."


@dataclass(frozen=True)
class SourceLine:
    """One line of another project's source whose output a signature is written to match
    (documentation and tests only: never read at scan time)."""

    project: str  # SOURCE_PROJECTS
    file: str  # the file it lives in (the newest read; ``releases`` says where it moved)
    format: str  # the printf format (or message text) exactly as in the source
    # NCCL's macro (WARN / INFO / TRACE), "none" (printf, exception text) or "frame"
    # (``format`` is a function's name; a debugger prints its frame)
    level: str
    releases: str  # the tags (or commits) it was read at
    args: tuple[str, ...] = ()  # sample values for its conversions, where generic ones would not do
    other_args: tuple[str, ...] = ()  # what another host prints (a `differs` signature's test)


@dataclass(frozen=True)
class Signature:
    id: str
    title: str
    kind: str
    scope: str
    level: str | None
    patterns: tuple[Pattern, ...]
    weight: int
    odd: str
    meaning: str
    cause: str
    fix: str
    confirm: tuple[str, ...]
    rules: tuple[str, ...]
    source: str  # the file it came from
    # the cause family it names (docs/diagnose.md, "Families"); several signatures may
    # name one family
    family: str = ""
    # what naming it says about the node stack: "stack" (a node-stack or fabric cause),
    # "not-stack" (a verdict of its own: not a node-stack problem), "neutral" (a wrapper
    # that names no cause)
    verdict: str = "stack"
    # signatures that must also fire for this one to stand as a stack cause (a symptom
    # of a version split is not a version split when the log shows one version)
    corroborate: tuple[str, ...] = ()
    # the line itself says that two ranks differ (NCCL compared them): a difference
    # between hosts whoever printed it (issue 44: a stack verdict needs one)
    between: bool = False
    # what it is, and what to do, when every host of the job shows it alike: no node
    # difference explains it (a release's bug, a setting or a fabric all share)
    alike: str = ""
    # the source lines (NCCL's, PyTorch's, a plugin's) whose output its patterns match
    sources: tuple[SourceLine, ...] = ()

    def match(
        self, text: bytes, level: str | None = None
    ) -> tuple[Pattern, re.Match[bytes]] | None:
        """The first pattern that matches ``text``, the message of a line of NCCL level
        ``level`` (None: not an NCCL line); a pattern with a level sees only its level."""
        for p in self.patterns:
            if p.level is not None and p.level != level:
                continue
            if p.needles is not None and not any(n in text for n in p.needles):
                continue
            m = p.regex.search(text)
            if m is not None:
                return p, m
        return None


@dataclass(frozen=True)
class Catalog:
    signatures: tuple[Signature, ...]
    sources: tuple[str, ...]

    def __iter__(self) -> Any:
        return iter(self.signatures)

    def __len__(self) -> int:
        return len(self.signatures)

    def get(self, sig_id: str) -> Signature | None:
        return next((s for s in self.signatures if s.id == sig_id), None)

    def gate(self) -> re.Pattern[bytes] | None:
        """A regex of plain literals, one of which every match of every pattern contains:
        the fast first test of each line. None when a pattern has no such literal."""
        needles: set[bytes] = set()
        for s in self.signatures:
            for p in s.patterns:
                if p.needles is None:
                    return None
                needles.update(p.needles)
        if not needles:
            return re.compile(b"(?!)")
        return re.compile(b"|".join(re.escape(n) for n in sorted(needles, key=len, reverse=True)))

    def literals(self) -> tuple[bytes, ...] | None:
        """The fewest plain literals one of which is in every line any pattern matches:
        what a whole chunk of log is searched for (``bytes.find``) before any line is
        looked at. ``None`` when a pattern has no required literal (an admin's
        ``(?i)…`` or ``\\d+ lost``): then every line must be tried.

        Each search costs a pass over the chunk, so literals that share a long enough
        piece (``NET/Plugin``, `` interface found``) are searched for by that piece
        (:func:`cover`): a line with a literal has every piece of it.
        """
        pats = [p for s in self.signatures for p in s.patterns]
        if not all(p.line_needles for p in pats):
            return None
        lits = list(cover(n for p in pats for n in p.line_needles or ()))
        # a pattern with several runs of literal text ("^NET/Plugin ?: ?Could not
        # find:") may be searched by another run: drop each literal that every pattern
        # can do without (fewer searches, and never more lines picked)
        for lit in sorted(lits):
            rest = [x for x in lits if x != lit]
            if all(
                any(all(any(x in n for x in rest) for n in o) for o in p.all_needles())
                for p in pats
            ):
                lits = rest
        return tuple(sorted(lits))

    def combined(self) -> re.Pattern[bytes] | None:
        """One regex that matches wherever any signature pattern could: a prefilter.

        ``None`` when the patterns cannot be joined (a back-reference to a named
        group; an unnamed group, whose number would shift); the caller then tries every
        signature on every line.
        """
        pats = [p for s in self.signatures for p in s.patterns]
        if any(p.regex.groups != len(p.regex.groupindex) for p in pats):
            return None
        parts = [_UNNAME.sub("(?:", p.text) for s in self.signatures for p in s.patterns]
        if not parts:
            return re.compile(b"(?!)")
        try:
            rx = re.compile("|".join(f"(?:{t})" for t in parts).encode("utf-8"))
        except re.error:
            return None
        return rx if rx.groups == 0 else None


def builtin_path() -> Path:
    return Path(str(resources.files("ncclguard.diagnose").joinpath(BUILTIN)))


def load(extra: Iterable[str | os.PathLike[str]] = ()) -> Catalog:
    """The built-in catalog merged with the admin's files, in order."""
    files = [builtin_path(), *(Path(p) for p in extra)]
    merged: dict[str, Signature] = {}
    for f in files:
        for sig_id, sig in _load_file(f):
            if sig is None:
                merged.pop(sig_id, None)
            else:
                merged[sig_id] = sig
    return Catalog(tuple(merged.values()), tuple(str(f) for f in files))


def _load_file(path: Path) -> list[tuple[str, Signature | None]]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise CatalogError(f"{path}: signature catalog not found") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise CatalogError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse(data, str(path))


def parse(data: dict[str, Any], source: str) -> list[tuple[str, Signature | None]]:
    """Validate a parsed catalog document. ``(id, None)`` marks a disabled entry."""
    unknown = set(data) - {"signature"}
    if unknown:
        raise CatalogError(
            f"{source}: unknown top-level key(s) {sorted(unknown)}; expected [[signature]]"
        )
    entries = data.get("signature", [])
    if not isinstance(entries, list):
        raise CatalogError(f"{source}: 'signature' must be an array of tables ([[signature]])")
    out: list[tuple[str, Signature | None]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries, 1):
        where = f"{source}: signature #{i}"
        if not isinstance(entry, dict):
            raise CatalogError(f"{where}: must be a table")
        sig_id = entry.get("id")
        if not isinstance(sig_id, str) or not _ID.match(sig_id):
            raise CatalogError(f"{where}: id = {sig_id!r}: expected lower-case words joined by '-'")
        where = f"{source}: signature {sig_id!r}"
        if sig_id in seen:
            raise CatalogError(f"{where}: duplicate id in the same file")
        seen.add(sig_id)
        extra = set(entry) - _KNOWN
        if extra:
            raise CatalogError(
                f"{where}: unknown key(s) {sorted(extra)} (known: {', '.join(sorted(_KNOWN))})"
            )
        disabled = entry.get("disabled", False)
        if not isinstance(disabled, bool):
            raise CatalogError(f"{where}: disabled = {disabled!r}: expected true or false")
        if disabled:
            out.append((sig_id, None))
            continue
        out.append((sig_id, _signature(entry, sig_id, where, source)))
    return out


def _signature(e: dict[str, Any], sig_id: str, where: str, source: str) -> Signature:
    texts = {}
    for key in _REQUIRED_TEXT:
        v = e.get(key)
        if not isinstance(v, str) or not v.strip():
            raise CatalogError(f"{where}: {key} is required (a non-empty string)")
        texts[key] = v.strip()
    kind = _choice(e, "kind", KINDS, "line", where)
    scope = _choice(e, "scope", SCOPES, "any", where)
    level = e.get("level")
    if level is not None and level not in LEVELS:
        raise CatalogError(f"{where}: level = {level!r}: expected one of {', '.join(LEVELS)}")
    odd = _choice(e, "odd", ODD, "none", where)
    weight = e.get("weight", 50)
    if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= 100:
        raise CatalogError(f"{where}: weight = {weight!r}: expected an integer from 1 to 100")
    patterns = _patterns(e.get("patterns"), where, level)
    if kind == "differs" and all(p.value is None for p in patterns):
        raise CatalogError(f"{where}: kind = 'differs' needs at least one pattern with a value")
    confirm = _strings(e, "confirm", where)
    rules = _strings(e, "rules", where)
    for r in rules:
        if r not in BY_NAME:
            raise CatalogError(f"{where}: rules: unknown rule {r!r} (known: {', '.join(BY_NAME)})")
    family = e.get("family", sig_id)
    if not isinstance(family, str) or not _ID.match(family):
        raise CatalogError(f"{where}: family = {family!r}: expected lower-case words joined by '-'")
    # an entry without a verdict (an admin's older file): a stack cause when it names
    # policy rules, else a wrapper that names none
    verdict = _choice(e, "verdict", VERDICTS, "stack" if rules else "neutral", where)
    if verdict == "not-stack" and rules:
        raise CatalogError(f"{where}: verdict = 'not-stack' with rules {list(rules)}: a cause "
                           "that is not a node-stack one has no policy rule to confirm it")
    corroborate = _strings(e, "corroborate", where)
    between = e.get("between", False)
    if not isinstance(between, bool):
        raise CatalogError(f"{where}: between = {between!r}: expected true or false")
    alike = e.get("alike", "")
    if not isinstance(alike, str):
        raise CatalogError(f"{where}: alike = {alike!r}: expected a string")
    return Signature(
        id=sig_id, kind=kind, scope=scope, level=level, patterns=patterns, weight=weight,
        odd=odd, confirm=confirm, rules=rules, source=source, family=family, verdict=verdict,
        corroborate=corroborate, between=between, alike=alike.strip(),
        sources=_sources(e.get("source", []), where), **texts,
    )  # fmt: skip


def _sources(raw: Any, where: str) -> tuple[SourceLine, ...]:
    """The entry's ``[[signature.source]]`` records (optional)."""
    if not isinstance(raw, list):
        raise CatalogError(f"{where}: source must be an array of tables ([[signature.source]])")
    out = []
    for i, r in enumerate(raw, 1):
        sw = f"{where}: source #{i}"
        if not isinstance(r, dict):
            raise CatalogError(f"{sw}: must be a table")
        extra = set(r) - _SOURCE_KEYS
        if extra:
            raise CatalogError(f"{sw}: unknown key(s) {sorted(extra)} "
                               f"(known: {', '.join(sorted(_SOURCE_KEYS))})")
        text = {}
        for key in ("project", "file", "format", "level", "releases"):
            v = r.get(key)
            if not isinstance(v, str) or not v.strip():
                raise CatalogError(f"{sw}: {key} is required (a non-empty string)")
            text[key] = v
        _choice(r, "project", SOURCE_PROJECTS, "", sw)
        _choice(r, "level", SOURCE_LEVELS, "", sw)
        out.append(SourceLine(**text, args=_strings(r, "args", sw),
                              other_args=_strings(r, "other_args", sw)))
    return tuple(out)


def _choice(e: dict[str, Any], key: str, choices: Sequence[str], default: str, where: str) -> str:
    v = e.get(key, default)
    if v not in choices:
        raise CatalogError(f"{where}: {key} = {v!r}: expected one of {', '.join(choices)}")
    return str(v)


def _strings(e: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = e.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise CatalogError(f"{where}: {key} = {v!r}: expected a list of strings")
    return tuple(v)


def _patterns(raw: Any, where: str, level: str | None = None) -> tuple[Pattern, ...]:
    """The entry's patterns; ``level``: the signature's level, the NCCL level of every
    line they see unless a pattern names its own (``{ regex, level }``)."""
    if not isinstance(raw, list) or not raw:
        raise CatalogError(f"{where}: patterns is required (a non-empty list)")
    out = []
    for j, item in enumerate(raw, 1):
        pw = f"{where}: patterns[{j}]"
        weak = False
        text: Any
        value: Any
        plevel: Any = level
        if isinstance(item, str):
            text, value = item, None
        elif isinstance(item, dict):
            extra = set(item) - {"regex", "value", "weak", "level"}
            if extra:
                raise CatalogError(
                    f"{pw}: unknown key(s) {sorted(extra)} (known: regex, value, weak, level)"
                )
            text, value = item.get("regex"), item.get("value")
            weak = item.get("weak", False)
            if not isinstance(weak, bool):
                raise CatalogError(f"{pw}: weak = {weak!r}: expected true or false")
            plevel = item.get("level", level)
            if plevel not in (None, *LEVELS):
                raise CatalogError(
                    f"{pw}: level = {plevel!r}: expected one of {', '.join(LEVELS)}"
                )
            if level is not None and plevel != level:
                raise CatalogError(
                    f"{pw}: level = {plevel!r}, but the signature's level is {level!r}"
                )
            if not isinstance(text, str):
                raise CatalogError(f"{pw}: regex is required (a string)")
            if value is not None and not isinstance(value, str):
                raise CatalogError(f"{pw}: value = {value!r}: expected a string template")
        else:
            raise CatalogError(f"{pw}: expected a regex string or a table {{regex, value}}")
        if not text:
            raise CatalogError(f"{pw}: empty regex (it would match every line)")
        try:
            rx = re.compile(text.encode("utf-8"))
        except re.error as err:
            raise CatalogError(f"{pw}: invalid regex {text!r}: {err}") from None
        if rx.search(b""):
            raise CatalogError(
                f"{pw}: regex {text!r} matches an empty line (it would match every line)"
            )
        if value is not None:
            try:
                fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(value)
                          if f is not None]
            except ValueError as err:
                raise CatalogError(f"{pw}: value {value!r}: malformed template: {err}") from None
            # each match is formatted with it: a conversion or a spec ('{v:d}', '{v!z}')
            # raised there, in run(), and '{v:{v}}' padded to a width the log chose
            if any(spec or conv for _, spec, conv in fields):
                raise CatalogError(f"{pw}: value {value!r}: each field must be a bare "
                                   "{name} (no '!conversion' or ':format')")
            names = [f for f, _, _ in fields]
            missing = [n for n in names if n not in rx.groupindex]
            if missing:
                raise CatalogError(
                    f"{pw}: value {value!r} uses {missing}, not named groups of the regex "
                    f"(named groups: {sorted(rx.groupindex) or 'none'})"
                )
        options = needle_options(text)
        needles = options[0] if options else None
        line_needles = needles
        if plevel in ("WARN", "TRACE"):
            # every line it is tried on has NCCL's "NCCL WARN" (the scanner's messages
            # repeated after "Last error:" are found by that literal): one search for all
            line_needles = (f"NCCL {plevel}".encode(),)
        elif plevel is not None and text.startswith("^") and needles is None:
            # the scanner's message of an NCCL line starts right after "NCCL <level> "
            line_needles = needles_of(re.escape(f"NCCL {plevel} ") + text[1:])
        others = tuple(options[1:]) if line_needles == needles else ()
        out.append(Pattern(rx, value, text, weak, needles, line_needles, plevel, others))
    return tuple(out)


# ---------------------------------------------------------------------------- needles
MIN_NEEDLE = 4  # a shorter literal is no faster than the regex
MIN_COVER = 8  # a shared piece shorter than this would pick too many lines
_EVERY_LINE = b" NCCL INFO  NCCL TRACE "


def cover(needles: Iterable[bytes]) -> tuple[bytes, ...]:
    """Fewer literals, one of which is in each of ``needles``: a needle that contains
    another is dropped, and needles that share a piece of :data:`MIN_COVER` bytes or
    more are replaced by it, the piece shared by most first."""
    rest = sorted(set(needles))
    rest = [n for n in rest if not any(m != n and m in n for m in rest)]
    pieces: set[bytes] = set()
    for i, a in enumerate(rest):
        for b in rest[i + 1 :]:
            m = SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
            piece = a[m.a : m.a + m.size]
            # never NCCL's " NCCL INFO " itself: it is on nearly every line of a log
            if m.size >= MIN_COVER and piece not in _EVERY_LINE:
                pieces.add(piece)
    out: list[bytes] = []
    while pieces:
        best = max(sorted(pieces), key=lambda c: (sum(c in n for n in rest), len(c)))
        covered = [n for n in rest if best in n]
        if len(covered) < 2:
            break
        out.append(best)
        rest = [n for n in rest if best not in n]
        pieces = {c for c in pieces if sum(c in n for n in rest) >= 2}
    return tuple(sorted(out + rest))


def needles_of(text: str) -> tuple[bytes, ...] | None:
    """Literals of which every match of ``text`` contains one (None: none worth it):
    the first of :func:`needle_options`."""
    options = needle_options(text)
    return options[0] if options else None


def needle_options(text: str) -> list[tuple[bytes, ...]]:
    """The sets of literals of which every match of ``text`` contains one, best first
    (longest shortest literal, then fewest literals); empty: none worth it.

    Walks the parsed regex (parsed as the bytes pattern that is compiled, so that an
    escape such as ``\\xe9`` is the byte it matches): runs of literal bytes at the top
    level, inside groups, inside repeats of at least one, and any-of sets from
    alternations whose every branch has one. Anything else (classes, optional parts,
    look-arounds, conditionals, scoped flags, an opcode this walk does not know) gives
    no literal, so the answer errs towards none (every line is tried), never towards
    a literal a match may lack. Case-insensitive and verbose patterns get none.
    """
    try:
        # CPython's own regex parser (private since 3.11, sre_parse before): typeshed has
        # no stubs for it
        from re import _constants as C  # type: ignore[attr-defined]
        from re import _parser as P  # type: ignore[attr-defined]

        parsed = P.parse(text.encode("utf-8"))
    except Exception:  # a regex this walk cannot read: no literal, never a wrong one
        return []
    if parsed.state.flags & (re.IGNORECASE | re.VERBOSE):
        return []

    def required(items: Any) -> list[list[bytes]]:
        cands: list[list[bytes]] = []
        run = bytearray()

        def flush() -> None:
            if run:
                cands.append([bytes(run)])
                run.clear()

        for op, av in items:
            if op is C.LITERAL:
                run.append(av)
                continue
            flush()
            sub: list[bytes] | None = None
            if op is C.SUBPATTERN:
                if av[1] or av[2]:  # inline flags on the group
                    continue
                sub = best(required(av[3]))
            elif op is C.BRANCH:
                alts = [best(required(a)) for a in av[1]]
                if all(alts):
                    sub = [n for a in alts if a for n in a]
            elif op in (C.MAX_REPEAT, C.MIN_REPEAT) and av[0] >= 1:
                sub = best(required(av[2]))
            if sub:
                cands.append(sub)
        flush()
        return cands

    def rank(c: list[bytes]) -> tuple[int, int]:
        return (min(len(n) for n in c), -len(c))

    def best(cands: list[list[bytes]]) -> list[bytes] | None:
        cands = [c for c in cands if c]
        if not cands:
            return None
        return max(cands, key=rank)

    try:
        top = [c for c in required(parsed) if c]
    except Exception:
        return []
    top.sort(key=rank, reverse=True)  # stable: of equals, the first in the pattern
    out: list[tuple[bytes, ...]] = []
    for c in top:
        t = tuple(dict.fromkeys(c))
        if min(len(n) for n in t) >= MIN_NEEDLE and t not in out:
            out.append(t)
    return out
