"""How ``inventory-v4.db`` was made (run once by hand; the test reads the file).

A real schema-v4 inventory, written by ncclguard as of commit 3e38422 (issue 13 and 14,
before issue 15): ``git archive 3e38422 | tar -x -C /tmp/v4src``, then, from this
checkout::

    .venv/bin/python tests/data/store/make_inventory_v4.py /tmp/v4src OUT.db

The v4 code opens a copy of ``inventory-v3.db`` as a writer (its own v3 -> v4 migration)
and stores one more heartbeat for each node, so every table is as the v4 code leaves it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

MIGRATE = """
import sys
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
with Inventory(sys.argv[1], values=GATE_VALUES) as inv:
    for host in ("new", "old"):
        inv.heartbeat(host, now=1_800_000_600)
    print(inv.schema_version())
"""


def main(v4src: str, out: str) -> None:
    shutil.copyfile(Path(__file__).parent / "inventory-v3.db", out)
    # -S and cwd: neither this checkout nor its editable install can shadow the old code
    import sysconfig

    path = f"{v4src}:{sysconfig.get_paths()['purelib']}"
    r = subprocess.run([sys.executable, "-S", "-c", MIGRATE, str(Path(out).resolve())],
                       env={"PYTHONPATH": path}, cwd=v4src,
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "4", r.stdout + r.stderr


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
