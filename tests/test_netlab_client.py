"""The lab's batch client (testkit/netlab_client.py) without namespaces: what an attempt
reports must be what came back, not when its thread got the CPU."""

from __future__ import annotations

import socket
import time

from testkit import netlab_client


def test_an_answer_queued_before_the_deadline_is_not_a_timeout() -> None:
    """A thread of a parallel batch that runs again only after its deadline (five threads on
    one GIL, a loaded machine) must still read the RST already queued for its socket: it once
    reported "timeout" without looking, and a side-by-side flow whose five attempts were all
    refused read ('refused', 'timeout')."""
    with socket.socket() as holder:  # bound, not listening: a connect to it is reset
        holder.bind(("127.0.0.1", 0))
        with socket.socket() as sock:
            try:
                netlab_client.stream_connect(sock, holder.getsockname(), time.monotonic() - 1)
            except OSError as exc:
                assert netlab_client.classify(exc) == "refused"
            else:
                raise AssertionError("connected to a port nobody listens on")
