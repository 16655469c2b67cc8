"""The inventory's classes as every reader names them: ``ncclguard classes``, the drain
advice, the collector's metrics and the features daemon (Slurm's features) alike.

A class is a :func:`~ncclguard.policy.schedule.class_key` (what the configured
refuse-level rules read from a node); its name is its Slurm feature
(:func:`~ncclguard.policy.schedule.feature_names`), unique over every class of the
inventory, so that a view of some nodes names each class as Slurm does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ncclguard.config import InventoryConfig, PolicyConfig
from ncclguard.policy.schedule import class_values, feature_names
from ncclguard.store import Inventory, NodeClass

__all__ = ["ClassView", "open_classes", "read_classes"]


@dataclass(frozen=True)
class ClassView:
    """The classes of some nodes, with the names the whole inventory gives them."""

    classes: list[NodeClass]
    names: dict[str, str]  # class key -> its name (the Slurm feature)

    def name(self, key: str) -> str:
        return self.names.get(key) or feature_names([key])[key]


def read_classes(inv: Inventory, hosts: Iterable[str] | None = None) -> ClassView:
    """The classes of ``hosts`` (every node: None) from an inventory opened with a
    policy's classes (:func:`open_classes`)."""
    wanted = None if hosts is None else list(hosts)
    classes = inv.classes(wanted)
    every = ({c.key for c in classes} if wanted is None
             else {k for k in inv.class_keys().values() if k is not None})
    return ClassView(classes, feature_names(every))


def open_classes(policy: PolicyConfig, inventory: InventoryConfig | None = None,
                 db: Path | str | None = None) -> Inventory:
    """The inventory, read-only, with ``policy``'s classes."""
    return Inventory(db, readonly=True, config=inventory, values=class_values(policy))
