"""The file of classes' image lines (ncclguard.sched.imagelines, issue 30): their bounds,
their in-place rewrite and carried ends, their judgement from a real inventory, and the
features daemon's image pass; without Slurm. The real slurmctld with the shipped
job_submit.lua and a real registry: tests/test_image_groups_slurm.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ncclguard.config import Config, FeaturesConfig, PolicyConfig
from ncclguard.policy.schedule import ClassCount
from ncclguard.sched import classfile, imagelines, sync


def _cf(**kw: object) -> classfile.ClassFile:
    """A file of classes with two classes (one in partition gpu) and what ``kw`` sets."""
    base: dict = dict(verified=1_700_000_000, partitions={
        "*": (ClassCount("nc_0123abcd", 4), ClassCount("nc_unknown", 2)),
        "gpu": (ClassCount("nc_0123abcd", 4),)})
    return classfile.ClassFile(**(base | kw))  # type: ignore[arg-type]


def test_image_lines_round_trip_and_stay_within_the_files_bounds() -> None:
    img = {"nvcr.io/nvidia/pytorch:25.01-py3": classfile.ImageGroup(1_700_003_600,
                                                                     ("nc_0123abcd",)),
           "/images/old.sqsh": classfile.ImageGroup(0, ())}
    cf = _cf(images=img)
    text = classfile.render(cf).decode()
    assert "image /images/old.sqsh 0\n" in text
    assert classfile.parse(text) == cf
    # a key the lua could not match is left out, not written
    odd = _cf(images={**img, "/a b.sqsh": classfile.ImageGroup(0, ()),
                      "/x\x01": classfile.ImageGroup(0, ())})
    assert classfile.parse(classfile.render(odd).decode()).images == img
    # at most MAX_IMAGES lines, and never past MAX_BYTES: the rest stay the gate's
    many = {f"/i/{n:04d}.sqsh": classfile.ImageGroup(0, ()) for n in range(400)}
    assert len(classfile.parse(classfile.render(_cf(images=many)).decode()).images) == \
        classfile.MAX_IMAGES
    wide = {f"/i/{n:04d}/" + "x" * 1000: classfile.ImageGroup(0, ("nc_0123abcd",) * 400)
            for n in range(256)}
    data = classfile.render(_cf(images=wide))
    assert len(data) <= classfile.MAX_BYTES and data.endswith(b"\nend\n")
    assert 0 < len(classfile.parse(data.decode()).images) < 256


def test_write_images_replaces_only_the_image_lines(tmp_path: Path) -> None:
    path = tmp_path / "features" / "classes"
    cfg = Config(features=FeaturesConfig(classes_file=str(path)))
    first = {"/a.sqsh": classfile.ImageGroup(0, ("nc_0123abcd",))}
    # no file: a full sync writes it
    assert not imagelines.write_images(cfg, first, now=1_700_000_100)
    cf = _cf(members={"nc_0123abcd": "n[1-4]"}, images=first)
    classfile.write(path, cf)
    second = {"/b.sqsh": classfile.ImageGroup(0, ()),
              "h:5000/ml/train:v1": classfile.ImageGroup(1_700_003_700, ("nc_unknown",))}
    assert imagelines.write_images(cfg, second, now=1_700_000_100)
    got = classfile.parse(path.read_text())
    assert got == replace(cf, verified=1_700_000_100, images=second)
    assert imagelines.write_images(cfg, {}, now=1_700_000_200)
    assert classfile.parse(path.read_text()) == replace(cf, verified=1_700_000_200, images={})
    path.write_text("ncclguard-classes 2\nverified 1\nend\n")  # not ours to change
    assert not imagelines.write_images(cfg, second)


def _image_record(version: str, abis: list[int]) -> dict:
    return {"libnccl": [{"default": True, "version": version, "path": "/usr/lib/libnccl.so.2",
                         "abis": {"net": abis}}], "plugins": [], "net_plugin": None}


NOW = 1_800_000_000.0


def _image_inventory(tmp_path: Path) -> tuple[Config, dict[str, str | None]]:
    """A real Inventory: n[1-2] inject a v6..v5 plugin, n[3-4] (another host libnccl: a
    class of their own) a v10..v9 one; squashfs images of NCCL 2.18.3 (net v6..v4) and
    2.26.2 (v10..v6), and a registry tag of 2.18.3 resolved 100 s before NOW. The config
    (registry on, max_age_s 600) and each host's class."""
    from helpers.inventory import NodeSpec, build

    from ncclguard.config import InventoryConfig, RegistryConfig
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory

    def inject(abis: list[int], name: str, **kw: object) -> NodeSpec:
        return NodeSpec(plugin=False, extra={"containers": {"net_plugin": {  # type: ignore[arg-type]
            "name": name, "abis": abis, "path": "/opt/p.so", "target": "/usr/lib/p.so"}}}, **kw)

    specs = {"n1": inject([6, 5], "A"), "n2": inject([6, 5], "A"),
             "n3": inject([10, 9], "B", nccl="2.18.3"), "n4": inject([10, 9], "B", nccl="2.18.3")}
    db = build(tmp_path / "inv.db", specs, now=NOW)
    cfg = Config(inventory=InventoryConfig(db=str(db)),
                 features=FeaturesConfig(classes_file=str(tmp_path / "features" / "classes")),
                 registry=RegistryConfig(enabled=True, registries=("h:5000",), max_age_s=600))
    with Inventory(db, values=class_values(cfg.policy)) as inv:
        inv.write_images([{"path": "/img/old.sqsh", "inode": 1, "size": 1, "mtime_ns": 1,
                           "record": _image_record("2.18.3", [6, 5, 4])},
                          {"path": "/img/new.sqsh", "inode": 2, "size": 1, "mtime_ns": 1,
                           "record": _image_record("2.26.2", [10, 9, 8, 7, 6])}], now=NOW)
        inv.write_registry([{"ref": "h:5000/ml/train:v1", "digest": "sha256:" + "1" * 64,
                             "state": "ok", "source": "config"}],
                           [{"digest": "sha256:" + "1" * 64, "platform": "linux/amd64",
                             "record": _image_record("2.18.3", [6, 5, 4])}], now=NOW - 100)
        classes = sync.desired(cfg, list(specs), NOW, inv)
    return cfg, classes


def test_image_groups_from_a_real_inventory(tmp_path: Path) -> None:
    """The lines the sync writes: a squashfs image and a registry tag holding NCCL 2.18.3
    (net v6..v4) run on the class that injects v6 only; 2.26.2 runs on both (no line); a
    tag resolved too long ago, a class whose nodes inject different plugins, and an
    image-stack that does not refuse give none; a max_age_s past the file's digits gives
    a line without an end."""
    from ncclguard.config import RegistryConfig
    from ncclguard.policy.schedule import class_values
    from ncclguard.store import Inventory

    cfg, classes = _image_inventory(tmp_path)
    a, b = classes["n1"], classes["n3"]
    assert a != b and classes["n2"] == a and classes["n4"] == b
    with Inventory(cfg.inventory.db, values=class_values(cfg.policy), readonly=True) as inv:
        got = imagelines.image_groups(cfg, inv, classes, NOW)
        assert got == {"h:5000/ml/train:v1": classfile.ImageGroup(int(NOW + 500), (a,)),
                       "/img/old.sqsh": classfile.ImageGroup(0, (a,))}
        assert next(iter(got)) == "h:5000/ml/train:v1"  # tags first (by use), then files
        # the tag's resolution too old for the gate: no line (the gate says image-unknown)
        assert set(imagelines.image_groups(cfg, inv, classes, NOW + 601)) == {"/img/old.sqsh"}
        # registry images not read: the squashfs file alone
        off = cfg.replace(registry=RegistryConfig(enabled=False))
        assert set(imagelines.image_groups(off, inv, classes, NOW)) == {"/img/old.sqsh"}
        warn = cfg.replace(policy=PolicyConfig(severity={"image-stack": "warn"}))
        assert imagelines.image_groups(warn, inv, classes, NOW) == {}
        # one class whose nodes inject different plugins: no line for what tells them apart
        one = dict.fromkeys(classes, a)
        assert imagelines.image_groups(cfg, inv, one, NOW) == {}
        huge = cfg.replace(registry=cfg.registry.replace(max_age_s=1e30))
        assert imagelines.image_groups(huge, inv, classes, NOW)["h:5000/ml/train:v1"].until == 0


def test_the_daemon_keeps_the_files_image_lines(tmp_path: Path) -> None:
    """FeatureKeeper's image pass (no Slurm call): the lines written when due, left when
    the file has them, put back after another writer took them out, and taken out while
    the inventory cannot be read (found by review: they stayed, and a path image's line
    kept refusing jobs the gate, failing open, would have let run)."""
    from inventoryd.controller.features import FeatureKeeper

    cfg, classes = _image_inventory(tmp_path)
    path = Path(cfg.features.classes_file)
    cf = _cf(members={}, partitions={"*": ()})
    classfile.write(path, cf)
    keeper = FeatureKeeper(cfg, slurm=object())  # type: ignore[arg-type]
    keeper.applied = dict(classes)
    assert keeper._refresh_images(NOW) == ("image groups: 2 images some class cannot run; "
                                           "changed: /img/old.sqsh, h:5000/ml/train:v1")
    assert len(classfile.read(path).images) == 2
    assert keeper._refresh_images(NOW + 1) is None  # not due: the index did not change
    classfile.write(path, cf)  # a hook's sync that could not read the images
    assert keeper._refresh_images(NOW + cfg.features.verify_s - 1) is None  # not due yet
    assert classfile.read(path).images == {}
    note = keeper._refresh_images(NOW + cfg.features.verify_s)
    assert note is not None and "the file had other lines" in note, note
    assert len(classfile.read(path).images) == 2
    Path(cfg.inventory.db).write_bytes(b"not a database")
    keeper.image_mark = None
    keeper._refresh_images(NOW + 3 * cfg.features.verify_s)
    assert classfile.read(path).images == {}
    path.unlink()
    assert keeper._refresh_images(NOW + 4 * cfg.features.verify_s) == ""  # a full sync next


def test_an_image_lines_end_moves_only_when_it_comes_near(tmp_path: Path) -> None:
    """A tag resolved again moves its line's end; each change of the file's body costs the
    lua a parse inside slurmctld, so an end stays until it is within 2 * (verify_s +
    interval_s) (124 s) of passing. The lines are written by key: the order in which jobs
    used the tags does not change the body (found by review: it did, at every
    resolution). Other classes, or a line the lua could not read: written at once."""
    path = tmp_path / "features" / "classes"
    cfg = Config(features=FeaturesConfig(classes_file=str(path)))
    assert imagelines.keep_s(cfg) == 124
    t0 = 1_800_000_000
    tag, other = "h:5000/ml/train:v1", "h:5000/ml/train:v2"
    classfile.write(path, _cf(images={tag: classfile.ImageGroup(t0 + 3600, ("nc_0123abcd",)),
                                      other: classfile.ImageGroup(t0 + 3600, ())}))

    def at(now: int, until: int, classes: tuple[str, ...] = ("nc_0123abcd",),
           first: str = tag) -> bool | None:
        lines = {tag: classfile.ImageGroup(until, classes),
                 other: classfile.ImageGroup(until, ())}
        order = [first, *(k for k in lines if k != first)]
        return imagelines.write_images(cfg, {k: lines[k] for k in order}, now=now)

    assert at(t0 + 300, t0 + 3900) is False  # resolved again: 3,300 s left, kept
    assert at(t0 + 600, t0 + 4200, first=other) is False  # used in another order: kept
    assert at(t0 + 3470, t0 + 7070) is False  # 130 s left
    assert classfile.read(path).images[tag].until == t0 + 3600
    assert at(t0 + 3480, t0 + 7080) is True  # 120 s left: moved, both together
    assert {g.until for g in classfile.read(path).images.values()} == {t0 + 7080}
    # tags resolved at other times: when the first end comes near, every end moves
    classfile.write(path, _cf(images={tag: classfile.ImageGroup(t0 + 7080, ("nc_0123abcd",)),
                                      other: classfile.ImageGroup(t0 + 5000, ())}))
    assert imagelines.write_images(cfg, {tag: classfile.ImageGroup(t0 + 7400, ("nc_0123abcd",)),
                                   other: classfile.ImageGroup(t0 + 8000, ())},
                             now=t0 + 4000) is False
    assert imagelines.write_images(cfg, {tag: classfile.ImageGroup(t0 + 7500, ("nc_0123abcd",)),
                                   other: classfile.ImageGroup(t0 + 8100, ())},
                             now=t0 + 4900) is True
    assert [g.until for g in classfile.read(path).images.values()] == [t0 + 7500, t0 + 8100]
    classfile.write(path, _cf(images={tag: classfile.ImageGroup(t0 + 7080, ("nc_0123abcd",)),
                                      other: classfile.ImageGroup(t0 + 7080, ())}))
    assert at(t0 + 3500, t0 + 7100, ()) is True  # the tag moved: no class runs it now
    assert classfile.read(path).images[tag] == classfile.ImageGroup(t0 + 7100, ())
    text = path.read_text()
    # a line the lua would refuse (found by review: int() took the first and raised on
    # the second, out of the daemon's pass): nothing carried from it, the lines rewritten
    for bad in ("1_800_007_100", f"{t0 + 7100}x"):
        path.write_text(text.replace(f"image {tag} {t0 + 7100}", f"image {tag} {bad}"))
        assert at(t0 + 3600, t0 + 7200, ()) is True
        assert classfile.read(path).images[tag] == classfile.ImageGroup(t0 + 7200, ())
