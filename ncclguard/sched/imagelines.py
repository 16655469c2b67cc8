"""The file of classes' ``image`` lines: which classes' nodes run each container image.

    image index (squashfs files, registry tags) ──▶ image_judged: the gate's values
    classes' sample nodes (samples_of) ───────────▶ runnable_classes, per image
                                                       │
      image_groups: the images some class cannot run ──▶ image lines (classfile)

The full sync (:func:`ncclguard.sched.sync.sync`) writes them with the classes; the
features daemon rewrites only them (:func:`write_images`) when the image index changes.
Their ends are :func:`carried` from the file while none comes near: each change of the
body costs job_submit.lua a parse inside slurmctld (docs/perf.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from ncclguard.config import Config
from ncclguard.policy.rules import container
from ncclguard.sched import classfile
from ncclguard.store import Inventory

__all__ = ["carried", "class_judgements", "image_groups", "image_judged", "keep_s",
           "samples_of", "write_images"]


def image_judged(config: Config, inventory: Inventory, key: str, now: float
                 ) -> tuple[dict | None, int, str | None]:
    """What the file's line for the image ``key`` (a path, or a registry reference's key)
    rests on: ``(values, until, None)``, the gate's values of the image and the line's
    end (0: none), or ``(None, 0, why)`` there is no line for it. The gate's own reads:
    ``load_image_values``, and for a tag
    :func:`~ncclguard.policy.rules.container.registry_image`."""
    from ncclguard.fingerprint.imageref import RefError, parse
    from ncclguard.policy.settings import severity_of

    if severity_of(config.policy, container.STACK) != "refuse":
        return None, 0, "image-stack does not refuse: the gate lets such a job run anywhere"
    until = 0
    if key.startswith("/"):
        got = inventory.load_image_values(key)
        if got is None:
            return None, 0, "not in the image index"
    else:
        try:
            registry = parse(key).registry
        except RefError as e:
            return None, 0, str(e)
        row = inventory.load_registry_values(key)
        got = container.registry_image(row, now, config.registry, registry)
        if got is None or row is None:
            return None, 0, "not in the registry index"
        if got[0] is not None:
            end = float(row["resolved_at"]) + config.registry.max_age_s
            until = int(end) if end < 10**18 else 0  # 0: no end the file's 18 digits hold
    if got[0] is None:
        return None, 0, str(got[1])
    if not container.checkable(got[0]):
        return None, 0, "no libnccl the job would load was found in it"
    return got[0], until, None


def class_judgements(image: Mapping, samples: Mapping[str, list[dict]]
                     ) -> dict[str, tuple[str, ...] | None]:
    """Each class alone through :func:`~ncclguard.policy.rules.container.runnable_classes`:
    ``(cls,)`` it runs the image, ``()`` it does not, None some of its nodes do."""
    return {cls: container.runnable_classes(image, {cls: recs})
            for cls, recs in sorted(samples.items())}


def samples_of(inventory: Inventory, classes: Mapping[str, str | None]
               ) -> dict[str, list[dict]]:
    """:func:`~ncclguard.policy.rules.container.class_samples` of the classes' nodes, from
    the gate's records."""
    loaded = inventory.load_values([h for h, c in classes.items() if c is not None])
    return container.class_samples({h: r[0] if r else None for h, r in loaded.items()},
                                   classes)


def image_groups(config: Config, inventory: Inventory, classes: Mapping[str, str | None],
                 now: float) -> dict[str, classfile.ImageGroup]:
    """The file's ``image`` lines: each image the gate can judge (:func:`image_judged`: a
    squashfs file of the index; a registry tag resolved within ``[registry] max_age_s``,
    until then) that some class cannot run, with the classes that can
    (:func:`~ncclguard.policy.rules.container.runnable_classes`). None while ``image-stack``
    does not refuse: the gate would let such a job run anywhere, and so does Slurm.
    Registry tags that jobs used last come first; at most ``2 * MAX_IMAGES`` are judged.
    ``inventory``: opened with the gate's values (:data:`GATE_VALUES` or the classes')."""
    from ncclguard.policy.settings import severity_of

    if severity_of(config.policy, container.STACK) != "refuse":
        return {}
    limit = 2 * classfile.MAX_IMAGES
    keys: list[str] = []
    if config.registry.enabled:
        tags = sorted(inventory.registry_tags().values(), key=lambda t: -(t.used_at or 0))
        keys += [t.ref for t in tags[:limit]]
    keys += [img["path"] for img in inventory.images()[:limit] if img["error"] is None]
    found = []
    for key in keys:
        values, until, why = image_judged(config, inventory, key, now)
        if values is not None and why is None:
            found.append((key, values, until))
            if len(found) == limit:
                break
    if not found:
        return {}
    samples = samples_of(inventory, classes)
    out = {}
    for key, values, until in found:
        able = container.runnable_classes(values, samples)
        if able is not None and len(able) < len(samples):  # some class cannot run it
            out[key] = classfile.ImageGroup(until, able)
    return out


def write_images(config: Config, images: Mapping[str, classfile.ImageGroup],
                 now: float | None = None,
                 envs: Mapping[str, tuple[str, ...]] | None = None) -> bool | None:
    """Replace the file's ``image`` lines, and its ``env`` lines where ``envs`` is given (and
    set ``verified``), the rest as the last sync wrote it: the image index or the job
    environments changed, the classes did not. True when written, False when
    the file's lines may stay (their ends :func:`carried`: nothing written), None when there is no
    file of ours to change (a full sync writes it). The lines are compared with the
    file's, not with what this process wrote last: a sync elsewhere (a hook, an admin)
    may have written others."""
    path = Path(config.features.classes_file)
    with classfile.locked(path):
        body = classfile.our_body(path)
        if body is None:
            return None
        lines = body[:-len(b"end\n")].split(b"\n")[:-1]
        ours = (b"image ", b"env ") if envs is not None else (b"image ",)
        kept = [ln for ln in lines if not ln.startswith(ours)]
        stamp = int(time.time() if now is None else now)
        top = [classfile.MAGIC.encode(), b"verified %d" % stamp, *kept]
        room = classfile.MAX_BYTES - sum(len(ln) + 1 for ln in top) - 4
        images = carried(body, images, stamp, keep_s(config))
        new = [ln.encode() for ln in classfile.image_lines(images, room)]
        if envs is not None:
            room -= sum(len(ln) + 1 for ln in new)
            new += [ln.encode() for ln in classfile.env_lines(envs, room)]
        if new == [ln for ln in lines if ln.startswith(ours)]:
            return False
        try:
            classfile.write_bytes(path, b"\n".join([*top, *new, b"end"]) + b"\n")
        except classfile.ClassFileError:
            return None
        return True


def keep_s(config: Config) -> float:
    """How near its end an image line's end is moved: a little more than the daemon takes
    to look again (``verify_s`` and a pass), so that a line never passes its end while
    its tag keeps being resolved, and ends move about once per ``max_age_s``."""
    return 2 * (config.features.verify_s + config.features.interval_s)


def carried(body: bytes | None, images: Mapping[str, classfile.ImageGroup], now: float,
            keep: float) -> dict[str, classfile.ImageGroup]:
    """``images`` with the ends the file's ``body`` (:func:`~ncclguard.sched.classfile.our_body`,
    read by the caller under its lock) already has where they may stay: the same
    classes, the file's end not past the new one, and no end of the file within ``keep``
    (then all move together).
    A tag resolved again moves its end every ``resolve_interval_s``, and each change of
    the body costs job_submit.lua a parse inside slurmctld (9 ms for 256 lines,
    docs/perf.md): ends move only when one comes near. A line the lua could not read
    (or a file that is not ours: ``body`` None) carries nothing."""
    old: dict[str, classfile.ImageGroup] = {}
    for line in (body or b"").split(b"\n"):
        if line.startswith(b"image "):
            found = classfile.image_line(line.decode("ascii", "replace").split(" "))
            if found is not None:
                old[found[0]] = found[1]
    if any(o.until and o.until - now <= keep for k, o in old.items() if k in images):
        return dict(images)  # one end comes near: all move, so the body changes once
    out = {}
    for key, g in images.items():
        o = old.get(key)
        keep_old = (o is not None and o.classes == g.classes and o.until != 0 and g.until != 0
                    and o.until <= g.until)
        out[key] = o if keep_old and o is not None else g
    return out
