"""``ncclguard-inventoryd once --json`` as admins run it: a subprocess, a node root, JSON out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers.parts import build_plugin, place, run_ldconfig

REPO = Path(__file__).resolve().parent.parent
MULTIARCH = "/usr/lib/x86_64-linux-gnu"
TOP_KEYS = {"schema", "host", "libnccl", "plugins", "net", "rdma", "netifs", "nccl_conf", "gpu",
            "errors"}


def _once(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NCCLGUARD_CACHE_DIR": str(tmp / "fcache")}
    env.pop("NCCLGUARD_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "inventoryd.main", "once", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def _json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_once_json_on_a_node_root(tmp_path: Path, nccl_lib) -> None:
    root = tmp_path / "node"
    place(root, f"{MULTIARCH}/libnccl.so.2.21.5", nccl_lib("2.21.5"))
    place(root, "/opt/envs/old/lib/libnccl.so.2", nccl_lib("2.18.3"))
    place(root, f"{MULTIARCH}/libnccl-net.so",
          build_plugin(tmp_path / "b", net_abis=[9, 8, 7], name="IBext_v8"))
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc/nccl.conf").write_text("NCCL_IB_HCA=mlx5\n")
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text("6.1.0-18-amd64\n")
    run_ldconfig(root)
    cfg = tmp_path / "config.toml"
    cfg.write_text('[inventoryd]\nnccl_search_paths = ["/opt/envs/*/lib"]\n')
    fp = _json(_once(tmp_path, "--json", "--root", str(root), "--hostname", "n7",
                     "--config", str(cfg)))
    assert set(fp) >= TOP_KEYS and fp["schema"] == 1
    assert fp["host"]["hostname"] == "n7" and fp["host"]["kernel"] == "6.1.0-18-amd64"
    assert [(x["path"], x["version"], x["default"], x["origin"]) for x in fp["libnccl"]] == [
        ("/opt/envs/old/lib/libnccl.so.2", "2.18.3", False, "config"),
        (f"{MULTIARCH}/libnccl.so.2", "2.21.5", True, "linker"),
        (f"{MULTIARCH}/libnccl.so.2.21.5", "2.21.5", False, "linker"),
    ]
    # node paths, never the --root prefix
    assert str(root) not in json.dumps(fp)
    assert fp["net"] == {"libnccl": f"{MULTIARCH}/libnccl.so.2",
                         "plugin": f"{MULTIARCH}/libnccl-net.so",
                         "effective_net_abi": 8, "reason": None}
    assert fp["nccl_conf"]["settings"] == {"NCCL_IB_HCA": "mlx5"}
    # the tree has no boot_id: exactly that, named (no other probe failed)
    assert fp["errors"] == [{"probe": "host", "field": "host.boot_id",
                             "path": "/proc/sys/kernel/random/boot_id",
                             "error": "[Errno 2] No such file or directory"}]
    # a second (warm) run gives the same fingerprint apart from the time
    again = _json(_once(tmp_path, "--json", "--root", str(root), "--hostname", "n7",
                        "--config", str(cfg)))
    for x in (fp, again):
        x["host"].pop("collected_at")
    assert again == fp


def test_once_exits_zero_when_probes_fail(tmp_path: Path) -> None:
    root = tmp_path / "node"
    (root / "etc").mkdir(parents=True)
    (root / "etc/ld.so.cache").write_bytes(b"garbage, not a cache")
    (root / MULTIARCH.lstrip("/")).mkdir(parents=True)
    (root / MULTIARCH.lstrip("/") / "libnccl.so.2").write_bytes(b"")
    fp = _json(_once(tmp_path, "--json", "--root", str(root), "--hostname", "x"))
    errs = {(e["probe"], e["path"]): e["error"] for e in fp["errors"]}
    assert "unknown magic" in errs[("nccl", "/etc/ld.so.cache")]
    assert fp["libnccl"][0]["version"] is None and fp["libnccl"][0]["default"] is True
    assert fp["net"]["effective_net_abi"] is None and fp["net"]["reason"]


def test_bad_config_is_exit_2_with_the_file_named(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[inventoryd]\nnccl_search_paths = 3\n")
    r = _once(tmp_path, "--json", "--root", str(tmp_path), "--config", str(cfg))
    assert r.returncode == 2
    assert str(cfg) in r.stderr and "nccl_search_paths" in r.stderr


def test_missing_root_is_an_empty_fingerprint(tmp_path: Path) -> None:
    fp = _json(_once(tmp_path, "--json", "--root", str(tmp_path / "absent"), "--hostname", "z"))
    assert fp["libnccl"] == [] and fp["plugins"] == []
    assert fp["net"]["reason"].startswith("no net plugin")
