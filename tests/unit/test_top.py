"""`dsec top`'s pure part (dsec.cli_top): trouble ordering, rows built from API records, frames, the key map, and
that a frame drawn at 100 (and 80) columns keeps every id whole."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from dsec.top.frame import build_frame, build_rows, parse_gauges, worker_row
from dsec.top.keys import ViewState, split_keys
from dsec.top.view import detail_frame, detail_view, frame_view

CAP = 85.0


def _w(
    wid: str,
    *,
    state: str = "active",
    level: int = 0,
    phase: str = "closed",
    pool: str = "pool-a",
    group: str = "learners",
    role: str = "learner",
    quota: float | None = 8.0,
    **metrics: float,
) -> dict[str, Any]:
    return {
        "id": wid,
        "pool": pool,
        "group": group,
        "rank": 0,
        "role": role,
        "state": state,
        "metrics": metrics,
        "breaker": {"phase": phase, "level": level},
        "caps": {"latency_ms": CAP, "bandwidth_mbps": 128.0, "memory_gb": 12.0},
        "directive": {"desired": {"memory_quota_gb": quota}, "desired_version": 1, "acked_version": 1},
    }


def _ids(rows: Any) -> list[str]:
    return [r.id for r in rows]


def test_trouble_order_lost_then_breaker_then_sync_then_memory() -> None:
    workers = [
        _w("w-healthy", sync_cost_ms_p99=10.0, memory_used_gb=2.0),
        _w("w-mem-over", memory_used_gb=9.0),  # 9/8
        _w("w-mem-far-over", memory_used_gb=16.0),  # 16/8
        _w("w-sync-over", sync_cost_ms_p99=100.0),  # 100/85
        _w("w-sync-far-over", sync_latency_ms_p99=400.0),  # no cost: the latency p99 counts
        _w("w-recovering", level=1, phase="recovering"),
        _w("w-escalating", level=1, phase="escalating", sync_cost_ms_p99=500.0),
        _w("w-level-2", level=2, phase="recovering"),
        _w("w-half-open", phase="half_open"),
        _w("w-lost-b", state="lost"),
        _w("w-lost-a", state="lost", level=3, phase="open"),
        _w("w-gone", state="deregistered", level=3, phase="open"),
    ]
    assert _ids(build_rows(workers)) == [
        "w-lost-a",  # lost first (the level orders them among themselves)
        "w-lost-b",
        "w-level-2",  # then the breaker level
        "w-escalating",  # then, at the same level, the phase
        "w-recovering",
        "w-half-open",
        "w-sync-far-over",  # then how far sync is over the cap
        "w-sync-over",
        "w-mem-far-over",  # then how far memory is over the quota
        "w-mem-over",
        "w-healthy",  # deregistered workers are left out
    ]


def test_row_values_from_the_api_record() -> None:
    last = {"id": 7, "type": "meltdown", "ts": 100.0, "worker_id": "w-1"}
    r = worker_row(
        _w("w-1", level=1, phase="escalating", sync_cost_ms_p99=170.0, sync_latency_ms_p99=9.0, memory_used_gb=4.0,
           step_ms_mean=12.5),
        last,
    )  # fmt: skip
    assert (r.sync_ms, r.sync_metric, r.cap_ms) == (170.0, "sync_cost_ms_p99", CAP)
    assert r.sync_over == pytest.approx(2.0) and r.mem_over == 0.0
    assert (r.step_ms, r.mem_used_gb, r.mem_quota_gb) == (12.5, 4.0, 8.0)
    assert (r.last_event, r.last_event_at) == ("meltdown", 100.0)
    d = r.to_dict()
    assert d["sync_over_cap"] and not d["memory_over_quota"] and d["troubled"] and d["id"] == "w-1"


def test_row_without_figures_is_not_troubled() -> None:
    r = worker_row(_w("w-quiet", quota=None, memory_used_gb=50.0, sync_cost_ms_p99=float("nan")))
    assert r.sync_ms is None and r.sync_metric is None and r.mem_quota_gb is None
    assert r.sync_over == 0.0 and r.mem_over == 0.0 and not r.troubled
    assert r.last_event is None


def test_pool_group_and_substring_filters() -> None:
    workers = [
        _w("w-a1", pool="pool-a", group="actors", role="actor"),
        _w("w-a2", pool="pool-a", level=1, phase="escalating"),
        _w("w-b1", pool="pool-b"),
    ]
    assert _ids(build_rows(workers, pool="pool-a")) == ["w-a2", "w-a1"]
    assert _ids(build_rows(workers, group="actors")) == ["w-a1"]
    assert _ids(build_rows(workers, match="ESCAL")) == ["w-a2"]
    assert _ids(build_rows(workers, match="b1")) == ["w-b1"]
    last = {"w-b1": {"type": "restore", "ts": 1.0}}
    assert _ids(build_rows(workers, last, match="restore")) == ["w-b1"]


def _status() -> dict[str, Any]:
    return {
        "server_time": 1000.0,
        "pools": [
            {"name": "pool-a", "workers": {"active": 2, "lost": 1}, "meltdowns": 3, "directives_pending": 1},
            {"name": "pool-b", "workers": {"active": 1, "lost": 0}, "meltdowns": 0, "directives_pending": 0},
        ],
        "workers": [
            _w("w-a1", group="actors", role="actor", sync_cost_ms_p99=12.0),
            _w("w-a2", level=1, phase="escalating", sync_cost_ms_p99=300.0),
            _w("w-a3", state="lost"),
            _w("w-b1", pool="pool-b"),
        ],
    }


EVENTS = [
    {"id": 1, "ts": 990.0, "type": "registered", "worker_id": "w-a1", "pool": "pool-a", "data": {}},
    {"id": 2, "ts": 991.0, "type": "meltdown", "worker_id": "w-a2", "pool": "pool-a", "data": {"to": "escalating"}},
    {"id": 3, "ts": 992.0, "type": "directive_acked", "worker_id": "w-a2", "pool": "pool-a", "data": {}},
    {"id": 4, "ts": 993.0, "type": "lost", "worker_id": "w-a3", "pool": "pool-a", "data": {}},
    {"id": 5, "ts": 994.0, "type": "registered", "worker_id": "w-b1", "pool": "pool-b", "data": {}},
    {"id": 6, "ts": 995.0, "type": "pool_changed", "worker_id": None, "pool": "pool-a", "data": {}},
]

GAUGES = {"pool-a": {"utilization": 0.5, "sync_success": 0.99, "recovery_s": None}}


def test_frame_headline_rows_and_events_of_the_scope() -> None:
    frame = build_frame(_status(), GAUGES, EVENTS, pool="pool-a", recent=3)
    assert [w["id"] for w in frame["workers"]] == ["w-a3", "w-a2", "w-a1"]
    assert frame["workers"][0]["last_event"] == "lost"
    assert frame["workers"][1]["last_event"] == "meltdown"  # the directive ack after it is left out
    (head,) = frame["pools"]
    assert head == {
        "pool": "pool-a",
        "known": True,
        "utilization": 0.5,
        "sync_success": 0.99,
        "recovery_s": None,
        "meltdowns": 3,
        "active": 2,
        "lost": 1,
        "directives_pending": 1,
        "sync_slowdown": False,
    }
    assert [e["id"] for e in frame["events"]] == [2, 4, 6]  # pool-a's, acks left out, the last 3
    assert frame["scope"] == {"pool": "pool-a", "group": None, "filter": None}


def test_frame_without_pool_heads_every_pool_with_workers_and_group_scopes_events() -> None:
    frame = build_frame(_status(), {}, EVENTS)
    assert [h["pool"] for h in frame["pools"]] == ["pool-a", "pool-b"]
    assert frame["pools"][1]["utilization"] is None
    grouped = build_frame(_status(), {}, EVENTS, group="actors")
    assert [w["id"] for w in grouped["workers"]] == ["w-a1"]
    assert [e["id"] for e in grouped["events"]] == [1]  # the group's workers only, not the pool's other events
    missing = build_frame(_status(), {}, EVENTS, pool="pool-z")
    assert missing["workers"] == [] and missing["pools"][0]["known"] is False
    filtered = build_frame(_status(), {}, EVENTS, pool="pool-a", match="a2")
    assert [w["id"] for w in filtered["workers"]] == ["w-a2"]
    assert filtered["pools"][0]["lost"] == 1  # the filter narrows rows, not the headline


def test_parse_gauges_reads_the_headline_and_nan_is_none() -> None:
    text = "\n".join(
        [
            "# TYPE dsec_sandbox_utilization_rate gauge",
            'dsec_sandbox_utilization_rate{pool="pool-a"} 0.25',
            "# TYPE dsec_gradient_sync_success_rate gauge",
            'dsec_gradient_sync_success_rate{pool="pool-a"} NaN',
            "# TYPE dsec_snapshot_recovery_time gauge",
            'dsec_snapshot_recovery_time{pool="pool-a"} 1.5',
            "# TYPE dsec_heartbeats_total counter",
            'dsec_heartbeats_total{pool="pool-a"} 9',
            "",
        ]
    )
    assert parse_gauges(text) == {"pool-a": {"utilization": 0.25, "sync_success": None, "recovery_s": 1.5}}
    assert parse_gauges("not { prometheus") == {}


def test_keys_quit_filter_select_detail() -> None:
    ids = ["w-1", "w-2", "w-3"]
    s = ViewState()
    for key in ["/", "w", "-", "x", "\x7f", "2", "\r"]:
        s.apply(key, ids)
    assert s.match == "w-2" and not s.editing
    s.apply("esc", ids)
    assert s.match == ""
    s.apply("f", ids)
    s.apply("a", ids)
    s.apply("esc", ids)  # Esc while typing drops the filter
    assert s.match == "" and not s.editing
    for key in ["j", "down", "down", "down"]:
        s.apply(key, ids)
    assert s.selected == 2  # stops at the last row
    s.apply("k", ids)
    s.apply("\r", ids)
    assert s.detail == "w-2"
    s.apply("j", ids)
    assert s.selected == 1  # the list does not move under the detail
    s.apply("esc", ids)
    assert s.detail is None
    s.apply("d", ids)
    assert s.detail == "w-2"
    s.apply("q", ids)
    assert s.quit
    empty = ViewState()
    empty.apply("\r", [])
    assert empty.detail is None


def test_split_keys() -> None:
    assert split_keys("q") == ["q"]
    assert split_keys("\x1b[A\x1b[Bj") == ["up", "down", "j"]
    assert split_keys("\x1b") == ["esc"]
    assert split_keys("\x1b[Cx") == ["x"]  # right arrow: ignored


def _draw(renderable: Any, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [100, 80])
def test_frame_fits_the_width_with_ids_whole(width: int) -> None:
    status = _status()
    long_id = "w-0123456789abcdef0123456789"
    status["workers"].append(_w(long_id, memory_used_gb=10.0, step_ms_mean=3.0))
    frame = build_frame(status, GAUGES, EVENTS, pool="pool-a")
    out = _draw(frame_view(frame, width=width), width)
    lines = out.splitlines()
    assert all(len(line) <= width for line in lines), out
    table = out.split("Recent events")[0]
    rows = [line for line in table.splitlines() if "│ w-" in line]
    assert [next(w for w in ("w-a3", "w-a2", long_id, "w-a1") if w in r) for r in rows] == [
        "w-a3",
        "w-a2",
        long_id,  # memory 10/8: over its quota
        "w-a1",
    ]
    assert "10/8" in rows[2] and "300/85" in rows[1]
    assert "pool-a" in out and "util 50%" in out and "sync ok 99.00%" in out and "lost 1" in out


def test_detail_view_shows_directive_versions_metrics_events() -> None:
    w = _w("w-1", level=1, phase="escalating", sync_cost_ms_p99=300.0, step_ms_mean=4.0)
    directive = {
        "desired_version": 3,
        "acked_version": 2,
        "in_sync": False,
        "desired": {"version": 3, "compression_bits": 4, "grad_accum_steps": 2},
        "unappliable": {"precision": {"reason": "no bf16 on this card"}},
        "caps": {"latency_ms": CAP},
    }
    d = detail_frame(w, directive, EVENTS)
    assert len(d["events"]) <= 10
    out = _draw(detail_view(d), 100)
    assert "desired v3  acked v2  not acked yet" in out
    assert "compression_bits" in out and "unappliable precision" in out and "no bf16" in out
    assert "sync_cost_ms_p99" in out and "step_ms_mean" in out and "cap latency_ms" in out
    assert all(len(line) <= 100 for line in out.splitlines())


def test_live_screen_shows_a_window_of_rows_that_holds_the_selection() -> None:
    status = _status()
    status["workers"] = [_w(f"w-{i:02d}", step_ms_mean=float(i)) for i in range(40)]
    frame = build_frame(status, GAUGES, EVENTS, pool="pool-a")
    state = ViewState(selected=30)
    out = _draw(frame_view(frame, state=state, live=True, width=100, height=30), 100)
    assert len(out.splitlines()) <= 30, out
    assert "w-30" in out and "of 40 (j/k to scroll" in out and "w-00" not in out
    assert "Recent events" in out  # the events keep their room under the rows
