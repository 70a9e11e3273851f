"""The scenes of ``dsec demo`` (what to do at which fraction of the run, and how to check it worked), and the
capabilities shown on the first run's processes: the circuit breaker, stuck episodes, gradient compression,
liveness and the Prometheus gauges. The other capabilities' scenes live in their own modules (policies,
integrations, snapshots)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec.demo import integrations as integration_scenes
from dsec.demo import policies as policy_scenes
from dsec.demo import snapshots as snapshot_scenes
from dsec.demo.state import HEARTBEAT_S, DemoRun


@dataclass
class Scene:
    """Something to show: ``act`` runs from ``at`` (fraction of the run) on until it returns True (done;
    False means "not ready yet, try again"); ``check`` runs at the end."""

    title: str
    at: float
    act: Callable[[DemoRun], bool]
    check: Callable[[DemoRun], bool]


def _learners(run: DemoRun) -> dict[int, dict[str, Any]]:
    return {w["rank"]: w for w in run.worker_ids("learner")}


def _compress_rank1(run: DemoRun) -> bool:
    # Only a running learner can take a directive (a finished one answers 409).
    learners = {r: w for r, w in _learners(run).items() if w["state"] == "active"}
    target = learners.get(max(learners)) if learners else None
    before = target["metrics"].get("bytes_per_sync") if target else None
    if target is None or not before:
        return False  # no gradient sync reported yet
    d = run.client.set_directive(target["id"], compression_bits=4)
    run.state["compress"] = (target["id"], target["rank"], d["desired_version"], before)
    run.notes.append(
        f"told learner rank {target['rank']} ({target['id']}) to send 4-bit gradients: directive "
        f"v{d['desired_version']}; it was sending {before:.0f} bytes per sync"
    )
    return True


def _compressed(run: DemoRun) -> bool:
    if "compress" not in run.state:
        return False
    wid, rank, version, before = run.state["compress"]
    acked = any(
        e["data"].get("version") == version for e in run.client.all_events(worker_id=wid, types=["directive_acked"])
    )
    after = run.client.worker(wid)["metrics"].get("bytes_per_sync")
    others = [w["metrics"].get("bytes_per_sync") for r, w in _learners(run).items() if r != rank]
    ratio = before / after if before and after else 0.0
    run.notes.append(
        f"directive v{version} acked at a synchronized step: {acked}; rank {rank} now sends {after or 0:.0f} bytes "
        f"per sync ({ratio:.1f}x less), the other ranks still {', '.join(f'{o:.0f}' for o in others if o)}"
    )
    return acked and ratio >= 6.0


#: How long the sampling-pause scene holds the actor before resuming it.
PAUSE_HOLD_S = 1.5
#: The pause scene's time bound: past it, the liveness scene kills the actor whatever the pause scene got to.
PAUSE_SCENE_S = 10.0


def _pause_actor(run: DemoRun) -> bool:
    """Pause the actor's asynchronous sampling, watch its env steps stay flat for ``PAUSE_HOLD_S``, resume it, and
    wait for its env steps to climb again. One step per call (the scene loop calls again while this returns False)."""
    st = run.state.setdefault("pause", {})
    now = time.time()
    st.setdefault("started", now)
    if now - st["started"] > PAUSE_SCENE_S:
        return True  # out of time; the check fails and says how far it got
    actor = next((w for w in run.worker_ids("actor") if w["state"] == "active"), None)
    steps = actor["metrics"].get("env_steps_total") if actor else None
    if actor is None or steps is None:
        return False  # not yet inferred an actor: a pause applies to actors only
    if "id" not in st:
        run.client.set_directive(actor["id"], async_sampling=False)
        st["id"] = actor["id"]
        return False
    if "held_from" not in st:
        if actor["metrics"].get("async_sampling") == 0:  # the probe reports the pause in force
            st.update(held_from=now, steps_from=steps)
        return False
    if "resumed_at" not in st:
        if now - st["held_from"] < PAUSE_HOLD_S:
            return False
        st.update(steps_to=steps, held_s=now - st["held_from"], resumed_at=now)
        run.client.set_directive(st["id"], async_sampling=True)
        return False
    if steps > st["steps_to"] and actor["metrics"].get("async_sampling") == 1:
        st.update(steps_after=steps, done=True)
        return True
    return False


def _pause_held(run: DemoRun) -> bool:
    st = run.state.get("pause", {})
    if "steps_to" not in st:
        run.notes.append(f"sampling pause: did not complete (got to {sorted(st)})")
        return False
    # A step under way when the pause came in may finish: one env step of slack.
    held = st["steps_to"] - st["steps_from"] <= 1
    run.notes.append(
        f"sampling paused on the actor ({st['id']}): env steps {st['steps_from']:.0f} -> {st['steps_to']:.0f} over "
        f"{st['held_s']:.1f} s held; resumed: {st.get('steps_after', 0):.0f} env steps"
    )
    return held and bool(st.get("done"))


def _kill_actor(run: DemoRun) -> bool:
    pause = run.state.get("pause", {})
    if pause and not pause.get("done") and time.time() - pause["started"] <= PAUSE_SCENE_S:
        return False  # the pause scene is still using the actor
    for p in run.procs:
        if p.role == "actor" and p.popen.poll() is None:
            os.killpg(p.popen.pid, signal.SIGKILL)
            run.state["killed_at"] = time.time()
            run.notes.append(f"killed the actor (process group {p.popen.pid}) with SIGKILL, no goodbye")
    return True


def _actor_lost(run: DemoRun) -> bool:
    # The kill may have been moments ago: give the control plane its detection window (3 beats) and some.
    killed_at = run.state.get("killed_at", 0.0)
    deadline = killed_at + 6 * HEARTBEAT_S + 2
    while True:
        actors = run.worker_ids("actor")
        events = [e for a in actors for e in run.client.all_events(worker_id=a["id"], types=["lost"])]
        # Only a loss after the kill answers the kill: one before it (a starved machine, missed beats) is noted.
        lost = [e for e in events if e["ts"] >= killed_at]
        if lost or time.time() > deadline:
            break
        time.sleep(0.2)
    early = [e for e in events if e["ts"] < killed_at]
    if early:
        run.notes.append(f"the actor was marked lost {len(early)}x before the kill (missed beats on a busy machine)")
    if lost and "killed_at" in run.state:
        run.notes.append(
            f"control plane marked the actor lost {lost[0]['ts'] - killed_at:.1f} s "
            f"after the kill ({lost[0]['data'].get('missed_beats')} missed beats of {HEARTBEAT_S} s)"
        )
    return bool(lost)


def _scrape(run: DemoRun) -> bool:
    run.state["metrics_text"] = run.client.metrics_text()
    return True


def _scraped(run: DemoRun) -> bool:
    text = run.state.get("metrics_text", "")
    return all(f"{name}{{" in text for name in HEADLINE_METRICS)


def chaos_for_learners(duration_s: float) -> str:
    """Learner rank 0 arrives 150 ms late at every gradient sync for a while, early in the run (the
    probe's clock starts with the process), leaving time to recover before the run ends — PPO may reach
    its target return and stop well before ``duration_s``. At least 20 syncs are delayed: PPO syncs only in
    its update phases, and on a loaded machine a rollout can outlast a window of seconds (a full test run
    here once saw rank 0's window pass with no delayed sync, and no meltdown to show)."""
    return f"sync_delay_ms=150,rank=0,after_s=4,for_s={max(3.0, 0.1 * duration_s):g},syncs=20"


CHAOS_ACTOR = "interrupt_episodes=collision,after_s=3,for_s=1.5"


def _note_chaos(run: DemoRun) -> bool:
    run.notes.append(f"learners run with DSEC_CHAOS={run.state['chaos_learners']!r}; the actor with {CHAOS_ACTOR!r}")
    return True


def _events_of(run: DemoRun, role: str, rank: int | None, *types: str) -> list[dict[str, Any]]:
    ids = [w["id"] for w in run.worker_ids(role) if rank is None or w["rank"] == rank]
    return [e for wid in ids for e in run.client.all_events(worker_id=wid, types=list(types))]


def _breaker_reacted(run: DemoRun) -> bool:
    melt = _events_of(run, "learner", 0, "meltdown")
    others = [
        e
        for w in run.worker_ids("learner")
        if w["rank"] != 0
        for e in run.client.all_events(worker_id=w["id"], types=["meltdown", "breaker"])
    ]
    moves = _events_of(run, "learner", 0, "meltdown", "breaker", "recovered")
    levels = [e["data"]["level_to"] for e in moves if e["data"]["action"] != "none"]
    closed = any(e["type"] == "recovered" for e in moves)
    if melt:
        over = melt[0]["data"]["evidence"]["over"].get("latency_ms", {})
        run.notes.append(
            f"breaker: rank 0 melted down on sync cost (median {over.get('median', 0):.0f} ms > cap "
            f"{over.get('cap', 0):g} ms); levels {' -> '.join(map(str, [0, *levels]))}"
            + ("; back to level 0" if levels and levels[-1] == 0 else "; not yet recovered")
            + (" and closed after a calm probe" if closed else "")
            + f"; other learners' breaker events: {len(others)}"
        )
    # Level 0 again is the recovery; the breaker closes one calm probe period later, which a run that
    # reaches its target early may not live to see.
    return bool(melt) and not others and bool(levels) and levels[-1] == 0


def _stuck_alerted(run: DemoRun) -> bool:
    alerts = [e for e in _events_of(run, "actor", None, "alert") if "_episode_stuck_" in e["data"].get("name", "")]
    lowered = [
        e
        for e in _events_of(run, "actor", None, "directive_set")
        if "stuck_episode" in str(e["data"].get("by")) and "sync_priority" in e["data"].get("changes", {})
    ]
    if alerts:
        changes = lowered[0]["data"]["changes"] if lowered else {}
        run.notes.append(
            f"stuck episodes: alert {alerts[0]['data']['name']!r}; the actor's directive changed {changes}"
        )
    return bool(alerts) and bool(lowered)


HEADLINE_METRICS = (
    "dsec_sandbox_utilization_rate",
    "dsec_gradient_sync_success_rate",
    "dsec_snapshot_recovery_time",
    "dsec_melt_down_count",
)


def _roles_inferred(run: DemoRun) -> bool:
    """Every process was started without --role: each worker's role comes from what it did (role_inferred)."""
    seen: dict[str, str] = {}
    for w in run.worker_ids():
        events = run.client.all_events(worker_id=w["id"], types=["role_inferred"])
        if events:
            rule = events[-1]["data"].get("evidence", {}).get("rule", "?")
            seen[f"{w['role']} {w['id']}"] = str(rule)
    if seen:
        run.notes.append("roles inferred, no --role given: " + "; ".join(f"{k} ({v})" for k, v in sorted(seen.items())))
    roles = [k.split(" ", 1)[0] for k in seen]
    return roles.count("learner") >= 2 and "actor" in roles


SCENES = [
    Scene(
        "circuit breaker: 150 ms injected into rank 0's sync -> only rank 0 degrades, then recovers to level 0",
        0.0,
        _note_chaos,
        _breaker_reacted,
    ),
    Scene(
        "stuck episodes: interrupted episodes -> alert, memory ceiling and sync priority lowered",
        0.0,
        lambda run: True,
        _stuck_alerted,
    ),
    Scene(
        "4-bit gradient compression on one rank: directive acked, its upload >= 6x smaller",
        0.3,
        _compress_rank1,
        _compressed,
    ),
    Scene(
        "paused sampling: the actor's env.step held by a directive (env steps flat), then resumed",
        0.05,
        _pause_actor,
        _pause_held,
    ),
    Scene("liveness: a worker killed -9 becomes 'lost'", 0.3, _kill_actor, _actor_lost),
    Scene(
        "roles inferred: no --role given; learners from synchronized optimizer steps, the actor from env steps",
        0.0,
        lambda run: True,
        _roles_inferred,
    ),
    Scene("Prometheus /metrics carries the four headline gauges per pool", 0.45, _scrape, _scraped),
    Scene(
        "policy engine: example policies loaded; a meltdown makes a rule lower the pool's latency cap (audited)",
        0.0,
        policy_scenes.load_policies,
        policy_scenes.policy_acted,
    ),
    Scene(
        "webhooks: an agent runtime registers, reports, and receives a signed policy exactly once",
        0.2,
        integration_scenes.start_runtime,
        integration_scenes.runtime_served,
    ),
    Scene(
        "libdsec_inject.so: a native program reports episodes through the C library",
        0.25,
        integration_scenes.run_native,
        integration_scenes.native_reported,
    ),
    Scene(
        "state snapshots: learners snapshot on request and every 3 s, in the background",
        0.1,
        snapshot_scenes.request_snapshots,
        snapshot_scenes.snapshots_taken,
    ),
]
