"""How ``inventory-v3.db`` was made (run once by hand; the test reads the file).

A real schema-v3 inventory, written by ncclguard as of commit 969d602 (before issue 13):
``git archive 969d602 | tar -x -C /tmp/v3src``, then, from this checkout::

    PYTHONPATH=$PWD .venv/bin/python tests/data/store/make_inventory_v3.py /tmp/v3src OUT.db

- ``old``: a node fingerprinted and stored by the v3 code itself (NCCL 2.28.9, a net
  plugin that also exports ``ncclTunerPlugin_v5``): no ``effective`` part;
- ``new``: a node fingerprinted by this checkout's daemon (NCCL 2.32.3, a packed
  net+tuner+profiler+GIN plugin and an env plugin) and stored by the v3 code, as a
  collector not yet upgraded does during a rolling upgrade (fields are only added).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from devtools.ncclwheels import build_plugin, extract_nccl
from devtools.nodetree import LIBDIR, build_node

STORE = """
import json, sys
from ncclguard.policy import GATE_VALUES
from ncclguard.store import Inventory
with Inventory(sys.argv[1], values=GATE_VALUES) as inv:
    for path in sys.argv[2:]:
        print(inv.upsert(json.load(open(path)), now=1_800_000_000))
    print(inv.schema_version())
"""


def main(v3src: str, out: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    packed = build_plugin(tmp / "p1", net_abis=[12, 11], name="IBext_v12", tuner_abis=[6],
                          tuner_name="PackedTuner", profiler_abis=[7], gin_abis=[14],
                          gin_name="PackedGin")
    env = build_plugin(tmp / "p2", env_abis=[2], env_name="SiteEnv", filename="libnccl-env.so")
    net5 = build_plugin(tmp / "p3", net_abis=[11, 10], name="IBext_v11", tuner_abis=[5])
    new = build_node(tmp / "new", libnccl=extract_nccl("2.32.3"), extra_files={
        f"{LIBDIR}/libnccl-net.so": packed, f"{LIBDIR}/libnccl-env.so": env})
    old = build_node(tmp / "old", libnccl=extract_nccl("2.28.9"), extra_files={
        f"{LIBDIR}/libnccl-net.so": net5})
    fps = []
    for root, src in ((new, None), (old, v3src)):
        env_ = {"PYTHONPATH": src} if src else {}
        r = subprocess.run([sys.executable, "-m", "inventoryd.main", "once", "--json",
                            "--root", str(root), "--hostname", root.name],
                           capture_output=True, text=True, check=True, cwd=src or None,
                           env={**__import__("os").environ, **env_})
        path = tmp / f"{root.name}.json"
        path.write_text(r.stdout)
        fps.append(str(path))
        assert ("effective" in json.loads(r.stdout)) == (src is None)
    r = subprocess.run([sys.executable, "-c", STORE, out, *fps], capture_output=True,
                       text=True, check=True, cwd=v3src,
                       env={**__import__("os").environ, "PYTHONPATH": v3src})
    print(r.stdout, end="")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
