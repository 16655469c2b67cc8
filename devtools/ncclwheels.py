"""Real NCCL parts for the tests and the demo: libnccl.so.2 from PyPI wheels, gcc plugins.

- :func:`extract_nccl` ``("2.21.5")`` -> the path of a real ``libnccl.so.2``, extracted once
  from the ``nvidia-nccl-cu11``/``-cu12`` wheel into ``~/.cache/ncclguard/nccl/<pkg>-<ver>/``.
  A missing wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into
  ``~/.cache/ncclguard/wheels`` (``$NCCLGUARD_TEST_CACHE`` moves both). Failure raises
  :class:`PartUnavailable` naming the cause (no network, pip failing).
- :func:`build_plugin` ``(out_dir, net_abis=[8, 7], name="IBext_v8")`` -> a ``.so`` that gcc
  builds from a tiny C file exporting the chosen ``ncclNetPlugin_vN`` (etc.) structs, each
  starting with its name string, as real plugins do (docs/nccl.md, "Plugins NCCL loads").
- :func:`loading_check` ``(data, version)`` -> where the strings of a real ``libnccl.so.2``
  disagree with the loading rules of that release (:mod:`ncclguard.fingerprint.loading`);
  ``python -m devtools.ncclwheels sweep`` runs it on every release here, and on any other
  PyPI release named (``2.29.7=nvidia-nccl-cu12``: fetched into a temporary directory).

The cache layout and the version table are those of the tests (``tests/helpers/parts.py``),
so the demo and the tests share one download.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ncclguard.fingerprint import loading
from ncclguard.fingerprint.abi import SYMBOLS

WHEEL_MEMBER = "nvidia/nccl/lib/libnccl.so.2"

# version -> PyPI project; each file's facts: tests/test_probe_nccl.py (FACTS), docs/nccl.md.
NCCL_WHEELS: dict[str, str] = {
    "2.18.3": "nvidia-nccl-cu12",
    "2.21.5": "nvidia-nccl-cu11",
    "2.26.2": "nvidia-nccl-cu12",
    # the plugin-kind boundaries of issue 13 (docs/fingerprint.md, "Plugin kinds by NCCL")
    "2.23.4": "nvidia-nccl-cu12",
    "2.27.7": "nvidia-nccl-cu12",
    "2.28.9": "nvidia-nccl-cu12",
    "2.30.7": "nvidia-nccl-cu13",  # the cu13 build: a CUDA 13 libnccl among the cu12 ones
    "2.32.3": "nvidia-nccl-cu12",
    # the loading-rule boundaries of issue 28 (ncclguard/fingerprint/loading.py)
    "2.19.3": "nvidia-nccl-cu11",  # tuner by NCCL_TUNER_PLUGIN only, no default name
    "2.20.5": "nvidia-nccl-cu12",
    "2.30.4": "nvidia-nccl-cu12",  # no external RMA: no libnccl-rma.so, gin.cc never uses it
}


class PartUnavailable(RuntimeError):
    """A real part (a wheel, a compiler) that cannot be had here; the message says why."""


def cache_dir() -> Path:
    env = os.environ.get("NCCLGUARD_TEST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ncclguard"


def _wheel_for(wheels: Path, project: str, version: str) -> Path | None:
    stem = project.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def _download(wheels: Path, project: str, version: str, timeout: float) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(wheels), f"{project}=={version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PartUnavailable(
            f"pip download {project}=={version} timed out after {timeout:.0f}s (no network?)"
        ) from None
    wheel = _wheel_for(wheels, project, version)
    if r.returncode != 0 or wheel is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PartUnavailable(f"cannot download {project}=={version} (no network?): {tail[0]}")
    return wheel


def _unzip(wheel: Path, dest: Path) -> None:
    tmp = dest.with_name(f".libnccl.so.2.{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        raise PartUnavailable(
            f"{wheel}: not a usable NCCL wheel ({e}); delete it and retry") from None
    os.replace(tmp, dest)


def nccl_path(version: str) -> Path:
    """Where :func:`extract_nccl` puts (or has put) that version's ``libnccl.so.2``."""
    project = NCCL_WHEELS[version]
    return cache_dir() / "nccl" / f"{project.replace('-', '_')}-{version}" / "libnccl.so.2"


def extract_nccl(version: str, timeout: float = 900) -> Path:
    """The path of a real ``libnccl.so.2`` of ``version`` (a key of :data:`NCCL_WHEELS`)."""
    if version not in NCCL_WHEELS:
        raise PartUnavailable(f"no wheel known for NCCL {version} (known: "
                              f"{', '.join(NCCL_WHEELS)})")
    project = NCCL_WHEELS[version]
    dest = nccl_path(version)
    if dest.is_file():
        return dest
    wheels = cache_dir() / "wheels"
    wheel = _wheel_for(wheels, project, version) or _download(wheels, project, version, timeout)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _unzip(wheel, dest)
    return dest


# ---- the loading rules against a library's strings -------------------------------------

_VAR = re.compile(rb"NCCL_([A-Z]+)_PLUGIN(?![A-Z0-9_])")
_PREFIX = re.compile(rb"libnccl-([a-z]+)")


def loading_check(data: bytes, version: tuple[int, int, int]) -> list[str]:
    """Where the strings of ``data`` (a real ``libnccl.so.2``) disagree with the loading rules
    of ``version`` (:func:`ncclguard.fingerprint.loading.rules_for`); ``[]``: they agree.

    What a row implies about the binary: a kind it loads has its ``<symbol>_vN`` literals
    (the ``dlsym`` names); a kind with a library of its own has its ``libnccl-<kind>``
    prefix; a variable read is a literal; ``STATIC_PLUGIN`` is one from 2.22.3; the one
    opener of 2.26 on formats ``%s-%s.so``, the loaders before it ``libnccl-<kind>-%s.so``
    each; a list's default name is a literal. And the binary names no ``NCCL_*_PLUGIN``
    variable and no ``libnccl-*`` library of a kind the table does not know.
    """
    from inventoryd.probes.nccl import scan

    rules = loading.rules_for(version)
    abis = scan(io.BytesIO(data))["abis"]
    out: list[str] = []

    def expect(what: str, want: bool, has: bool) -> None:
        if want != has:
            out.append(f"{what}: the {rules.row} row says {'yes' if want else 'no'}, the "
                       f"strings {'have it' if has else 'do not'}")

    for kind in loading.PREFIXES:
        rule = rules.kinds.get(kind)
        symbols = bool(abis.get(kind))
        if rule is None or not rule.external:
            if symbols and rule is None:
                out.append(f"{kind}: the strings name {SYMBOLS[kind]}_vN, the {rules.row} row "
                           f"loads no {kind} plugin")
        else:
            expect(f"{kind}: {SYMBOLS[kind]}_vN", True, symbols)
        own = rule is not None and rule.own and (rule.default is not None
                                                  or rule.names != loading.GIVEN)
        expect(f"{kind}: libnccl-{kind}", own, f"libnccl-{kind}".encode() in data)
        var = f"NCCL_{kind.upper()}_PLUGIN"
        expect(f"{kind}: {var}", rule is not None and rule.var is not None,
               re.search(var.encode() + rb"(?![A-Z0-9_])", data) is not None)
        if rule is not None and rules.opener == "per kind" and rule.var:
            expect(f"{kind}: libnccl-{kind}-%s.so", rule.names in (loading.PREFIXED,
                   loading.BOTH), f"libnccl-{kind}-%s.so".encode() in data)
        if rule is not None and rule.listed and rule.own and rule.default:
            expect(f"{kind}: {rule.default}", True, rule.default.encode() in data)
    expect("STATIC_PLUGIN", rules.static, b"STATIC_PLUGIN" in data)
    expect("%s-%s.so (plugin_open.cc)", rules.opener == "plugin_open.cc", b"%s-%s.so" in data)
    for m in sorted(set(_VAR.findall(data))):
        if m.decode().lower() not in loading.PREFIXES:
            out.append(f"the strings name NCCL_{m.decode()}_PLUGIN: a kind the table does not "
                       "know")
    for m in sorted(set(_PREFIX.findall(data))):
        if not any(m.decode().startswith(k) for k in loading.PREFIXES):
            out.append(f"the strings name libnccl-{m.decode()}: a kind the table does not know")
    return out


def sweep(targets: Sequence[str], timeout: float = 900) -> int:
    """``sweep [VERSION[=PROJECT] ...]``: :func:`loading_check` on each release (default:
    every one of :data:`NCCL_WHEELS`); one not cached is fetched into a temporary directory
    and deleted after. Exit 1 if any disagrees, 2 if a wheel cannot be had."""
    bad = 0
    for target in targets or list(NCCL_WHEELS):
        version, _, project = target.partition("=")
        v = loading.parse_version(version)
        if v is None:
            print(f"ncclwheels: {target!r} is not a VERSION[=PROJECT]", file=sys.stderr)
            return 2
        try:
            if version in NCCL_WHEELS and not project:
                data = extract_nccl(version, timeout).read_bytes()
            else:
                with tempfile.TemporaryDirectory(prefix="ncclwheels-") as tmp:
                    wheel = _download(Path(tmp), project or "nvidia-nccl-cu12", version, timeout)
                    _unzip(wheel, Path(tmp) / "libnccl.so.2")
                    data = (Path(tmp) / "libnccl.so.2").read_bytes()
        except PartUnavailable as e:
            print(f"ncclwheels: NCCL {version}: {e}", file=sys.stderr)
            return 2
        problems = loading_check(data, v)
        row = loading.rules_for(v).row
        print(f"NCCL {version}: row {row}: " + ("agrees" if not problems else
                                              "DISAGREES: " + "; ".join(problems)))
        bad += bool(problems)
    return 1 if bad else 0


_PLUGIN_TYPE = "typedef struct { const char *name; void *fn[16]; } ncclguard_plugin_t;\n"


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def plugin_source(exports: Sequence[tuple[str, str]], reloc: str = "relative",
                  writable: bool = False) -> str:
    """C source exporting one struct per (symbol, name); the name is the first field."""
    lines = [_PLUGIN_TYPE]
    qual = "" if writable else "const "
    for i, (symbol, name) in enumerate(exports):
        if reloc == "symbol":  # a pointer to an exported string: R_X86_64_64 against it
            lines.append(f"const char ncclguard_name_{i}[] = {_c_string(name)};")
            init = f"ncclguard_name_{i}"
        else:  # a string literal: R_X86_64_RELATIVE
            init = _c_string(name)
        lines.append(f'__attribute__((visibility("default"))) {qual}ncclguard_plugin_t '
                     f"{symbol} = {{ {init}, {{0}} }};")
    return "\n".join(lines) + "\n"


def build_plugin(
    out_dir: Path,
    net_abis: Sequence[int] = (),
    name: str = "testnet",
    *,
    tuner_abis: Sequence[int] = (),
    collnet: Sequence[int] = (),
    profiler_abis: Sequence[int] = (),
    env_abis: Sequence[int] = (),
    gin_abis: Sequence[int] = (),
    rma_abis: Sequence[int] = (),
    collnet_name: str = "testcoll",
    tuner_name: str = "testtuner",
    profiler_name: str = "testprof",
    env_name: str = "testenv",
    gin_name: str = "testgin",
    rma_name: str = "testrma",
    filename: str = "libnccl-net.so",
    reloc: str = "relative",
    writable: bool = False,
    executable: bool = False,
) -> Path:
    """Compile a plugin with gcc; raises :class:`PartUnavailable` without gcc.

    ``reloc``: "relative" (a string literal), "symbol" (an exported string), "relr" (packed
    relative relocations; :class:`PartUnavailable` if the linker cannot).
    ``executable``: a non-PIE executable exporting the structs (``-rdynamic``).
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise PartUnavailable("gcc is not installed (apt-get install gcc)")
    exports = [(f"ncclNetPlugin_v{v}", name) for v in net_abis]
    exports += [(f"ncclCollNetPlugin_v{v}", collnet_name) for v in collnet]
    exports += [(f"ncclTunerPlugin_v{v}", tuner_name) for v in tuner_abis]
    exports += [(f"ncclProfiler_v{v}", profiler_name) for v in profiler_abis]
    exports += [(f"ncclEnvPlugin_v{v}", env_name) for v in env_abis]
    exports += [(f"ncclGinPlugin_v{v}", gin_name) for v in gin_abis]
    exports += [(f"ncclRmaPlugin_v{v}", rma_name) for v in rma_abis]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / (filename + ".c")
    body = plugin_source(exports, reloc, writable)
    if executable:
        body += "int main(void) { return 0; }\n"
    src.write_text(body)
    out = out_dir / filename
    if executable:
        cmd = [gcc, "-O1", "-no-pie", "-fno-pie", "-rdynamic", "-o", str(out), str(src)]
    else:
        cmd = [gcc, "-O1", "-shared", "-fPIC", "-o", str(out), str(src)]
        if reloc == "relr":
            cmd.insert(1, "-Wl,-z,pack-relative-relocs")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        if reloc == "relr":
            raise PartUnavailable(f"this linker cannot pack relative relocations: "
                                  f"{r.stderr.strip()}")
        raise RuntimeError(f"gcc failed: {r.stderr.strip()}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m devtools.ncclwheels fetch``: have every NCCL of :data:`NCCL_WHEELS` in
    the cache (scripts/test.sh runs it before the tests). Exit 2 naming the part that
    cannot be had. ``sweep [VERSION[=PROJECT] ...]``: :func:`sweep`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["sweep"]:
        return sweep(args[1:])
    if args != ["fetch"]:
        print("usage: python -m devtools.ncclwheels fetch | sweep [VERSION[=PROJECT] ...]",
              file=sys.stderr)
        return 2
    for version, project in NCCL_WHEELS.items():
        try:
            path = extract_nccl(version)
        except PartUnavailable as e:
            print(f"ncclwheels: the real part libnccl.so.2 {version} ({project}=={version}) "
                  f"cannot be had: {e}", file=sys.stderr)
            return 2
        print(f"NCCL {version}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
