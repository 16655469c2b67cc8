"""Registry images under attack (issue 41): each case a reproduction of the hostile review,
scaled down to run in seconds, that failed before its fix. Layers are real tar streams;
the cases that need a registry use the real one on loopback (tests/helpers/registry.py).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.registry import Registry

from inventoryd.controller.images.layers import (
    MAX_KEPT,
    MAX_NAME_BYTES,
    LayeredImage,
    read_layer,
)
from inventoryd.controller.images.registry import Client, Credentials, RegistryError, resolve
from inventoryd.controller.images.squashfs import MAX_DEPTH
from inventoryd.controller.images.tree import ImageError
from ncclguard.fingerprint.imageref import parse

TAR = "application/vnd.oci.image.layer.v1.tar"


def _dirs(paths: list[str]) -> bytes:
    """A plain tar of directory entries (pax: any path length)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for p in paths:
            info = tarfile.TarInfo(p)
            info.type = tarfile.DIRTYPE
            t.addfile(info)
    return buf.getvalue()


def _summary(blob: bytes) -> dict:
    return read_layer(io.BytesIO(blob), digest="sha256:" + hashlib.sha256(blob).hexdigest(),
                      size=len(blob), media_type=TAR, deadline=time.monotonic() + 30,
                      max_bytes=1 << 30, max_unpacked=1 << 30, max_read_bytes=1 << 30)


# ---- 1. memory: the parents a member implies


def test_a_path_deeper_than_the_squashfs_bound_is_refused() -> None:
    """One member 800 levels deep (the review's): refused, as a squashfs image that deep is."""
    with pytest.raises(ImageError, match=rf"deeper than {MAX_DEPTH} levels"):
        _summary(_dirs(["/".join(["d"] * 800)]))


def test_implied_directories_count_against_the_name_bound() -> None:
    """Members 60 levels deep with 4 KB paths: their own names are 0.7 MB, the parents
    they imply 17 MB: the review's 195 MB from an 18 KB layer, scaled down."""
    part = "x" * 64
    paths = [f"{i:05d}/" + "/".join([part] * 59) for i in range(180)]
    assert sum(len(p) for p in paths) < MAX_NAME_BYTES // 16
    with pytest.raises(ImageError, match="bytes of paths the fingerprint keeps"):
        _summary(_dirs(paths))


def test_implied_directories_count_against_the_entry_bound() -> None:
    """Each member of distinct parents 60 deep implies 59 entries: MAX_KEPT / 59 + 1
    members are over the bound of entries kept, whatever they name."""
    n = MAX_KEPT // 59 + 2
    paths = [f"{i}/" + "/".join(["d"] * 59) for i in range(n)]
    with pytest.raises(ImageError, match=f"more than {MAX_KEPT} entries"):
        _summary(_dirs(paths))


def test_a_deep_but_legal_layer_still_reads() -> None:
    """64 levels (the bound) is read, its parents made as tar makes them."""
    deep = "/".join(["d"] * MAX_DEPTH)
    image = LayeredImage("t", [_summary(_dirs([deep]))])
    assert image.entries["/" + deep].kind == "d"
    assert image.entries["/d/d"].kind == "d"


def test_the_collectors_unit_bounds_its_memory_and_tasks() -> None:
    """The collector reads what users push to registries: its unit caps memory above the
    worst image the bounds let through (bench/bench_registry_hostile.py: 325 MB) and
    the squashfs reader's child (1 GiB of address space), and its tasks."""
    unit = Path(__file__).resolve().parents[1] / "systemd" / "ncclguard-collector.service"
    lines = [x.strip() for x in unit.read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert "MemoryMax=2G" in lines and "TasksMax=64" in lines


# ---- 3. a bearer realm on another host, a scope of the registry's choosing


@contextmanager
def _challenger(challenge: str) -> Iterator[int]:
    """A hostile registry on loopback: every request answered 401 with ``challenge``."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(401)
            self.send_header("WWW-Authenticate", challenge)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_credentials_go_to_a_token_realm_only_on_a_host_the_admin_named(
        tmp_path: Path) -> None:
    """A registry with a credentials line (here ``localhost``) answers 401 with a realm on
    another host that has one (the real token service on 127.0.0.1) and a scope of its
    choosing: the realm is asked anonymously, for the reference's own pull scope. Once the
    admin names that realm for the registry, its credentials go there, for that scope."""
    with Registry(tmp_path / "reg", auth="token", users={"bob": "pw"}) as victim:
        svc = victim.token_service
        assert svc is not None
        realm = urllib.parse.urlsplit(svc.url).netloc
        wanted = 'repository:secret/weights:pull,push,delete'
        with _challenger(f'Bearer realm="{svc.url}",service="{victim.service}",'
                         f'scope="{wanted}"') as port:
            host = f"localhost:{port}"
            creds = Credentials({"localhost": ("mallory", "m"), "127.0.0.1": ("bob", "pw")})

            def client(**kw: object) -> Client:
                return Client(parse(f"{host}#ml/train:v1"),
                              deadline=time.monotonic() + 20, credentials=creds,
                              insecure=(host, realm), **kw)  # type: ignore[arg-type]
            with pytest.raises(RegistryError):
                resolve(client(), "linux/amd64")
            asked = list(svc.requests)
            assert asked and all(r.authorization is None for r in asked), asked
            assert all(r.scopes == ["repository:ml/train:pull"] for r in asked), asked
            svc.requests.clear()
            with pytest.raises(RegistryError):
                resolve(client(token_realms={"localhost": ("127.0.0.1",)}), "linux/amd64")
            asked = list(svc.requests)
            assert asked and all(r.user == "bob" for r in asked), asked
            assert all(r.scopes == ["repository:ml/train:pull"] for r in asked), asked


def test_token_realms_is_a_table_of_lists_of_hosts() -> None:
    from ncclguard.config import ConfigError, from_dict

    cfg = from_dict({"registry": {"token_realms": {"nvcr.io": ["authn.nvidia.com"]}}})
    assert cfg.registry.token_realms == {"nvcr.io": ("authn.nvidia.com",)}
    with pytest.raises(ConfigError, match="token_realms"):
        from_dict({"registry": {"token_realms": {"nvcr.io": "authn.nvidia.com"}}})
