"""The cyclic collector's pause around big batches (pyproxy/sync/gcutil.py)."""

from __future__ import annotations

import gc

from pyproxy.sync.gcutil import gc_paused


def test_the_collector_comes_back_when_the_last_pause_ends() -> None:
    """Two initial lists converting in parallel threads: the first to finish must not turn
    the collector back on under the other."""
    assert gc.isenabled()
    services, slices = gc_paused(), gc_paused()
    services.__enter__()
    slices.__enter__()
    try:
        services.__exit__(None, None, None)
        assert not gc.isenabled()
    finally:
        slices.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
