"""The node's filesystem as seen through ``--root``, and the probe error log.

Every probe takes a :class:`NodeFS`. ``NodeFS("/")`` is the real node; tests and the
demo hand in a directory tree laid out like one. Reads either return a value or
record an error for that one field and return ``None``: one unreadable file costs
one field, never the device or the node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_SMALL_READ = 64 * 1024  # sysfs/procfs attributes are tiny; never read more


@dataclass
class ErrorLog:
    """The fingerprint's ``errors`` list: what could not be read, and why."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def add(self, probe: str, field_: str, path: str | None, error: BaseException | str) -> None:
        if isinstance(error, OSError) and error.strerror:
            text = f"[Errno {error.errno}] {error.strerror}"
        else:
            text = str(error) or type(error).__name__
        self.entries.append({"probe": probe, "field": field_, "path": path, "error": text})

    def for_probe(self, probe: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["probe"] == probe]


class NodeFS:
    """Root-prefixed access to one node's files. Node paths are absolute (``/sys/...``)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def host(self, node_path: str | os.PathLike[str]) -> Path:
        """The path on this machine for a node path: ``/sys/x`` -> ``<root>/sys/x``."""
        p = str(node_path)
        if not p.startswith("/"):
            raise ValueError(f"node paths are absolute: {p!r}")
        return self.root / p.lstrip("/") if str(self.root) != "/" else Path(p)

    def node(self, host_path: str | os.PathLike[str]) -> str:
        """The node path for a path on this machine (the inverse of :meth:`host`)."""
        p = Path(host_path)
        if str(self.root) == "/":
            return str(p)
        try:
            return "/" + str(p.relative_to(self.root))
        except ValueError:
            return str(p)

    def read_text(
        self,
        node_path: str,
        errors: ErrorLog | None = None,
        probe: str = "",
        field_: str = "",
        missing_ok: bool = True,
    ) -> str | None:
        """Read a small text attribute, stripped of its trailing newline.

        A missing file returns ``None`` (and records an error only if ``missing_ok`` is
        false). Any other failure (EINVAL from a driver, EACCES, EISDIR, bad UTF-8)
        records an error naming the file and returns ``None``.
        """
        host = self.host(node_path)
        try:
            with open(host, "rb") as f:
                data = f.read(MAX_SMALL_READ)
        except FileNotFoundError as e:
            if not missing_ok and errors is not None:
                errors.add(probe, field_ or node_path, node_path, e)
            return None
        except OSError as e:
            if errors is not None:
                errors.add(probe, field_ or node_path, node_path, e)
            return None
        try:
            return data.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as e:
            if errors is not None:
                errors.add(probe, field_ or node_path, node_path, f"not UTF-8 text: {e}")
            return None
