"""Reliability and security drills for pyproxy (docs/drills.md).

`drills.harness` runs them (the environment, the daemon, the probe, results, benches); one
module per kind of fault holds the drills themselves, parameterised by duration and scale:
`api` (API outage, 410 storm, stalled watch), `restart` (SIGKILL), `tamper`, `kernel`
(refused transactions), `burst`, `inputs` (bad input, injection, regressions, oversized
objects), `security`; `migration` (kube-proxy and back) and `fuzz` (generated objects).
`drills.scenarios` indexes them all, so the CI suite (tests/test_drills.py, short versions)
and `make chaos` (drills/chaos.py, long versions that print the figures) run the same code.
"""

import sys
from pathlib import Path

# The drills run on the tests' kit (netlab, apiemu, builders, nftns): on the path before any
# drills module imports it.
_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
