"""Memory housekeeping for big batches (initial lists, full syncs)."""

from __future__ import annotations

import ctypes
import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

_lock = threading.Lock()
_pausing = 0  # threads inside gc_paused
_enabled_before = False


@dataclass
class Pause:
    """A pause in progress: `keep` may still be decided inside it (a sync knows only at its
    end whether it was a full one)."""

    keep: bool = False


@contextmanager
def gc_paused(keep: bool = False) -> Iterator[Pause]:
    """No cyclic garbage collection inside: a sync or a list allocates hundreds of
    thousands of short tuples and strings (no cycles), which would trigger collections of
    everything. The collector is one for the process and the initial lists run in parallel
    threads: it comes back when the last thread inside leaves. (It used to come back when
    the first list finished, for the others' remaining pages; at 10k x 10 that cost little,
    ~0.1 s of young collections either way, but nothing bounds how long the others run.)

    `keep` (or `Pause.keep` set inside): what was made inside lives on (a list's models, a
    full sync's store): frozen on the way out, as `gc.freeze` does, so the collector never
    walks it. Left young, all of it was walked by
    the first collection after the pause (~0.1 s at 10k services, between the last list and
    the first sync)."""
    global _pausing, _enabled_before
    pause = Pause(keep)
    with _lock:
        if not _pausing:
            _enabled_before = gc.isenabled()
            gc.disable()
        _pausing += 1
    try:
        yield pause
    finally:
        if pause.keep:
            gc.freeze()
        with _lock:
            _pausing -= 1
            if not _pausing and _enabled_before:
                gc.enable()


def trim_heap() -> None:
    """Give freed memory back to the system. A full sync (and the initial lists before it)
    allocates the whole script, libnftables' cache and the API's JSON; glibc keeps the freed
    arenas, which at 10k services doubled the resident size (650 → 300 MB when trimmed)."""
    with suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
