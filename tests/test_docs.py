"""The documents' links and cited paths resolve, and so do the source's.

:func:`problems` takes any list of files and returns what is broken in them, one
``path:line: what`` each:

- Markdown links to a file of the repository (and the heading their ``#anchor`` names,
  as GitHub makes anchors);
- cited repository paths, in a code span or in running text (``inventoryd/probes/nccl.py``,
  ``tests/<file>.py::<test>``, ``docs/<doc>.md``), which must exist (a ``::name`` must be
  defined there; a glob must match); in running text only a name with an extension, a
  trailing ``/`` or a glob counts as a path (not the project prometheus/procfs);
- a heading named with a document, ``docs/<doc>.md#<anchor>`` or ``docs/<doc>.md,
  "<Heading>"``: the document must have it (a quoted heading may be the start of a longer
  one and leave out its number: ``"Bounds"`` names ``## Bounds``, ``"Plugin kinds by
  NCCL"`` names ``## Plugin kinds by NCCL (issue 13)``, ``"Before you start"`` names
  ``## 1. Before you start``);
- a path outside the repository: anything under a build machine's ``/work`` or a
  ``/home`` directory, or a ``<name>-facts.md`` that the repository does not hold. The
  project's facts are its own documents (docs/nccl.md, docs/slurm.md).

Markdown files are read whole (links outside fenced blocks); in Python only comments and
docstrings are read (a test's string naming a conda directory under ``/home`` is a
node's path, not a reference); other source files (lua, shell, units, rules, TOML) whole.
Links to the web are not fetched (CI has no network for them). Checked here: the README,
CHANGELOG.md, every document under docs/ and every Markdown file elsewhere, and the
source of :data:`SOURCE_DIRS` but for recorded data (:data:`DATA`).
"""

from __future__ import annotations

import bisect
import re
import subprocess
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~)")
# what a cited repository path starts with: a top-level directory or file of the repo
TOP = ("ncclguard/", "inventoryd/", "prolog/", "devtools/", "tests/", "scripts/", "docs/",
       "systemd/", "slurm/", "prometheus/", "bench/", ".ci/")
TOP_FILES = ("README.md", "CHANGELOG.md", "pyproject.toml", "Makefile", ".ci/run")
#: whose source is checked (comments and docstrings of Python, other files whole)
SOURCE_DIRS = ("ncclguard", "inventoryd", "prolog", "devtools", "bench", "scripts", "slurm",
               "systemd", "prometheus", "tests")
SOURCE_SUFFIXES = frozenset((".py", ".lua", ".sh", ".yml", ".yaml", ".toml", ".conf",
                             ".service", ".socket", ".timer", ".md"))
#: recorded outputs and captured inputs: evidence, not references (their README.md is read)
DATA = ("tests/data/", "tests/diagnose_logs/", "tests/fixtures/")


@cache
def repo_files(repo: Path = REPO) -> frozenset[str]:
    """The repository's files as git has them (tracked and new, not ignored)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                         capture_output=True, check=True, timeout=60).stdout
    return frozenset(f for f in out.decode().split("\0") if f and (repo / f).exists())


@cache
def repo_dirs(repo: Path = REPO) -> frozenset[str]:
    return frozenset(str(p) for f in repo_files(repo) for p in Path(f).parents
                     if str(p) != ".")


def _plain(heading: str) -> str:
    """A heading's text as read: code spans and links reduced to their text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def headings(path: Path) -> tuple[str, ...]:
    """The headings of a Markdown file, as written (outside fenced blocks)."""
    out = []
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.append(m[1])
    return tuple(out)


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return frozenset(out)


def has_heading(path: Path, quoted: str) -> bool:
    """Whether ``path`` has a heading that reads ``quoted``, or starts with it (at a word's
    end), letter case aside."""
    want = " ".join(quoted.split()).lower()
    for heading in headings(path):
        text = " ".join(_plain(heading).split()).lower()
        if not re.match(r"\d+\. ", want):  # "Before you start" for "1. Before you start"
            text = re.sub(r"^\d+\. ", "", text)
        if text == want or (text.startswith(want) and not text[len(want)].isalnum()):
            return True
    return False


def _lines(path: Path) -> Iterable[tuple[int, str, bool]]:
    """(line number, text, inside a fenced block) of a file."""
    in_fence = False
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            yield no, line, True
            continue
        yield no, line, in_fence


def _link_problem(source: Path, target: str, repo: Path) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, file:
        return None
    path, _, frag = target.partition("#")
    dest = (source.parent / path).resolve() if path else source.resolve()
    try:
        rel = str(dest.relative_to(repo))
    except ValueError:
        return f"link {target!r} leaves the repository"
    if path and rel not in repo_files(repo) and rel not in repo_dirs(repo):
        return f"link {target!r}: no {rel} in the repository"
    if frag and dest.suffix == ".md" and frag not in anchors(dest):
        return f"link {target!r}: {rel} has no heading #{frag}"
    return None


def cited_path(span: str) -> str | None:
    """The repository path a code span cites, or None when it cites none."""
    word = span.strip().split()[0] if span.strip() else ""
    word = word.rstrip(".,;:)")
    if not (word.startswith(TOP) or word in TOP_FILES):
        return None
    if "<" in word or "{" in word or "$" in word:  # a pattern the text explains
        return None
    return word


# a path in running text (not in a code span or a link): a top-level directory, then a
# name with an extension or a trailing "/"
_TOPS = "|".join(re.escape(t) for t in TOP)
PLAIN_PATH = re.compile(rf"(?<![\w/.`<-])((?:{_TOPS})[\w./*-]*[\w/*](?:::\w+)?)")


def _looks_like_a_path(word: str) -> bool:
    """In running text: a name with an extension, a trailing ``/`` or a glob (so that
    the project prometheus/procfs on GitHub is not taken for a directory here)."""
    last = word.rstrip("/").rsplit("/", 1)[-1]
    return word.endswith("/") or "." in last or "*" in last or "::" in word


def _path_problem(cited: str, repo: Path) -> str | None:
    if "::" in cited:
        path, _, name = cited.partition("::")
    else:  # path:NAME, a name defined in that file
        path, _, name = cited.partition(":")
    path = path.rstrip("/")
    if any(c in path for c in "*?["):
        if not any(Path(f).match(path) for f in repo_files(repo)):
            return f"{cited!r}: no file matches"
        return None
    if path not in repo_files(repo) and path not in repo_dirs(repo):
        return f"{cited!r}: no such file or directory in the repository"
    if name:
        func = name.split("[")[0]
        text = (repo / path).read_text()
        if not re.search(rf"^\s*(?:(?:async\s+)?def|class)\s+{re.escape(func)}\b"
                         rf"|^\s*{re.escape(func)}\s*(?::[^=]+)?=", text, re.M):
            return f"{cited!r}: {path} defines no {func}"
    return None


# a string literal, a comment or a bracket, whichever starts first
_PY_TOKEN = re.compile(
    r"(?P<s>[rRbBuUfF]{0,2}(?:"
    r'"""[\s\S]*?"""'
    r"|'''[\s\S]*?'''"
    r'|"(?:\\.|[^"\\\n])*"'
    r"|'(?:\\.|[^'\\\n])*'))"
    r"|(?P<c>#[^\n]*)|(?P<o>[([{])|(?P<e>[)\]}])")


def _python_lines(path: Path) -> Iterable[tuple[int, str, bool]]:
    """(line number, text, False) of each comment and docstring line of a Python file.

    A docstring here is a string that is a statement of its own: outside any bracket,
    alone on the line it starts on (a module's, class's or function's docstring, or one
    after an assignment). One regular expression finds strings, comments and brackets
    (the standard library's tokenizer took 3 s for the source, :mod:`ast` 2 s)."""
    text = path.read_text()
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    out: dict[int, list[str]] = {}
    depth = 0
    for m in _PY_TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "o":
            depth += 1
        elif kind == "e":
            depth = max(depth - 1, 0)
        elif kind == "c":
            out.setdefault(bisect.bisect_right(starts, m.start()), []).append(m[0])
        elif depth == 0:
            first = bisect.bisect_right(starts, m.start())
            eol = text.find("\n", m.end())
            rest = text[m.end(): eol if eol >= 0 else len(text)].strip()
            if text[starts[first - 1]: m.start()].strip() or (rest and rest[0] != "#"):
                continue
            for k, line in enumerate(m[0].splitlines()):
                out.setdefault(first + k, []).append(line)
    for no in sorted(out):
        yield no, " ".join(out[no]), False


#: a repository's Markdown file, as cited from anywhere
_MD = rf"((?:{_TOPS})[\w./-]*\.md|README\.md|CHANGELOG\.md)"
CITED_ANCHOR = re.compile(rf"(?<![\w/.`-]){_MD}#([\w-]+)")
# a document, then a quoted heading (also across a line break and a comment marker)
CITED_HEADING = re.compile(rf"(?<![\w/.`-]){_MD}`?,\s*(?:(?:#:?|--)\s*)?\"([^\"]{{1,200}}?)\"")
OUTSIDE = re.compile(r"(?<![\w.~-])(/work/|/home/)[^\s`'\"]*"
                     r"|(?<![\w.*<-])([\w.-]+-facts)(?:\.md)?(?![\w-])")


def _heading_problems(text: str, repo: Path) -> Iterable[tuple[int, str]]:
    """(offset, what) for each heading that a cited document lacks."""
    for m in CITED_ANCHOR.finditer(text):
        path, frag = m[1], m[2]
        if (repo / path).is_file() and frag not in anchors(repo / path):
            yield m.start(), f"'{path}#{frag}': {path} has no heading #{frag}"
    for m in CITED_HEADING.finditer(text):
        path = m[1]
        quoted = re.sub(r"\s*\n\s*(?:#:?|--)?\s*", " ", m[2]).strip()
        if (repo / path).is_file() and not has_heading(repo / path, quoted):
            yield m.start(), f"'{path}, \"{quoted}\"': {path} has no such heading"


@cache
def _names(repo: Path) -> frozenset[str]:
    return frozenset(Path(f).name for f in repo_files(repo))


def _outside_problems(line: str, repo: Path) -> Iterable[str]:
    names = _names(repo)
    for m in OUTSIDE.finditer(line):
        if m[1]:
            yield f"{m[0]!r}: a path outside the repository"
        elif m[2] + ".md" not in names:
            yield f"{m[0]!r}: no such document in the repository"


def problems(files: Iterable[Path], repo: Path = REPO) -> list[str]:
    """Every broken link, cited path or heading, and every path outside the repository,
    in ``files`` (of the repository at ``repo``): ``path:line: what``."""
    out = []
    for f in files:
        name = f.relative_to(repo) if f.is_relative_to(repo) else f
        markdown = f.suffix == ".md"
        lines = list(_python_lines(f) if f.suffix == ".py" else _lines(f))
        for no, line, fenced in lines:
            if markdown and not fenced:
                for target in LINK.findall(line):
                    why = _link_problem(f, target, repo)
                    if why:
                        out.append(f"{name}:{no}: {why}")
            spans = CODE_SPAN.findall(line) if not fenced else []
            spans += re.findall(r"<!-- (?:ci|not-run-by-ci): ([^ ]+)", line)
            if not fenced:
                plain = CODE_SPAN.sub(" ", line)
                spans += [w for w in PLAIN_PATH.findall(LINK.sub(" ", plain) if markdown
                                                        else plain) if _looks_like_a_path(w)]
            for span in spans:
                cited = cited_path(span)
                why = cited and _path_problem(cited, repo)
                if why:
                    out.append(f"{name}:{no}: {why}")
            out += [f"{name}:{no}: {why}" for why in _outside_problems(line, repo)]
        # headings, in the text as a whole (a citation may run over a line break)
        text = "\n".join(line for _, line, fenced in lines if not fenced or not markdown)
        numbers = [no for no, _, fenced in lines if not fenced or not markdown]
        text = LINK.sub(lambda m: " " * len(m[0]), text) if markdown else text
        for offset, why in _heading_problems(text.replace("`", " "), repo):
            out.append(f"{name}:{numbers[text.count(chr(10), 0, offset)]}: {why}")
    return out


def documents() -> list[Path]:
    """The README, CHANGELOG.md, docs/ and every other Markdown file of the repository."""
    top = [REPO / f for f in ("README.md", "CHANGELOG.md") if (REPO / f).is_file()]
    docs = sorted((REPO / "docs").rglob("*.md"))
    rest = sorted(REPO / f for f in repo_files() if f.endswith(".md")
                  and not f.startswith("docs/") and "/" in f)
    return [*top, *docs, *rest]


def sources(repo: Path = REPO) -> list[Path]:
    """The source files of :data:`SOURCE_DIRS` whose comments and text are checked."""
    return sorted(
        repo / f for f in repo_files(repo)
        if f.split("/", 1)[0] in SOURCE_DIRS and Path(f).suffix in SOURCE_SUFFIXES
        and not f.endswith(".md") and not f.startswith(DATA))


def test_every_link_and_cited_path_in_the_documents_resolves() -> None:
    found = problems(documents())
    assert not found, "\n".join(found)


def test_every_reference_in_the_source_resolves() -> None:
    """Comments, docstrings and the text of units, rules and scripts cite only what the
    repository holds; the whole check (documents and source) stays fast."""
    t0 = time.monotonic()
    files = sources()
    assert len(files) > 200 and REPO / "slurm" / "job_submit.lua" in files
    found = problems(files)
    assert not found, "\n".join(found)
    problems(documents())
    assert time.monotonic() - t0 < 5.0


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    """It fails on each kind of break, in a small repository of its own, and passes what
    resolves."""
    repo = tmp_path / "repo"
    for f, text in {
        "docs/gate.md": "# The gate\n\n## Configuration (`[gate]`)\n",
        "inventoryd/probes/nccl.py": "CONSTANT = 1\n",
        "tests/test_x.py": "def test_y() -> None:\n    pass\n",
        "systemd/a.service": "",
    }.items():
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(text)
    probe = repo / "docs" / "probe.md"
    probe.write_text(
        "# Title\n\n## A heading (`[gate]`)\n\n"
        "[ok](gate.md) [ok](gate.md#configuration-gate) [ok](#a-heading-gate) [ok](../docs/)\n"
        "[web](https://example.org/x) `inventoryd/probes/nccl.py` `tests/test_x.py::test_y`\n"
        "`inventoryd/probes/nccl.py:CONSTANT` `ncclguard/policy/rules/<family>.py` "
        "`systemd/*.service` and in text inventoryd/probes/nccl.py too\n"
        "[gone](nowhere.md)\n[bad anchor](gate.md#no-such-heading)\n[self](#missing)\n"
        "`inventoryd/probes/nothing.py` `tests/test_x.py::no_such_test`\n"
        "`systemd/*.nothing` and in text tests/gone.py too\n[out](../../elsewhere.md)\n"
        "```sh\n[not a link](inside-a-fence.md) `tests/not-checked-in-a-fence.py`\n```\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    found = problems([probe], repo)
    causes = [x.split(": ", 1)[1] for x in found]
    assert causes == [
        "link 'nowhere.md': no docs/nowhere.md in the repository",
        "link 'gate.md#no-such-heading': docs/gate.md has no heading #no-such-heading",
        "link '#missing': docs/probe.md has no heading #missing",
        "'inventoryd/probes/nothing.py': no such file or directory in the repository",
        "'tests/test_x.py::no_such_test': tests/test_x.py defines no no_such_test",
        "'systemd/*.nothing': no file matches",
        "'tests/gone.py': no such file or directory in the repository",
        "link '../../elsewhere.md' leaves the repository",
    ], found


def test_the_checker_finds_what_is_broken_in_the_source(tmp_path: Path) -> None:
    """Comments and docstrings of Python, and lua, shell and rules files whole: each kind
    of dangling reference is named with its line; code (a node's path in a test) is not
    read, and what resolves passes."""
    repo = tmp_path / "repo"
    for f, text in {
        "docs/gate.md": "# The gate\n\n## 1. Configuration (`[gate]`)\n\n## Bounds\n",
        "tests/test_x.py": "def test_y() -> None:\n    pass\n",
    }.items():
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(text)
    code = repo / "ncclguard" / "mod.py"
    code.parent.mkdir()
    code.write_text(
        '"""A module (docs/gate.md, "Configuration"; docs/gate.md#1-configuration-gate;\n'
        "tests/test_x.py::test_y, ``docs/gate.md``, docs/gate.md, \"Bounds\").\n\n"
        'Facts: docs/gone.md, and docs/gate.md, "No such\nheading".\n"""\n\n'
        'NODE_PATH = "/home/alice/conda/lib"  # a value, not a reference: not read\n'
        "CALL = print(\n    \"/work/also/a/value\"\n)\n\n\n"
        "def f() -> None:\n"
        '    """Per /work/shared/docs/x.md and the nccl-facts.md."""\n'
        "    # see tests/test_x.py::test_gone and docs/gate.md#nothing, (docs/gate.md,\n"
        '    # "Limits")\n')
    lua = repo / "slurm" / "job_submit.lua"
    lua.parent.mkdir()
    lua.write_text('-- docs/gate.md, "Bounds" holds; docs/gate.md, "Missing" does not\n'
                   'local x = "slurm-facts"\n')
    rules = repo / "prometheus" / "rules.yml"
    rules.parent.mkdir()
    rules.write_text("runbook_url: docs/gate.md#bounds\nother: docs/gate.md#gone\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    assert sources(repo) == [code, rules, lua, repo / "tests" / "test_x.py"]
    found = problems(sources(repo), repo)
    assert found == [
        "ncclguard/mod.py:4: 'docs/gone.md': no such file or directory in the repository",
        "ncclguard/mod.py:15: '/work/shared/docs/x.md': a path outside the repository",
        "ncclguard/mod.py:15: 'nccl-facts.md': no such document in the repository",
        "ncclguard/mod.py:16: 'tests/test_x.py::test_gone': tests/test_x.py defines no "
        "test_gone",
        "ncclguard/mod.py:16: 'docs/gate.md#nothing': docs/gate.md has no heading #nothing",
        "ncclguard/mod.py:4: 'docs/gate.md, \"No such heading\"': docs/gate.md has no such "
        "heading",
        "ncclguard/mod.py:16: 'docs/gate.md, \"Limits\"': docs/gate.md has no such heading",
        "prometheus/rules.yml:2: 'docs/gate.md#gone': docs/gate.md has no heading #gone",
        "slurm/job_submit.lua:2: 'slurm-facts': no such document in the repository",
        "slurm/job_submit.lua:1: 'docs/gate.md, \"Missing\"': docs/gate.md has no such "
        "heading",
    ], "\n".join(found)
    # and the repository's own source has none of these (the test above): a reference
    # that dangles there fails CI with its file and line


def test_the_wheel_ships_every_document() -> None:
    """README.md, CHANGELOG.md and every document under docs/ (the guides included) are
    matched by a ``share/doc/ncclguard`` glob of pyproject.toml's data-files, so that an
    installed ncclguard carries the same pages its links name."""
    import tomllib

    files = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "data-files"]
    globs = [g for dest, gs in files.items() if dest.startswith("share/doc/ncclguard")
             for g in gs]
    wanted = [str(p.relative_to(REPO)) for p in documents() if p.parent.name != "sysfs"
              and not str(p.relative_to(REPO)).startswith("tests/")]
    assert "CHANGELOG.md" in wanted and "docs/nccl.md" in wanted
    missing = [f for f in wanted if not any(Path(f).match(g) and f.count("/") == g.count("/")
                                            for g in globs)]
    assert not missing, f"not shipped in the wheel: {missing}"


def test_anchors_as_github_makes_them() -> None:
    assert slug("Configuration (`[gate]`)") == "configuration-gate"
    assert slug("10. Other changes (PrologSlurmctld, requeue)") == (
        "10-other-changes-prologslurmctld-requeue")
    assert slug("6. The controller: class features and job_submit.lua") == (
        "6-the-controller-class-features-and-job_submitlua")
