"""Bad input against a REAL server, sent with raw httpx (not the Client, which would refuse to build
some of it): every rejection is a 4xx, never a 500, and its JSON body names the offending field.

One server serves the whole module (``api``); a baseline worker with events is registered first, and
the last test checks that, after everything above, the server still serves and that data is intact.
Tests of bugs that once made the server answer 500 use their own server, so a regression cannot take
the shared one down.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conftest import ADMIN_TOKEN, MAX_BODY_BYTES, Harness, Worker, make_settings, start_harness
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.service import ControlPlane
from dsec.control.store import EventQuery, open_store
from dsec.model import EventType, Pool

JSON_CT = {"content-type": "application/json"}


@dataclass
class Api:
    """The module's server plus the workers registered on it."""

    h: Harness
    baseline: Worker
    baseline_events: list[dict[str, Any]]
    baseline_view: dict[str, Any]
    http: httpx.Client

    def call(
        self, method: str, path: str, token: str | None = None, *, headers: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        """One request on its own connection, so no rejection can affect the next request."""
        hdrs = {"Connection": "close", **(headers or {})}
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        return self.http.request(method, path, headers=hdrs, **kw)

    def beat(
        self, w: Worker, body: Any = None, *, raw: bytes | None = None, token: str | None = None
    ) -> httpx.Response:
        tok = w.token if token is None else token
        if raw is not None:
            return self.call("POST", f"/v1/workers/{w.id}/heartbeat", tok, content=raw, headers=JSON_CT)
        return self.call("POST", f"/v1/workers/{w.id}/heartbeat", tok, json=body)

    def register(self, body: Any, token: str | None) -> httpx.Response:
        return self.call("POST", "/v1/workers/register", token, json=body)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.call(method, path, ADMIN_TOKEN, **kw)

    def patch(self, w: Worker, body: Any = None, raw: bytes | None = None) -> httpx.Response:
        if raw is not None:
            return self.admin("PATCH", f"/v1/workers/{w.id}/directive", content=raw, headers=JSON_CT)
        return self.admin("PATCH", f"/v1/workers/{w.id}/directive", json=body)

    def new_worker(self, pool: str = "pool-a") -> Worker:
        return self.h.register(pool)

    def worker_view(self, w: Worker) -> dict[str, Any]:
        r = self.admin("GET", f"/v1/workers/{w.id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def events_of(self, w: Worker) -> list[dict[str, Any]]:
        return self.h.admin.all_events(worker_id=w.id)


def rejected(resp: httpx.Response, status: int, field: str | None) -> dict[str, Any]:
    """Assert a well-formed rejection: ``status``, the error JSON shape, and the field it names."""
    assert resp.status_code < 500, f"server error {resp.status_code}: {resp.text[:500]}"
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:500]}"
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) >= {"error", "message", "field", "details"}, body
    assert isinstance(body["message"], str) and body["message"], body
    if field is not None:
        assert body["field"] == field, f"expected field {field!r}, got {body['field']!r}: {body['message']}"
    return dict(body)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    h = start_harness(make_settings(tmp_path_factory.mktemp("bad-input")), pools=True)
    try:
        baseline = h.register("pool-a", rank=7, host="baseline-host", heartbeat_interval_s=3600)
        with h.client(baseline.token) as c:
            c.heartbeat(
                baseline.id,
                1,
                metrics={"loss": 0.25},
                events=[{"type": "log", "data": {"msg": "baseline"}}, {"type": "snapshot", "data": {"step": 10}}],
            )
        events = h.admin.all_events(worker_id=baseline.id)
        assert [e["type"] for e in events] == ["registered", "log", "snapshot"]
        with h.http() as http:
            yield Api(h, baseline, events, h.admin.worker(baseline.id), http)
    finally:
        h.close()


@pytest.fixture
def worker(api: Api) -> Worker:
    """A fresh pool-a worker on the module's server."""
    return api.new_worker()


# -- malformed bodies -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"seq": 1,', id="truncated"),
        pytest.param(b"{seq: 1}", id="unquoted-key"),
        pytest.param(b"{'seq': 1}", id="single-quotes"),
        pytest.param(b'{"seq": 1}}', id="trailing-garbage"),
        pytest.param(b"not json at all", id="text"),
        pytest.param(b"\x00\x01\x02", id="binary"),
    ],
)
def test_malformed_json_is_422_naming_body(api: Api, worker: Worker, raw: bytes) -> None:
    body = rejected(api.beat(worker, raw=raw), 422, "body")
    assert "malformed JSON" in body["message"]
    assert body["details"][0]["type"] == "json_invalid"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        pytest.param(b"", "body", id="empty"),
        pytest.param(b"[1, 2]", "body", id="array"),
        pytest.param(b'"seq"', "body", id="string"),
        pytest.param(b"null", "body", id="null"),
    ],
)
def test_body_that_is_not_an_object_is_422(api: Api, worker: Worker, raw: bytes, field: str) -> None:
    rejected(api.beat(worker, raw=raw), 422, field)


def test_malformed_json_on_every_body_route(api: Api, worker: Worker) -> None:
    bad = b'{"pool": '
    rejected(
        api.call("POST", "/v1/workers/register", api.h.pool_tokens["pool-a"], content=bad, headers=JSON_CT), 422, "body"
    )
    rejected(api.admin("PUT", "/v1/pools/pool-z", content=bad, headers=JSON_CT), 422, "body")
    rejected(api.admin("PUT", "/v1/devices/d0", content=bad, headers=JSON_CT), 422, "body")
    rejected(api.admin("POST", "/v1/tokens", content=bad, headers=JSON_CT), 422, "body")
    rejected(api.patch(worker, raw=bad), 422, "body")


# -- wrong types -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"seq": "one"}, "seq", id="seq-str"),
        pytest.param({"seq": 1.5}, "seq", id="seq-fraction"),
        pytest.param({"seq": [1]}, "seq", id="seq-list"),
        pytest.param({"seq": None}, "seq", id="seq-null"),
        pytest.param({}, "seq", id="seq-missing"),
        pytest.param({"seq": 1, "metrics": [1, 2]}, "metrics", id="metrics-list"),
        pytest.param({"seq": 1, "metrics": {"loss": "low"}}, "metrics.loss", id="metric-str"),
        pytest.param({"seq": 1, "metrics": {"loss": {"v": 1}}}, "metrics.loss", id="metric-object"),
        pytest.param({"seq": 1, "events": {"type": "log"}}, "events", id="events-object"),
        pytest.param({"seq": 1, "events": ["log"]}, "events[0]", id="event-str"),
        pytest.param({"seq": 1, "events": [{"type": "log", "data": [1]}]}, "events[0].data", id="data-list"),
        pytest.param({"seq": 1, "events": [{"type": "log", "ts": "now"}]}, "events[0].ts", id="ts-str"),
        pytest.param({"seq": 1, "events": [{"data": {}}]}, "events[0].type", id="type-missing"),
        pytest.param({"seq": 1, "acked_directive_version": "v1"}, "acked_directive_version", id="ack-str"),
    ],
)
def test_heartbeat_wrong_types_name_the_field(api: Api, worker: Worker, body: Any, field: str) -> None:
    rejected(api.beat(worker, body), 422, field)
    assert api.worker_view(worker)["last_seq"] == 0  # nothing applied


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"pool": 123}, "pool", id="pool-int"),
        pytest.param({"pool": "pool-a", "role": "king"}, "role", id="role-enum"),
        pytest.param({"pool": "pool-a", "rank": "first"}, "rank", id="rank-str"),
        pytest.param({"pool": "pool-a", "group": "has space"}, "group", id="group-pattern"),
        pytest.param({"pool": "pool-a", "heartbeat_interval_s": "fast"}, "heartbeat_interval_s", id="iv-str"),
        pytest.param({"pool": "pool-a", "device": ["gpu0"]}, "device", id="device-list"),
        pytest.param({"role": "actor"}, "pool", id="pool-missing"),
    ],
)
def test_register_wrong_types_name_the_field(api: Api, body: Any, field: str) -> None:
    rejected(api.register(body, api.h.pool_tokens["pool-a"]), 422, field)


# -- NaN and Infinity ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "field"),
    [
        pytest.param(b'{"seq":1,"metrics":{"x":NaN}}', "metrics.x", id="metric-nan"),
        pytest.param(b'{"seq":1,"metrics":{"x":Infinity}}', "metrics.x", id="metric-inf"),
        pytest.param(b'{"seq":1,"metrics":{"x":-Infinity}}', "metrics.x", id="metric-neg-inf"),
        pytest.param(b'{"seq":1,"metrics":{"x":1e999}}', "metrics.x", id="metric-overflow"),
        pytest.param(b'{"seq":1,"metrics":{"ok":1.0,"bad":NaN}}', "metrics.bad", id="second-metric"),
        pytest.param(b'{"seq":NaN}', "seq", id="seq-nan"),
        pytest.param(b'{"seq":1,"events":[{"type":"log","ts":NaN}]}', "events[0].ts", id="event-ts-nan"),
        pytest.param(b'{"seq":1,"events":[{"type":"log","ts":Infinity}]}', "events[0].ts", id="event-ts-inf"),
        pytest.param(b'{"seq":1,"events":[{"type":"log","data":{"v":NaN}}]}', "events[0].data", id="data-nan"),
        pytest.param(
            b'{"seq":1,"events":[{"type":"log","data":{"a":[{"b":Infinity}]}}]}', "events[0].data", id="data-nested-inf"
        ),
    ],
)
def test_non_finite_numbers_in_heartbeat_are_422(api: Api, worker: Worker, raw: bytes, field: str) -> None:
    body = rejected(api.beat(worker, raw=raw), 422, field)
    assert "finite" in body["message"]
    assert api.worker_view(worker)["last_seq"] == 0


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        pytest.param("/v1/pools/pool-z", b'{"memory_base_gb": NaN}', "memory_base_gb", id="pool-nan"),
        pytest.param("/v1/pools/pool-z", b'{"snapshot_interval_s": Infinity}', "snapshot_interval_s", id="pool-inf"),
        pytest.param(
            "/v1/pools/pool-z",
            b'{"thresholds": {"latency_cap_ms": NaN}}',
            "thresholds.latency_cap_ms",
            id="threshold-nan",
        ),
        pytest.param(
            "/v1/devices/d0", b'{"id": "d0", "node": "n0", "memory_gb": Infinity}', "memory_gb", id="device-inf"
        ),
    ],
)
def test_non_finite_numbers_in_admin_bodies_are_422(api: Api, path: str, raw: bytes, field: str) -> None:
    rejected(api.admin("PUT", path, content=raw, headers=JSON_CT), 422, field)
    assert api.admin("GET", "/v1/pools/pool-z").status_code == 404  # nothing created


def test_non_finite_directive_value_is_422(api: Api, worker: Worker) -> None:
    rejected(api.patch(worker, raw=b'{"memory_quota_gb": NaN}'), 422, "memory_quota_gb")
    rejected(api.patch(worker, raw=b'{"snapshot_interval_s": Infinity}'), 422, "snapshot_interval_s")
    assert api.worker_view(worker)["directive"]["desired_version"] == 1


def test_non_finite_query_parameters_are_422(api: Api) -> None:
    rejected(api.admin("GET", "/v1/events", params={"since": "nan"}), 422, "since")
    rejected(api.admin("GET", "/v1/events", params={"until": "inf"}), 422, "until")


# -- negative and absurd sizes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"memory_base_gb": -1}, "memory_base_gb", id="base-negative"),
        pytest.param({"memory_base_gb": 1e9}, "memory_base_gb", id="base-absurd"),
        pytest.param({"memory_ceiling_gb": 4097}, "memory_ceiling_gb", id="ceiling-above-max"),
        pytest.param({"snapshot_interval_s": 0}, "snapshot_interval_s", id="snapshot-zero"),
        pytest.param({"snapshot_interval_s": 1e9}, "snapshot_interval_s", id="snapshot-absurd"),
        pytest.param({"snapshot_compression_level": 7}, "snapshot_compression_level", id="snapshot-level"),
        pytest.param(
            {"thresholds": {"bandwidth_cap_mbps": -5}}, "thresholds.bandwidth_cap_mbps", id="bandwidth-negative"
        ),
        pytest.param({"devices": ["ok", "-bad"]}, "devices[1]", id="device-name"),
    ],
)
def test_pool_sizes_out_of_range(api: Api, body: dict[str, Any], field: str) -> None:
    rejected(api.admin("PUT", "/v1/pools/pool-z", json=body), 422, field)
    assert api.admin("GET", "/v1/pools/pool-z").status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"rank": -1}, "rank", id="rank-negative"),
        pytest.param({"rank": 10**12}, "rank", id="rank-absurd"),
        pytest.param({"pid": -1}, "pid", id="pid-negative"),
        pytest.param({"heartbeat_interval_s": 0}, "heartbeat_interval_s", id="interval-zero"),
        pytest.param({"heartbeat_interval_s": -5}, "heartbeat_interval_s", id="interval-negative"),
        pytest.param({"heartbeat_interval_s": 1e9}, "heartbeat_interval_s", id="interval-absurd"),
        pytest.param({"host": "h" * 256}, "host", id="host-long"),
    ],
)
def test_register_sizes_out_of_range(api: Api, body: dict[str, Any], field: str) -> None:
    before = len(api.h.admin.workers(pool="pool-a"))
    rejected(api.register({"pool": "pool-a", **body}, api.h.pool_tokens["pool-a"]), 422, field)
    assert len(api.h.admin.workers(pool="pool-a")) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"seq": 0}, "seq", id="seq-zero"),
        pytest.param({"seq": -1}, "seq", id="seq-negative"),
        pytest.param({"seq": 2**63}, "seq", id="seq-absurd"),
        pytest.param({"seq": 1, "acked_directive_version": -1}, "acked_directive_version", id="ack-negative"),
        pytest.param({"seq": 1, "metrics": {f"m{i}": 1.0 for i in range(513)}}, "metrics", id="too-many-metrics"),
        pytest.param({"seq": 1, "events": [{"type": "log"}] * 257}, "events", id="too-many-events"),
        pytest.param({"seq": 1, "events": [{"type": "log", "ts": -1}]}, "events[0].ts", id="ts-negative"),
        pytest.param(
            {"seq": 1, "events": [{"type": "log", "data": {"blob": "x" * 20_000}}]},
            "events[0].data",
            id="data-too-large",
        ),
        pytest.param(
            {
                "seq": 1,
                "events": [{"type": "log", "data": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}}],
            },
            "events[0].data",
            id="data-too-deep",
        ),
    ],
)
def test_heartbeat_sizes_out_of_range(api: Api, worker: Worker, body: dict[str, Any], field: str) -> None:
    rejected(api.beat(worker, body), 422, field)
    assert api.worker_view(worker)["last_seq"] == 0


def test_metric_name_must_match_the_pattern(api: Api, worker: Worker) -> None:
    body = rejected(api.beat(worker, {"seq": 1, "metrics": {"1bad-name": 1.0}}), 422, None)
    assert body["field"].startswith("metrics.1bad-name"), body


def test_acked_version_never_issued_is_422(api: Api, worker: Worker) -> None:
    rejected(api.beat(worker, {"seq": 1, "acked_directive_version": 99}), 422, "acked_directive_version")
    assert api.worker_view(worker)["last_seq"] == 0


# -- unknown fields --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        pytest.param("heartbeat", {"seq": 1, "sneaky": True}, "sneaky", id="heartbeat"),
        pytest.param(
            "heartbeat", {"seq": 1, "events": [{"type": "log", "level": "x"}]}, "events[0].level", id="heartbeat-event"
        ),
        pytest.param("register", {"pool": "pool-a", "gpu_count": 8}, "gpu_count", id="register"),
        pytest.param("pool", {"memory_base_gb": 1, "color": "red"}, "color", id="pool"),
        pytest.param("pool", {"thresholds": {"jitter_ms": 1}}, "thresholds.jitter_ms", id="pool-thresholds"),
        pytest.param("pool", {"name": "pool-z"}, "name", id="pool-name-in-body"),
        pytest.param("device", {"id": "d0", "node": "n0", "vendor": "x"}, "vendor", id="device"),
        pytest.param("token", {"kind": "admin", "expires": 1}, "expires", id="token"),
        pytest.param("directive", {"turbo": True}, "turbo", id="directive"),
    ],
)
def test_unknown_fields_are_rejected_by_name(api: Api, worker: Worker, route: str, body: Any, field: str) -> None:
    if route == "heartbeat":
        resp = api.beat(worker, body)
    elif route == "register":
        resp = api.register(body, api.h.pool_tokens["pool-a"])
    elif route == "pool":
        resp = api.admin("PUT", "/v1/pools/pool-z", json=body)
    elif route == "device":
        resp = api.admin("PUT", "/v1/devices/d0", json=body)
    elif route == "token":
        resp = api.admin("POST", "/v1/tokens", json=body)
    else:
        resp = api.patch(worker, body)
    rejected(resp, 422, field)


# -- oversized bodies ------------------------------------------------------------------------------
def _padded(body: dict[str, Any], size: int) -> bytes:
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))  # trailing whitespace is valid JSON


def test_body_at_the_limit_is_accepted(api: Api, worker: Worker) -> None:
    resp = api.beat(worker, raw=_padded({"seq": 1}, MAX_BODY_BYTES))
    assert resp.status_code == 200, resp.text
    assert api.worker_view(worker)["last_seq"] == 1


def test_oversized_body_with_content_length_is_413(api: Api, worker: Worker) -> None:
    raw = _padded({"seq": 1}, MAX_BODY_BYTES + 1)
    body = rejected(api.beat(worker, raw=raw), 413, "body")
    assert str(MAX_BODY_BYTES + 1) in body["message"] and str(MAX_BODY_BYTES) in body["message"]
    assert api.worker_view(worker)["last_seq"] == 0


def test_oversized_admin_body_is_413(api: Api) -> None:
    raw = _padded({"memory_base_gb": 1}, MAX_BODY_BYTES * 2)
    rejected(api.admin("PUT", "/v1/pools/pool-z", content=raw, headers=JSON_CT), 413, "body")
    assert api.admin("GET", "/v1/pools/pool-z").status_code == 404


def test_oversized_chunked_body_is_413(api: Api, worker: Worker) -> None:
    raw = _padded({"seq": 1}, MAX_BODY_BYTES + 100)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 4096):
            yield raw[i : i + 4096]

    resp = api.call("POST", f"/v1/workers/{worker.id}/heartbeat", worker.token, content=chunks(), headers=JSON_CT)
    assert "content-length" not in {k.lower() for k in resp.request.headers}
    assert resp.request.headers["transfer-encoding"] == "chunked"
    rejected(resp, 413, "body")
    assert api.worker_view(worker)["last_seq"] == 0


def test_small_chunked_body_is_accepted(api: Api, worker: Worker) -> None:
    raw = json.dumps({"seq": 1, "metrics": {"loss": 0.5}}).encode()

    def chunks() -> Iterator[bytes]:
        yield raw[:5]
        yield raw[5:]

    resp = api.call("POST", f"/v1/workers/{worker.id}/heartbeat", worker.token, content=chunks(), headers=JSON_CT)
    assert resp.status_code == 200, resp.text
    assert api.worker_view(worker)["metrics"] == {"loss": 0.5}


# -- unknown ids, paths and query parameters -----------------------------------------------------------
def test_unknown_worker_id_is_404(api: Api, worker: Worker) -> None:
    # An admin learns that an id does not exist; a worker token is authenticated first and learns nothing: an
    # unknown id answers the same 403 as another worker's (docs/security.md, finding 9).
    body = rejected(api.beat(Worker("w-doesnotexist", worker.token, "pool-a", {}), {"seq": 1}), 403, "worker_id")
    assert "w-doesnotexist" in body["message"]
    rejected(api.admin("GET", "/v1/workers/w-doesnotexist"), 404, "worker_id")
    rejected(api.admin("GET", "/v1/workers/w-doesnotexist/directive"), 404, "worker_id")
    rejected(api.admin("PATCH", "/v1/workers/w-doesnotexist/directive", json={"precision": "bf16"}), 404, "worker_id")
    rejected(api.admin("POST", "/v1/workers/w-doesnotexist/deregister"), 404, "worker_id")
    rejected(api.call("POST", "/v1/workers/w-doesnotexist/deregister", worker.token), 403, "worker_id")


def test_unknown_pool_is_404(api: Api) -> None:
    rejected(api.register({"pool": "pool-nope"}, ADMIN_TOKEN), 404, "pool")
    rejected(api.admin("GET", "/v1/pools/pool-nope"), 404, "name")
    rejected(api.admin("DELETE", "/v1/pools/pool-nope"), 404, "name")
    rejected(api.admin("POST", "/v1/tokens", json={"kind": "pool", "pool": "pool-nope"}), 404, "pool")


def test_malformed_path_parameters_are_422(api: Api, worker: Worker) -> None:
    rejected(api.call("POST", f"/v1/workers/{'x' * 65}/heartbeat", worker.token, json={"seq": 1}), 422, "worker_id")
    rejected(api.admin("PUT", "/v1/pools/-leading-dash", json={}), 422, "name")
    rejected(api.admin("PUT", "/v1/devices/d0", json={"id": "d1", "node": "n0"}), 422, "id")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        pytest.param({"limit": 0}, "limit", id="limit-zero"),
        pytest.param({"limit": 100_000}, "limit", id="limit-absurd"),
        pytest.param({"limit": "ten"}, "limit", id="limit-str"),
        pytest.param({"cursor": -1}, "cursor", id="cursor-negative"),
        pytest.param({"since": -1}, "since", id="since-negative"),
        pytest.param({"type": "explosion"}, "type[0]", id="type-unknown"),
        pytest.param({"type": ["log", "explosion"]}, "type[1]", id="type-second"),
    ],
)
def test_bad_event_query_parameters(api: Api, params: dict[str, Any], field: str) -> None:
    rejected(api.admin("GET", "/v1/events", params=params), 422, field)


def test_bad_list_and_deregister_parameters(api: Api, worker: Worker) -> None:
    rejected(api.admin("GET", "/v1/workers", params={"state": "zombie"}), 422, "state")
    rejected(
        api.call("POST", f"/v1/workers/{worker.id}/deregister", worker.token, params={"reason": "r" * 201}),
        422,
        "reason",
    )
    assert api.worker_view(worker)["state"] == "active"


# -- sequence numbers: replay, reordering, retries ------------------------------------------------------
def test_replayed_or_out_of_order_seq_is_409(api: Api, worker: Worker) -> None:
    assert api.beat(worker, {"seq": 5, "metrics": {"loss": 1.0}}).status_code == 200
    body = rejected(api.beat(worker, {"seq": 3, "metrics": {"loss": 9.0}}), 409, "seq")
    assert "3" in body["message"] and "5" in body["message"]
    rejected(api.beat(worker, {"seq": 1}), 409, "seq")
    view = api.worker_view(worker)
    assert view["last_seq"] == 5 and view["metrics"] == {"loss": 1.0} and view["beats"] == 1


def test_exact_retry_of_last_seq_is_a_duplicate_and_not_applied_twice(api: Api, worker: Worker) -> None:
    marker = uuid.uuid4().hex
    beat = {"seq": 1, "metrics": {"loss": 0.5}, "events": [{"type": "alert", "data": {"marker": marker}}]}
    first = api.beat(worker, beat)
    assert first.status_code == 200 and first.json()["duplicate"] is False
    for _ in range(3):
        again = api.beat(worker, beat)
        assert again.status_code == 200, again.text
        assert again.json()["duplicate"] is True
        assert again.json()["seq"] == 1
    # A retry carrying different content is still the same beat: nothing of it is applied.
    changed = api.beat(worker, {"seq": 1, "metrics": {"loss": 99.0}, "events": [{"type": "log"}]})
    assert changed.status_code == 200 and changed.json()["duplicate"] is True

    alerts = [e for e in api.events_of(worker) if e["type"] == "alert"]
    # Recorded as the worker sent it, attributed to the worker (docs/security.md, finding 6).
    assert len(alerts) == 1 and alerts[0]["data"] == {"marker": marker, "source": "worker"}
    assert not [e for e in api.events_of(worker) if e["type"] == "log"]
    view = api.worker_view(worker)
    assert view["beats"] == 1 and view["last_seq"] == 1 and view["metrics"] == {"loss": 0.5}
    # The next seq is applied normally; the old one is now out of order.
    assert api.beat(worker, {"seq": 2}).json()["duplicate"] is False
    rejected(api.beat(worker, beat), 409, "seq")


async def test_concurrent_retry_of_a_beat_with_events_is_not_double_applied(tmp_path: Any) -> None:
    # Driven through ControlPlane (the service behind the route) on a real SQLite store, so that the
    # interleaving is deterministic: gather() runs the retry while the original awaits its commit.
    settings = make_settings(tmp_path)
    store = open_store(settings.database_url)
    cp = ControlPlane(settings, store)
    try:
        await cp.put_pool(Pool("pool-a"))
        reg = await cp.register(RegisterRequest(pool="pool-a"), ADMIN_TOKEN)
        w = cp.state.workers[reg["worker_id"]]
        beat = HeartbeatRequest(seq=1, events=[{"type": "alert", "data": {"once": True}}])
        answers = await asyncio.gather(cp.heartbeat(w, beat), cp.heartbeat(w, beat))
        assert sorted(a["duplicate"] for a in answers) == [False, True]
        alerts = store.query_events(EventQuery(worker_id=w.id, types=(EventType.ALERT,)))
        assert len(alerts) == 1, f"the retried beat's event was stored {len(alerts)} times"
    finally:
        cp.close()
        store.close()


async def test_concurrent_directive_patches_are_not_lost(tmp_path: Any) -> None:
    settings = make_settings(tmp_path)
    store = open_store(settings.database_url)
    cp = ControlPlane(settings, store)
    try:
        await cp.put_pool(Pool("pool-a"))
        reg = await cp.register(RegisterRequest(pool="pool-a"), ADMIN_TOKEN)
        w = cp.state.workers[reg["worker_id"]]
        a, b = await asyncio.gather(
            cp.set_directive(w, {"compression_bits": 8}, actor="api"),
            cp.set_directive(w, {"precision": "bf16"}, actor="api"),
        )
        assert {a.version, b.version} == {2, 3}, "two changes must get two versions"
        stored = {d.worker_id: d for d in store.list_directives()}[w.id]
        assert (stored.fields.compression_bits, stored.fields.precision) == (8, "bf16")
    finally:
        cp.close()
        store.close()


# -- authentication and authorisation ----------------------------------------------------------------
def test_worker_token_cannot_heartbeat_as_a_worker_of_another_pool(api: Api) -> None:
    a = api.new_worker("pool-a")
    b = api.new_worker("pool-b")
    body = rejected(api.beat(b, {"seq": 1, "metrics": {"x": 1.0}}, token=a.token), 403, "worker_id")
    assert a.id in body["message"] and b.id in body["message"]
    assert "pool-b" not in body["message"], "a 403 must not tell a worker where another worker runs"
    view = api.worker_view(b)
    assert view["last_seq"] == 0 and view["metrics"] == {}
    # ... nor as another worker of its own pool, nor read or deregister it.
    a2 = api.new_worker("pool-a")
    rejected(api.beat(a2, {"seq": 1}, token=a.token), 403, "worker_id")
    rejected(api.call("GET", f"/v1/workers/{b.id}/directive", a.token), 403, "worker_id")
    rejected(api.call("POST", f"/v1/workers/{b.id}/deregister", a.token), 403, "worker_id")
    assert api.worker_view(b)["state"] == "active"


def test_pool_token_cannot_register_into_another_pool(api: Api) -> None:
    before = len(api.h.admin.workers(pool="pool-a"))
    body = rejected(api.register({"pool": "pool-a"}, api.h.pool_tokens["pool-b"]), 403, "pool")
    assert "pool-a" in body["message"] and "pool-b" in body["message"]
    assert len(api.h.admin.workers(pool="pool-a")) == before


def test_pool_token_cannot_heartbeat(api: Api, worker: Worker) -> None:
    rejected(api.beat(worker, {"seq": 1}, token=api.h.pool_tokens["pool-a"]), 403, "Authorization")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/workers/register", {"pool": "pool-a"}),
        ("POST", "/v1/workers/{wid}/heartbeat", {"seq": 1}),
        ("POST", "/v1/workers/{wid}/deregister", None),
        ("GET", "/v1/workers/{wid}/directive", None),
        ("PATCH", "/v1/workers/{wid}/directive", {"precision": "bf16"}),
        ("GET", "/v1/workers", None),
        ("GET", "/v1/pools", None),
        ("PUT", "/v1/pools/pool-z", {}),
        ("DELETE", "/v1/pools/pool-b", None),
        ("POST", "/v1/tokens", {"kind": "admin"}),
        ("GET", "/v1/events", None),
        ("GET", "/v1/status", None),
    ],
)
def test_missing_or_malformed_token_is_401(api: Api, worker: Worker, method: str, path: str, body: Any) -> None:
    for header in (None, "", "Bearer", "Token dsa_x", "Basic dXNlcjpwYXNz", worker.token):
        headers = {} if header is None else {"Authorization": header}
        resp = api.call(method, path.format(wid=worker.id), headers=headers, json=body)
        rejected(resp, 401, "Authorization")
    assert api.worker_view(worker)["state"] == "active"
    assert api.worker_view(worker)["last_seq"] == 0


def test_unknown_token_is_403(api: Api, worker: Worker) -> None:
    rejected(api.beat(worker, {"seq": 1}, token="dsw_forged"), 403, "Authorization")
    rejected(api.register({"pool": "pool-a"}, "dsp_forged"), 403, "Authorization")
    rejected(api.call("GET", "/v1/status", "dsa_forged"), 403, "Authorization")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/status", None),
        ("GET", "/v1/workers", None),
        ("GET", "/v1/workers/{wid}", None),
        ("PATCH", "/v1/workers/{wid}/directive", {"compression_bits": 8}),
        ("GET", "/v1/pools", None),
        ("PUT", "/v1/pools/pool-a", {"memory_base_gb": 1}),
        ("DELETE", "/v1/pools/pool-b", None),
        ("GET", "/v1/devices", None),
        ("PUT", "/v1/devices/d0", {"id": "d0", "node": "n0"}),
        ("GET", "/v1/events", None),
        ("POST", "/v1/tokens", {"kind": "admin"}),
        ("POST", "/v1/tokens", {"kind": "pool", "pool": "pool-a"}),
    ],
)
def test_admin_route_with_worker_or_pool_token_is_403(
    api: Api, worker: Worker, method: str, path: str, body: Any
) -> None:
    before = api.h.admin.pools()
    for token in (worker.token, api.h.pool_tokens["pool-a"], api.h.pool_tokens["pool-b"]):
        rejected(api.call(method, path.format(wid=worker.id), token, json=body), 403, "Authorization")
    assert api.h.admin.pools() == before
    assert api.worker_view(worker)["directive"]["desired_version"] == 1


# -- event types reserved for the control plane --------------------------------------------------------
@pytest.mark.parametrize(
    "etype", ["meltdown", "registered", "lost", "rejoined", "directive_acked", "policy_action", "pool_changed"]
)
def test_reserved_event_type_from_a_worker_is_422(api: Api, worker: Worker, etype: str) -> None:
    body = rejected(api.beat(worker, {"seq": 1, "events": [{"type": etype}]}), 422, "events[0].type")
    assert etype in body["message"]
    assert [e["type"] for e in api.events_of(worker)] == ["registered"]


def test_reserved_event_type_rejects_the_whole_beat(api: Api, worker: Worker) -> None:
    beat = {
        "seq": 1,
        "metrics": {"loss": 1.0},
        "events": [{"type": "log", "data": {"m": "ok"}}, {"type": "meltdown", "data": {}}],
    }
    rejected(api.beat(worker, beat), 422, "events[1].type")
    view = api.worker_view(worker)
    assert view["last_seq"] == 0 and view["metrics"] == {}
    assert [e["type"] for e in api.events_of(worker)] == ["registered"]
    assert api.h.admin.status()["pools"][0]["meltdowns"] == 0


def test_unknown_event_type_is_422(api: Api, worker: Worker) -> None:
    rejected(api.beat(worker, {"seq": 1, "events": [{"type": "explosion"}]}), 422, "events[0].type")


# -- directive patches --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("patch", "field"),
    [
        pytest.param({"compression_bits": 3}, "compression_bits", id="bits-3"),
        pytest.param({"compression_bits": "8"}, "compression_bits", id="bits-str"),
        pytest.param({"precision": "fp8"}, "precision", id="precision-fp8"),
        pytest.param({"grad_accum_steps": 0}, "grad_accum_steps", id="accum-zero"),
        pytest.param({"grad_accum_steps": 4096}, "grad_accum_steps", id="accum-absurd"),
        pytest.param({"sync_priority": 11}, "sync_priority", id="priority"),
        pytest.param({"memory_quota_gb": -1}, "memory_quota_gb", id="quota-negative"),
        pytest.param({"memory_quota_gb": 1e9}, "memory_quota_gb", id="quota-absurd"),
        pytest.param({"snapshot_interval_s": 0.5}, "snapshot_interval_s", id="snapshot-short"),
        pytest.param({"snapshot_compression_level": -1}, "snapshot_compression_level", id="snapshot-level"),
        pytest.param({"snapshot_compression_level": 1.5}, "snapshot_compression_level", id="snapshot-level-float"),
        pytest.param({"target_device": "bad device"}, "target_device", id="device-pattern"),
        pytest.param({"async_sampling": "maybe"}, "async_sampling", id="async-str"),
        pytest.param({"memory_quota_gb": 10, "memory_ceiling_gb": 5}, "memory_ceiling_gb", id="ceiling<quota"),
        pytest.param({"memory_ceiling_gb": 1}, "memory_ceiling_gb", id="ceiling<current-quota"),
        pytest.param({"precision": None}, "precision", id="precision-null"),
        pytest.param({"latency_cap_ms": 0}, "latency_cap_ms", id="latency-cap-zero"),
        pytest.param({"latency_cap_ms": "fast"}, "latency_cap_ms", id="latency-cap-str"),
        pytest.param({"bandwidth_cap_mbps": -5}, "bandwidth_cap_mbps", id="bandwidth-cap-negative"),
        pytest.param({"bandwidth_cap_mbps": 1e12}, "bandwidth_cap_mbps", id="bandwidth-cap-absurd"),
        pytest.param({"bogus": 1}, "bogus", id="unknown"),
        pytest.param({"precision": "bf16", "bogus": 1}, "bogus", id="unknown-with-valid"),
        pytest.param({}, "body", id="empty"),
    ],
)
def test_invalid_directive_patch_is_422(api: Api, worker: Worker, patch: dict[str, Any], field: str) -> None:
    before = api.worker_view(worker)["directive"]
    rejected(api.patch(worker, patch), 422, field)
    assert api.worker_view(worker)["directive"] == before
    assert not [e for e in api.events_of(worker) if e["type"] == "directive_set"]


def test_compression_bits_null_returns_to_the_probe_default_and_32_is_kept(api: Api, worker: Worker) -> None:
    # null is not "keep": it is the probe's configured default, distinct from 32 (uncompressed)
    for bits in (32, None, 8, None):
        resp = api.patch(worker, {"compression_bits": bits})
        assert resp.status_code == 200, resp.text
        assert resp.json()["desired"]["compression_bits"] == bits


def test_directive_patch_for_a_deregistered_worker_is_409(api: Api, worker: Worker) -> None:
    assert api.call("POST", f"/v1/workers/{worker.id}/deregister", worker.token).status_code == 200
    rejected(api.patch(worker, {"precision": "bf16"}), 409, "worker_id")


def test_heartbeat_from_a_deregistered_worker_is_rejected(api: Api, worker: Worker) -> None:
    assert api.call("POST", f"/v1/workers/{worker.id}/deregister", worker.token).status_code == 200
    resp = api.beat(worker, {"seq": 1, "events": [{"type": "log"}]})
    assert resp.status_code in (404, 409, 410), resp.text
    rejected(resp, resp.status_code, "worker_id")


def test_token_request_validation(api: Api) -> None:
    body = rejected(api.admin("POST", "/v1/tokens", json={"kind": "pool"}), 422, "body")
    assert "pool" in body["message"]
    body = rejected(api.admin("POST", "/v1/tokens", json={"kind": "admin", "pool": "pool-a"}), 422, "body")
    assert "pool" in body["message"]
    rejected(api.admin("POST", "/v1/tokens", json={"kind": "root"}), 422, "kind")
    rejected(api.admin("POST", "/v1/tokens", json={"kind": "admin", "label": "l" * 201}), 422, "label")


def test_deleting_a_pool_with_workers_is_409(api: Api) -> None:
    rejected(api.admin("DELETE", "/v1/pools/pool-a"), 409, "name")
    assert api.admin("GET", "/v1/pools/pool-a").status_code == 200


# -- known bugs: each on its own server, because some of them make it answer 500 ----------------------
def stop_before_asserting(server: Harness) -> None:
    """Stop the server (joining its thread) before a failing assertion is reported.

    After a 500, uvicorn formats the exception's traceback on the server thread while the client already
    has the answer; on CPython 3.11 that formatting (ast-based caret anchors) racing with pytest's own
    report formatting on the main thread can raise "SystemError: AST constructor recursion depth
    mismatch" and abort the session with an INTERNALERROR.
    """
    server.close()


@pytest.mark.parametrize("body", [{"memory_base_gb": 10, "memory_ceiling_gb": 5}, {"memory_base_gb": 20}])
def test_pool_ceiling_below_base_is_422(server: Harness, body: dict[str, Any]) -> None:
    with server.http() as c:
        resp = c.put("/v1/pools/pool-z", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    stop_before_asserting(server)
    rejected(resp, 422, "memory_ceiling_gb")


@pytest.mark.parametrize("field", ["grad_accum_steps", "sync_priority", "async_sampling"])
def test_directive_patch_null_for_a_required_field_is_422(server: Harness, field: str) -> None:
    w = server.register("pool-a")
    with server.http() as c:
        resp = c.patch(
            f"/v1/workers/{w.id}/directive", json={field: None}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
    stop_before_asserting(server)
    rejected(resp, 422, field)


@pytest.mark.parametrize("name", ["path", "body", "query", "header"])
def test_metric_named_like_a_location_keyword_is_named(server: Harness, name: str) -> None:
    w = server.register("pool-a")
    with server.http() as c:
        resp = c.post(
            f"/v1/workers/{w.id}/heartbeat",
            content=b'{"seq":1,"metrics":{"%s":NaN}}' % name.encode(),
            headers={**JSON_CT, "Authorization": f"Bearer {w.token}"},
        )
    rejected(resp, 422, f"metrics.{name}")


def test_body_that_is_not_utf8_is_rejected_with_the_error_shape(server: Harness) -> None:
    w = server.register("pool-a")
    with server.http() as c:
        resp = c.post(
            f"/v1/workers/{w.id}/heartbeat",
            content=b'{"seq":1,"events":[{"type":"log","data":{"m":"\xff"}}]}',
            headers={**JSON_CT, "Authorization": f"Bearer {w.token}"},
        )
    assert resp.status_code in (400, 422)
    rejected(resp, resp.status_code, "body")


# -- after all of the above ----------------------------------------------------------------------------
def test_server_survives_and_stored_data_is_intact(api: Api) -> None:
    assert api.call("GET", "/healthz").status_code == 200
    ready = api.call("GET", "/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    # The baseline worker and its events are exactly as before.
    assert api.events_of(api.baseline) == api.baseline_events
    view = api.h.admin.worker(api.baseline.id)
    assert view == api.baseline_view
    assert view["rank"] == 7 and view["host"] == "baseline-host" and view["metrics"] == {"loss": 0.25}
    # It still works: the next beat is applied, its token is still its own.
    with api.h.client(api.baseline.token) as c:
        answer = c.heartbeat(api.baseline.id, 2, events=[{"type": "log", "data": {"msg": "after"}}])
    assert answer["duplicate"] is False
    assert [e["type"] for e in api.events_of(api.baseline)] == ["registered", "log", "snapshot", "log"]
    assert {p["name"] for p in api.h.admin.pools()} == {"pool-a", "pool-b"}
    # No request on this server was answered with a 5xx.
    metrics = api.h.admin.metrics_text()
    assert 'status="5' not in metrics
