"""Watches against the real API server: a quiet watch never lists again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from testkit.controlplane import (
    ControlPlane,
    Daemon,
    Kube,
    apply_manifests,
    service_account_token,
    start_pyproxy,
    wait_for,
)
from testkit.fixtures import requires_netns
from testkit.netlab import Lab

pytestmark = [pytest.mark.netns, pytest.mark.k8s, requires_netns]


# -- a quiet watch ---------------------------------------------------------------------------
#
# A real API server may send nothing at all on a healthy watch of a kind nobody changes
# (ServiceCIDR here) until the watch's timeoutSeconds (5 to 10 min): its watch cache sends a
# bookmark only with a resourceVersion newer than the watch's, and learns of one for such a
# kind only from an etcd progress notification (cluster/watch.py's docstring). A client read
# timeout shorter than timeoutSeconds ends such a watch as an error: with 60 s every quiet
# watch relisted about once a minute; with 150 s the ServiceCIDR watch failed this test in one
# of ten runs. The read timeout is now timeoutSeconds + 30 s. The daemon below starts after
# the other tests here have made their changes and sits through the rest of the suite
# (k8s_last puts the check at the very end of the session; at least QUIET_SECONDS, more than
# the old 150 s), so its watches are quiet for minutes without the suite sleeping for it.

QUIET_SECONDS = 180.0


@dataclass
class QuietWatcher:
    # content type → the daemon asking for it (the watches are tested in both)
    daemons: dict[str, Daemon]
    started: float


CONTENT_TYPES = {"application/vnd.kubernetes.protobuf": "quiet",
                 "application/json": "quiet-json"}


@pytest.fixture(scope="session")
def quiet_watcher(control_plane: ControlPlane) -> Iterator[QuietWatcher]:
    kube = Kube(control_plane.admin_client())
    apply_manifests(kube)
    with Lab() as lab:
        daemons = {}
        for content_type, name in CONTENT_TYPES.items():
            ns = lab.add_ns(name)
            attachment = control_plane.attach(ns)
            kube.node(f"node-{name}", (attachment.address,), zone="zone-9", region="region-9")
            kubeconfig = control_plane.node_kubeconfig(lab.workdir / f"{name}.kubeconfig",
                                                       service_account_token(kube))
            daemons[content_type] = start_pyproxy(
                lab, ns, kubeconfig, f"node-{name}", "--bind-address", attachment.address,
                "--kube-api-content-type", content_type, name=f"pyproxy-{name}")
        for content_type, daemon in daemons.items():
            wait_for(lambda d=daemon: len(d.watches()) >= 3
                     and all(w["synced"] for w in d.watches().values()), 30,
                     f"the quiet daemon's initial lists ({content_type})")
        try:
            yield QuietWatcher(daemons, time.monotonic())
        finally:
            for name, daemon in zip(CONTENT_TYPES.values(), daemons.values(), strict=False):
                lab.stop_process(daemon.proc)
                kube.core.delete_node(f"node-{name}")


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_quiet_watch_begins(quiet_watcher: QuietWatcher, content_type: str) -> None:
    watches = quiet_watcher.daemons[content_type].watches()
    assert {"Service", "EndpointSlice", "Node"} <= set(watches)
    assert all(w["lists"] == 1 for w in watches.values()), watches
    # the first lists are one page each (few objects), so every watch is a plain one
    encoding = "json" if content_type == "application/json" else "protobuf"
    assert {w["watch_encoding"] for w in watches.values()} == {encoding}, watches


@pytest.mark.k8s_last
@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_quiet_watch_relists_zero_times(quiet_watcher: QuietWatcher, content_type: str) -> None:
    remaining = quiet_watcher.started + QUIET_SECONDS - time.monotonic()
    if remaining > 0:  # the rest of the suite usually takes longer than this
        time.sleep(remaining)
    daemon = quiet_watcher.daemons[content_type]
    watches = daemon.watches()
    assert daemon.proc.poll() is None
    log = daemon.log.read_text().splitlines()
    for kind, status in watches.items():
        # The daemon's lines about this kind say when (seen once in ten runs before the read
        # timeout was above timeoutSeconds: ServiceCIDR's watch had no byte for 150 s).
        lines = "\n".join([line for line in log if f"kind={kind} " in line][-8:])
        assert status["lists"] == 1, f"{kind} listed again: {status}\n{lines}"
        assert status["errors"] == 0, f"{kind}: {status['last_error']}\n{lines}"
        assert status["connected"], status
