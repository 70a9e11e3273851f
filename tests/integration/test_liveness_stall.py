"""A stall of the control plane's own event loop is not blamed on its workers (a real uvicorn server on loopback,
a worker beating over real HTTP): beats that waited unread during the stall are not counted as missed, and a worker
that really stops beating is still lost within the usual detection time.

Here the beat that waited is dispatched before the late pass runs (asyncio reads ready sockets before it resumes a
task woken by a timer), so this passes with or without the pass's stall allowance (Reconciler._mark_lost; its unit
test in test_beats_contract.py pins the rule); it guards the outcome a user sees against a change of that order."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from conftest import Harness, wait_for

BEAT_S = 0.1


def _beating(server: Harness, worker_id: str, token: str, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        client = server.client(token)
        seq = 0
        while not stop.is_set():
            seq += 1
            with contextlib.suppress(Exception):  # a beat refused while the loop is stalled: the next one follows
                client.heartbeat(worker_id, seq)
            stop.wait(BEAT_S)

    t = threading.Thread(target=run, name="test-beats", daemon=True)
    t.start()
    return t


def test_a_stalled_loop_marks_no_beating_worker_lost(server: Harness) -> None:
    w = server.register("pool-a", heartbeat_interval_s=BEAT_S)
    window = server.settings.lost_after_beats * BEAT_S
    stop = threading.Event()
    beats = _beating(server, w.id, w.token, stop)
    try:
        wait_for(lambda: server.admin.worker(w.id)["beats"] >= 3, timeout=10, what="the first beats")
        loop: asyncio.AbstractEventLoop = server.server.server.servers[0].get_loop()
        stalled = threading.Event()
        # The whole loop blocked, as a long GC pause or a descheduled process would: 8 detection windows.
        loop.call_soon_threadsafe(lambda: (time.sleep(8 * window), stalled.set()))
        assert stalled.wait(30)
        time.sleep(4 * window)  # passes after the stall, while the beats keep coming
        assert server.admin.worker(w.id)["state"] == "active"
        assert server.admin.all_events(worker_id=w.id, types=["lost"]) == []
    finally:
        stop.set()
        beats.join(10)
    assert not beats.is_alive()
    # A worker that really went quiet is still lost, within the window plus a pass or two.
    t0 = time.monotonic()
    wait_for(lambda: server.admin.worker(w.id)["state"] == "lost", timeout=10, what="the silent worker to be lost")
    assert time.monotonic() - t0 < window + 2.0
    assert len(server.admin.all_events(worker_id=w.id, types=["lost"])) == 1
