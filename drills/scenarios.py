"""The drills: faults injected into a running `pyproxy run` in test network namespaces, with a
continuous connection probe through a Service, and the figures each one produces.

Every drill takes an `Env` (the standard netlab topology: node, client, backend pods) and its
length or scale as parameters, and returns a `Result`: connections attempted/failed, the time
to converge and the drill's own figures, plus `violations` (what went against the
expectation). tests/test_drills.py runs short versions and asserts there are no violations;
drills/chaos.py runs long versions and prints the figures.

The code lives in one module per kind of fault on a shared harness (drills/__init__.py);
this module indexes them: `from drills import scenarios as d; d.tamper(env)`.

Everything happens in namespaces the lab created (the daemon, the API emulator's socket, the
probes); the root namespace is never touched.
"""

from __future__ import annotations

from drills.api import (
    GONE_LOG,
    api_outage,
    reflector_read_timeout,
    stalled_watch,
    watch_gone_storm,
)
from drills.burst import (
    burst,
)
from drills.harness import (
    DOOMED,
    FRESH,
    HEALTHZ,
    LB,
    LB_HEALTH_PORT,
    METRICS,
    NODE,
    PYPROXY,
    STICKY,
    WEB,
    ApiBench,
    Daemon,
    DrillError,
    Env,
    Health,
    HealthWatch,
    Obj,
    Probe,
    Result,
    SnapshotBench,
    api_bench,
    api_errors,
    dump_yaml,
    ejections_logged,
    lb_local,
    markdown_table,
    running,
    snapshot_bench,
    stamp,
    sticky,
    until,
    wait_loaded,
    web,
    write_snapshot,
)
from drills.inputs import (
    KNOWN_BUGS,
    PAYLOADS,
    REGRESSIONS,
    Baseline,
    Expectation,
    InputCase,
    bad_input,
    check_programmed,
    injection,
    input_case,
    input_cases,
    offline_explain,
    oversized,
)
from drills.kernel import (
    kernel_faults,
)
from drills.restart import (
    kill_restart,
)
from drills.security import (
    KUBE_PROXY_HEALTHZ_FIELDS,
    health_surface,
    security,
    unprivileged_connect,
)
from drills.tamper import (
    CLASHES,
    ELEMENTS,
    HANGING,
    TAMPERS,
    tamper,
)

__all__ = [
    "CLASHES",
    "DOOMED",
    "ELEMENTS",
    "FRESH",
    "GONE_LOG",
    "HANGING",
    "HEALTHZ",
    "KNOWN_BUGS",
    "KUBE_PROXY_HEALTHZ_FIELDS",
    "LB",
    "LB_HEALTH_PORT",
    "METRICS",
    "NODE",
    "PAYLOADS",
    "PYPROXY",
    "REGRESSIONS",
    "STICKY",
    "TAMPERS",
    "WEB",
    "ApiBench",
    "Baseline",
    "Daemon",
    "DrillError",
    "Env",
    "Expectation",
    "Health",
    "HealthWatch",
    "InputCase",
    "Obj",
    "Probe",
    "Result",
    "SnapshotBench",
    "api_bench",
    "api_errors",
    "api_outage",
    "bad_input",
    "burst",
    "check_programmed",
    "dump_yaml",
    "ejections_logged",
    "health_surface",
    "injection",
    "input_case",
    "input_cases",
    "kernel_faults",
    "kill_restart",
    "lb_local",
    "markdown_table",
    "offline_explain",
    "oversized",
    "reflector_read_timeout",
    "running",
    "security",
    "snapshot_bench",
    "stalled_watch",
    "stamp",
    "sticky",
    "tamper",
    "unprivileged_connect",
    "until",
    "wait_loaded",
    "watch_gone_storm",
    "web",
    "write_snapshot",
]
