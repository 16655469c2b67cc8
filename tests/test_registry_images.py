"""Registry images read through a real registry (Debian's docker-registry on loopback,
images built here with real libnccl files and pushed with skopeo; tests/helpers/registry.py):
resolved as enroot resolves them, read layer by layer with whiteouts, cached by layer
digest, stored by the inventory's writer and judged by the gate's policy.

Over 500 lines: one registry fixture and one set of image builders serve every case, the
hostile ones found by the review included; split, each part would build them again."""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
import tarfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.registry import (
    File,
    HangingServer,
    Opaque,
    Registry,
    Symlink,
    Whiteout,
    layer_tar,
    push_image,
    push_index,
    push_raw,
)

from inventoryd.controller.images.registry import (
    Client,
    Credentials,
    RegistryError,
    RegistryLimits,
    load_credentials,
    read_image,
    resolve,
)
from inventoryd.controller.images.registry_index import RegistryIndex, write_batches
from inventoryd.controller.images.tree import ImageError
from ncclguard import config as configmod
from ncclguard.fingerprint.image import image_values
from ncclguard.fingerprint.imageref import parse
from ncclguard.policy import GATE_VALUES
from ncclguard.policy.rules.container import registry_image
from ncclguard.store import Inventory

LIB = "/usr/lib/x86_64-linux-gnu"
PIP = "/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry") as reg:
        yield reg


@functools.lru_cache(maxsize=8)
def _linker_layer(lib: Path, version: str, compression: str = "gzip") -> bytes:
    """A layer like a CUDA base image's (built once a session: a libnccl is 200-300 MB)."""
    return layer_tar([
        File(f"{LIB}/libnccl.so.{version}", lib),
        Symlink(f"{LIB}/libnccl.so.2", f"libnccl.so.{version}"),
        File("/etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n"),
        File("/etc/environment", b"NCCL_DEBUG=WARN\n"),
    ], compression, level=1)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=8)
def _pip_layer(lib: Path, compression: str = "zstd") -> bytes:
    # PyTorch beside pip's libnccl loads it (a stray pip copy is not the default: issue 48)
    torch = File(PIP.replace("/nvidia/nccl/lib", "/torch/__init__.py"), b"")
    return layer_tar([File(f"{PIP}/libnccl.so.2", lib), torch],  # type: ignore[arg-type]
                     compression, level=1)


def _client(reg_host: str, repo: str, tag: str, *, creds: Credentials | None = None,
            timeout: float = 120.0, insecure: bool = True, also: tuple[str, ...] = ()
            ) -> Client:
    return Client(parse(f"{reg_host}#{repo}:{tag}"), deadline=time.monotonic() + timeout,
                  credentials=creds or Credentials(),
                  insecure=(reg_host, *also) if insecure else ())


def _read(client: Client, platform: str = "linux/amd64", cache: dict | None = None
          ) -> dict:
    cache = {} if cache is None else cache
    return read_image(client, platform, RegistryLimits(), cached=cache.get,
                      store=lambda s: cache.__setitem__(s["digest"], s))


def _default(record: dict) -> dict:
    return next(r for r in record["libnccl"] if r["default"])


def test_a_real_image_is_read_layer_by_layer(registry: Registry, nccl_lib) -> None:
    """A base layer (gzip) with the linker's 2.18.3, a second (zstd) with pip's 2.21.5: the
    job loads pip's (read from the file's banner), and the config's Env replaces the
    image's /etc/environment, as enroot writes it."""
    old, new = nccl_lib("2.18.3"), nccl_lib("2.21.5")
    digest = push_image(registry, "ml/train", "v1",
                        [_linker_layer(old, "2.18.3"), _pip_layer(new)],
                        env=["PATH=/usr/bin", "NCCL_SOCKET_IFNAME=ib0"])
    client = _client(registry.host, "ml/train", "v1")
    rec = _read(client)
    assert rec["image"]["digest"] == digest
    assert [x["media_type"].rsplit("+", 1)[-1] for x in rec["image"]["layers"]] == [
        "gzip", "zstd"]
    versions = {r["path"]: r["version"] for r in rec["libnccl"]}
    assert versions == {f"{LIB}/libnccl.so.2": "2.18.3", f"{LIB}/libnccl.so.2.18.3": "2.18.3",
                        f"{PIP}/libnccl.so.2": "2.21.5"}
    assert _default(rec)["path"] == f"{PIP}/libnccl.so.2"
    assert rec["env"] == {"NCCL_SOCKET_IFNAME": "ib0"}  # not the layer's NCCL_DEBUG
    values = image_values(rec)
    assert values["nccl_version"] == "2.21.5" and values["net_abis"]


def test_a_whiteout_removes_the_lower_layers_libnccl(registry: Registry, nccl_lib) -> None:
    """pip's 2.21.5 whited out by a third layer: the job loads the linker's 2.18.3; an
    opaque directory hides the linker's copy in turn."""
    old, new = nccl_lib("2.18.3"), nccl_lib("2.21.5")
    base = [_linker_layer(old, "2.18.3"), _pip_layer(new)]
    push_image(registry, "ml/train", "wh", [*base, layer_tar([Whiteout(f"{PIP}/libnccl.so.2")])])
    rec = _read(_client(registry.host, "ml/train", "wh"))
    assert [r["path"] for r in rec["libnccl"]] == [f"{LIB}/libnccl.so.2",
                                                   f"{LIB}/libnccl.so.2.18.3"]
    assert _default(rec)["version"] == "2.18.3"
    push_image(registry, "ml/train", "opq", [*base, layer_tar([Opaque(LIB)])])
    rec = _read(_client(registry.host, "ml/train", "opq"))
    assert [r["path"] for r in rec["libnccl"]] == [f"{PIP}/libnccl.so.2"]


def test_an_index_gives_the_nodes_platform(registry: Registry, nccl_lib) -> None:
    """A multi-arch index: linux/amd64 and linux/arm64 hold different NCCL releases; the
    configured platform picks its own, and one the index lacks is a named not-found."""
    index, per = push_index(registry, "ml/multi", "v1", {
        ("linux", "amd64"): [_pip_layer(nccl_lib("2.21.5"))],
        ("linux", "arm64"): [_pip_layer(nccl_lib("2.18.3"))],
    }, via="http")  # skopeo 1.22 (forky) will not copy an index with --preserve-digests
    amd = _read(_client(registry.host, "ml/multi", "v1"), "linux/amd64")
    arm = _read(_client(registry.host, "ml/multi", "v1"), "linux/arm64")
    assert amd["image"]["index_digest"] == arm["image"]["index_digest"] == index
    assert amd["image"]["digest"] == per[("linux", "amd64")]
    assert arm["image"]["digest"] == per[("linux", "arm64")]
    assert (_default(amd)["version"], _default(arm)["version"]) == ("2.21.5", "2.18.3")
    with pytest.raises(RegistryError) as e:
        resolve(_client(registry.host, "ml/multi", "v1"), "linux/ppc64le")
    assert e.value.state == "not-found" and "linux/amd64" in e.value.cause


def test_a_moved_tag_is_judged_by_its_new_digest_and_shared_layers_are_not_read_again(
        tmp_path: Path, registry: Registry, nccl_lib) -> None:
    """The collector's worker and writer on a real inventory: v1 read; the tag moved to
    an image with another NCCL that shares v1's base layer: the index has the new digest
    with moved_at, only the new layer was downloaded, and the gate's read of the tag
    gives the new release."""
    base = _linker_layer(nccl_lib("2.18.3"), "2.18.3")
    first = push_image(registry, "ml/train", "v1", [base, _pip_layer(nccl_lib("2.21.5"))])
    cfg = _config(tmp_path, registry, refs=[f"{registry.host}#ml/train:v1"])
    index = RegistryIndex(cfg)
    with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
        index.run_pass()
        write_batches(inv, index.drain())
        row = inv.load_registry_values(f"{registry.host}/ml/train:v1")
        assert row is not None and row["digest"] == first
        values, why = registry_image(row, time.time(), cfg.registry, registry.host) or (None, "")
        assert why is None and values is not None and values["nccl_version"] == "2.21.5"
        moved_first = row["moved_at"]

        second = push_image(registry, "ml/train", "v1", [base, _pip_layer(nccl_lib("2.23.4"))])
        batch = index.run_pass(now=time.time() + cfg.registry.resolve_interval_s + 1, keep=True)
        write_batches(inv, index.drain())
        (img,) = batch.images
        assert [x["cached"] for x in img["record"]["image"]["layers"]] == [True, False]
        assert [s["digest"] for s in batch.layers] == [
            img["record"]["image"]["layers"][1]["digest"]]
        row = inv.load_registry_values(f"{registry.host}/ml/train:v1")
        assert row is not None and row["digest"] == second != first
        assert row["moved_at"] > moved_first
        values, why = registry_image(row, time.time(), cfg.registry, registry.host) or (None, "")
        assert why is None and values is not None and values["nccl_version"] == "2.23.4"
        # resolved too long ago: unknown, and the reason says so
        later = time.time() + cfg.registry.max_age_s + 60
        assert "more than [registry] max_age_s" in str(
            registry_image(row, later, cfg.registry, registry.host))


def _config(tmp_path: Path, registry: Registry, **kw: object) -> configmod.Config:
    cfg = configmod.Config()
    reg = cfg.registry.replace(enabled=True, insecure=(registry.host,),
                               platform="linux/amd64", **kw)
    inv = cfg.inventory.replace(db=str(tmp_path / "inv.db"))
    gate = cfg.gate.replace(audit_log=str(tmp_path / "audit.jsonl"))
    return cfg.replace(registry=reg, inventory=inv, gate=gate)


def test_basic_auth_with_enroots_credentials_file(tmp_path: Path, nccl_lib) -> None:
    """HTTP basic: refused by name without an entry for the registry; read with enroot's
    netrc line; a $NAME password comes from the environment, a command is never run."""
    with Registry(tmp_path / "reg", auth="basic", users={"alice": "s3cret"}) as reg:
        push_image(reg, "ml/train", "v1", [_pip_layer(nccl_lib("2.21.5"))], creds=reg.admin)
        with pytest.raises(RegistryError) as e:
            resolve(_client(reg.host, "ml/train", "v1"), "linux/amd64")
        assert e.value.state == "refused" and "no entry" in e.value.cause
        creds_file = tmp_path / "credentials"
        creds_file.write_text("machine 127.0.0.1 login alice password $REG_PW\n")
        creds_file.chmod(0o600)
        creds = load_credentials(str(creds_file), env={"REG_PW": "s3cret"})
        rec = _read(_client(reg.host, "ml/train", "v1", creds=creds))
        assert _default(rec)["version"] == "2.21.5"
        bad = load_credentials(str(creds_file), env={"REG_PW": "wrong"})
        with pytest.raises(RegistryError) as e:
            resolve(_client(reg.host, "ml/train", "v1", creds=bad), "linux/amd64")
        assert e.value.state == "refused" and "refused the credentials" in e.value.cause
        creds_file.write_text("machine 127.0.0.1 login alice password $(id)\n")
        with pytest.raises(ValueError, match="is a command, which is not run"):
            load_credentials(str(creds_file))
        creds_file.chmod(0o622)
        with pytest.raises(ValueError, match="writable by no one else"):
            load_credentials(str(creds_file))


def test_the_token_flow_of_the_distribution_spec(tmp_path: Path, nccl_lib) -> None:
    """Bearer: the registry's challenge is answered at its realm, with the realm host's
    credentials, for the challenge's service and scope; the token is then used."""
    with Registry(tmp_path / "reg", auth="token", users={"bob": "pw"}) as reg:
        push_image(reg, "ml/train", "v1", [_pip_layer(nccl_lib("2.21.5"))], creds=reg.admin)
        assert reg.token_service is not None
        realm = urllib.parse.urlsplit(reg.token_service.url).netloc  # another port
        with pytest.raises(RegistryError) as e:  # plain HTTP only where configured
            resolve(_client(reg.host, "ml/train", "v1"), "linux/amd64")
        assert e.value.state == "invalid" and "not in registry.insecure" in e.value.cause
        with pytest.raises(RegistryError) as e:
            resolve(_client(reg.host, "ml/train", "v1", also=(realm,)), "linux/amd64")
        assert e.value.state == "refused", e.value
        creds = Credentials({"127.0.0.1": ("bob", "pw")})
        rec = _read(_client(reg.host, "ml/train", "v1", creds=creds, also=(realm,)))
        assert _default(rec)["version"] == "2.21.5"
        granted = [r for r in reg.token_requests if r.user == "bob"]
        assert granted and all(r.service == reg.service for r in granted)
        assert any("repository:ml/train:pull" in r.scopes for r in granted)


@pytest.mark.parametrize("mode", ["accept-and-silence", "slow-body"])
def test_a_registry_that_hangs_is_a_named_time_out(mode: str) -> None:
    with HangingServer(mode, interval=1.0) as srv:  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(RegistryError) as e:
            resolve(_client(srv.host, "ml/train", "v1", timeout=3.0), "linux/amd64")
        took = time.monotonic() - t0
    assert e.value.state == "timeout", e.value
    assert took < 6.0


def test_plain_http_only_where_configured(registry: Registry) -> None:
    with pytest.raises(RegistryError) as e:
        resolve(_client(registry.host, "ml/train", "v1", insecure=False, timeout=10),
                "linux/amd64")
    assert e.value.state == "unreachable"  # TLS to a plain-HTTP registry


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.PAX_FORMAT
         ) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _push_hostile(registry: Registry, tag: str, blob: bytes, media: str) -> Client:
    import hashlib

    push_raw(registry, "ml/bad", tag, [blob], [media],
             ["sha256:" + hashlib.sha256(blob).hexdigest()])
    return _client(registry.host, "ml/bad", tag, timeout=60)


GZ = "application/vnd.oci.image.layer.v1.tar+gzip"
TAR = "application/vnd.oci.image.layer.v1.tar"


def test_hostile_layers_are_named_and_bounded(registry: Registry) -> None:
    """A corrupt gzip, a tar bomb, a member longer than the layer, a pax header that
    claims a gigabyte, a link that climbs out: each a clear error or read inside the
    image, none unpacked to disk or into memory."""
    corrupt = gzip.compress(_tar([(tarfile.TarInfo("etc/x"), None)]))
    corrupt = corrupt[:20] + bytes(b ^ 0xFF for b in corrupt[20:40]) + corrupt[40:]
    with pytest.raises(ImageError, match=r"cannot be decompressed \(application"):
        _read(_push_hostile(registry, "corrupt", corrupt, GZ))

    # 256 MiB of zeros in a 256 KiB gzip: more than 64x the layer
    zeros = tarfile.TarInfo(f"{PIP[1:]}/libnccl.so.2")
    zeros.size = 256 << 20
    head = zeros.tobuf(tarfile.PAX_FORMAT)
    bomb = gzip.compress(head + b"\0" * zeros.size + b"\0" * 1024, compresslevel=9)
    with pytest.raises(ImageError, match=r"unpacked \(at most 64x"):
        _read(_push_hostile(registry, "bomb", bomb, GZ))

    # a member that says it is 100 GB in a small layer
    huge = tarfile.TarInfo(f"{PIP[1:]}/libnccl.so.2")
    huge.size = 100 << 30
    blob = huge.tobuf(tarfile.GNU_FORMAT) + b"x" * 4096
    with pytest.raises(ImageError, match=r"the archive ends inside a member"):
        _read(_push_hostile(registry, "huge", blob, TAR))

    # a pax header declaring 1 GiB: refused before it is read
    pax = bytearray(tarfile.TarInfo("././@PaxHeader").tobuf(tarfile.USTAR_FORMAT))
    pax[156:157] = b"x"
    pax[124:136] = b"%011o\0" % (1 << 30)
    pax[148:156] = b" " * 8
    pax[148:156] = b"%06o\0 " % (sum(pax))
    with pytest.raises(ImageError, match="pax header of 1073741824 bytes"):
        _read(_push_hostile(registry, "pax", bytes(pax) + b"\0" * 4096, TAR))

    # links that climb out of the image resolve inside it
    link = tarfile.TarInfo(f"{LIB[1:]}/libnccl.so.2")
    link.type, link.linkname = tarfile.SYMTYPE, "../../../../../../etc/shadow"
    dots = tarfile.TarInfo("../../etc/nccl.conf")
    dots.size = 3
    rec = _read(_push_hostile(registry, "escape",
                              _tar([(link, None), (dots, b"x=1")]), TAR))
    assert rec["libnccl"] == [] and not rec["nccl_conf"]["present"]
    assert not os.path.exists("/etc/nccl.conf") or os.path.getsize("/etc/nccl.conf") != 3


def test_the_cli_lists_shows_and_diffs_registry_images(tmp_path: Path, registry: Registry,
                                                       nccl_lib) -> None:
    """``images`` lists registry references beside squashfs files; ``images show`` and
    ``images diff`` take a reference as pyxis does; a reference the index lacks is named."""
    base = _linker_layer(nccl_lib("2.18.3"), "2.18.3")
    push_image(registry, "ml/train", "v1", [base, _pip_layer(nccl_lib("2.21.5"))])
    push_image(registry, "ml/train", "v2", [base, _pip_layer(nccl_lib("2.23.4"))])
    a, b = f"{registry.host}#ml/train:v1", f"{registry.host}#ml/train:v2"
    cfg = _config(tmp_path, registry, refs=[a, b])
    index = RegistryIndex(cfg)
    with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
        index.run_pass()
        write_batches(inv, index.drain())
    db = tmp_path / "inv.db"
    listed = run_cli("images", "--json", db=db)
    assert listed.exit_code == 0, listed.output
    rows = {r["path"]: r for r in json.loads(listed.stdout)["images"]}
    assert rows[f"{registry.host}/ml/train:v1"]["nccl_version"] == "2.21.5"
    assert rows[f"{registry.host}/ml/train:v2"]["nccl_version"] == "2.23.4"
    shown = run_cli("images", "show", a, db=db)
    assert shown.exit_code == 0 and "digest sha256:" in shown.stdout
    assert "2.21.5 (loaded)" in shown.stdout
    diffed = run_cli("images", "diff", a, b, db=db)
    assert diffed.exit_code == 1 and "2.23.4" in diffed.stdout
    missing = run_cli("images", "show", f"{registry.host}#ml/other:v1", db=db)
    assert missing.exit_code != 0 and "not in the registry index" in missing.output


def test_only_the_registries_an_admin_named_are_contacted(tmp_path: Path, registry: Registry,
                                                          nccl_lib) -> None:
    """A user names any host in --container-image: the references the gate saw jobs use
    are read only on [registry] registries (and refs' own); another host is never
    contacted, and the gate's reason says why."""
    push_image(registry, "ml/train", "v1", [_pip_layer(nccl_lib("2.21.5"))])
    with HangingServer("accept-and-silence") as other:
        audit_log = tmp_path / "audit.jsonl"
        lines = [{"ts": time.time(), "job": 1, "image": f"{registry.host}#ml/train:v1"},
                 {"ts": time.time(), "job": 2, "image": f"{other.host}#internal/thing:1"},
                 {"ts": time.time(), "job": 3, "image": "/shared/a.sqsh"}]
        audit_log.write_text("".join(json.dumps(x) + "\n" for x in lines))
        cfg = _config(tmp_path, registry, registries=(registry.host,))
        index = RegistryIndex(cfg)
        with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES) as inv:
            batch = index.run_pass(keep=True)
            write_batches(inv, index.drain())
            assert [t["ref"] for t in batch.tags] == [f"{registry.host}/ml/train:v1"]
            assert other.connections == 0
            got = registry_image(inv.load_registry_values(f"{other.host}/internal/thing:1"),
                                 time.time(), cfg.registry, other.host)
        assert got is not None and got[0] is None
        assert f"registry {other.host} is neither in [registry] registries" in str(got[1])


# ---- found by the hostile review of 2026-12-03: each failed before its fix


def _header(name: str, flag: bytes, size: int = 0, link: str = "") -> bytes:
    """One ustar header as a hostile layer would write it (any type, any size field)."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.REGTYPE, link
    block = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    block[156:157] = flag
    block[124:136] = b"%011o\0" % size
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _summary(blob: bytes) -> dict:
    import hashlib

    from inventoryd.controller.images.layers import read_layer

    return read_layer(io.BytesIO(blob), digest="sha256:" + hashlib.sha256(blob).hexdigest(),
                      size=len(blob), media_type=TAR, deadline=time.monotonic() + 30,
                      max_bytes=1 << 30, max_unpacked=1 << 30, max_read_bytes=1 << 30)


def _union(*blobs: bytes):
    from inventoryd.controller.images.layers import LayeredImage

    return LayeredImage("test", [_summary(b) for b in blobs])


def test_a_fifo_with_a_size_hides_nothing_behind_it() -> None:
    """A FIFO (or device) carries no data in tar, whatever its size field says: what
    follows it is the next member, as GNU tar (enroot's extractor) reads it."""
    hidden = _header(f"{LIB[1:]}/libnccl.so.2", b"2", link="libnccl.so.2.18.3")
    blob = _header("tmp/fifo", b"6", size=len(hidden)) + hidden + b"\0" * 1024
    image = _union(blob)
    assert image.entries[f"{LIB}/libnccl.so.2"].target == "libnccl.so.2.18.3"


def test_a_later_member_wins_and_hard_links_are_read_as_tar_reads_them() -> None:
    """In one layer a symlink, then a file at the same path: the file is what is there.
    A hard link to a file the reader did not keep is an error on that path, not nothing."""
    link = tarfile.TarInfo("etc/nccl.conf")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/elsewhere.conf"
    conf = tarfile.TarInfo("etc/nccl.conf")
    conf.size = 17
    blob = tarfile.TarInfo("opt/blob.bin")
    blob.size = 4
    hard = tarfile.TarInfo(f"{LIB[1:]}/libnccl.so.2")
    hard.type, hard.linkname = tarfile.LNKTYPE, "opt/blob.bin"
    image = _union(_tar([(link, None), (conf, b"NCCL_PROTO=Simple"), (blob, b"abcd"),
                         (hard, None)]))
    assert image.read_small("/etc/nccl.conf") == b"NCCL_PROTO=Simple"
    from inventoryd.controller.images.layers import ANALYZERS
    from inventoryd.controller.images.tree import ImagePathError

    with pytest.raises(ImagePathError, match=r"a hard link to opt/blob\.bin"):
        image.analyze(f"{LIB}/libnccl.so.2", ANALYZERS["nccl"], "/tmp")


def test_a_member_makes_its_directories_over_a_lower_symlink() -> None:
    """Layer 1: /opt/new -> /usr/lib; layer 2 holds opt/new/README and no directory
    entry: tar makes /opt/new a directory, which hides the symlink."""
    sym = tarfile.TarInfo("opt/new")
    sym.type, sym.linkname = tarfile.SYMTYPE, "/usr/lib"
    readme = tarfile.TarInfo("opt/new/README")
    readme.size = 2
    image = _union(_tar([(sym, None)]), _tar([(readme, b"hi")], tarfile.USTAR_FORMAT))
    assert image.entries["/opt/new"].kind == "d"


def test_gnu_sparse_members_are_refused() -> None:
    blob = _header(f"{LIB[1:]}/libnccl.so.2", b"S", size=512) + b"\0" * 2048
    with pytest.raises(ImageError, match="GNU sparse"):
        _summary(blob)


def test_a_layer_cut_short_by_the_network_is_tried_again_not_stored() -> None:
    """A blob that ends before its descriptor's size: the connection, not the layer."""
    import hashlib

    from inventoryd.controller.images.layers import read_layer
    from inventoryd.controller.images.tree import ImageTransient

    whole = gzip.compress(_tar([(tarfile.TarInfo("etc/x"), b"")]) + b"\0" * 100_000)
    with pytest.raises(ImageTransient, match="ended after"):
        read_layer(io.BytesIO(whole[: len(whole) // 2]),
                   digest="sha256:" + hashlib.sha256(whole).hexdigest(), size=len(whole),
                   media_type=GZ, deadline=time.monotonic() + 30, max_bytes=1 << 30,
                   max_unpacked=1 << 30, max_read_bytes=1 << 30)


def test_a_registry_cannot_have_the_collector_log_in_to_another_token_service(
        tmp_path: Path, nccl_lib) -> None:
    """The realm is what the registry says: credentials go to a realm only for an image
    whose own registry has a line (enroot's rule). Here the registry is addressed as
    localhost, which has no line; the token service (127.0.0.1) has one: no login."""
    with Registry(tmp_path / "reg", auth="token", users={"bob": "pw"}) as reg:
        push_image(reg, "ml/train", "v1", [_pip_layer(nccl_lib("2.21.5"))], creds=reg.admin)
        assert reg.token_service is not None
        realm = urllib.parse.urlsplit(reg.token_service.url).netloc
        host = reg.host.replace("127.0.0.1", "localhost")
        creds = Credentials({"127.0.0.1": ("bob", "pw")})
        with pytest.raises(RegistryError) as e:
            resolve(_client(host, "ml/train", "v1", creds=creds, also=(realm,)), "linux/amd64")
        assert e.value.state == "refused"
        assert reg.token_requests and all(r.user is None for r in reg.token_requests)


def test_headers_a_byte_at_a_time_cannot_outlast_the_deadline() -> None:
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def drip() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.3):
                try:
                    conn.sendall(b"X")
                except OSError:
                    return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    host = f"127.0.0.1:{srv.getsockname()[1]}"
    t0 = time.monotonic()
    try:
        with pytest.raises(RegistryError) as e:
            resolve(_client(host, "ml/train", "v1", timeout=2.0), "linux/amd64")
    finally:
        stop.set()
        srv.close()
    assert e.value.state == "timeout" and time.monotonic() - t0 < 4.0


def test_one_reference_that_breaks_the_reader_holds_no_other_back(
        tmp_path: Path, registry: Registry, nccl_lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape nobody foresaw (here: the reader raising AttributeError on one reference)
    is that reference's ``invalid`` state with a back-off; the others are read in the same
    pass. Before, the exception left the pass, which lost every tag it had found."""
    import inventoryd.controller.images.registry_index as ri

    push_image(registry, "ml/train", "v1", [_pip_layer(nccl_lib("2.21.5"))])
    bad, good = f"{registry.host}#ml/bad:v1", f"{registry.host}#ml/train:v1"
    real = ri.resolve

    def resolve(client, platform):  # type: ignore[no-untyped-def]
        if client.ref.repository == "ml/bad":
            raise AttributeError("'str' object has no attribute 'get'")
        return real(client, platform)

    monkeypatch.setattr(ri, "resolve", resolve)
    cfg = _config(tmp_path, registry, refs=[bad, good])
    index = RegistryIndex(cfg)
    with Inventory(tmp_path / "inv.db", config=cfg.inventory, values=GATE_VALUES):
        batch = index.run_pass(keep=True)
    states = {t["ref"]: t["state"] for t in batch.tags}
    assert states == {f"{registry.host}/ml/bad:v1": "invalid",
                      f"{registry.host}/ml/train:v1": "ok"}
    assert [i["record"]["image"]["ref"] for i in batch.images] == [
        f"{registry.host}/ml/train:v1"]
