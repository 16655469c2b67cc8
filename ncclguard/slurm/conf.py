"""One setting of slurm.conf, read as slurmctld reads it, for the gate: ``StateSaveLocation``
(where slurmctld keeps each batch job's saved environment, docs/slurm.md).

slurm.conf(5): ``Key=Value`` words (several may share a line), keys case-insensitive,
``#`` starts a comment, a later setting overrides an earlier one. ``Include`` files are
not followed: a site that sets ``StateSaveLocation`` in one names it in ``[gate]
state_save_location`` instead. The file
is the admin's (root's, read by every Slurm command); it is still read bounded and without
blocking.

Standard library only (the gate's hot path).
"""

from __future__ import annotations

import os
import re
import stat

__all__ = ["DEFAULT_CONF", "MAX_CONF_BYTES", "conf_path", "setting"]

#: Where Slurm's commands look without SLURM_CONF (Debian's slurm-wlm: --sysconfdir=/etc/slurm).
DEFAULT_CONF = "/etc/slurm/slurm.conf"
#: A slurm.conf longer than this is not read (the largest sites' files are a few 100 KB).
MAX_CONF_BYTES = 4 << 20


def conf_path(configured: str = "") -> str:
    """The slurm.conf the gate's Slurm commands use: ``[gate] slurm_conf``, else
    ``$SLURM_CONF``, else Slurm's default."""
    return configured or os.environ.get("SLURM_CONF") or DEFAULT_CONF


def setting(path: str, key: str) -> tuple[str | None, str | None]:
    """``(value, None)`` of ``key`` in the slurm.conf at ``path`` (the last line that sets
    it), ``(None, None)`` when no line does, ``(None, why)`` when the file cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        return None, f"{path}: cannot open: {e.strerror or e}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path}: not a regular file"
        if st.st_size > MAX_CONF_BYTES:
            return None, f"{path}: {st.st_size} bytes, more than {MAX_CONF_BYTES} read"
        data = os.read(fd, MAX_CONF_BYTES + 1)
    except OSError as e:
        return None, f"{path}: cannot read: {e.strerror or e}"
    finally:
        os.close(fd)
    want = key.lower()
    found: str | None = None
    for raw in data.decode("utf-8", "replace").splitlines():
        # a line may hold several Key=Value words (NodeName=a Gres=gpu:1 ...); a value in
        # double quotes may hold spaces
        for m in _WORD.finditer(raw.split("#", 1)[0]):
            if m.group(1).lower() == want:
                value = m.group(3) if m.group(3) is not None else m.group(2)
                found = value or None
    return found, None


_WORD = re.compile(r'(?:^|\s)([A-Za-z]+)=("([^"]*)"|\S*)')
