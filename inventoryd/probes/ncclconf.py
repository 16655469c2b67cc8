"""``/etc/nccl.conf``, kept raw and parsed the way NCCL parses it (fingerprint ``nccl_conf``).

NCCL's ``setEnvFile`` reads the file line by line: the trailing ``\\n`` is dropped and
nothing else (no whitespace trimming, a ``\\r`` stays); a line without ``=`` is skipped;
the name is what precedes the first ``=`` and the value what follows, each cut at 1023
bytes (and at a NUL byte, as C strings are); an empty name is rejected by ``setenv``;
the first occurrence of a name wins (``setenv(..., 0)``).

``#`` in column 1: NCCL 2.26 and later skip the line. Older NCCL parses it like any
other line, and so sets a variable whose name starts with ``#`` (``#NCCL_IB_HCA``).
NCCL reads no such variable, so ``NCCL_*`` settings are the same in both; ``settings``
follows 2.26+, and ``comment_settings`` holds what older NCCL would also have set, so a
policy can tell. The file is read up to :data:`MAX_PARSE` bytes (a huge file costs
bounded time, ``truncated`` says so, plus an error); ``raw`` keeps the first
:data:`MAX_RAW` bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from inventoryd.nodefs import ErrorLog, NodeFS
from ncclguard.fingerprint.model import NCCL_CONF_PATH

PROBE = "nccl_conf"
PATH = NCCL_CONF_PATH
MAX_RAW = 64 * 1024
MAX_PARSE = 1024 * 1024
NCCL_MAX = 1023  # envVar/envValue are char[1024]


def parse(data: bytes) -> tuple[dict[str, str], dict[str, str]]:
    """``(settings, comment_settings)`` of a config file's bytes, as NCCL ≥ 2.26 / < 2.26.

    Non-UTF-8 bytes become U+FFFD (the fingerprint is JSON).
    """
    settings: dict[str, str] = {}
    comments: dict[str, str] = {}
    for line in data.split(b"\n"):
        line = line.split(b"\0", 1)[0]
        eq = line.find(b"=")
        if eq <= 0:  # no '=' (skipped), or an empty name (setenv fails)
            continue
        name = line[: min(eq, NCCL_MAX)].decode("utf-8", "replace")
        value = line[eq + 1 :][:NCCL_MAX].decode("utf-8", "replace")
        target = comments if line.startswith(b"#") else settings
        target.setdefault(name, value)
    return settings, comments


def probe(fs: NodeFS, errors: ErrorLog) -> dict[str, Any]:
    out: dict[str, Any] = {
        "path": PATH, "present": False, "sha256": None, "raw": None, "truncated": False,
        "settings": {}, "comment_settings": {},
    }
    if not fs.exists(PATH) and not fs.host(PATH).is_symlink():
        return out
    out["present"] = True
    got = fs.read_bytes(PATH, MAX_PARSE, errors, PROBE, "nccl_conf", missing_ok=False)
    if got is None:
        out["settings"] = out["comment_settings"] = None
        return out
    data, over = got
    if over:
        errors.add(PROBE, "nccl_conf.settings", PATH,
                   f"larger than {MAX_PARSE} bytes: parsed the first {MAX_PARSE} bytes only")
    out["sha256"] = hashlib.sha256(data).hexdigest() if not over else None
    out["raw"] = data[:MAX_RAW].decode("utf-8", "replace")
    out["truncated"] = over or len(data) > MAX_RAW
    out["settings"], out["comment_settings"] = parse(data)
    return out
