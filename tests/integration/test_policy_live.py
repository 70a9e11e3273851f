"""The policy engine in a running control plane (real uvicorn, SQLite, HTTP), in virtual time.

The control plane's clock is a virtual one the test advances; simulated workers beat over HTTP with sync costs
that make their breakers melt down, so the meltdown counter, the sampled history and the rules are the real ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, wait_for
from dsec.breaker import BreakerConfig
from dsec.client import ApiError, Client
from dsec.control.app import create_app
from dsec.control.judge import JudgeConfig
from dsec.control.server import ServerThread
from dsec.control.store import open_store

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "policies" / "meltdowns-tighten-latency-cap.yaml"
FAST = BreakerConfig(window_s=1.0, min_samples=3, recovery_s=0.5, max_recovery_s=2.0)
SLOW = {"sync_cost_ms_p50": 200.0}
CALM = {"sync_cost_ms_p50": 5.0}


class VirtualClock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds


@pytest.fixture
def servers() -> Iterator[list[Harness]]:
    started: list[Harness] = []
    yield started
    for h in started:
        h.close()


def start(servers: list[Harness], home: Path, clock: VirtualClock, port: int | None = None, **kw: Any) -> Harness:
    settings = make_settings(home, judge=JudgeConfig(breaker=FAST), policy_interval_s=15.0, **kw)
    server = ServerThread(create_app(settings, clock=clock), port=port)
    h = Harness(settings=settings, server=server, admin=Client(server.url, token=settings.admin_token))
    servers.append(h)
    return h


class SimWorker:
    """A worker that beats over HTTP and acks every directive it gets (as the probe does)."""

    def __init__(self, h: Harness, clock: VirtualClock) -> None:
        self.h, self.clock = h, clock
        # A long declared interval: virtual time jumps minutes between beats without the worker becoming lost.
        answer = h.admin.register("pool-a", token=h.pool_tokens["pool-a"], role="learner", heartbeat_interval_s=3600)
        self.id = answer["worker_id"]
        self.client = h.client(answer["worker_token"])
        self.ack = int(answer["directive"]["version"])
        self.version = self.ack
        self.seq = 0
        self.last: dict[str, Any] = {}

    def beat(self, metrics: dict[str, float], dt: float) -> dict[str, Any]:
        self.clock.advance(dt)
        self.seq += 1
        self.last = self.client.heartbeat(self.id, self.seq, acked_directive_version=self.ack, metrics=metrics)
        if self.last["directive"] is not None:
            self.version = int(self.last["directive"]["version"])
        self.ack = self.version
        return self.last

    def breaker(self) -> dict[str, Any]:
        return dict(next(w for w in self.h.admin.workers() if w["id"] == self.id)["breaker"])

    def melt_down_and_recover(self) -> None:
        before = self.breaker()["meltdowns"]
        for _ in range(10):
            self.beat(SLOW, 0.2)
            if self.breaker()["meltdowns"] > before:
                break
        assert self.breaker()["meltdowns"] == before + 1, "the breaker did not melt down"
        for _ in range(60):
            self.beat(CALM, 1.0)
            if self.breaker()["level"] == 0 and self.breaker()["phase"] == "closed":
                return
        pytest.fail(f"the breaker did not recover: {self.breaker()}")


def actions(h: Harness, outcome: str | None = None) -> list[dict[str, Any]]:
    evs = h.admin.all_events(types=["policy_action"])
    return [e for e in evs if outcome is None or e["data"]["outcome"] == outcome]


def policy_ticked(h: Harness, clock: VirtualClock) -> None:
    """Let one policy interval (15 s) of virtual time pass and wait until the reconcile loop has sampled the gauges
    and evaluated the rules at the new time."""
    clock.advance(15.0)

    def sampled() -> bool:
        series = h.admin.metric_series()["series"]
        melt = [s for s in series if s["metric"] == "dsec_melt_down_count" and s["labels"]["pool"] == "pool-a"]
        return bool(melt) and melt[0]["samples"][-1][0] >= clock()

    wait_for(sampled, timeout=10, what="a policy evaluation at the current virtual time")


def test_four_meltdowns_in_an_hour_change_the_latency_cap_exactly_once(servers: list[Harness], tmp_path: Path) -> None:
    clock = VirtualClock()
    h = start(servers, tmp_path / "cp", clock, policy_file=EXAMPLE)
    h.create_pools()
    w = SimWorker(h, clock)
    policy_ticked(h, clock)
    assert h.admin.policies()["rules"][0]["name"] == "tighten-latency-cap-on-meltdowns"
    for i in range(4):
        w.melt_down_and_recover()
        policy_ticked(h, clock)
        if i < 3:
            assert actions(h) == [], "no action before the fourth meltdown"
            w.beat(CALM, 10 * 60)  # ten quiet minutes between meltdowns
            policy_ticked(h, clock)
    wait_for(lambda: actions(h, "applied"), timeout=10, what="the policy action")
    # The rest of the hour: the rule keeps firing, but its cooldown (1 h) allows no second step.
    for _ in range(6):
        w.beat(CALM, 5 * 60)
        policy_ticked(h, clock)
    (act,) = actions(h)
    data = act["data"]
    assert (data["rule"], data["scope"], data["knob"], data["old"], data["new"], data["outcome"]) == (
        "tighten-latency-cap-on-meltdowns", "pool-a", "latency_cap_ms", 85.0, 75.0, "applied",
    )  # fmt: skip
    assert data["evidence"]["observed"] == 4.0 and "increase(dsec_melt_down_count[1h])" in data["evidence"]["when"]
    # Visible in the API (the pool), in the audit trail, and in what the workers are told.
    assert h.admin.request("GET", "/v1/pools/pool-a")["thresholds"]["latency_cap_ms"] == 75.0
    changed = [e for e in h.admin.all_events(types=["pool_changed"]) if e["data"].get("by", "").startswith("policy:")]
    assert len(changed) == 1 and changed[0]["data"]["spec"]["thresholds"]["latency_cap_ms"] == 75.0
    assert w.beat(CALM, 1.0)["latency_cap_ms"] == 75.0
    directive = h.admin.request("GET", f"/v1/workers/{w.id}/directive")
    assert directive["caps"]["latency_ms"] == 75.0
    phases = [e["data"]["phase"] for e in h.admin.all_events(types=["policy"]) if e["data"].get("rule")]
    assert phases == ["pending", "firing"]


HOLD_RULE = """
policies:
  - name: hold-then-act
    when: dsec_melt_down_count >= 1
    for: 30m
    scope: {pools: [pool-a]}
    then:
      - knob: snapshot_compression_level
        to: 3
"""


def test_pending_state_survives_a_restart(servers: list[Harness], tmp_path: Path) -> None:
    clock = VirtualClock()
    home = tmp_path / "cp"
    h = start(servers, home, clock)
    h.create_pools()
    h.admin.put_policies(HOLD_RULE, "hold.yaml")
    w = SimWorker(h, clock)
    w.melt_down_and_recover()
    policy_ticked(h, clock)

    def state() -> dict[str, Any]:
        states = h.admin.policies()["rules"][0]["states"]
        return dict(states.get("pool-a", {}))

    wait_for(lambda: state().get("phase") == "pending", timeout=10, what="the rule pending")
    since = state()["since"]
    clock.advance(20 * 60)
    policy_ticked(h, clock)
    port = h.port
    h.close()
    # Same home and database; the applied file and the pending state come back.
    h = start(servers, home, clock, port=port)
    assert h.admin.policies()["rules"][0]["name"] == "hold-then-act"
    assert state()["phase"] == "pending" and state()["since"] == since
    clock.advance(11 * 60)  # 31 min after it became pending: fires now, not 30 min after the restart
    policy_ticked(h, clock)
    wait_for(lambda: actions(h, "applied"), timeout=10, what="the held rule acting after the restart")
    # The action's event and the pool's new value commit in one transaction: once the event is there, so is the value.
    assert h.admin.request("GET", "/v1/pools/pool-a")["snapshot_compression_level"] == 3
    store = open_store(h.database_url)
    try:
        assert {p.name: p.snapshot_compression_level for p in store.list_pools()}["pool-a"] == 3
    finally:
        store.close()


def test_apply_rejects_a_bad_file_and_keeps_the_running_rules(servers: list[Harness], tmp_path: Path) -> None:
    clock = VirtualClock()
    h = start(servers, tmp_path / "cp", clock, policy_file=EXAMPLE)
    bad = HOLD_RULE.replace("dsec_melt_down_count >= 1", "dsec_melt_down_cont >= 1")
    with pytest.raises(ApiError) as info:
        h.admin.put_policies(bad, "bad.yaml")
    assert info.value.status == 422 and info.value.field == "text"
    assert "bad.yaml:4:11: policies[0].when: unknown metric 'dsec_melt_down_cont'" in str(info.value)
    assert [r["name"] for r in h.admin.policies()["rules"]] == ["tighten-latency-cap-on-meltdowns"]
