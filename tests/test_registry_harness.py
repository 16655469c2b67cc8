"""The registry harness itself (tests/helpers/registry.py), against the real registry
(Debian's docker-registry, pushed to by skopeo), with the stdlib's urllib as the client:
what it pushes is what a client is served, each kind of auth answers as a registry does,
and the hanging server hangs. Without docker-registry or skopeo these are skips that say
why, failures under NCCLGUARD_REQUIRE_PARTS=1 (helpers.parts.unavailable)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import subprocess
import tarfile
import time
import urllib.parse
from email.message import Message
from pathlib import Path

import pytest
import zstandard
from helpers.registry import (
    LAYER_GZIP,
    LAYER_TAR,
    LAYER_ZSTD,
    MANIFEST_ACCEPT,
    OCI_INDEX,
    Dir,
    Entry,
    File,
    HangingServer,
    Hardlink,
    Layer,
    Opaque,
    Registry,
    RegistryError,
    Symlink,
    Whiteout,
    basic_header,
    http,
    layer_tar,
    parse_challenge,
    push_image,
    push_index,
    push_raw,
    sha256_digest,
)


def _manifest(reg: Registry, repo: str, ref: str, auth: str | None = None,
              accept: str = MANIFEST_ACCEPT) -> tuple[int, Message, bytes]:
    headers = {"Accept": accept}
    if auth is not None:
        headers["Authorization"] = auth
    r = http("GET", f"{reg.url}/v2/{repo}/manifests/{ref}", headers=headers)
    return r.status, r.headers, r.body  # the headers: case-insensitive


def _small_layer(text: bytes = b"hello\n") -> Layer:
    return layer_tar([Dir("usr/lib"), File("usr/lib/libnccl.so.2", text, 0o755)])


def test_layer_tar_writes_each_kind_of_entry(tmp_path: Path) -> None:
    src = tmp_path / "libnccl.so.2"
    src.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    entries: list[Entry] = [Dir("usr/lib", 0o700), File("usr/lib/libnccl.so.2", src, 0o755),
               Symlink("usr/lib/libnccl.so", "libnccl.so.2"),
               Hardlink("usr/lib/copy.so", "usr/lib/libnccl.so.2"),
               Whiteout("etc/nccl.conf"), Opaque("opt/plugins")]  # fmt: skip
    blobs = {c: layer_tar(entries, c) for c in ("gzip", "zstd", "none")}
    tars = {"gzip": gzip.decompress(blobs["gzip"]), "none": bytes(blobs["none"]),
            "zstd": zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blobs["zstd"])
                                                               ).read()}  # fmt: skip
    assert len({sha256_digest(t) for t in tars.values()}) == 1  # one tar, three ways
    for c, blob in blobs.items():
        assert blob.diff_id == sha256_digest(tars[c])
    assert [blobs[c].media_type for c in ("gzip", "zstd", "none")] == [LAYER_GZIP, LAYER_ZSTD,
                                                                       LAYER_TAR]
    with tarfile.open(fileobj=io.BytesIO(tars["none"])) as tar:
        m = {i.name: i for i in tar.getmembers()}
        assert list(m) == ["usr/lib", "usr/lib/libnccl.so.2", "usr/lib/libnccl.so",
                           "usr/lib/copy.so", "etc/.wh.nccl.conf", "opt/plugins/.wh..wh..opq"]
        assert m["usr/lib"].isdir() and m["usr/lib"].mode == 0o700
        f = tar.extractfile("usr/lib/libnccl.so.2")
        assert f is not None and f.read() == src.read_bytes()
        assert m["usr/lib/libnccl.so.2"].mode == 0o755
        link = m["usr/lib/libnccl.so"]
        assert link.issym() and link.linkname == "libnccl.so.2"
        assert m["usr/lib/copy.so"].islnk()
        assert m["etc/.wh.nccl.conf"].isfile() and m["etc/.wh.nccl.conf"].size == 0


def test_anonymous_pull_by_tag_gives_the_pushed_digest(tmp_path: Path) -> None:
    layer = _small_layer()
    with Registry(tmp_path / "registry") as reg:
        digest = push_image(reg, "nccl/app", "v1", [layer], env=["NCCL_DEBUG=WARN"])
        status, headers, body = _manifest(reg, "nccl/app", "v1")
        assert status == 200
        assert headers["Docker-Content-Digest"] == digest == sha256_digest(body)
        manifest = json.loads(body)
        assert [d["digest"] for d in manifest["layers"]] == [layer.digest]
        config = http("GET", f"{reg.url}/v2/nccl/app/blobs/{manifest['config']['digest']}")
        assert config.json()["rootfs"]["diff_ids"] == [layer.diff_id]
        assert config.json()["config"]["Env"] == ["NCCL_DEBUG=WARN"]
        assert http("GET", f"{reg.url}/v2/nccl/app/blobs/{layer.digest}").body == layer
        # the tag moved: pushed again, another image
        moved = push_image(reg, "nccl/app", "v1", [_small_layer(b"other\n")])
        assert moved != digest
        assert _manifest(reg, "nccl/app", "v1")[1]["Docker-Content-Digest"] == moved
        assert _manifest(reg, "nccl/app", digest)[0] == 200  # the old one by digest still


def test_basic_auth_refuses_without_credentials_and_serves_with_them(tmp_path: Path) -> None:
    with Registry(tmp_path / "registry", auth="basic", users={"alice": "secret"}) as reg:
        digest = push_image(reg, "app", "v1", [_small_layer()])  # the harness's own user
        status, headers, _ = _manifest(reg, "app", "v1")
        assert status == 401
        assert parse_challenge(headers["WWW-Authenticate"])[0] == "basic"
        assert _manifest(reg, "app", "v1", basic_header("alice", "wrong"))[0] == 401
        status, headers, _ = _manifest(reg, "app", "v1", basic_header("alice", "secret"))
        assert status == 200 and headers["Docker-Content-Digest"] == digest


def _token(realm: str, service: str, scope: str, auth: str | None = None) -> tuple[int, dict]:
    q = urllib.parse.urlencode({"service": service, "scope": scope})
    r = http("GET", f"{realm}?{q}", headers={"Authorization": auth} if auth else {})
    return r.status, (r.json() if r.status == 200 else {})


def test_token_auth_runs_the_docker_token_flow(tmp_path: Path) -> None:
    with Registry(tmp_path / "registry", auth="token", users={"alice": "secret"}) as reg:
        digest = push_image(reg, "team/app", "v1", [_small_layer()])
        assert reg.token_requests == []  # the harness's own are not recorded
        status, headers, _ = _manifest(reg, "team/app", "v1")
        assert status == 401
        scheme, params = parse_challenge(headers["WWW-Authenticate"])
        assert scheme == "bearer"
        assert reg.token_service is not None
        assert params == {"realm": reg.token_service.url, "service": reg.service,
                          "scope": "repository:team/app:pull"}  # fmt: skip
        status, body = _token(params["realm"], params["service"], params["scope"],
                              basic_header("alice", "secret"))  # fmt: skip
        assert status == 200 and body["token"] == body["access_token"]
        assert body["expires_in"] == 300
        status, headers, _ = _manifest(reg, "team/app", "v1", "Bearer " + body["token"])
        assert status == 200 and headers["Docker-Content-Digest"] == digest
        # a wrong password: no token; anonymous (no anonymous pull): a token for nothing
        assert _token(params["realm"], reg.service, params["scope"],
                      basic_header("alice", "nope"))[0] == 401  # fmt: skip
        status, anon = _token(params["realm"], reg.service, params["scope"])
        assert status == 200
        assert _manifest(reg, "team/app", "v1", "Bearer " + anon["token"])[0] == 401
        seen = [(r.user, r.scopes, r.status, r.granted) for r in reg.token_requests]
        assert seen == [
            ("alice", ["repository:team/app:pull"], 200,
             [{"type": "repository", "name": "team/app", "actions": ["pull"]}]),
            (None, ["repository:team/app:pull"], 401, []),
            (None, ["repository:team/app:pull"], 200, []),
        ]  # fmt: skip


def test_token_auth_anonymous_pull_only_pulls(tmp_path: Path) -> None:
    with Registry(tmp_path / "registry", auth="token", anonymous_pull=True) as reg:
        push_image(reg, "app", "v1", [_small_layer()])
        assert reg.token_service is not None
        status, body = _token(reg.token_service.url, reg.service, "repository:app:pull,push")
        assert status == 200
        assert _manifest(reg, "app", "v1", "Bearer " + body["token"])[0] == 200
        assert reg.token_requests[-1].granted == [{"type": "repository", "name": "app",
                                                   "actions": ["pull"]}]
        r = http("POST", f"{reg.url}/v2/app/blobs/uploads/", b"",
                 {"Authorization": "Bearer " + body["token"]})
        assert r.status == 401  # no push


def test_multi_arch_index_lists_both_platforms(tmp_path: Path) -> None:
    amd, arm = _small_layer(b"amd64\n"), _small_layer(b"arm64\n")
    with Registry(tmp_path / "registry") as reg:
        index_digest, per = push_index(reg, "multi", "latest",
                                       {("linux", "amd64"): [amd], ("linux", "arm64"): [arm]})
        status, headers, body = _manifest(reg, "multi", "latest")
        assert status == 200 and headers["Content-Type"] == OCI_INDEX
        assert headers["Docker-Content-Digest"] == index_digest
        listed = {(m["platform"]["os"], m["platform"]["architecture"]): m["digest"]
                  for m in json.loads(body)["manifests"]}  # fmt: skip
        assert listed == per and len(listed) == 2
        for platform, layer in ((("linux", "amd64"), amd), (("linux", "arm64"), arm)):
            status, _, child = _manifest(reg, "multi", per[platform])
            assert status == 200
            assert json.loads(child)["layers"][0]["digest"] == layer.digest


def test_zstd_and_uncompressed_layers_are_pushed_as_they_are(tmp_path: Path) -> None:
    layers = [layer_tar([File("a", b"A" * 4096)], "zstd"), layer_tar([File("b", b"B")], "none")]
    with Registry(tmp_path / "registry") as reg:
        push_image(reg, "zstd", "v1", layers)  # by skopeo --preserve-digests
        manifest = json.loads(_manifest(reg, "zstd", "v1")[2])
        assert [d["mediaType"] for d in manifest["layers"]] == [
            "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.oci.image.layer.v1.tar"]
        assert [d["digest"] for d in manifest["layers"]] == [b.digest for b in layers]
        for b in layers:
            assert http("GET", f"{reg.url}/v2/zstd/blobs/{b.digest}").body == b


def test_push_raw_pushes_hostile_bytes_the_registry_checks_digests(tmp_path: Path) -> None:
    corrupt = b"\x1f\x8b\x08\x00" + b"not deflate at all"
    with Registry(tmp_path / "registry", auth="token", users={"alice": "secret"}) as reg:
        digest = push_raw(reg, "bad", "v1", [corrupt], [LAYER_GZIP], ["sha256:" + "0" * 64])
        r = reg.request("GET", f"/v2/bad/manifests/{digest}",
                        headers={"Accept": MANIFEST_ACCEPT})  # fmt: skip
        assert r.status == 200 and r.json()["layers"][0]["digest"] == sha256_digest(corrupt)
        assert reg.request("GET", f"/v2/bad/blobs/{sha256_digest(corrupt)}").body == corrupt
        # bytes that are not what their digest says: the registry refuses them
        r = reg.request("POST", "/v2/bad/blobs/uploads/", b"")
        loc = r.headers["Location"]
        bogus = "sha256:" + hashlib.sha256(b"something else").hexdigest()
        r = reg.request("PUT", f"{loc}{'&' if '?' in loc else '?'}digest={bogus}", b"abc")
        assert r.status == 400 and b"DIGEST_INVALID" in r.body


def test_the_registry_is_gone_after_the_block(tmp_path: Path) -> None:
    with Registry(tmp_path / "registry") as reg:
        proc = reg._proc
        assert proc is not None and proc.poll() is None
        port = reg.port
    assert proc.returncode is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert "listening on 127.0.0.1:" in reg.log_path.read_text()


def test_a_registry_that_does_not_start_is_named_with_its_log(tmp_path: Path) -> None:
    class Broken(Registry):
        def _write_config(self) -> None:
            self.config_path.write_text("version: 0.1\nstorage: {nosuchdriver: {}}\n")

    with pytest.raises(RegistryError, match=r"(?s)exited.*nosuchdriver"):
        Broken(tmp_path / "registry").start()


def test_hanging_server_silence_times_a_client_out() -> None:
    with HangingServer("accept-and-silence") as hs:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            http("GET", f"{hs.url}/v2/", timeout=0.3)
        assert 0.25 < time.monotonic() - start < 5
        assert hs.connections == 1 and hs.requests[0].startswith(b"GET /v2/ HTTP/1.1")


def test_hanging_server_slow_body_trickles() -> None:
    with (HangingServer("slow-body", interval=0.2, content_length=100) as hs,
          socket.create_connection(("127.0.0.1", hs.port), timeout=2) as s):
        s.sendall(b"GET /v2/x/blobs/sha256:0 HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(4096)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 100" in head
        start = time.monotonic()
        while len(body) < 3:
            body += s.recv(4096)  # each read answered within the per-read timeout
        assert body == b"xxx" and time.monotonic() - start < 2


def test_skopeo_leaves_nothing_outside_the_directory(tmp_path: Path) -> None:
    # skopeo as root keeps a blob-info cache in /var/lib/containers/cache unless told not to
    before = Path("/var/lib/containers/cache").exists()
    with Registry(tmp_path / "registry") as reg:
        push_image(reg, "app", "v1", [_small_layer()])
        assert not (reg.directory / "pushes").exists() or not any(
            (reg.directory / "pushes").iterdir())  # the layouts pushed are removed
    assert Path("/var/lib/containers/cache").exists() == before
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1
