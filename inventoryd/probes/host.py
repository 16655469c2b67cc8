"""Host facts: name, kernel, boot id, time of collection, tool version (fingerprint ``host``).

All from ``<root>/proc/sys/kernel/`` (``hostname``, ``osrelease``, ``random/boot_id``),
so that ``--root`` describes the node, not the machine running the probe. The host name
is the ``--hostname`` value if given, else the short form (up to the first dot) of
``kernel/hostname``, else of ``/etc/hostname``.
"""

from __future__ import annotations

import time
from typing import Any

from inventoryd.nodefs import ErrorLog, NodeFS
from ncclguard import __version__
from ncclguard.timeparse import iso_utc

PROBE = "host"


def utc_now() -> str:
    """Now as the schema's UTC ISO-8601 string with a ``Z`` (second precision)."""
    return iso_utc(time.time())


def short_name(name: str) -> str:
    return name.strip().split(".", 1)[0]


def probe(fs: NodeFS, errors: ErrorLog, hostname: str | None) -> dict[str, Any]:
    if not hostname:
        for path in ("/proc/sys/kernel/hostname", "/etc/hostname"):
            text = fs.read_text(path, errors, PROBE, "host.hostname")
            if text and short_name(text):
                hostname = short_name(text)
                break
        else:
            errors.add(PROBE, "host.hostname", "/proc/sys/kernel/hostname",
                       "no host name in /proc/sys/kernel/hostname or /etc/hostname")
    return {
        "hostname": hostname or None,
        "kernel": fs.read_text("/proc/sys/kernel/osrelease", errors, PROBE, "host.kernel",
                               missing_ok=False),
        "boot_id": fs.read_text("/proc/sys/kernel/random/boot_id", errors, PROBE,
                                "host.boot_id", missing_ok=False),
        "collected_at": utc_now(),
        "tool_version": __version__,
    }
