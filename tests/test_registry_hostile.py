"""Registry images under attack (issue 41): each case a reproduction of the hostile review,
scaled down to run in seconds, that failed before its fix. Layers are real tar streams;
the cases that need a registry use the real one on loopback (tests/helpers/registry.py).

Over 500 lines: one set of hostile servers (a challenger, a fixed-body registry, a
proxy) and one index configuration serve every case of the issue; split, each part
would build them again.
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
from helpers.registry import (
    File,
    Registry,
    Symlink,
    image_blobs,
    layer_tar,
    push_image,
    push_raw,
)

from inventoryd.controller.images.layers import (
    MAX_KEPT,
    MAX_NAME_BYTES,
    LayeredImage,
    read_layer,
)
from inventoryd.controller.images.registry import Client, Credentials, RegistryError, resolve
from inventoryd.controller.images.squashfs import MAX_DEPTH
from inventoryd.controller.images.tree import ImageError
from ncclguard import config as configmod
from ncclguard.fingerprint.imageref import parse
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory

TAR = "application/vnd.oci.image.layer.v1.tar"
GZ = "application/vnd.oci.image.layer.v1.tar+gzip"


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


def test_a_layer_of_many_conf_files_keeps_what_the_fingerprint_reads() -> None:
    """Issue 41's hostile review: a layer of 6,000 ``ld.so.conf.d`` files of 64 KiB (8.2
    MB of gzip) kept every file's content: 500 MB of summaries, 1.57 GB of peak memory.
    The layer keeps the first 65 by name, as many as the fingerprint reads, their bytes
    counted against the layer's bound; a file named by a later member still wins."""
    import tarfile

    keep = 65  # the fingerprint's 64 (MAX_CONF_FILES) and /etc/ld.so.conf's place
    raw = io.BytesIO()
    body = (b"/opt/x\n" * 9400)[:65536]
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as t:
        for i in reversed(range(300)):  # the last by name first: each later one evicts
            info = tarfile.TarInfo(f"etc/ld.so.conf.d/{i:04d}.conf")
            info.size = len(body)
            t.addfile(info, io.BytesIO(body))
    s = _summary(raw.getvalue())
    kept = sorted(s["small"])
    assert kept == [f"/etc/ld.so.conf.d/{i:04d}.conf" for i in range(keep)]
    assert s["kept_bytes"] >= sum(map(len, s["small"].values()))


# ---- 3. a bearer realm on another host, a scope of the registry's choosing


@contextmanager
def _loopback(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    """``handler`` served on loopback in a thread, for as long as the block runs: its port."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


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

    with _loopback(H) as port:
        yield port


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


def test_a_long_challenge_is_refused_in_linear_time() -> None:
    """Issue 41's hostile review: a 401 whose ``WWW-Authenticate`` holds a long run of
    letters with no ``=`` made the parameter regex backtrack quadratically, holding the
    GIL: one 65 KB header froze the whole collector (node records, the watchdog, SIGTERM)
    for 27 s past the read's deadline."""
    with _challenger("Bearer " + "a" * 60000) as port:
        host = f"127.0.0.1:{port}"
        t = time.monotonic()
        with pytest.raises(RegistryError, match="no challenge this client takes"):
            resolve(Client(parse(f"{host}#ml/train:v1"), deadline=time.monotonic() + 10,
                           credentials=Credentials(), insecure=(host,)), "linux/amd64")
        assert time.monotonic() - t < 2.0
    from inventoryd.controller.images.registry import _challenge

    # a real challenge reads as before (docker-registry's token realm)
    assert _challenge('Bearer realm="https://auth.example/token",service="reg",'
                      'scope="repository:ml/train:pull"') == (
        "bearer", {"realm": "https://auth.example/token", "service": "reg",
                   "scope": "repository:ml/train:pull"})


def test_token_realms_is_a_table_of_lists_of_hosts() -> None:
    from ncclguard.config import ConfigError, from_dict

    cfg = from_dict({"registry": {"token_realms": {"nvcr.io": ["authn.nvidia.com"]}}})
    assert cfg.registry.token_realms == {"nvcr.io": ("authn.nvidia.com",)}
    with pytest.raises(ConfigError, match="token_realms"):
        from_dict({"registry": {"token_realms": {"nvcr.io": "authn.nvidia.com"}}})


# ---- 2. poisoning: nothing about a blob decided before its digest is verified


@contextmanager
def _serving(routes: dict[str, tuple[str, bytes]], seen: list[str] | None = None
             ) -> Iterator[str]:
    """A registry on loopback that serves fixed bodies (path -> (content type, body)),
    404 otherwise; its host:port. ``seen`` gets each path asked."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if seen is not None:
                seen.append(self.path)
            kind, body = routes.get(self.path, ("text/plain", b""))
            self.send_response(200 if self.path in routes else 404)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    with _loopback(H) as port:
        yield f"127.0.0.1:{port}"


def _index_config(tmp_path: Path, refs: list[str], insecure: tuple[str, ...]
                  ) -> configmod.Config:
    cfg = configmod.Config()
    reg = cfg.registry.replace(enabled=True, insecure=insecure, platform="linux/amd64",
                               refs=refs, timeout_s=30.0)
    inv = cfg.inventory.replace(db=str(tmp_path / "inv.db"))
    gate = cfg.gate.replace(audit_log=str(tmp_path / "audit.jsonl"))
    return cfg.replace(registry=reg, inventory=inv, gate=gate)


def _honest_image() -> tuple[list[bytes], bytes]:
    return [layer_tar([File("/etc/nccl.conf", b"NCCL_PROTO=Simple\n")])], b""


def test_a_hostile_registry_serving_an_honest_digest_with_a_garbage_layer_poisons_nothing(
        tmp_path: Path) -> None:
    """A hostile allowed registry serves the honest image's manifest bytes (same digest)
    and garbage (not even gzip) for its layer, and is read first: that is the hostile
    registry's failure, on its own tag; the honest tag of the same digest is read and
    judged in the same pass. Before, the zlib error was filed as the digest's content
    before the blob's sha256 was checked, for every registry, and never read again."""
    layers, _ = _honest_image()
    manifest, cfg_blob, lbs = image_blobs(layers)
    with Registry(tmp_path / "honest") as honest:
        digest = push_image(honest, "ml/train", "v1", layers, via="http")
        assert digest == manifest.digest
        garbage = bytes((i * 7 + 3) % 251 for i in range(len(lbs[0].data)))
        routes = {
            "/v2/ml/train/manifests/v1": (manifest.media_type, manifest.data),
            f"/v2/ml/train/blobs/{cfg_blob.digest}": (cfg_blob.media_type, cfg_blob.data),
            f"/v2/ml/train/blobs/{lbs[0].digest}": ("application/octet-stream", garbage),
        }
        with _serving(routes) as hostile:
            bad, good = f"{hostile}#ml/train:v1", f"{honest.host}#ml/train:v1"
            cfg = _index_config(tmp_path, [bad, good], (hostile, honest.host))
            from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

            index = RegistryIndex(cfg)
            with Inventory(tmp_path / "inv.db", config=cfg.inventory,
                           values=GATE_VALUES) as inv:
                index.run_pass()
                write_batches(inv, index.drain())
                rows = {r["ref"]: r for r in inv.registry_images()}
                # a long run: pass after pass the honest tag stays judged by the gate
                from ncclguard.policy.rules.container import registry_image

                for n in range(1, 4):
                    later = time.time() + n * (cfg.registry.resolve_interval_s + 1)
                    index.run_pass(now=later)
                    write_batches(inv, index.drain())
                    got = registry_image(inv.load_registry_values(
                        f"{honest.host}/ml/train:v1"), time.time(), cfg.registry, honest.host)
                    assert got is not None and got[0] is not None, got
    h, g = rows[f"{hostile}/ml/train:v1"], rows[f"{honest.host}/ml/train:v1"]
    assert g["digest"] == h["digest"] == digest
    assert g["image_error"] is None and g["record_hash"] is not None, g
    assert h["error"] and "does not match its digest" in h["error"], h


def test_the_collectors_own_disk_failing_is_not_the_images_content(tmp_path: Path) -> None:
    """A libnccl streamed to a tmp_dir that fails (gone here; ENOSPC alike): tried again,
    never stored as the image's content (before: `cannot be decompressed`)."""
    from inventoryd.controller.images.tree import ImageTransient

    info = tarfile.TarInfo("usr/lib/libnccl.so.2")
    info.size = 4096
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.addfile(info, io.BytesIO(b"\0" * 4096))
    blob = buf.getvalue()
    gone = tmp_path / "gone"
    with pytest.raises(ImageTransient, match=r"temporary directory .*not the image's content"):
        read_layer(io.BytesIO(blob), digest="sha256:" + hashlib.sha256(blob).hexdigest(),
                   size=len(blob), media_type=TAR, deadline=time.monotonic() + 30,
                   max_bytes=1 << 30, max_unpacked=1 << 30, max_read_bytes=1 << 30,
                   tmpdir=str(gone))


def test_a_good_read_replaces_a_stored_error(tmp_path: Path) -> None:
    """A digest stored unreadable (by an older collector, or a hostile registry before
    this fix) is read again when its tag is next due, and the good read replaces it."""
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    layers, _ = _honest_image()
    with Registry(tmp_path / "honest") as honest:
        digest = push_image(honest, "ml/train", "v1", layers, via="http")
        ref = f"{honest.host}#ml/train:v1"
        cfg = _index_config(tmp_path, [ref], (honest.host,))
        key = f"{honest.host}/ml/train:v1"
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            inv.write_registry([{"ref": key, "digest": digest, "state": "ok", "source":
                                 "config", "attempts": 1}],
                               [{"digest": digest, "platform": "linux/amd64",
                                 "error": "poisoned"}], now=time.time() - 86400)
            index = RegistryIndex(cfg)
            index.run_pass()
            write_batches(inv, index.drain())
            row = next(r for r in inv.registry_images() if r["ref"] == key)
    assert row["image_error"] is None and row["record_hash"] is not None, row


# ---- 8. a FIFO at the credentials path; enroot's own credentials file


def test_a_fifo_at_the_credentials_path_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    from inventoryd.controller.images.registry import load_credentials

    fifo = tmp_path / "credentials"
    os.mkfifo(fifo, 0o600)
    got: list[object] = []

    def load() -> None:
        try:
            got.append(load_credentials(str(fifo)))
        except ValueError as e:
            got.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # blocked in open(): unblock it, then fail
        with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        t.join(5)
        pytest.fail("load_credentials blocked on a FIFO")
    assert isinstance(got[0], ValueError) and "not a regular file" in str(got[0])


ENROOT_DOC = """\
# NVIDIA GPU Cloud (both endpoints are required)
machine nvcr.io login $oauthtoken password KEY
machine authn.nvidia.com login $oauthtoken password KEY
"""


def test_enroots_documented_credentials_file_is_read(tmp_path: Path) -> None:
    """enroot's doc/cmd/import.md, copied: a comment line, then NGC's two lines; quoted
    passwords and ``default`` as curl (enroot's reader) and Python's netrc read them."""
    import netrc

    from inventoryd.controller.images.registry import load_credentials

    f = tmp_path / "credentials"
    f.write_text(ENROOT_DOC)
    f.chmod(0o600)
    creds = load_credentials(str(f))
    assert creds.get("nvcr.io") == ("$oauthtoken", "KEY")
    assert creds.get("authn.nvidia.com") == ("$oauthtoken", "KEY")
    f.write_text(ENROOT_DOC + 'machine registry.example.org login "a b" password '
                 '"p w#1\\"x" # the site\'s\n'
                 "macdef init\ncd /\n\ndefault login anon password guest\n")
    creds = load_credentials(str(f))
    py = netrc.netrc(str(f))
    assert creds.get("registry.example.org") == ("a b", 'p w#1"x')
    assert py.authenticators("registry.example.org") == ("a b", "", 'p w#1"x')
    assert creds.get("other.example.org:5000") == ("anon", "guest")  # default, as curl


# ---- 9. JSON bounded by depth and count as well as bytes


@pytest.mark.parametrize("shape", ["wide", "deep"])
def test_a_config_of_nested_lists_is_refused_before_it_is_parsed(
        tmp_path: Path, shape: str) -> None:
    """An 8 MiB config of 2.8 million empty lists (200 MB while parsed, before), or lists
    500 deep (under the parser's recursion limit): refused by count or depth, named."""
    import resource

    from inventoryd.controller.images.registry import MAX_CONFIG, RegistryLimits, read_image

    if shape == "wide":
        n = (MAX_CONFIG - 2) // 3
        config = b"[" + b"[]," * (n - 1) + b"[]]"
    else:
        config = b"[" * 500 + b"]" * 500
    layer = layer_tar([File("/etc/hostname", b"x\n")])
    with Registry(tmp_path / "reg") as reg:
        push_raw(reg, "ml/cfg", shape, [layer], [GZ], ["sha256:" + "0" * 64], config=config)
        client = Client(parse(f"{reg.host}#ml/cfg:{shape}"), deadline=time.monotonic() + 30,
                        credentials=Credentials(), insecure=(reg.host,))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(RegistryError) as e:
            read_image(client, "linux/amd64", RegistryLimits(), cached=lambda d: None)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert e.value.state == "invalid", e.value
    assert ("more than" if shape == "wide" else "deeper than") in e.value.cause, e.value
    assert grown < 60_000, f"peak RSS grew {grown} KB"


# ---- 7. layers no image holds are dropped


def test_layers_no_stored_image_holds_are_dropped(tmp_path: Path) -> None:
    """Two tags sharing a base layer; one forgotten: its own layer's summary goes, the
    shared one and the other tag's stay (before: every summary stayed for good)."""
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    base = layer_tar([File("/etc/nccl.conf", b"NCCL_PROTO=Simple\n")])
    own = [layer_tar([File(f"/etc/rc.{n}", n.encode())]) for n in ("a", "b")]
    with Registry(tmp_path / "reg") as reg:
        refs = []
        for n, top in zip("ab", own, strict=True):
            push_image(reg, "ml/train", n, [base, top], via="http")
            refs.append(f"{reg.host}#ml/train:{n}")
        cfg = _index_config(tmp_path, refs, (reg.host,))
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            index = RegistryIndex(cfg)
            index.run_pass()
            write_batches(inv, index.drain())
            digests = [image_blobs([base, top])[2] for top in own]
            held = [[b.digest for b in lbs] for lbs in digests]
            assert all(inv.registry_layer(d) for d in {*held[0], *held[1]})
            inv.forget_registry([f"{reg.host}/ml/train:a"], layer_grace_s=0.0)
            assert inv.registry_layer(held[0][1]) is None
            assert inv.registry_layer(held[0][0]) is not None  # the shared base
            assert inv.registry_layer(held[1][1]) is not None


# ---- 6. disk pressure: the worker paused, its queue bounded


def test_a_writer_that_does_not_drain_pauses_the_worker(tmp_path: Path) -> None:
    """The collector's loop stops draining the worker (disk pressure): the worker's queue
    stays within its bound and the worker waits instead of resolving everything again;
    held by the loop, it asks nothing at all (before: a batch queued and every
    reference asked again at every pass, the queue without bound)."""
    from inventoryd.controller.images.registry_index import QUEUE_MAX, RegistryIndex

    seen: list[str] = []
    with _serving({}, seen) as host:
        refs = [f"{host}#ml/t{i}:v1" for i in range(3)]
        cfg = _index_config(tmp_path, refs, (host,))
        cfg = cfg.replace(registry=cfg.registry.replace(resolve_interval_s=0.05))
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES):
            pass
        index = RegistryIndex(cfg)
        index.start()
        try:
            time.sleep(1.5)
            assert index.out.qsize() <= QUEUE_MAX
            asked = len(seen)
            assert asked <= 3 * (QUEUE_MAX + 2), asked
            index.hold("disk pressure: 10 bytes free")
            index.drain()
            time.sleep(0.3)
            asked = len(seen)
            time.sleep(1.0)
            assert len(seen) == asked and index.out.qsize() <= 1  # the one in hand
        finally:
            index.stop()


# ---- 4 and 5. starvation and eviction


def _two_passes(tmp_path: Path, honest: Registry, first: configmod.Config,
                second: configmod.Config) -> tuple[list[dict], float]:
    """Pass 1 with ``first`` (the honest tag read and written), then, a resolve interval
    later, pass 2 with ``second``: its tags and how long it took."""
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    with Inventory(tmp_path / "inv.db", config=first.inventory, values=GATE_VALUES) as inv:
        index = RegistryIndex(first)
        index.run_pass()
        write_batches(inv, index.drain())
        index = RegistryIndex(second)
        t0 = time.monotonic()
        batch = index.run_pass(now=time.time() + first.registry.resolve_interval_s + 1,
                               keep=True)
        took = time.monotonic() - t0
        write_batches(inv, index.drain())
    return batch.tags, took


def test_slow_fresh_tags_cannot_age_a_tag_in_use(tmp_path: Path) -> None:
    """Three fresh tags on a registry that accepts and never answers, and an honest tag
    in use: the honest one is resolved first, and the silent registry costs one time
    limit a pass, not one per tag (before: never-resolved first, each its time limit)."""
    from helpers.registry import HangingServer

    layers, _ = _honest_image()
    with Registry(tmp_path / "honest") as honest, \
            HangingServer("accept-and-silence") as silent:
        push_image(honest, "ml/train", "v1", layers, via="http")
        good = f"{honest.host}#ml/train:v1"
        slow = [f"{silent.host}#ml/t{i}:v1" for i in range(3)]
        first = _index_config(tmp_path, [good], (honest.host, silent.host))
        first = first.replace(registry=first.registry.replace(timeout_s=1.5))
        second = first.replace(registry=first.registry.replace(refs=(*slow, good)))
        tags, took = _two_passes(tmp_path, honest, first, second)
    assert tags[0]["ref"] == f"{honest.host}/ml/train:v1" and tags[0]["state"] == "ok"
    assert silent.connections == 1 and took < 4.0, (silent.connections, took)


def test_fresh_tags_cannot_push_a_tag_in_use_out_of_max_refs(tmp_path: Path) -> None:
    """max_refs = 2; the honest tag, used by a job 100 s ago, is in the index; jobs then
    name four fresh tags: the honest one keeps its place (before: most recent use first,
    it was dropped from the passes until too old to judge)."""
    import json

    layers, _ = _honest_image()
    seen: list[str] = []
    with Registry(tmp_path / "honest") as honest, _serving({}, seen) as other:
        push_image(honest, "ml/train", "v1", layers, via="http")
        good = f"{honest.host}#ml/train:v1"
        now = time.time()
        audit = tmp_path / "audit.jsonl"
        audit.write_text(json.dumps({"ts": now - 100, "job": 1, "image": good}) + "\n")
        cfg = _index_config(tmp_path, [], (honest.host, other))
        cfg = cfg.replace(registry=cfg.registry.replace(
            registries=(honest.host, other), max_refs=2))
        from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            index = RegistryIndex(cfg)
            index.run_pass()
            write_batches(inv, index.drain())
            with audit.open("a") as f:
                for i in range(4):
                    f.write(json.dumps({"ts": now, "job": 2 + i,
                                        "image": f"{other}#ml/new{i}:v1"}) + "\n")
            index = RegistryIndex(cfg)
            batch = index.run_pass(now=now + cfg.registry.resolve_interval_s + 1, keep=True)
    refs = [t["ref"] for t in batch.tags]
    assert f"{honest.host}/ml/train:v1" in refs, refs
    assert len(refs) == 2


# ---- proxies, as curl and enroot take them, through a real proxy on loopback


@contextmanager
def _tinyproxy(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Debian's tinyproxy on 127.0.0.1, in the foreground; (its host:port, its log)."""
    import shutil
    import socket
    import subprocess

    from helpers.parts import unavailable

    if shutil.which("tinyproxy") is None:
        unavailable("tinyproxy is not installed (apt-get install tinyproxy)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "tinyproxy.conf"
    conf.write_text(f"Port {port}\nListen 127.0.0.1\nTimeout 30\nMaxClients 20\n"
                    "Allow 127.0.0.1\nLogLevel Connect\nDisableViaHeader Yes\n")
    log = tmp_path / "tinyproxy.log"
    with log.open("wb") as out:
        p = subprocess.Popen(["tinyproxy", "-d", "-c", str(conf)], stdout=out,
                             stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"127.0.0.1:{port}", log
    finally:
        p.terminate()
        p.wait(10)


def test_a_registry_is_read_through_a_proxy_as_curl_takes_it(tmp_path: Path) -> None:
    """HTTP_PROXY of the environment, and [registry] proxy: every request goes through
    the proxy (its log has them); NO_PROXY naming the registry: none does; the proxy
    gone: `unreachable`, naming it (before: the environment was ignored, and the key
    did not exist)."""
    from inventoryd.controller.images.registry import Proxies, RegistryLimits, read_image
    from inventoryd.controller.images.registry_index import RegistryIndex

    layers, _ = _honest_image()
    with Registry(tmp_path / "reg") as reg, _tinyproxy(tmp_path) as (proxy, log):
        push_image(reg, "ml/train", "v1", layers, via="http")

        def read(proxies: Proxies) -> dict:
            client = Client(parse(f"{reg.host}#ml/train:v1"),
                            deadline=time.monotonic() + 20, credentials=Credentials(),
                            insecure=(reg.host,), proxy=proxies)
            try:
                return read_image(client, "linux/amd64", RegistryLimits(),
                                  cached=lambda d: None)
            finally:
                client.close()

        rec = read(Proxies.from_env(env={"HTTP_PROXY": f"http://{proxy}"}))
        assert rec["nccl_conf"]["present"]
        time.sleep(0.2)
        asked = log.read_text()
        assert f"GET http://{reg.host}/v2/ml/train/manifests/v1" in asked, asked[-2000:]
        assert f"GET http://{reg.host}/v2/ml/train/blobs/sha256:" in asked
        n = asked.count("GET http://")
        read(Proxies.from_env(env={"http_proxy": f"http://{proxy}",
                                   "NO_PROXY": "localhost,127.0.0.1"}))
        time.sleep(0.2)
        assert log.read_text().count("GET http://") == n
        cfg = _index_config(tmp_path, [f"{reg.host}#ml/train:v1"], (reg.host,))
        cfg = cfg.replace(registry=cfg.registry.replace(proxy=f"http://{proxy}"))
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES):
            pass
        batch = RegistryIndex(cfg).run_pass(keep=True)
        assert batch.images and "record" in batch.images[0], batch
        time.sleep(0.2)
        assert log.read_text().count("GET http://") > n
    with pytest.raises(RegistryError) as e:  # the proxy is gone
        read(Proxies.from_env(env={"HTTPS_PROXY": "", "HTTP_PROXY": f"http://{proxy}"}))
    assert e.value.state == "unreachable" and f"through the proxy {proxy}" in e.value.cause


def test_no_proxy_and_the_proxy_key_as_curl_reads_them() -> None:
    from inventoryd.controller.images.registry import Proxies
    from ncclguard.config import ConfigError, from_dict

    p = Proxies.from_env(env={"HTTPS_PROXY": "http://u:p%40w@proxy:3128",
                              "NO_PROXY": ".corp.example, registry:5000"})
    assert p.url_for("https", "nvcr.io") == ("proxy:3128", {
        "Proxy-Authorization": "Basic dTpwQHc="})
    assert p.url_for("http", "nvcr.io") is None  # HTTP_PROXY unset
    assert p.url_for("https", "reg.corp.example:443") is None
    assert p.url_for("https", "registry:5000") is None
    assert p.url_for("https", "registry:5001") is not None
    assert Proxies.from_env(env={"NO_PROXY": "*", "HTTPS_PROXY": "http://p:1"}).url_for(
        "https", "x") is None
    assert Proxies.from_env("http://p:8080", env={}).url_for("http", "x") == ("p:8080", {})
    with pytest.raises(ConfigError, match="proxy"):
        from_dict({"registry": {"proxy": "socks5://p:1080"}})


def test_a_long_gzip_file_name_is_not_read_a_byte_a_call() -> None:
    """A gzip header with a 2 MB file name: Python's gzip reads it a byte at a time;
    each byte was one read of the registry's stream (a socket timeout set, a recv: 8.5 s
    of CPU in the review). Now the stream is read 1 MiB at a time whatever gzip asks."""
    import gzip as gz

    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as t:
        t.addfile(tarfile.TarInfo("etc/x"), io.BytesIO(b""))
    out = io.BytesIO()
    with gz.GzipFile(filename="n" * (2 << 20), mode="wb", fileobj=out, mtime=0) as g:
        g.write(inner.getvalue())
    blob = out.getvalue()

    class Counted(io.BytesIO):
        calls = 0

        def read(self, n: int | None = -1) -> bytes:
            Counted.calls += 1
            return super().read(n)

    read_layer(Counted(blob), digest="sha256:" + hashlib.sha256(blob).hexdigest(),
               size=len(blob), media_type=GZ, deadline=time.monotonic() + 60,
               max_bytes=1 << 30, max_unpacked=1 << 30, max_read_bytes=1 << 30)
    assert Counted.calls < 64, Counted.calls


def test_one_user_naming_many_fresh_tags_takes_one_place_a_turn(tmp_path: Path) -> None:
    """max_refs = 3; user mallory's jobs name five fresh tags, after alice's one: alice's
    tag is among the three (before: the most recent use first, mallory's took them all)."""
    import json

    seen: list[str] = []
    with _serving({}, seen) as other:
        now = time.time()
        lines = [{"ts": now - 50, "job": 1, "user": "alice", "image": f"{other}#a/x:v1"}]
        lines += [{"ts": now - i, "job": 2 + i, "user": "mallory",
                   "image": f"{other}#m/x{i}:v1"} for i in range(5)]
        (tmp_path / "audit.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        cfg = _index_config(tmp_path, [], (other,))
        cfg = cfg.replace(registry=cfg.registry.replace(registries=(other,), max_refs=3))
        from inventoryd.controller.images.registry_index import RegistryIndex

        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES):
            pass
        batch = RegistryIndex(cfg).run_pass(keep=True)
    refs = [t["ref"] for t in batch.tags]
    assert f"{other}/a/x:v1" in refs and len(refs) == 3, refs


# ---- 9. the union of cached layers: the image's deadline and the collector's stop

#: each resolution under the crafted layer's link costs about 6 ms of CPU (2 cores)
UNION_TIMEOUT_S = 2.0
MARGIN_S = 1.5


def _crafted_layer() -> bytes:
    """A 20 KB layer whose union the fingerprint reads for seconds of CPU (issue 48's
    hostile review): ``/l``, a link to itself through a 4 KB target of ``./`` (each
    resolution under it follows it 40 times: 84,000 components), and a linker
    configuration naming 1,024 directories under it (MAX_SEARCH_DIRS)."""
    conf = "".join(f"/l/{i}\n" for i in range(1024)).encode()
    return layer_tar([Symlink("/l", "./" * 2046 + "l"),
                      File("/etc/ld.so.conf.d/l.conf", conf)], "none")


def test_a_crafted_cached_layer_holds_the_union_no_longer_than_its_deadline_or_a_stop(
        tmp_path: Path) -> None:
    """The crafted image, first in the pass, gives up its union at registry.timeout_s
    with ``time limit reached`` (stored as its content's error) and the honest image
    after it is read in the same pass; read again from its cached layer, the union is
    given up within a moment of the collector's stop (before: no deadline or stop
    flag: read to the end 8.6 s after it began, 5.6 s of CPU, past a 2 s deadline)."""
    from inventoryd.controller.images.registry import RegistryLimits, read_image
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches
    from inventoryd.controller.images.tree import ImageStopped

    layers, _ = _honest_image()
    with Registry(tmp_path / "reg") as reg:
        push_image(reg, "ml/crafted", "v1", [_crafted_layer()], via="http")
        push_image(reg, "ml/train", "v1", layers, via="http")
        refs = [f"{reg.host}#ml/crafted:v1", f"{reg.host}#ml/train:v1"]
        cfg = _index_config(tmp_path, refs, (reg.host,))
        cfg = cfg.replace(registry=cfg.registry.replace(timeout_s=UNION_TIMEOUT_S))
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            index = RegistryIndex(cfg)
            t0 = time.monotonic()
            index.run_pass()
            took = time.monotonic() - t0
            write_batches(inv, index.drain())
            rows = {r["ref"]: r for r in inv.registry_images()}
            crafted, honest = rows[f"{reg.host}/ml/crafted:v1"], rows[f"{reg.host}/ml/train:v1"]
            assert crafted["image_error"] and "time limit reached" in crafted["image_error"], \
                crafted
            assert honest["image_error"] is None and honest["record_hash"] is not None, honest
            assert took < UNION_TIMEOUT_S + 2 * MARGIN_S, took

            hits: list[str] = []

            def cached(digest: str) -> dict | None:
                s = inv.registry_layer(digest)
                if s is not None:
                    hits.append(digest)
                return s

            client = Client(parse(refs[0]), deadline=time.monotonic() + 30,
                            credentials=Credentials(), insecure=(reg.host,))
            stop = threading.Event()
            timer = threading.Timer(0.5, stop.set)
            try:
                t0 = time.monotonic()
                timer.start()
                with pytest.raises(ImageStopped, match="the collector is stopping"):
                    read_image(client, "linux/amd64", RegistryLimits(), cached=cached,
                               stop=stop.is_set)
                took = time.monotonic() - t0
            finally:
                timer.cancel()
                client.close()
    assert hits, "the crafted layer was not read from the inventory"
    assert took < 0.5 + MARGIN_S, took


def test_stopping_the_registry_worker_stops_a_union_read(tmp_path: Path) -> None:
    """The collector's SIGTERM stops the registry worker (RegistryIndex.stop): a union
    being read ends within a moment, and nothing of that image is handed to the writer
    (before: the worker read on for seconds after stop() gave up waiting on it)."""
    from inventoryd.controller.images.registry_index import RegistryIndex

    with Registry(tmp_path / "reg") as reg:
        push_image(reg, "ml/crafted", "v1", [_crafted_layer()], via="http")
        cfg = _index_config(tmp_path, [f"{reg.host}#ml/crafted:v1"], (reg.host,))
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES):
            pass
        index = RegistryIndex(cfg)
        index.start()
        assert index._thread is not None
        try:
            time.sleep(1.5)  # resolved and downloaded (0.2 s): the union is being read
            assert index._thread.is_alive()
            t0 = time.monotonic()
            index.stop(timeout=5.0)
            took = time.monotonic() - t0
            alive = index._thread.is_alive()
        finally:
            index.stop(timeout=30.0)
    assert not alive and took < MARGIN_S, took
    assert not any(b.images for b in index.drain())


def test_a_layer_being_downloaded_stops_at_the_collectors_stop() -> None:
    """A layer's stream is given up at the worker's stop, not read on to its deadline
    (registry.timeout_s, 15 minutes by default)."""
    from inventoryd.controller.images.tree import ImageStopped

    blob = _dirs([f"d{i:06d}" for i in range(8192)])  # 8 MiB: eight reads of the source
    stop = threading.Event()

    class Stopping(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            stop.set()  # SIGTERM once the first chunk is in
            return super().read(n)

    with pytest.raises(ImageStopped, match="the collector is stopping"):
        read_layer(Stopping(blob), digest="sha256:" + hashlib.sha256(blob).hexdigest(),
                   size=len(blob), media_type=TAR, deadline=time.monotonic() + 60,
                   max_bytes=1 << 30, max_unpacked=1 << 30, max_read_bytes=1 << 30,
                   stop=stop.is_set)
