#!/usr/bin/env python3
"""Capture real NCCL log lines from a real libnccl.so.2, on a machine without a GPU.

With ``NCCL_DEBUG=INFO``, ``ncclGetUniqueId`` runs NCCL's bootstrap and (up to 2.2x)
its net-plugin loader, and ``ncclCommInitRank`` then fails at the first CUDA call; both
print their lines as NCCL formats them. Each capture runs in a child process (a crash
costs one capture), bounded by a timeout, with an argument list (never a shell).

    devtools/capture_nccl_output.py \
        --lib ~/.cache/ncclguard/nccl/nvidia_nccl_cu12-2.18.3/libnccl.so.2 \
        --out tests/diagnose_logs/captured/2.18.3-n1-noplugin.log [--plugin DIR] [--hostname n3]

``--plugin DIR``: build a minimal net plugin (``libnccl-net.so``, gcc) in DIR and put DIR
first in ``LD_LIBRARY_PATH``. ``--hostname``: run the child in a new UTS namespace (root
only) with that host name, so that NCCL's prefix names it. The lines are written as
they came, nothing edited.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 60

# A net plugin of our own: init succeeds, it has no device, every other call fails.
# The struct layout is ncclNet_v6..v8's leading fields: name, init, devices, then calls.
_PLUGIN_C = r"""
typedef int (*fn_t)(void);
static int plugin_init(void *logfn) { (void)logfn; return 0; }
static int plugin_devices(int *n) { *n = 0; return 0; }
static int plugin_fail(void) { return 3; }
#define FAIL ((fn_t)plugin_fail)
#define PLUGIN(sym) __attribute__((visibility("default"))) const struct { \
  const char *name; void *init; void *devices; fn_t rest[24]; } sym = { \
  "%(name)s", (void *)plugin_init, (void *)plugin_devices, \
  { FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, \
    FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL, FAIL } };
%(exports)s
"""


def build_plugin(
    out_dir: Path, name: str = "ncclguardTestNet", abis: tuple[int, ...] = (8, 7, 6)
) -> Path:
    """Compile ``libnccl-net.so`` exporting ``ncclNetPlugin_vN`` for each N in ``abis``."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("capture: gcc is not installed (needed for --plugin)")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "libnccl-net.c"
    exports = "\n".join(f"PLUGIN(ncclNetPlugin_v{n});" for n in abis)
    src.write_text(_PLUGIN_C % {"name": name, "exports": exports})
    out = out_dir / "libnccl-net.so"
    r = subprocess.run(
        [gcc, "-O1", "-shared", "-fPIC", "-o", str(out), str(src)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"capture: gcc failed for {src}: {r.stderr.strip()}")
    return out


def child(lib: str, hostname: str | None) -> int:
    """In the child: (optionally) set the host name, then call NCCL. Lines go to stdout."""
    if hostname:
        socket.sethostname(hostname)
    os.dup2(1, 2)  # NCCL writes its debug lines to stdout; keep our own in the same stream
    nccl = ctypes.CDLL(lib)
    uid = ctypes.create_string_buffer(128)
    rc = nccl.ncclGetUniqueId(uid)
    sys.stdout.flush()
    if rc != 0:
        return 0
    comm = ctypes.c_void_p()
    rc = nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0)
    nccl.ncclGetErrorString.restype = ctypes.c_char_p
    ctypes.CDLL(None).fflush(None)  # NCCL's buffered lines first, in their order
    if rc != 0:
        # The text a framework wraps (PyTorch: "NCCL error in: ..., <this>, NCCL version X")
        text = nccl.ncclGetErrorString(rc).decode()
        print(f"capture: ncclCommInitRank returned {rc}: {text}", flush=True)
    return 0


def capture(lib: Path, plugin_dir: Path | None, hostname: str | None) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "NCCL_DEBUG": "INFO",
        "HOME": os.environ.get("HOME", "/"),
    }
    if plugin_dir is not None:
        env["LD_LIBRARY_PATH"] = str(plugin_dir)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(lib)]
    if hostname:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise SystemExit("capture: --hostname needs unshare(1) (util-linux)")
        argv = [unshare, "--uts", *argv, "--set-hostname", hostname]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )
    if r.returncode != 0 and not r.stdout:
        raise SystemExit(f"capture: child failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="path to a real libnccl.so.2")
    ap.add_argument("--out", help="file to write the lines to (default: stdout)")
    ap.add_argument("--plugin", metavar="DIR", help="build a test net plugin in DIR and use it")
    ap.add_argument("--plugin-name", default="ncclguardTestNet")
    ap.add_argument("--hostname", help="host name for NCCL's prefix (needs root: unshare --uts)")
    ap.add_argument("--child", metavar="LIB", help=argparse.SUPPRESS)
    ap.add_argument("--set-hostname", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child, a.set_hostname)
    if not a.lib:
        ap.error("--lib is required")
    lib = Path(a.lib)
    if not lib.is_file():
        raise SystemExit(f"capture: {lib}: no such library")
    plugin_dir = None
    if a.plugin:
        plugin_dir = Path(a.plugin)
        build_plugin(plugin_dir, a.plugin_name)
    text = capture(lib, plugin_dir, a.hostname)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
