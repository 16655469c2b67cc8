"""Registry images over many passes (issue 41, the parts left open by
tests/test_registry_hostile.py): a fair share per user within each registry's share, an
https registry reached only through a real proxy (a CONNECT tunnel, TLS end to end), and
a long run of a hostile registry beside an honest one, the gate's read of the honest tag
checked after every pass.

The registries are scripted servers on loopback (every answer a function of the path,
with its delay), the honest one of the long run and the TLS one the real registry
(tests/helpers/registry.py); the pass's budget and resolution limit are made small
(``MIN_PASS_S``, ``RESOLVE_TIMEOUT_S``) so that many passes fit in seconds.

Over 500 lines: the scripted registry, the TLS registry and proxy launchers and the
index configuration serve all three parts; split, each file would build them again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers.registry import OCI_MANIFEST, Blob, File, image_blobs, layer_tar

from ncclguard import config as configmod
from ncclguard.fingerprint.imageref import parse
from ncclguard.policy import GATE_VALUES
from ncclguard.policy.rules.container import registry_image
from ncclguard.store import Inventory


@dataclass
class Answer:
    """One answer of a :class:`Scripted` registry: its status, body, and how slowly."""

    status: int = 404
    body: bytes = b""
    kind: str = "application/octet-stream"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # before the head
    close: bool = False  # the connection dropped instead of an answer


class Scripted:
    """A registry on loopback in threads: ``answer(path)`` gives every answer; ``asked``
    the paths asked, in order. ``host`` is "127.0.0.1:PORT"."""

    def __init__(self, answer: Callable[[str], Answer]) -> None:
        self.answer = answer
        self.asked: list[str] = []
        self._stop = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else 40 ms an answer (the head, then the body)

            def do_GET(self) -> None:
                outer.asked.append(self.path)
                a = outer.answer(self.path)
                if a.delay and outer._stop.wait(a.delay):
                    return
                if a.close:
                    self.close_connection = True
                    return
                self.send_response(a.status)
                self.send_header("Content-Type", a.kind)
                self.send_header("Content-Length", str(len(a.body)))
                for k, v in a.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                with suppress(OSError):
                    self.wfile.write(a.body)

            def log_message(self, *a: object) -> None:
                pass

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self._srv.daemon_threads = True
        self.host = f"127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)

    def __enter__(self) -> Scripted:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._srv.shutdown()
        self._srv.server_close()


@dataclass
class Image:
    """An image's blobs, served by path."""

    manifest: Blob
    config: Blob
    layers: list[Blob]

    @classmethod
    def of(cls, text: str) -> Image:
        m, c, ls = image_blobs([layer_tar([File("/etc/nccl.conf", text.encode())])])
        return cls(m, c, ls)

    def blob(self, digest: str) -> Blob | None:
        for b in (self.config, *self.layers):
            if b.digest == digest:
                return b
        return None


def _served(image: Image, path: str, delay: float = 0.0) -> Answer:
    """``image`` as a registry serves it under any repository and tag."""
    if "/manifests/" in path:
        return Answer(200, image.manifest.data, OCI_MANIFEST, delay=delay)
    b = image.blob(path.rsplit("/", 1)[-1])
    return Answer(200, b.data, b.media_type, delay=delay) if b else Answer(404)


def _config(tmp_path: Path, hosts: tuple[str, ...], **registry: Any) -> configmod.Config:
    cfg = configmod.Config()
    reg = cfg.registry.replace(enabled=True, registries=hosts, insecure=hosts,
                               platform="linux/amd64", **registry)
    inv = cfg.inventory.replace(db=str(tmp_path / "inv.db"))
    gate = cfg.gate.replace(audit_log=str(tmp_path / "audit.jsonl"))
    return cfg.replace(registry=reg, inventory=inv, gate=gate)


def _audit(tmp_path: Path, lines: list[tuple[float, str, str]]) -> None:
    """Image jobs as the gate writes them (prolog/gate.py): ts, user, image."""
    with (tmp_path / "audit.jsonl").open("a") as f:
        for ts, user, image in lines:
            f.write(json.dumps({"ts": ts, "job": int(ts * 1000) % 10**9, "user": user,
                                "image": image, "decision": "warn"}) + "\n")


def _judged(inv: Inventory, cfg: configmod.Config, host: str, ref: str) -> bool:
    """Whether the gate judges ``ref`` now (``registry_image``, as prolog/gate.py reads
    it), not ``image-unknown``."""
    got = registry_image(inv.load_registry_values(parse(ref).key), time.time(),
                         cfg.registry, host)
    return got is not None and got[0] is not None


@pytest.fixture
def small_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's budget of 0.5 s and a resolution of at most 0.4 s (60 s each in the
    collector): the starvation of hours, in seconds."""
    from inventoryd.controller.images import registry_index

    monkeypatch.setattr(registry_index, "MIN_PASS_S", 0.5)
    monkeypatch.setattr(registry_index, "RESOLVE_TIMEOUT_S", 0.4)


# ---- 1. a fair share per user within each registry's share


def test_one_users_slow_tags_cannot_keep_another_users_tag_unresolved(
        tmp_path: Path, small_passes: None) -> None:
    """eve's jobs named six tags on a registry (resolved, read); then zoe's job names
    one, and the registry answers eve's manifests in 0.2 s (under the time limit), the
    pass's share 0.5 s. zoe's tag is resolved and judged at every pass; eve's wait their
    turns. Before: the tags last resolved well first, then by age, then the new one:
    eve's six took every pass's share and zoe's tag was never resolved (`image-unknown`
    for good)."""
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    image = Image.of("NCCL_PROTO=Simple\n")
    slow = {"eve": 0.0}

    def answer(path: str) -> Answer:
        return _served(image, path, slow["eve"] if path.startswith("/v2/eve/") else 0.0)

    with Scripted(answer) as reg:
        now = time.time()
        eve = [f"{reg.host}#eve/t{i}:v1" for i in range(6)]
        zoe = f"{reg.host}#zoe/app:v1"
        _audit(tmp_path, [(now - 100 + i, "eve", ref) for i, ref in enumerate(eve)])
        cfg = _config(tmp_path, (reg.host,), resolve_interval_s=0.5, timeout_s=5.0)
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            index = RegistryIndex(cfg)
            for p in range(4):  # eve's six resolved and read (a slow machine: passes)
                write_batches(inv, [index.run_pass(now=now + 10 * p, keep=True)])
                index.drain()
                if all(_judged(inv, cfg, reg.host, r) for r in eve):
                    break
            assert all(_judged(inv, cfg, reg.host, r) for r in eve), inv.registry_tags()
            _audit(tmp_path, [(now, "zoe", zoe)])
            slow["eve"] = 0.2
            resolved, judged = [], []
            for p in range(5, 9):
                batch = index.run_pass(now=now + 10 * p, keep=True)
                index.drain()
                write_batches(inv, [batch])
                resolved.append([t["ref"].split("/", 1)[1] for t in batch.tags])
                judged.append(_judged(inv, cfg, reg.host, zoe))
    assert all(judged), (judged, resolved)
    assert all("zoe/app:v1" in r for r in resolved), resolved
    assert len({x for r in resolved for x in r}) == 7, resolved  # eve's in turns too


def test_one_users_moved_slow_images_cannot_keep_another_users_image_unread(
        tmp_path: Path, small_passes: None) -> None:
    """eve's tag moves at every pass to a new image whose layer takes 0.7 s (past the
    pass's budget of 0.5 s, under the time limit); zoe's fresh tag on the same registry
    is read from the second pass on, and judged at every pass after. Before: the reads
    went in the order of the resolutions, eve's first at every pass, and the budget was
    spent when zoe's turn came: never read (`not read yet`)."""
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    zoes = Image.of("NCCL_PROTO=Simple\n")
    eves = {"image": Image.of("NCCL_ALGO=Ring\n")}

    def answer(path: str) -> Answer:
        if path.startswith("/v2/eve/"):
            slow = eves["image"].layers[0].digest in path
            return _served(eves["image"], path, 0.7 if slow else 0.0)
        return _served(zoes, path)

    with Scripted(answer) as reg:
        now = time.time()
        eve, zoe = f"{reg.host}#eve/big:v1", f"{reg.host}#zoe/app:v1"
        _audit(tmp_path, [(now - 50, "zoe", zoe), (now - 10, "eve", eve)])
        cfg = _config(tmp_path, (reg.host,), resolve_interval_s=0.5, timeout_s=5.0)
        judged = []
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            index = RegistryIndex(cfg)
            for p in range(1, 6):
                eves["image"] = Image.of(f"NCCL_ALGO=Ring\n# pass {p}\n")
                write_batches(inv, [index.run_pass(now=now + 10 * p, keep=True)])
                index.drain()
                judged.append(_judged(inv, cfg, reg.host, zoe))
    assert all(judged[1:]), judged


# ---- 2. an https registry reached only through a proxy (a CONNECT tunnel)


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for 127.0.0.1 it signed: (ca, cert, key), PEM."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
             signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1))
             .not_valid_after(now + datetime.timedelta(days=7))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                            critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                            critical=False)
             # Python 3.13+ verifies strictly (VERIFY_X509_STRICT): without it, "Missing
             # Authority Key Identifier", which the registry logged as "bad record MAC"
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                 signer.public_key()), critical=False))
        if ca:
            b = b.add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        else:
            import ipaddress

            b = (b.add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                critical=False))
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ncclguard test CA")])
    ca = cert("ncclguard test CA", ca_key, ca_name, ca_key, True)
    leaf = cert("127.0.0.1", key, ca_name, ca_key, False)
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _program(name: str) -> str:
    import shutil

    from helpers.parts import unavailable

    exe = shutil.which(name)
    if exe is None:
        unavailable(f"{name} is not installed (apt-get install {name})")
    return exe


def _started(p: Any, ready: Callable[[], bool], log: Path, what: str) -> None:
    for _ in range(300):
        if p.poll() is not None:
            raise AssertionError(f"{what} exited ({p.returncode}): {log.read_text()[-2000:]}")
        if ready():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not start: {log.read_text()[-2000:]}")


@contextmanager
def _tls_registry(directory: Path, storage: Path, ca: Path, cert: Path, key: Path
                  ) -> Iterator[str]:
    """Debian's docker-registry over TLS (``cert``, ``key``) on 127.0.0.1, serving the
    images of another's ``storage``; its host:port."""
    import os
    import ssl
    import subprocess
    import urllib.request

    exe = _program("docker-registry")
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    conf = directory / "config.yml"
    conf.write_text(json.dumps({  # JSON is YAML
        "version": "0.1", "log": {"level": "info", "formatter": "text"},
        "storage": {"filesystem": {"rootdirectory": str(storage)}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": "longrun",
                 "tls": {"certificate": str(cert), "key": str(key)}}}))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("REGISTRY_") and "proxy" not in k.lower()}
    log = directory / "registry.log"
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=str(ca))))

    def ready() -> bool:
        try:
            with opener.open(f"https://127.0.0.1:{port}/v2/", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    with log.open("wb") as out:
        p = subprocess.Popen([exe, "serve", str(conf)], stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, cwd=directory)
    try:
        _started(p, ready, log, "docker-registry (TLS)")
        yield f"127.0.0.1:{port}"
    finally:
        p.terminate()
        p.wait(10)


@contextmanager
def _tinyproxy(directory: Path, connect_ports: tuple[int, ...]) -> Iterator[tuple[str, Path]]:
    """Debian's tinyproxy on 127.0.0.1 in the foreground, CONNECT allowed to
    ``connect_ports`` only (tinyproxy's ``ConnectPort``); (its host:port, its log)."""
    import socket
    import subprocess

    exe = _program("tinyproxy")
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    conf = directory / "tinyproxy.conf"
    conf.write_text(f"Port {port}\nListen 127.0.0.1\nTimeout 30\nMaxClients 20\n"
                    "Allow 127.0.0.1\nLogLevel Connect\nDisableViaHeader Yes\n"
                    + "".join(f"ConnectPort {p}\n" for p in connect_ports))
    log = directory / "tinyproxy.log"

    def ready() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    with log.open("wb") as out:
        p = subprocess.Popen([exe, "-d", "-c", str(conf)], stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _started(p, ready, log, "tinyproxy")
        yield f"127.0.0.1:{port}", log
    finally:
        p.terminate()
        p.wait(10)


def test_an_https_registry_is_read_through_a_proxys_connect_tunnel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry over TLS (a certificate of a test CA, ``[registry] ca_file``) reached
    through Debian's tinyproxy (``[registry] proxy``; ``ConnectPort`` the registry's):
    the proxy's log has the CONNECT, the image is read and the gate judges the tag; as
    ``HTTPS_PROXY`` too. The proxy refusing the port, or gone: `unreachable`, naming the
    proxy. A ca_file that cannot be loaded: that tag's `unreachable`, naming it (before:
    an exception out of the pass, every reference unread)."""
    from helpers.registry import Registry, push_image

    from inventoryd.controller.images.registry import (
        Client,
        Credentials,
        Proxies,
        RegistryError,
        RegistryLimits,
        read_image,
    )
    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    for name in ("no_proxy", "https_proxy", "http_proxy"):  # the collector's own only
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    ca, cert, key = _tls_files(tmp_path)
    layers = [layer_tar([File("/etc/nccl.conf", b"NCCL_PROTO=Simple\n")])]
    with Registry(tmp_path / "plain") as plain:
        push_image(plain, "ml/train", "v1", layers, via="http")
        with _tls_registry(tmp_path / "tls", plain.storage_dir, ca, cert, key) as host:
            port = int(host.rsplit(":", 1)[1])
            ref = f"{host}#ml/train:v1"

            def read(proxies: Proxies, ca_file: str = str(ca)) -> dict:
                client = Client(parse(ref), deadline=time.monotonic() + 20,
                                credentials=Credentials(), ca_file=ca_file, proxy=proxies)
                try:
                    return read_image(client, "linux/amd64", RegistryLimits(),
                                      cached=lambda d: None)
                finally:
                    client.close()

            with _tinyproxy(tmp_path / "proxy", (port,)) as (proxy, log):
                cfg = _config(tmp_path, (), refs=(ref,), proxy=f"http://{proxy}",
                              ca_file=str(ca))
                with Inventory(tmp_path / "inv.db", config=cfg.inventory,
                               values=GATE_VALUES) as inv:
                    batch = RegistryIndex(cfg).run_pass(keep=True)
                    write_batches(inv, [batch])
                    assert batch.images and "record" in batch.images[0], batch.tags
                    assert _judged(inv, cfg, host, ref)
                time.sleep(0.2)
                tunnels = log.read_text().count(f"CONNECT {host} ")
                assert tunnels >= 3, log.read_text()[-2000:]  # manifest, config, layer
                rec = read(Proxies.from_env(env={"HTTPS_PROXY": f"http://{proxy}"}))
                assert rec["nccl_conf"]["present"]
                time.sleep(0.2)
                assert log.read_text().count(f"CONNECT {host} ") > tunnels
            with pytest.raises(RegistryError) as gone:  # the proxy stopped
                read(Proxies.from_env(env={"HTTPS_PROXY": f"http://{proxy}"}))
            with _tinyproxy(tmp_path / "strict", (443,)) as (strict, _), \
                    pytest.raises(RegistryError) as refused:
                read(Proxies.from_env(f"http://{strict}", env={}))
            with pytest.raises(RegistryError) as no_ca:
                read(Proxies(), ca_file=str(tmp_path / "missing.pem"))
            cfg = _config(tmp_path, (), refs=(ref,), ca_file=str(tmp_path / "missing.pem"))
            tags = RegistryIndex(cfg).run_pass(now=time.time() + 3600, keep=True).tags
    assert gone.value.state == "unreachable" and f"through the proxy {proxy}" in \
        gone.value.cause, gone.value.cause
    assert refused.value.state == "unreachable" and f"through the proxy {strict}" in \
        refused.value.cause and "403" in refused.value.cause, refused.value.cause
    assert no_ca.value.state == "unreachable" and "registry.ca_file" in no_ca.value.cause
    assert [(t["state"], "registry.ca_file" in t["error"]) for t in tags] == [
        ("unreachable", True)], tags


# ---- 3. a hostile registry beside an honest one, over a long run

#: what the hostile registry does with a tag, by (the tag's number + the pass) in turn
BEHAVIOURS = ("slow", "timeout", "poison", "moved", "401", "garbage", "drop", "500")


def _hostile(state: dict[str, Any], honest: tuple[Blob, Blob, list[Blob]], host: str
             ) -> Callable[[str], Answer]:
    """The hostile registry's answers: tag ``hN`` of any repository behaves as
    BEHAVIOURS[(N + pass) % 8]; ``state["pass"]`` is the pass, ``state["seen"]`` what
    each behaviour served."""
    manifest, cfg_blob, lbs = honest
    garbage = bytes((i * 7 + 3) % 251 for i in range(4096))

    def moved(p: int) -> Image:  # a new image at every pass (a tag pushed again)
        return Image.of(f"NCCL_ALGO=Ring\n# pass {p}\n")

    def behaviour(path: str) -> str:
        tag = path.rsplit("/", 1)[-1]
        return BEHAVIOURS[(int(tag[1:]) + state["pass"]) % len(BEHAVIOURS)] \
            if tag[:1] == "h" and tag[1:].isdigit() else state["blobs"].get(tag, "")

    def answer(path: str) -> Answer:
        what = behaviour(path)
        state["seen"][what] = state["seen"].get(what, 0) + 1
        blob = "/blobs/" in path
        if what == "slow":  # under the resolution's limit: costs the registry's share
            return Answer(200, manifest.data, OCI_MANIFEST, delay=0.15) if not blob \
                else Answer(404)
        if what == "timeout":  # past it
            return Answer(200, manifest.data, OCI_MANIFEST, delay=1.0)
        if what in ("poison", "garbage"):  # the honest digest's bytes, a garbage layer
            m = manifest if what == "poison" else Image.of("NCCL_P2P_LEVEL=NVL\n").manifest
            if not blob:
                for b in (cfg_blob, *lbs):
                    state["blobs"][b.digest] = what
                state["blobs"].update({d: what for d in _digests(m)})
                return Answer(200, m.data, OCI_MANIFEST)
            digest = path.rsplit("/", 1)[-1]
            if digest == cfg_blob.digest:
                return Answer(200, cfg_blob.data, cfg_blob.media_type)
            return Answer(200, garbage + digest.encode())
        if what == "moved":  # a new image at every pass, its layer past the time limit
            image = moved(state["pass"])
            if not blob:
                state["blobs"].update({b.digest: what for b in (image.config, *image.layers)})
                return Answer(200, image.manifest.data, OCI_MANIFEST)
            return _served(image, path, 0.8 if image.layers[0].digest in path else 0.0)
        if what == "401":  # a storm: a realm here that never gives a token
            return Answer(401, headers={"WWW-Authenticate":
                                        f'Bearer realm="http://{host}/token",service="x"'})
        if what == "drop":
            return Answer(close=True)
        if path.startswith("/token"):
            return Answer(401)
        return Answer(500)

    return answer


def _digests(manifest: Blob) -> list[str]:
    doc = json.loads(manifest.data)
    return [doc["config"]["digest"], *(x["digest"] for x in doc["layers"])]


@pytest.mark.slow
def test_a_hostile_registry_beside_an_honest_one_keeps_the_honest_tags_judged_for_long(
        tmp_path: Path, small_passes: None) -> None:
    """34 passes of a collector reading the real registry (zoe's tag, a ``refs`` tag, and
    four tags of eve's that do not exist) and a hostile one (eve's twelve tags and one
    fresh tag a pass, each in turn slow, past the time limit, the honest digest's
    manifest with a garbage layer, a garbage layer, moved to a new image read past the
    time limit, a 401 storm, a dropped connection, a 500), with a pass's
    budget of 0.5 s, a resolution of 0.4 s and an image of 0.6 s at most, and
    ``max_age_s`` = 6 s: after every pass the gate's read of both honest tags
    (``registry_image`` on ``load_registry_values``) is judged from the first pass that
    read them on, never ``image-unknown``; the honest digest is never stored unreadable."""
    from helpers.registry import Registry, push_image

    from inventoryd.controller.images.registry_index import RegistryIndex, write_batches

    layers = [layer_tar([File("/etc/nccl.conf", b"NCCL_PROTO=Simple\n")])]
    honest_blobs = image_blobs(layers)
    state: dict[str, Any] = {"pass": 0, "seen": {}, "blobs": {}}
    with Registry(tmp_path / "honest") as honest:
        digest = push_image(honest, "ml/train", "v1", layers, via="http")
        push_image(honest, "ml/base", "v1", layers, via="http")
        assert digest == honest_blobs[0].digest
        with Scripted(lambda p: _hostile(state, honest_blobs, hostile.host)(p)) as hostile:
            zoe, base = f"{honest.host}#ml/train:v1", f"{honest.host}#ml/base:v1"
            now = time.time()
            _audit(tmp_path, [(now, "zoe", zoe)])
            _audit(tmp_path, [(now + i, "eve", f"{hostile.host}#e{i % 3}/x:h{i}")
                              for i in range(12)])
            # and four on the honest registry that do not exist: her turns there too
            _audit(tmp_path, [(now + i, "eve", f"{honest.host}#eve/x:missing{i}")
                              for i in range(4)])
            cfg = _config(tmp_path, (honest.host, hostile.host), refs=(base,),
                          resolve_interval_s=0.3, timeout_s=0.6, max_age_s=6.0)
            judged: list[tuple[bool, bool]] = []
            states: dict[str, int] = {}
            t0 = time.monotonic()
            with Inventory(tmp_path / "inv.db", config=cfg.inventory,
                           values=GATE_VALUES) as inv:
                index = RegistryIndex(cfg)
                for p in range(34):
                    state["pass"] = p
                    _audit(tmp_path, [(now + 100 + p, "eve",
                                       f"{hostile.host}#fresh/x:h{100 + p}")])
                    batch = index.run_pass(now=now + 10 * p, keep=True)
                    index.drain()
                    write_batches(inv, [batch])
                    for t in batch.tags:
                        if t["ref"].startswith(hostile.host) or "/eve/" in t["ref"]:
                            err = str(t.get("error") or "")
                            s = t["state"] if t["state"] != "ok" or not err else \
                                "read: " + err.split("(", 1)[-1].split(")", 1)[0]
                            states[s] = states.get(s, 0) + 1
                    judged.append((_judged(inv, cfg, honest.host, zoe),
                                   _judged(inv, cfg, honest.host, base)))
                    first = judged.index((True, True)) if (True, True) in judged else None
                    assert (first is not None and first <= 2) or p < 2, judged
                    assert first is None or all(j == (True, True) for j in judged[first:]), (
                        p, judged, inv.registry_tags().get(parse(zoe).key))
                took = time.monotonic() - t0
                rows = [r for r in inv.registry_images() if r["digest"] == digest]
    assert rows and all(r["image_error"] is None and r["record_hash"] for r in rows), rows
    assert set(BEHAVIOURS) <= set(state["seen"]), state["seen"]
    assert {"timeout", "refused", "unreachable", "not-found", "ok", "read: invalid",
            "read: timeout"} <= set(states), states
    assert took < 60, took
