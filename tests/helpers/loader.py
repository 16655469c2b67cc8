"""A real process that loads NCCL as a job does (issue 42): ``loadnccl`` ``dlopen``s
``libnccl.so.2`` (found as the dynamic linker finds it: ``LD_LIBRARY_PATH``, the cache),
calls ``ncclGetVersion`` (no GPU needed), then ``dlopen``s each further library it is
given (a net plugin, as NCCL's own net initialisation would), prints one line and sleeps.
``--fork N`` first: N processes in all, forked after the load (bench/bench_jobmaps.py).

    loader = build_loader(tmp_path)
    subprocess.Popen([loader, "60", "/opt/plugin/libnccl-net.so"])
    # stdout: "loaded 22105 libnccl.so.2\n"

Compiled with gcc in the test (a real part: :func:`tests.helpers.parts.unavailable`
without gcc).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from helpers.parts import unavailable

SOURCE = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int fork_n = 1;  /* --fork N: N processes in all share the loaded library (benches) */
    if (argc > 2 && argv[1][0] == '-' && argv[1][1] == '-') {
        fork_n = atoi(argv[2]);
        argv += 2;
        argc -= 2;
    }
    if (argc < 2) { fprintf(stderr, "usage: loadnccl [--fork N] SECONDS [LIB...]\n"); return 2; }
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "loadnccl: %s\n", dlerror()); return 1; }
    int (*get)(int *) = (int (*)(int *))dlsym(h, "ncclGetVersion");
    int v = 0;
    if (!get || get(&v) != 0) { fprintf(stderr, "loadnccl: no ncclGetVersion\n"); return 1; }
    for (int i = 2; i < argc; i++) {
        if (!dlopen(argv[i], RTLD_NOW | RTLD_LOCAL)) {
            fprintf(stderr, "loadnccl: %s\n", dlerror());
            return 1;
        }
    }
    printf("loaded %d libnccl.so.2\n", v);
    fflush(stdout);
    for (int i = 1; i < fork_n; i++)
        if (fork() == 0)
            break;
    sleep((unsigned)atoi(argv[1]));
    return 0;
}
"""


def build_loader(out_dir: Path) -> Path:
    """Compile ``loadnccl`` into ``out_dir`` (mode 0755) and return its path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        unavailable("gcc is not installed (the test's NCCL loader is compiled with it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "loadnccl.c"
    src.write_text(SOURCE)
    exe = out_dir / "loadnccl"
    subprocess.run([gcc, "-O1", "-o", str(exe), str(src), "-ldl"], check=True,
                   capture_output=True, timeout=120)
    exe.chmod(0o755)
    return exe
