"""What the real ``libnccl.so.2`` of each wheel the tests use holds: its version code, CUDA
version and the plugin ABIs it looks for (``FACTS``). ``tests/test_probe_nccl.py`` checks
every wheel against it; ``tests/test_offers.py`` checks the product's release table
(``ncclguard/fingerprint/releases.py``) against it."""

from __future__ import annotations

from typing import Any

# The ABIs per release (docs/nccl.md, "Plugins NCCL loads"; docs/fingerprint.md, "Plugin
# kinds by NCCL"): net/collnet ABIs tried per NCCL version, newest
# first; tuner and profiler literals as found in these very files (tuner v2 only in
# 2.21; the profiler from 2.23.4). Env, GIN and RMA (issue 13): read with strings(1) from
# these wheels and from NCCL's source: 2.28.9 dlsyms "ncclGinPlugin_v11" in
# src/plugin/net/net_v11.cc and "ncclEnvPlugin_v1" in src/plugin/env/env_v1.cc
# (v2.28.9-1); 2.30.7 has gin_v13/v14, rma_v13/v14, env_v1/v2 in src/plugin/ (v2.30.7-1);
# 2.32.3's own strings name ncclRmaPlugin_v13..v16 and ncclProfiler_v1..v7. Issue 28: 2.19.3
# and 2.20.5 dlsym "ncclTunerPlugin_v1" (src/misc/tuner.cc, NCCL_TUNER_PLUGIN_SYMBOL at
# v2.19.1-1, v2.20.5-1); 2.30.4 has gin_v11..v13 and "ncclRmaPlugin_v13" in
# src/plugin/gin/gin_v13.cc (v2.30.4-1).
NO_NEW = {"env": [], "gin": [], "rma": []}
FACTS: dict[str, dict[str, Any]] = {
    "2.18.3": {"code": 21803, "cuda": "12.1", "net": [6, 5, 4], "tuner": [], "profiler": [],
               **NO_NEW},
    "2.19.3": {"code": 21903, "cuda": "11.0", "net": [7, 6, 5], "tuner": [1], "profiler": [],
               **NO_NEW},
    "2.20.5": {"code": 22005, "cuda": "12.4", "net": [8, 7, 6, 5], "tuner": [1],
               "profiler": [], **NO_NEW},
    "2.21.5": {"code": 22105, "cuda": "11.0", "net": [8, 7, 6, 5], "tuner": [2],
               "profiler": [], **NO_NEW},
    "2.23.4": {"code": 22304, "cuda": "12.6", "net": [8, 7, 6, 5], "tuner": [3, 2],
               "profiler": [1], **NO_NEW},
    "2.26.2": {"code": 22602, "cuda": "12.2", "net": [10, 9, 8, 7, 6], "tuner": [4, 3, 2],
               "profiler": [3, 2, 1], **NO_NEW},
    "2.27.7": {"code": 22707, "cuda": "12.9", "net": [10, 9, 8, 7, 6], "tuner": [4, 3, 2],
               "profiler": [4, 3, 2, 1], **NO_NEW},
    "2.28.9": {"code": 22809, "cuda": "12.9", "net": [11, 10, 9, 8, 7, 6],
               "tuner": [5, 4, 3, 2], "profiler": [5, 4, 3, 2, 1],
               "env": [1], "gin": [11], "rma": []},
    "2.30.4": {"code": 23004, "cuda": "12.9", "net": [12, 11, 10, 9, 8, 7, 6],
               "tuner": [6, 5, 4, 3, 2], "profiler": [6, 5, 4, 3, 2, 1],
               "env": [1], "gin": [13, 12, 11], "rma": [13]},
    "2.30.7": {"code": 23007, "cuda": "13.3", "net": [12, 11, 10, 9, 8, 7, 6],
               "tuner": [6, 5, 4, 3, 2], "profiler": [6, 5, 4, 3, 2, 1],
               "env": [2, 1], "gin": [14, 13], "rma": [14, 13]},
    "2.32.3": {"code": 23203, "cuda": "12.9", "net": [12, 11, 10, 9, 8, 7, 6],
               "tuner": [6, 5, 4, 3, 2], "profiler": [7, 6, 5, 4, 3, 2, 1],
               "env": [2, 1], "gin": [14, 13], "rma": [16, 15, 14, 13]},
}
