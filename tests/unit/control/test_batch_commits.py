"""A batch of heartbeats writes its beats that carry events in one transaction (``ControlPlane.commits_together``),
and answers each of them only once it is durable. A real control plane over a real SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from conftest import ADMIN_TOKEN, control_plane_with_pool
from dsec.control.ingest import handle_batch
from dsec.control.metrics import ControlPlaneMetrics
from dsec.control.schemas import RegisterRequest
from dsec.control.service import ControlPlane
from dsec.control.store import EventQuery
from dsec.model import EventType


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    # No hot-row flush in between: the only commits are the batch's.
    async with control_plane_with_pool(tmp_path, flush_interval_s=60) as plane:
        yield plane


async def test_a_batchs_beats_with_events_are_committed_together(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = ControlPlaneMetrics(cp.gauges)
    workers = [await cp.register(RegisterRequest(pool="pool-a", rank=r, role="learner"), ADMIN_TOKEN) for r in range(8)]

    def item(reg: dict[str, Any], seq: int, events: list[dict[str, Any]]) -> dict[str, Any]:
        return {"worker_id": reg["worker_id"], "token": reg["worker_token"], "seq": seq,
                "acked_directive_version": reg["directive"]["version"], "metrics": {"step_ms_mean": 100.0},
                "events": events}  # fmt: skip

    auth = f"Bearer {ADMIN_TOKEN}"
    status, answer = await handle_batch(cp, metrics, auth, orjson.dumps({"items": [item(w, 1, []) for w in workers]}))
    assert status == 200 and {i["status"] for i in answer["items"]} == {200}

    inside = [False]
    submitted_inside: list[bool] = []
    real_block, real_submit = cp.commits_together, cp.writer.submit

    @contextmanager
    def block() -> Iterator[None]:
        with real_block():
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    def submit(batch: Any) -> Any:
        submitted_inside.append(inside[0])
        return real_submit(batch)

    monkeypatch.setattr(cp, "commits_together", block)
    monkeypatch.setattr(cp.writer, "submit", submit)
    log = [{"type": "log", "data": {"msg": "step"}}]
    items = [item(w, 2, log if r % 2 == 0 else []) for r, w in enumerate(workers)]
    commits = cp.writer.commits
    status, answer = await handle_batch(cp, metrics, auth, orjson.dumps({"items": items}))
    assert status == 200 and [i["status"] for i in answer["items"]] == [200] * 8
    assert submitted_inside == [True] * 4  # the four beats with an event, each submitted inside the block
    assert cp.writer.commits == commits + 1  # and written in one transaction
    stored = cp.store.query_events(EventQuery(types=(EventType.LOG,), limit=100))
    assert sorted(e.worker_id for e in stored) == sorted(w["worker_id"] for w in workers[::2])  # durable when answered
