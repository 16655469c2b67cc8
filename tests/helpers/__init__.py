"""What the tests and benchmarks share, in one place (docs/development.md, "The tests").

- :mod:`.fingerprints`: the one fingerprint factory and its parts;
- :mod:`.inventory`: generated inventories (a node's spec, a standard 16-node cluster);
- :mod:`.properties`: node kinds and allocations for the property tests (hypothesis);
- :mod:`.cli`: the one way to run the admin CLI (``run_cli``);
- :mod:`.wait`: the one wait-until (``wait_until``);
- :mod:`.parts`: real parts (NCCL wheels, gcc-built plugins, ldconfig), ``unavailable``;
- :mod:`.munge`, :mod:`.slurm`: real munged daemons, the dev Slurm cluster;
- :mod:`.collector`, :mod:`.exporter`, :mod:`.gate`, :mod:`.load`: what the tests of
  the collector, its metrics, the gate and the load tests share.

The modules that define fixtures are pytest plugins, loaded by ``tests/conftest.py``.
The rule (``tests/test_testlib.py`` checks it): no file under tests/ or bench/ imports a
test module (``test_*``) or a conftest; what two of them share lives here. Test modules
import these as ``helpers.<module>`` (pytest puts tests/ on ``sys.path``); bench/
scripts put tests/ on ``sys.path`` first.
"""

from __future__ import annotations

from pathlib import Path

#: the checkout
REPO = Path(__file__).resolve().parents[2]
