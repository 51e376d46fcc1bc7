"""bench/bench_vs_kube_proxy.py's own arithmetic: pyproxy's start read back from its log."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from bench.bench_vs_kube_proxy import start_timeline


def test_the_start_timeline_is_the_measured_start_only(tmp_path: Path) -> None:
    """Lines of an earlier start (the alternated cold starts share the log) and lines that
    are not JSON are left out; the phases are seconds after the exec."""
    started = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC).timestamp()

    def line(offset: float, event: str, **fields: object) -> str:
        stamp = datetime.fromtimestamp(started + offset, UTC).isoformat()
        return json.dumps({"timestamp": stamp, "event": event, **fields})

    log = tmp_path / "pyproxy.log"
    log.write_text("\n".join([
        line(-5.0, "starting"), line(-4.0, "synced", render_ms=9, kernel_ms=9, duration_ms=9),
        "Traceback (most recent call last):",
        line(0.4, "starting"),
        line(0.9, "initial_list_completed", source="Service"),
        line(1.0, "initial_list_completed", source="EndpointSlice"),
        line(1.3, "synced", render_ms=120.0, kernel_ms=80.0, duration_ms=250.0),
        line(2.0, "synced", render_ms=1.0, kernel_ms=1.0, duration_ms=3.0),
    ]))
    timeline = start_timeline(log, started)
    assert {k: round(v, 3) for k, v in timeline.items()} == {
        "starting": 0.4, "listed Service": 0.9, "listed EndpointSlice": 1.0,
        "first_sync_end": 1.3, "first_sync_render": 0.12, "first_sync_kernel": 0.08,
        "first_sync_duration": 0.25}
