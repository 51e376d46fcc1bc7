"""Reliability and security drills for pyproxy (docs/drills.md).

`drills.harness` runs them (the environment, the daemon, the probe, results, benches); one
module per kind of fault holds the drills themselves, parameterised by duration and scale:
`api` (API outage, 410 storm, stalled watch), `restart` (SIGKILL), `tamper`, `kernel`
(refused transactions), `burst`, `inputs` (bad input, injection, regressions, oversized
objects), `security`; `migration` (kube-proxy and back) and `fuzz` (generated objects).
`drills.scenarios` indexes them all, so the CI suite (tests/test_drills.py, short versions)
and `make chaos` (`python -m drills.chaos`, long versions that print the figures) run the
same code. The drills run on the test kit (testkit/: the lab, the API emulator, builders,
waits), imported by package name: run them from the repository root.
"""
