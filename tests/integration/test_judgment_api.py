"""Health judgment through the real API: workers beat over HTTP against a real control plane, and what the
judgment decides shows up where an operator and the worker see it (beat answers, directives, events,
/metrics, /v1/status, a signed webhook).

Covers the circuit breaker (escalation in the detecting beat's answer, one level per ack, recovery),
per-worker caps, stuck episodes, precision fallback and restore, alert routing with de-duplication,
elastic memory quotas, and fleet comparison (a straggler vs a whole-pool slowdown)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, Worker, http_receiver, make_settings, wait_for
from dsec.alerts import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, verify
from dsec.breaker import BreakerConfig
from dsec.client import ApiError, Client
from dsec.control.judge import JudgeConfig

FAST_BREAKER = BreakerConfig(window_s=1.0, min_samples=3, recovery_s=0.5, max_recovery_s=2.0)
BEAT_S = 0.05


class Beater:
    """One worker's side of the protocol: real HTTP heartbeats with its own token, explicit acks."""

    def __init__(self, h: Harness, w: Worker) -> None:
        self.h = h
        self.w = w
        self.id = w.id
        self.client: Client = h.client(w.token)
        self.seq = 0
        self.directive: dict[str, Any] = dict(w.answer["directive"])
        self.ack = int(self.directive["version"])  # the registration's directive is in force

    def beat(
        self, metrics: Mapping[str, float] | None = None, events: Iterable[Mapping[str, Any]] = ()
    ) -> dict[str, Any]:
        self.seq += 1
        answer = self.client.heartbeat(
            self.id, self.seq, acked_directive_version=self.ack, metrics=metrics, events=list(events)
        )
        if answer["directive"] is not None:
            self.directive = answer["directive"]
        return answer

    def ack_latest(self) -> int:
        self.ack = int(self.directive["version"])
        return self.ack

    def beat_until(
        self,
        metrics: Mapping[str, float],
        until: Callable[[dict[str, Any]], bool],
        timeout: float = 10.0,
        what: str = "condition",
    ) -> dict[str, Any]:
        """Beat every BEAT_S until ``until(answer)``; answers that answer."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.beat(metrics)
            if until(answer):
                return answer
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(BEAT_S)


def events_of(h: Harness, worker_id: str | None = None, *types: str) -> list[dict[str, Any]]:
    filters: dict[str, Any] = {"types": list(types)}
    if worker_id is not None:
        filters["worker_id"] = worker_id
    found: list[dict[str, Any]] = h.admin.all_events(**filters)
    return found


def api_worker(h: Harness, worker_id: str) -> dict[str, Any]:
    return next(w for w in h.admin.workers() if w["id"] == worker_id)


def start(server_factory: Callable[..., Harness], home: Path, judge: JudgeConfig, **settings: Any) -> Harness:
    h: Harness = server_factory(settings=make_settings(home, judge=judge, **settings), pools=True)
    return h


# -- a. the breaker ------------------------------------------------------------------------------------
def test_breaker_escalates_in_the_detecting_beat_one_level_per_ack_and_recovers(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "a", JudgeConfig(breaker=FAST_BREAKER))
    b = Beater(h, h.register("pool-a", role="learner", rank=0))
    slow = {"sync_cost_ms_p50": 200.0}

    # Overloaded beats: the first few are evidence only; the beat that completes the evidence carries the
    # degraded directive in its own answer (no extra round trip).
    answers = [b.beat(slow) for _ in range(2)]
    assert all(a["directive"] is None for a in answers)
    assert all(a["latency_cap_ms"] == 85.0 for a in answers)
    detecting = b.beat_until(slow, lambda a: a["directive"] is not None, timeout=5, what="level 1 directive")
    d1 = detecting["directive"]
    assert d1["compression_bits"] == 4 and d1["grad_accum_steps"] == 1 and d1["async_sampling"] is True
    assert d1["version"] == 2

    (melt,) = events_of(h, b.id, "meltdown")
    assert melt["pool"] == "pool-a"
    assert (melt["data"]["level_from"], melt["data"]["level_to"], melt["data"]["action"]) == (0, 1, "escalate")
    over = melt["data"]["evidence"]["over"]["latency_ms"]
    assert over["cap"] == 85.0 and over["median"] == 200.0 and over["exceeding"] == over["samples"] >= 3
    alerts = [e["data"]["name"] for e in events_of(h, b.id, "alert")]
    assert alerts == ["learner0_meltdown_latency_ms"]
    assert 'dsec_melt_down_count{pool="pool-a"} 1.0' in h.admin.metrics_text()
    assert 'dsec_melt_down_count{pool="pool-b"} 0.0' in h.admin.metrics_text()
    view = api_worker(h, b.id)
    assert view["breaker"]["level"] == 1 and view["breaker"]["phase"] == "escalating"
    assert view["meltdowns"] == 1
    assert view["directive"]["desired_version"] == 2 and view["directive"]["in_sync"] is False

    # Still overloaded, but the worker has not acked level 1: no further escalation, however long.
    deadline = time.monotonic() + 1.5 * FAST_BREAKER.window_s
    while time.monotonic() < deadline:
        a = b.beat(slow)
        assert a["directive"] is not None and a["directive"]["version"] == 2  # re-sent until acked
        time.sleep(BEAT_S)
    assert api_worker(h, b.id)["breaker"]["level"] == 1
    assert len(events_of(h, b.id, "directive_set")) == 1

    # Acked, and the overload continues with level 1 in force: level 2 (accumulate 4 steps).
    b.ack_latest()
    d2 = b.beat_until(slow, lambda a: a["directive"] is not None, timeout=5, what="level 2 directive")["directive"]
    assert (d2["version"], d2["compression_bits"], d2["grad_accum_steps"]) == (3, 4, 4)
    assert api_worker(h, b.id)["breaker"]["level"] == 2
    assert len(events_of(h, b.id, "meltdown")) == 1  # one entry into degradation, not one per level
    assert 'dsec_melt_down_count{pool="pool-a"} 1.0' in h.admin.metrics_text()

    # Calm (well under the cap) for longer than recovery_s: steps down one level per ack, then closes.
    b.ack_latest()
    calm = {"sync_cost_ms_p50": 10.0}
    started = time.monotonic()
    d = b.beat_until(calm, lambda a: a["directive"] is not None, timeout=5, what="step down to level 1")["directive"]
    assert time.monotonic() - started >= FAST_BREAKER.recovery_s
    assert (d["compression_bits"], d["grad_accum_steps"]) == (4, 1)
    assert api_worker(h, b.id)["breaker"]["level"] == 1
    b.ack_latest()
    d = b.beat_until(calm, lambda a: a["directive"] is not None, timeout=5, what="step down to level 0")["directive"]
    assert (d["compression_bits"], d["grad_accum_steps"], d["async_sampling"]) == (None, 1, True)
    b.ack_latest()
    b.beat_until(
        calm,
        lambda a: api_worker(h, b.id)["breaker"]["phase"] == "closed",
        timeout=5,
        what="breaker closed",
    )
    view = api_worker(h, b.id)
    assert view["breaker"]["level"] == 0 and view["meltdowns"] == 1
    (recovered,) = events_of(h, b.id, "recovered")
    assert recovered["data"]["to"] == "closed"
    steps = [e["data"]["level_to"] for e in events_of(h, b.id, "breaker") if e["data"]["action"] == "step_down"]
    assert steps == [1, 0]


# -- b. per-worker cap override ------------------------------------------------------------------------
def test_per_worker_latency_cap_override_prevents_escalation(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "b", JudgeConfig(breaker=FAST_BREAKER))
    tolerant = Beater(h, h.register("pool-a", role="learner", rank=0))
    control = Beater(h, h.register("pool-a", role="learner", rank=1))
    patched = h.admin.set_directive(tolerant.id, latency_cap_ms=300)
    assert patched["desired"]["latency_cap_ms"] == 300
    assert api_worker(h, tolerant.id)["caps"]["latency_ms"] == 300

    slow = {"sync_cost_ms_p50": 200.0}
    # The same signal degrades the worker on the pool's cap...
    control.beat_until(slow, lambda a: a["directive"] is not None, timeout=5, what="control worker degraded")
    assert control.directive["compression_bits"] == 4
    # ...and not the one whose cap is 300 ms (200 is even calm there: < 300 x (1 - margin)).
    tolerant.beat({})  # picks up the patched directive
    tolerant.ack_latest()
    for _ in range(20):
        a = tolerant.beat(slow)
        assert a["directive"] is None, a
        assert a["latency_cap_ms"] == 300
        time.sleep(0.02)
    view = api_worker(h, tolerant.id)
    assert view["breaker"]["level"] == 0 and view["meltdowns"] == 0
    assert view["directive"]["desired"]["compression_bits"] is None  # never degraded: the probe's default
    assert events_of(h, tolerant.id, "meltdown", "breaker") == []
    assert len(events_of(h, control.id, "meltdown")) == 1


# -- c. stuck episodes ---------------------------------------------------------------------------------
def test_stuck_episode_lowers_ceiling_and_priority_and_raises_an_alert(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "c", JudgeConfig())
    b = Beater(h, h.register("pool-a", role="learner", rank=0))
    peer = Beater(h, h.register("pool-a", role="learner", rank=1))
    assert b.directive["memory_ceiling_gb"] == 12.0 and b.directive["sync_priority"] == 0

    stuck = {"type": "anomaly", "data": {"kind": "episode_stuck", "reason": "collision", "count": 3}}
    answer = b.beat({}, [stuck])
    d = answer["directive"]
    assert d is not None, "the decision rides back in the same answer"
    assert (d["memory_ceiling_gb"], d["sync_priority"], d["version"]) == (11.0, -1, 2)
    assert d["memory_quota_gb"] == 7.0  # the quota is not touched

    alerts = events_of(h, b.id, "alert")
    assert [a["data"]["name"] for a in alerts] == ["learner0_episode_stuck_collision_3x"]
    data = alerts[0]["data"]
    assert data["reason"] == "collision" and data["count"] == 3 and data["memory_ceiling_gb"] == [12.0, 11.0]
    assert alerts[0]["pool"] == "pool-a" and alerts[0]["worker_id"] == b.id
    (changed,) = [e for e in events_of(h, b.id, "directive_set") if e["data"]["by"] == "stuck_episode"]
    assert changed["data"]["changes"] == {"sync_priority": -1, "memory_ceiling_gb": 11.0}
    # The worker's own anomaly is recorded too.
    assert [e["data"]["kind"] for e in events_of(h, b.id, "anomaly")] == ["episode_stuck"]

    # Again, with an odd reason: one more step, and the alert name is sanitised.
    b.ack_latest()
    odd = {"type": "anomaly", "data": {"kind": "episode_stuck", "reason": "sim crash!", "count": 5}}
    d = b.beat({}, [odd])["directive"]
    assert (d["memory_ceiling_gb"], d["sync_priority"]) == (10.0, -2)
    names = [a["data"]["name"] for a in events_of(h, None, "alert")]
    assert names == ["learner0_episode_stuck_collision_3x", "learner0_episode_stuck_sim_crash__5x"]
    # Its peer is untouched.
    assert api_worker(h, peer.id)["directive"]["desired"]["memory_ceiling_gb"] == 12.0


# -- d. precision fallback -----------------------------------------------------------------------------
def test_precision_falls_back_on_non_finite_gradients_and_is_restored_when_stable(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    stable_s = 0.5
    h = start(server_factory, tmp_path / "d", JudgeConfig(precision_stable_s=stable_s))
    b = Beater(h, h.register("pool-a", role="learner", rank=0))
    h.admin.set_directive(b.id, precision="bf16")
    assert b.beat({})["directive"]["precision"] == "bf16"
    b.ack_latest()

    nan = {"type": "anomaly", "data": {"kind": "non_finite_gradient", "grad_norm": "nan"}}
    d = b.beat({"grad_norm": 1.0}, [nan])["directive"]
    assert d is not None and d["precision"] == "fp16"
    fallback_at = time.time()
    (alert,) = events_of(h, b.id, "alert")
    assert alert["data"]["name"] == "learner0_precision_fallback_bf16_to_fp16"
    assert (alert["data"]["kind"], alert["data"]["from"], alert["data"]["to"]) == (
        "non_finite_gradient",
        "bf16",
        "fp16",
    )
    b.ack_latest()

    # Stable from here on: the reconcile loop restores bf16 after stable_s, not before.
    def restored() -> bool:
        b.beat({"grad_norm": 1.0})
        return bool(b.directive["precision"] == "bf16")

    wait_for(restored, timeout=10, interval=BEAT_S, what="precision restored to bf16")
    assert time.time() - fallback_at >= stable_s * 0.9
    (rec,) = events_of(h, b.id, "recovered")
    assert rec["data"]["kind"] == "precision_restored"
    assert (rec["data"]["from"], rec["data"]["to"]) == ("fp16", "bf16")
    assert rec["data"]["stable_s"] >= stable_s
    assert rec["ts"] - alert["ts"] >= stable_s
    by = [e["data"]["by"] for e in events_of(h, b.id, "directive_set")]
    assert by == ["api", "precision_fallback", "precision_fallback"]


def test_non_finite_gradient_at_fp32_alerts_without_a_fallback(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "d2", JudgeConfig())
    b = Beater(h, h.register("pool-a", role="actor", rank=4))
    nan = {"type": "anomaly", "data": {"kind": "non_finite_gradient", "grad_norm": "inf"}}
    assert b.beat({}, [nan])["directive"] is None  # fp32: nothing safer to fall back to
    (alert,) = events_of(h, b.id, "alert")
    assert alert["data"]["name"] == "actor4_non_finite_gradient"
    assert alert["data"]["severity"] == "critical"


# -- e. alerts to a signed webhook ---------------------------------------------------------------------
@dataclass
class Receiver:
    secret: str
    url: str = ""
    notifications: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, headers: Mapping[str, str], body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        try:
            verify(self.secret, headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER), body, now=time.time())
        except SignatureError as exc:
            with self.lock:
                self.rejected.append(str(exc))
            return 401, {}, b""
        with self.lock:
            self.notifications.append(json.loads(body))
        return 200, {}, b""

    def received(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.notifications)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rcv = Receiver(secret="s3cret")
    with http_receiver(rcv.handle) as url:
        rcv.url = url
        yield rcv


def test_alerts_reach_a_signed_webhook_once_despite_repeats(
    server_factory: Callable[..., Harness], tmp_path: Path, receiver: Receiver
) -> None:
    h = start(
        server_factory,
        tmp_path / "e",
        JudgeConfig(),
        alert_webhooks=((receiver.url, "s3cret"),),
        alert_group_wait_s=0.1,
        # Short, so that a broken de-duplication would show up as a second notification within the test.
        alert_group_interval_s=0.1,
    )
    try:
        b = Beater(h, h.register("pool-a", role="learner", rank=0))
        stuck = {"type": "anomaly", "data": {"kind": "episode_stuck", "reason": "collision", "count": 3}}
        b.beat({}, [stuck])
        (note,) = wait_for(receiver.received, timeout=10, what="webhook notification")
        assert note["group"] == {"pool": "pool-a", "name": "learner0_episode_stuck_collision_3x"}
        (alert,) = note["alerts"]
        assert alert["name"] == "learner0_episode_stuck_collision_3x"
        assert alert["worker_id"] == b.id and alert["pool"] == "pool-a" and alert["severity"] == "warning"
        assert alert["data"]["reason"] == "collision" and alert["data"]["count"] == 3

        # The same alert 20 more times, quickly: recorded every time, notified no more (repeat interval 300 s).
        for _ in range(20):
            b.beat({}, [stuck])
        assert len(events_of(h, b.id, "alert")) == 21
        time.sleep(1.0)  # > several group intervals and router ticks: a second notification would be here
        assert len(receiver.received()) == 1  # exactly the first one: the repeats were folded
        assert receiver.rejected == []
    finally:
        h.close()  # stop the router before the receiver goes away


# -- f. elastic memory quotas --------------------------------------------------------------------------
def test_elastic_quotas_grow_in_steps_up_to_the_ceiling_while_capacity_allows(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "f", JudgeConfig(quota_interval_s=0.1))
    for dev in ("gpu-0", "gpu-1"):
        body = {"id": dev, "node": "node-0", "memory_gb": 4.0, "pool": "pool-q"}
        assert h.admin.request("PUT", f"/v1/devices/{dev}", json=body)["memory_gb"] == 4.0
    pool = h.admin.put_pool("pool-q", devices=["gpu-0", "gpu-1"], memory_base_gb=2, memory_ceiling_gb=4)
    assert pool["devices"] == ["gpu-0", "gpu-1"]
    token = h.admin.create_token("pool-q")
    a = Beater(h, h.register("pool-q", token=token, role="learner", rank=0))
    b = Beater(h, h.register("pool-q", token=token, role="learner", rank=1))
    assert a.directive["memory_quota_gb"] == 2.0 and a.directive["memory_ceiling_gb"] == 4.0

    def quota(w: Beater) -> float:
        return float(w.directive["memory_quota_gb"])

    def hungry(w: Beater) -> None:
        w.beat({"memory_used_gb": round(0.95 * quota(w), 3)})  # close to whatever it was granted
        w.ack_latest()

    def pool_memory() -> dict[str, Any]:
        p = next(p for p in h.admin.status()["pools"] if p["name"] == "pool-q")
        mem: dict[str, Any] = p["memory"]
        return mem

    def drive(needy: list[Beater], idle: list[Beater], seconds: float, until: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until()):
            for w in needy:
                hungry(w)
            for w in idle:
                w.beat({"memory_used_gb": 0.5})
            time.sleep(BEAT_S)

    # Phase 1: capacity 8 GB, two workers at base 2. A needs more and more; B uses little.
    drive([a], [b], 10, until=lambda: quota(a) == 4.0)
    assert quota(a) == 4.0
    drive([a], [b], 0.6)  # several more plans: A stays at the ceiling although the pool has headroom
    assert (quota(a), quota(b)) == (4.0, 2.0)
    mem = pool_memory()
    assert mem["capacity_gb"] == 8.0 and mem["granted_gb"] == 6.0 and mem["headroom_gb"] == 2.0
    assert (mem["base_gb"], mem["ceiling_gb"], mem["workers"]) == (2.0, 4.0, 2)

    # Phase 2: a third worker joins at base; now all three want more, but the pool is fully granted.
    c = Beater(h, h.register("pool-q", token=token, role="learner", rank=2))
    drive([a, b, c], [], 0.8)
    assert (quota(a), quota(b), quota(c)) == (4.0, 2.0, 2.0)
    mem = pool_memory()
    assert mem["workers"] == 3 and mem["granted_gb"] == 8.0 and mem["headroom_gb"] == 0.0
    assert mem["used_gb"] == pytest.approx(3.8 + 1.9 + 1.9)

    # Every change was one 1 GB step, each with its own quota event; never above the ceiling.
    # (Events that only move a worker's allocator limit carry from_gb == to_gb.)
    all_quota_events = events_of(h, None, "quota")
    quota_events = [e for e in all_quota_events if e["data"]["from_gb"] != e["data"]["to_gb"]]
    steps = [(e["worker_id"], e["data"]["from_gb"], e["data"]["to_gb"]) for e in quota_events]
    assert steps == [(a.id, 2.0, 3.0), (a.id, 3.0, 4.0)]
    assert all(e["pool"] == "pool-q" and e["data"]["kind"] == "memory_quota" for e in all_quota_events)
    assert quota_events[-1]["data"]["pool_memory"]["granted_gb"] == 6.0
    desired = {w["id"]: w["directive"]["desired"] for w in h.admin.workers(pool="pool-q")}
    directives = {wid: d["memory_quota_gb"] for wid, d in desired.items()}
    assert directives == {a.id: 4.0, b.id: 2.0, c.id: 2.0}
    assert sum(directives.values()) <= 8.0
    # Limits: each worker may take what the others do not hold (8 GB pool of two 4 GB devices: at most one device),
    # never less than its grant; limits follow usage (hysteresis of one step), so allow a step of lag.
    for w, used_by_others in ((a, 1.9 + 1.9), (b, 3.8 + 1.9), (c, 3.8 + 1.9)):
        limit = desired[w.id]["memory_limit_gb"]
        assert limit >= directives[w.id]
        assert limit <= max(directives[w.id], min(4.0, 8.0 - used_by_others)) + 1.0 + 1e-9


def test_quotas_are_planned_per_card_for_devices_that_are_slots_of_one_card(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    # Two process slots of one 8 GB card (card0-a, card0-b: each gives the card's memory) and gpu-1, a card of its
    # own. A bursts on card0-a beside B, who holds 3 GB there: A's limit is what B leaves of card0 (5 GB), not
    # the pool's free memory (the pool-wide rule counted 24 GB and let A take the whole card, B's memory included).
    h = start(server_factory, tmp_path / "cards", JudgeConfig(quota_interval_s=0.1))
    for dev, card in (("card0-a", "card0"), ("card0-b", "card0"), ("gpu-1", None)):
        body = {"id": dev, "node": "node-0", "memory_gb": 8.0, "card": card}
        assert h.admin.request("PUT", f"/v1/devices/{dev}", json=body)["card"] == card
    assert {d["id"]: d["card"] for d in h.admin.request("GET", "/v1/devices")["items"]} == {
        "card0-a": "card0",
        "card0-b": "card0",
        "gpu-1": None,
    }
    h.admin.put_pool("pool-c", devices=["card0-a", "card0-b", "gpu-1"], memory_base_gb=2, memory_ceiling_gb=4)
    token = h.admin.create_token("pool-c")
    a, b, c = (
        Beater(h, h.register("pool-c", token=token, role="actor", rank=i, device=dev))
        for i, dev in enumerate(("card0-a", "card0-b", "gpu-1"))
    )

    def limits() -> dict[str, float]:
        return {w["id"]: w["directive"]["desired"]["memory_limit_gb"] for w in h.admin.workers(pool="pool-c")}

    used_a = 2.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        used_a = min(3.9, used_a + 0.4)  # a burst: ~8 GB/s, far past the 0.05 GB/s line between a leak and a burst
        a.beat({"memory_used_gb": used_a})
        b.beat({"memory_used_gb": 3.0})
        c.beat({"memory_used_gb": 1.0})
        for w in (a, b, c):
            w.ack_latest()
        if limits()[a.id] > 4.0:
            break
        time.sleep(BEAT_S)
    # Past the pool's ceiling (a burst), but only into what card0 has free: 8 - 3 (B's) = 5.
    assert limits()[a.id] == pytest.approx(5.0)
    mem = next(p for p in h.admin.status()["pools"] if p["name"] == "pool-c")["memory"]
    assert mem["capacity_gb"] == 16.0 and mem["workers"] == 3  # card0 once, gpu-1 once
    ev = next(e for e in reversed(events_of(h, a.id, "quota")) if e["data"].get("limit_to_gb") == limits()[a.id])
    assert ev["data"]["card"] == "card0" and ev["data"]["card_memory"]["capacity_gb"] == 8.0
    assert ev["data"]["pool_memory"]["capacity_gb"] == 16.0


# -- g. fleet comparison -------------------------------------------------------------------------------
def test_fleet_flags_one_straggler_not_a_whole_pool_slowdown(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "g", JudgeConfig(fleet_interval_s=0.1))
    workers = [Beater(h, h.register("pool-a", role="learner", rank=i)) for i in range(6)]
    *healthy, straggler = workers
    for w, v in zip(healthy, [49.8, 50.0, 50.2, 50.1, 49.9], strict=True):
        w.beat({"step_ms_mean": v})
    straggler.beat({"step_ms_mean": 400.0})

    def fleet_events() -> list[dict[str, Any]]:
        return [e for e in events_of(h, None, "anomaly") if str(e["data"].get("kind", "")).startswith("fleet_outlier")]

    wait_for(lambda: fleet_events(), timeout=10, what="the straggler flagged")
    (flag,) = fleet_events()
    assert flag["worker_id"] == straggler.id and flag["pool"] == "pool-a"
    assert flag["data"]["kind"] == "fleet_outlier" and flag["data"]["feature"] == "step_ms_mean"
    assert flag["data"]["value"] == 400.0 and flag["data"]["median"] == pytest.approx(50.0, abs=0.3)
    assert flag["data"]["peers"] == 6
    assert api_worker(h, straggler.id)["fleet_outlier"] == ["step_ms_mean"]
    assert all(api_worker(h, w.id)["fleet_outlier"] == [] for w in healthy)
    names = [e["data"]["name"] for e in events_of(h, straggler.id, "alert")]
    assert names == ["learner5_straggler_step_ms_mean"]

    # The whole pool slows down to the straggler's pace. The healthy workers move together in steps of
    # 7% (below the 10% that is worth flagging), so no comparison pass can catch one of them mid-move
    # ahead of the others: whatever the timing, nobody new may be flagged.
    v = 50.0
    while v < 400.0:
        v = min(400.0, v * 1.07)
        for w in healthy:
            w.beat({"step_ms_mean": v})
        straggler.beat({"step_ms_mean": 400.0})
    wait_for(
        lambda: any(e["data"]["kind"] == "fleet_outlier_cleared" for e in fleet_events()),
        timeout=10,
        what="the straggler cleared",
    )
    time.sleep(0.4)  # several more comparison passes with all six at 400
    kinds = [(e["worker_id"], e["data"]["kind"], e["data"]["feature"]) for e in fleet_events()]
    assert kinds == [
        (straggler.id, "fleet_outlier", "step_ms_mean"),
        (straggler.id, "fleet_outlier_cleared", "step_ms_mean"),
    ]
    assert all(api_worker(h, w.id)["fleet_outlier"] == [] for w in workers)
    assert [e["data"]["name"] for e in events_of(h, None, "alert")] == ["learner5_straggler_step_ms_mean"]


def test_quota_growth_respects_a_lowered_worker_ceiling_and_does_not_starve_peers(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "f2", JudgeConfig(quota_interval_s=0.1))
    for dev in ("gpu-0", "gpu-1"):
        h.admin.request("PUT", f"/v1/devices/{dev}", json={"id": dev, "node": "node-0", "memory_gb": 4.0})
    h.admin.put_pool("pool-q", devices=["gpu-0", "gpu-1"], memory_base_gb=2, memory_ceiling_gb=4)
    token = h.admin.create_token("pool-q")
    a, b, c = (Beater(h, h.register("pool-q", token=token, role="learner", rank=i)) for i in range(3))
    stuck = {"type": "anomaly", "data": {"kind": "episode_stuck", "reason": "collision", "count": 3}}
    assert a.beat({}, [stuck])["directive"]["memory_ceiling_gb"] == 3.0  # A may use at most 3 GB now
    a.ack_latest()

    def round_(used_a: float, used_b: float) -> None:
        a.beat({"memory_used_gb": used_a})
        b.beat({"memory_used_gb": used_b})
        c.beat({"memory_used_gb": 0.5})
        for w in (a, b, c):
            w.ack_latest()
        time.sleep(BEAT_S)

    # A grows to its own ceiling (3); the pool (8 GB) then has 1 GB of headroom left.
    deadline = time.monotonic() + 5
    while a.directive["memory_quota_gb"] < 3.0 and time.monotonic() < deadline:
        round_(1.9, 0.5)
    assert a.directive["memory_quota_gb"] == 3.0
    # Now A presses against its ceiling and B needs more: the free gigabyte must go to B.
    deadline = time.monotonic() + 1.5
    while b.directive["memory_quota_gb"] < 3.0 and time.monotonic() < deadline:
        round_(2.97, 1.8)
    quotas = {w["id"]: w["directive"]["desired"]["memory_quota_gb"] for w in h.admin.workers(pool="pool-q")}
    mem = next(p for p in h.admin.status()["pools"] if p["name"] == "pool-q")["memory"]
    assert quotas[a.id] == 3.0
    assert mem["granted_gb"] == sum(quotas.values()), (mem, quotas)  # the accounting is what was granted
    assert quotas[b.id] == 3.0, quotas


def test_a_pools_default_compression_is_a_new_workers_and_the_one_the_breaker_steps_back_down_to(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """``compression_bits`` on a pool (the issue's per-pool default: 8-bit with error feedback where a pool opts in):
    its workers register at it, the breaker's first rung is still 4-bit, and recovering to level 0 returns them to
    the pool's default, not to the probe's own. Values the ladder would not honour: 422 naming the field."""
    h = start(server_factory, tmp_path / "bits", JudgeConfig(breaker=FAST_BREAKER))
    spec = {k: v for k, v in h.admin.request("GET", "/v1/pools/pool-a").items() if k != "name"}
    for bad in (4, 7, "8", True):
        with pytest.raises(ApiError) as err:
            h.admin.put_pool("pool-a", **{**spec, "compression_bits": bad})
        assert err.value.status == 422 and err.value.field == "compression_bits", (bad, err.value)
    h.admin.put_pool("pool-a", **{**spec, "compression_bits": 8})
    assert h.admin.request("GET", "/v1/pools/pool-a")["compression_bits"] == 8
    b = Beater(h, h.register("pool-a", role="learner", rank=0))
    assert api_worker(h, b.id)["directive"]["desired"]["compression_bits"] == 8
    other = h.register("pool-b", role="learner", rank=0)
    assert api_worker(h, other.id)["directive"]["desired"]["compression_bits"] is None  # the probe's default

    slow, calm = {"sync_cost_ms_p50": 200.0}, {"sync_cost_ms_p50": 10.0}
    d1 = b.beat_until(slow, lambda a: a["directive"] is not None, timeout=5, what="level 1")["directive"]
    assert d1["compression_bits"] == 4
    b.ack_latest()
    d0 = b.beat_until(calm, lambda a: a["directive"] is not None, timeout=5, what="level 0")["directive"]
    assert (d0["compression_bits"], d0["grad_accum_steps"]) == (8, 1)
    assert api_worker(h, b.id)["breaker"]["level"] == 0


# -- memory-pressure path of the breaker ------------------------------------------------------------------
def test_memory_over_the_ceiling_degrades_through_accumulation_and_alerts_never_kills(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    # The memory path is opt-in (DSEC_MEMORY_PRESSURE): for training code that shrinks its micro-batch when
    # grad_accum_steps rises. Off, as shipped, the same beats degrade nothing (tests/unit/decide).
    h = start(server_factory, tmp_path / "mem", JudgeConfig(breaker=FAST_BREAKER, memory_pressure=1.0))
    b = Beater(h, h.register("pool-a", role="learner", rank=0))
    over = {"memory_used_gb": 13.5}  # pool-a: base 7, ceiling 12
    answer = b.beat_until(over, lambda a: a["directive"] is not None, timeout=5, what="memory-pressure directive")
    d = answer["directive"]
    # Level 1 on the memory path: accumulation (smaller micro-batches) and the quota held at the ceiling.
    assert (d["compression_bits"], d["grad_accum_steps"], d["memory_quota_gb"]) == (4, 4, 12.0)
    (melt,) = events_of(h, b.id, "meltdown")
    assert set(melt["data"]["evidence"]["over"]) == {"memory_gb"}
    assert melt["data"]["evidence"]["over"]["memory_gb"]["cap"] == 12.0
    assert [e["data"]["name"] for e in events_of(h, b.id, "alert")] == ["learner0_meltdown_memory_gb"]
    assert api_worker(h, b.id)["state"] == "active"

    # Usage back under the ceiling by the hysteresis margin: it steps down to level 0 (the worker acks
    # every directive it gets, as the probe does).
    def recovered(_answer: dict[str, Any]) -> bool:
        b.ack_latest()
        return bool(api_worker(h, b.id)["breaker"]["phase"] == "closed")

    b.beat_until({"memory_used_gb": 6.0}, recovered, timeout=15, what="memory path recovered")
    final = api_worker(h, b.id)["directive"]["desired"]
    assert (final["compression_bits"], final["grad_accum_steps"]) == (None, 1)


def test_a_pool_turns_the_memory_path_on_for_its_own_workers_only(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """``memory_pressure`` on a pool: its workers' memory cap is the ceiling times it, whatever the control plane's
    default (off here); another pool's workers with the same memory are not judged on it. Out of range: 422 naming
    the field, and the pool as it was."""
    h = start(server_factory, tmp_path / "pools", JudgeConfig(breaker=FAST_BREAKER))
    spec = {k: v for k, v in h.admin.request("GET", "/v1/pools/pool-a").items() if k != "name"}
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ApiError) as err:
            h.admin.put_pool("pool-a", **{**spec, "memory_pressure": bad})
        assert err.value.status == 422 and err.value.field == "memory_pressure", (bad, err.value)
    assert h.admin.request("GET", "/v1/pools/pool-a")["memory_pressure"] is None
    h.admin.put_pool("pool-a", **{**spec, "memory_pressure": 0.9})
    assert h.admin.request("GET", "/v1/pools/pool-a")["memory_pressure"] == 0.9
    on = Beater(h, h.register("pool-a", role="learner", rank=0))
    off = Beater(h, h.register("pool-b", role="learner", rank=0))
    over = {"memory_used_gb": 11.5}  # under both pools' ceiling of 12, over pool-a's cap of 12 x 0.9 = 10.8
    answer = on.beat_until(over, lambda a: a["directive"] is not None, timeout=5, what="memory-pressure directive")
    assert answer["directive"]["grad_accum_steps"] == 4
    (melt,) = events_of(h, on.id, "meltdown")
    assert melt["data"]["evidence"]["over"]["memory_gb"]["cap"] == pytest.approx(10.8)
    for _ in range(30):  # as many beats as the breaker needed and more: nothing in the pool without the switch
        assert off.beat(over)["directive"] is None
        time.sleep(BEAT_S)
    assert events_of(h, off.id, "meltdown") == []


def test_an_actor_is_paused_only_when_its_lateness_outweighs_its_samples(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """The ladder's top rung (dsec.decide.pause): at accumulation x4 with 600 ms steps, one of 2 actors is worth
    (1 - 0.432) x 600 ms of progress a step, so a sync cost under ~1.36 s is not worth pausing it for — the breaker
    holds it at level 2 — while 3 s is."""
    h = start(server_factory, tmp_path / "p", JudgeConfig(breaker=FAST_BREAKER, fleet_interval_s=0.1))
    slow_actor = Beater(h, h.register("pool-a", role="actor", rank=1))
    peer = Beater(h, h.register("pool-a", role="actor", rank=2))
    time.sleep(0.3)  # a fleet pass counts the pool's actors
    late = {"sync_cost_ms_p50": 200.0, "step_ms_mean": 600.0}
    for level in (1, 2):
        d = slow_actor.beat_until(late, lambda a: a["directive"] is not None, timeout=5, what=f"level {level}")
        assert d["directive"]["async_sampling"] is True
        slow_actor.ack_latest()
        peer.beat({"sync_cost_ms_p50": 0.0, "step_ms_mean": 600.0})
    # Overloaded at level 2 for three evidence windows: held there, sampling on.
    deadline = time.monotonic() + 3 * FAST_BREAKER.window_s
    while time.monotonic() < deadline:
        assert slow_actor.beat(late)["directive"] is None
        peer.beat({"sync_cost_ms_p50": 0.0, "step_ms_mean": 600.0})
        time.sleep(BEAT_S)
    view = api_worker(h, slow_actor.id)
    assert view["breaker"]["level"] == 2 and slow_actor.directive["async_sampling"] is True
    # Late enough that waiting costs more than its samples: the top rung.
    very_late = {"sync_cost_ms_p50": 3000.0, "step_ms_mean": 600.0}
    d3 = slow_actor.beat_until(very_late, lambda a: a["directive"] is not None, timeout=5, what="level 3")
    assert d3["directive"]["async_sampling"] is False
    assert api_worker(h, slow_actor.id)["breaker"]["level"] == 3


def test_a_burst_about_to_fill_a_learners_card_moves_an_actor_off_it_and_placement_keeps_the_room(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    # Three process slots of one 8 GB card: a learner bursting on card0-a beside two actors (2.0 and 2.5 GB); gpu-1
    # is a card of its own. The control plane asks for the larger actor to move (a room event,
    # which the launcher's supervisor acts on: tests/integration/test_launch_local.py), once; until the burst's hold
    # is over, placement puts no new worker on card0.
    h = start(server_factory, tmp_path / "room", JudgeConfig(quota_interval_s=0.1))
    for dev, card in (("card0-a", "card0"), ("card0-b", "card0"), ("card0-c", "card0"), ("gpu-1", None)):
        h.admin.request("PUT", f"/v1/devices/{dev}", json={"id": dev, "node": "node-0", "memory_gb": 8.0, "card": card})
    h.admin.put_pool("pool-r", devices=["card0-a", "card0-b", "card0-c", "gpu-1"], memory_base_gb=2,
                     memory_ceiling_gb=4)  # fmt: skip
    token = h.admin.create_token("pool-r")
    learner, small, large = (
        Beater(h, h.register("pool-r", token=token, role=role, rank=i, device=dev))
        for i, (role, dev) in enumerate((("learner", "card0-a"), ("actor", "card0-b"), ("actor", "card0-c")))
    )

    def rooms() -> list[dict[str, Any]]:
        return events_of(h, None, "room")

    used = 2.0
    deadline = time.monotonic() + 10
    while not rooms() and time.monotonic() < deadline:
        used = min(3.9, used + 0.3)  # a burst: ~3 GB/s; the card holds 2 + 2.5 + 2.3 = 6.8 GB, then 7.1, ...
        learner.beat({"memory_used_gb": used})
        small.beat({"memory_used_gb": 2.0})
        large.beat({"memory_used_gb": 2.5})
        time.sleep(BEAT_S)
    (room,) = rooms()
    assert room["worker_id"] == large.id and room["pool"] == "pool-r"
    data = room["data"]
    assert (data["card"], data["device"], data["bursting"]) == ("card0", "card0-c", [learner.id])
    assert data["projected_gb"] > 8.0 and data["until"] > time.time() and "moves off it" in data["reason"]
    # The card keeps the room: a new worker goes to gpu-1, and card0's slots say why they were left out.
    job = {"name": "j", "pool": "pool-r", "groups": [{"name": "g", "workers": [{"name": "a", "memory_gb": 1}]}]}
    p = h.admin.place(job)
    assert p["assignments"][0]["device"] == "gpu-1"
    assert "keeps room for a memory burst" in p["excluded"]["card0-c"]
    h.admin.release_placement("j")
    # Asked once per hold, however long the burst goes on.
    for _ in range(5):
        learner.beat({"memory_used_gb": 3.9})
        time.sleep(BEAT_S)
    assert len(rooms()) == 1
