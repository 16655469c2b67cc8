"""Registry image references as pyxis and enroot read them (docs/containers.md, "Registry
images").

pyxis hands a ``--container-image`` that is not a path (it starts with neither ``/`` nor
``.``) to ``enroot import docker://REF`` (pyxis v0.24.0 ``pyxis_slurmstepd.c``), and enroot
v4.1.2 (``src/docker.sh``, ``docker::_parse_uri``) reads ``REF`` in three forms:

- ``[USER@]REGISTRY#IMAGE[:TAG][@DIGEST]``: the registry as written;
- ``[USER@]X/IMAGE[:TAG][@DIGEST]``: ``X`` is the registry when it holds a ``.`` or a
  ``:`` (``nvcr.io/nvidia/pytorch:25.01-py3``, ``localhost:5000/ml/train``), else a
  Docker Hub namespace (``nvidia/cuda:12``);
- ``[USER@]IMAGE[:TAG][@DIGEST]``: Docker Hub's ``library/IMAGE``.

Docker Hub is ``registry-1.docker.io``; the tag is ``latest`` when none is given, and a
digest wins over a tag given beside it. enroot v4.1.2 does not rewrite ``docker.io`` (its
unreleased main does): neither does this.

:func:`parse` gives the :class:`Reference`; its :attr:`~Reference.key` is the one name
the index, the gate and the CLI use for it. Standard library only: the gate imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DOCKER_HUB", "RefError", "Reference", "parse"]

#: the registry of a reference that names none (enroot: ``registry-1.docker.io``)
DOCKER_HUB = "registry-1.docker.io"
MAX_REF = 1024  # longer is refused (Slurm's own SPANK option bound is lower)

# OCI distribution spec: repository name components and tags; a registry host[:port]
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]{1,5})?")
_USER = re.compile(r"[A-Za-z0-9._$-]{1,128}")


class RefError(ValueError):
    """A reference that pyxis and enroot would not import as a registry image; the
    message says which part is wrong."""


@dataclass(frozen=True, slots=True)
class Reference:
    registry: str  # host[:port]
    repository: str
    tag: str | None  # None when the reference gives only a digest
    digest: str | None  # "sha256:..." when the reference pins one
    user: str | None = None  # enroot's USER@ (the credentials' login), not part of the key

    @property
    def key(self) -> str:
        """``registry/repository:tag`` or ``registry/repository@digest`` (a digest wins
        over a tag given beside it: that is what is pulled)."""
        base = f"{self.registry}/{self.repository}"
        return f"{base}@{self.digest}" if self.digest else f"{base}:{self.tag}"

    @property
    def reference(self) -> str:
        """What the distribution API's ``/manifests/`` is asked for."""
        return self.digest or str(self.tag)


def parse(text: str) -> Reference:
    """The reference ``text`` names, as enroot reads it (module docstring); raises
    RefError naming what is wrong."""
    raw = text.strip()
    if not raw:
        raise RefError("empty image reference")
    if len(raw) > MAX_REF:
        raise RefError(f"image reference longer than {MAX_REF} characters")
    if raw.startswith(("/", ".")):
        raise RefError("a path, not a registry reference")
    raw = raw.removeprefix("docker://")
    if "://" in raw:
        raise RefError(f"scheme {raw.split('://', 1)[0]!r}: only registry references "
                       "(docker://) are read")
    user = None
    head, hash_, rest = raw.partition("#")
    if hash_:  # [USER@]REGISTRY#IMAGE
        if "@" in head:
            user, _, head = head.rpartition("@")
        registry, image, hub = head, rest, False
        if not registry:
            raise RefError("empty registry before '#'")
    else:
        pos = raw.find("@")
        if pos >= 0 and not raw[pos + 1:].startswith("sha256:"):
            user, raw = raw[:pos], raw[pos + 1:]
        first, slash, rest = raw.partition("/")
        if slash and ("." in first or ":" in first):  # X/IMAGE, X a registry
            registry, image, hub = first, rest, False
        else:
            registry, image, hub = DOCKER_HUB, raw, True
    if user is not None and not _USER.fullmatch(user):
        raise RefError("a user name enroot would not take before '@'")
    if not _HOST.fullmatch(registry):
        raise RefError(f"registry {registry!r} is not a host[:port]")
    digest = None
    name, at, dig = image.partition("@")
    if at:
        if not _DIGEST.fullmatch(dig):
            raise RefError("a digest must be sha256: and 64 lowercase hex digits")
        digest = dig
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise RefError(f"tag {tag!r} is not a valid tag")
    if not _REPO.fullmatch(name):
        raise RefError(f"repository {name!r} is not a valid name (lowercase components "
                       "separated by '/')")
    if hub and "/" not in name:
        name = f"library/{name}"
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, name, tag, digest, user)
