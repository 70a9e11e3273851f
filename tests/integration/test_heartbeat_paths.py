"""The heartbeat is answered by the ASGI shortcut or by the FastAPI route: same answers either way,
and the route (with its body schema) stays documented in /openapi.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Harness, make_settings


@pytest.mark.parametrize("shortcut", [True, False])
def test_same_answers_on_both_paths(server_factory: Callable[..., Harness], tmp_path: Path, shortcut: bool) -> None:
    h = server_factory(settings=make_settings(tmp_path / "h", heartbeat_shortcut=shortcut), pools=True)
    w = h.register("pool-a")
    url = f"/v1/workers/{w.id}/heartbeat"
    auth = {"Authorization": f"Bearer {w.token}"}
    with h.http() as http:
        ok = http.post(url, json={"seq": 1, "metrics": {"x": 1.5}}, headers=auth)
        assert ok.status_code == 200 and ok.json()["duplicate"] is False
        again = http.post(url, json={"seq": 1, "metrics": {"x": 1.5}}, headers=auth)
        assert again.status_code == 200 and again.json()["duplicate"] is True
        bad = http.post(url, content=b'{"seq": 2, "metrics": {"loss": NaN}}', headers=auth)
        assert bad.status_code == 422 and bad.json()["field"] == "metrics.loss"
        broken = http.post(url, content=b'{"seq": ', headers=auth)
        assert broken.status_code == 422 and broken.json()["field"] == "body"
        old = http.post(url, json={"seq": 0}, headers=auth)
        assert old.status_code == 422 and old.json()["field"] == "seq"
        # A worker token is authenticated before the id is looked up: an unknown id is as forbidden as another's.
        unknown = http.post("/v1/workers/w-nope/heartbeat", json={"seq": 1}, headers=auth)
        assert unknown.status_code == 403 and unknown.json()["field"] == "worker_id"
        anonymous = http.post(url, json={"seq": 2})
        assert anonymous.status_code == 401
        metrics = http.get("/metrics").text
    assert (
        'dsec_http_requests_total{method="POST",route="/v1/workers/{worker_id}/heartbeat",status="200"} 2.0' in metrics
    )
    assert h.admin.worker(w.id)["metrics"] == {"x": 1.5}


def test_openapi_documents_the_heartbeat_body(server: Harness) -> None:
    with server.http() as http:
        spec = http.get("/openapi.json").json()
    op = spec["paths"]["/v1/workers/{worker_id}/heartbeat"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/HeartbeatRequest"
    schema = spec["components"]["schemas"]["HeartbeatRequest"]
    assert set(schema["properties"]) == {"seq", "acked_directive_version", "metrics", "events", "inferred_role"}
    assert "EventIn" in spec["components"]["schemas"]
    assert spec["components"]["schemas"]["InferredRole"]["required"] == ["role"]


@pytest.mark.parametrize("shortcut", [True, False])
def test_an_inferred_role_updates_the_record_once_with_an_event(
    server_factory: Callable[..., Harness], tmp_path: Path, shortcut: bool
) -> None:
    h = server_factory(settings=make_settings(tmp_path / "h", heartbeat_shortcut=shortcut), pools=True)
    w = h.register("pool-a")
    assert h.admin.worker(w.id)["role"] == "other"
    url = f"/v1/workers/{w.id}/heartbeat"
    auth = {"Authorization": f"Bearer {w.token}"}
    inferred = {"role": "actor", "evidence": {"env_steps": 1000, "optimizer_steps": 0}}
    with h.http() as http:
        ok = http.post(url, json={"seq": 1, "inferred_role": inferred}, headers=auth)
        assert ok.status_code == 200
        assert http.post(url, json={"seq": 1, "inferred_role": inferred}, headers=auth).json()["duplicate"] is True
        # The same role again changes nothing; an unknown role or field is refused, naming it.
        assert http.post(url, json={"seq": 2, "inferred_role": inferred}, headers=auth).status_code == 200
        bad = http.post(url, json={"seq": 3, "inferred_role": {"role": "critic"}}, headers=auth)
        assert bad.status_code == 422 and bad.json()["field"] == "inferred_role.role"
        extra = http.post(url, json={"seq": 3, "inferred_role": {"role": "actor", "why": 1}}, headers=auth)
        assert extra.status_code == 422 and extra.json()["field"] == "inferred_role.why"
        later = {"role": "learner", "evidence": {"optimizer_steps": 1, "gradient_syncs": 2}}
        assert http.post(url, json={"seq": 3, "inferred_role": later}, headers=auth).status_code == 200
    assert h.admin.worker(w.id)["role"] == "learner"
    evs = h.admin.all_events(worker_id=w.id, types=["role_inferred"])
    assert [(e["data"]["from"], e["data"]["to"]) for e in evs] == [("other", "actor"), ("actor", "learner")]
    assert evs[0]["data"]["evidence"] == {"env_steps": 1000, "optimizer_steps": 0}
    assert evs[0]["data"]["source"] == "worker"
    # Durable: a restarted control plane knows the inferred role.
    settings = h.settings
    h.close()
    again = server_factory(settings=settings)
    assert again.admin.worker(w.id)["role"] == "learner"


def test_workers_may_not_send_role_inferred_as_an_event(server: Harness) -> None:
    w = server.register("pool-a")
    with server.http() as http:
        r = http.post(
            f"/v1/workers/{w.id}/heartbeat",
            json={"seq": 1, "events": [{"type": "role_inferred", "data": {}}]},
            headers={"Authorization": f"Bearer {w.token}"},
        )
    assert r.status_code == 422 and r.json()["field"] == "events[0].type"
