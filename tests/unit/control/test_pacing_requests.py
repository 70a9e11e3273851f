"""Heartbeats count as requests in progress for ``dsec.pacing`` while they are answered — single and batched, on
the paths the ASGI shortcut and the FastAPI routes share — and stop counting when answered, however they end. A
real control plane over a real SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from conftest import ADMIN_TOKEN, control_plane_with_pool
from dsec import pacing
from dsec.control.ingest import handle_batch, handle_heartbeat
from dsec.control.metrics import ControlPlaneMetrics
from dsec.control.schemas import RegisterRequest
from dsec.control.service import ControlPlane


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with control_plane_with_pool(tmp_path) as plane:
        yield plane


async def test_a_beat_is_a_request_in_progress_while_it_is_applied(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = await cp.register(RegisterRequest(pool="pool-a", rank=0, role="learner"), ADMIN_TOKEN)
    metrics = ControlPlaneMetrics(cp.gauges)
    seen: list[int] = []
    real = cp.heartbeat

    async def heartbeat(w: Any, req: Any) -> dict[str, Any]:
        seen.append(pacing.in_progress())
        return await real(w, req)

    monkeypatch.setattr(cp, "heartbeat", heartbeat)
    body = orjson.dumps({"seq": 1, "acked_directive_version": 1, "metrics": {"step_ms_mean": 100.0}})
    status, _ = await handle_heartbeat(cp, metrics, reg["worker_id"], f"Bearer {reg['worker_token']}", body)
    assert status == 200
    item = {"worker_id": reg["worker_id"], "token": reg["worker_token"], "seq": 2, "acked_directive_version": 1}
    status, answer = await handle_batch(cp, metrics, f"Bearer {ADMIN_TOKEN}", orjson.dumps({"items": [item, item]}))
    assert status == 200 and [i["status"] for i in answer["items"]] == [200, 200]
    assert seen == [1, 1, 1]  # each beat, single or batched, was applied while its request counted
    assert pacing.in_progress() == 0  # and nothing counts once they are answered


async def test_a_refused_request_stops_counting_too(cp: ControlPlane) -> None:
    metrics = ControlPlaneMetrics(cp.gauges)
    status, _ = await handle_batch(cp, metrics, "Bearer nope", b'{"items": []}')
    assert status in (401, 403)
    status, _ = await handle_batch(cp, metrics, f"Bearer {ADMIN_TOKEN}", b"{not json")
    assert status == 422
    status, _ = await handle_heartbeat(cp, metrics, "w-unknown", "Bearer nope", b"{}")
    assert status in (401, 403, 404)
    assert pacing.in_progress() == 0
