"""Demo phase for launching and recovery: the PPO learners restarted by DSec's supervisor (local launcher) from
their snapshots — every rank at one agreed step — then one rank killed -9 and *healed in place*: its peer keeps
its process and its step counter, the group re-forms without the dead rank, and a replacement joins at the next
PPO update with the live state from the peer. Replicas are compared at the end (the PPO script all-gathers its
parameters)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor
from dsec.probe.epoch_setup import journal_tails

if TYPE_CHECKING:
    from dsec.demo import DemoRun

# Healing admits a replacement where the script's loop starts over; the group must have seen its loop a few times
# first (heal/sequence.py): a PPO update is 32 gradient syncs + 1 all-reduce here, so ~4 updates of every rank.
WARM_STEPS = 140
ACTORS = 2  # env runners of the actor-restart scene's job (it kills one)


def _snapshots_since(run: DemoRun, since: float) -> set[str]:
    evs = run.client.all_events(types=["snapshot"], since=since)
    return {str(e["worker_id"]) for e in evs if e["data"].get("status") == "ok"}


def _updates(run: DemoRun, pool: str) -> dict[int, tuple[str, int, int]]:
    """rank -> (worker id, pid, optimizer steps) of the active learners."""
    return {
        w["rank"]: (w["id"], int(w["pid"]), int(w["metrics"].get("updates_total", 0)))
        for w in run.client.workers(pool=pool)
        if w["state"] == "active" and w["role"] == "learner"
    }


def _wait(sup: Supervisor, cond: Any, timeout: float) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        sup.step()
        time.sleep(0.05)
    return None


def supervised_recovery(
    run: DemoRun, env: dict[str, str], pool: str, pool_token: str, endpoint: str, ppo: list[str], home: Path
) -> dict[str, Any]:
    """Start the learners under the supervisor from the first run's snapshots (group ``default``: the names the
    first run's snapshots carry), kill one rank once they have trained a few updates, let the supervisor heal the
    group, then stop them. Returns the recovery timings, what the survivor did meanwhile, and the PPO result."""
    world = int(ppo[ppo.index("--world-size") + 1])
    stop = home / "recovery-stop"
    job = _recovery_job(pool, world, ppo[1], env["DSEC_SNAPSHOT_DIR"], stop, home / "heal-journal")
    base = {k: v for k, v in env.items() if k not in ("DSEC_CHAOS", "DSEC_SNAPSHOT_DIR", "DSEC_RESTORE")}
    launcher = LocalLauncher(base_env=base, log_dir=home / "launch")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=run.client, endpoint=endpoint, pool_token=pool_token, poll_s=0.02,
                     on_recovery=recoveries.append)  # fmt: skip
    out: dict[str, Any] = {}
    try:
        started = time.time()
        sup.start(restore=True)
        warm = _wait(
            sup,
            lambda: (
                len(_updates(run, pool)) == world and min(u for _, _, u in _updates(run, pool).values()) >= WARM_STEPS
            ),
            60,
        )
        out["warm"] = bool(warm)
        victim = world - 1
        before = _updates(run, pool)
        t_kill = time.time()
        os.kill(launcher.pids("default")[f"default-{victim}"], signal.SIGKILL)
        _wait(sup, lambda: recoveries, 60)
        after = _updates(run, pool)
        if recoveries:
            rec = recoveries[0]
            out["recovery"] = {**rec.timings(), "total_from_kill_s": round((rec.resumed_at or t_kill) - t_kill, 3)}
        else:  # what the group went through instead (an intermittent failure leaves nothing else to read)
            out["heal_story"] = [
                f"{e['data'].get('what')}@{e['data'].get('epoch')}"
                + (f" rank {e['data']['rank']}" if "rank" in e["data"] else "")
                for e in run.client.all_events(types=["heal"], since=t_kill - 1)
            ]
            log = home / "launch" / f"default-{victim}.log"
            tail = log.read_text(errors="replace").splitlines()[-2:] if log.exists() else []
            out["heal_story"] += [f"replacement's log: {ln[:200]}" for ln in tail]
            for name, kept in journal_tails(home / "heal-journal", 4):
                out["heal_story"] += [f"{name}: {ln[:200]}" for ln in kept]
        # The survivors: the same worker and process, with a step counter that only went up.
        out["survivors"] = {
            r: {"same_process": after.get(r, ("", 0, 0))[1] == pid, "steps_before": n, "steps_after": after[r][2]}
            for r, (_, pid, n) in before.items()
            if r != victim and r in after
        }
        out["restores"] = [
            e["data"]
            for e in run.client.all_events(types=["restore"], since=started - 1)
            if e["data"].get("status") == "ok"
        ]
        out["cadence"] = [
            {"interval_s": e["data"]["interval_s"], "total_ms": e["data"].get("total_ms"), "ts": e["ts"]}
            for e in run.client.all_events(types=["snapshot"], since=started - 1)
            if e["data"].get("status") == "ok" and "interval_s" in e["data"]
        ]
        # Train on before stopping: the run's return is the mean of its last finished episodes, and right after a
        # restart only short (failed) episodes have finished yet — a window that ends early reads a good policy as
        # a poor one. Another WARM_STEPS updates let the long episodes of the restored policy finish.
        resumed = max((n for _, _, n in after.values()), default=0)
        _wait(sup, lambda: _updates(run, pool).get(0, ("", 0, 0))[2] >= resumed + WARM_STEPS, 60)
        stop.touch()
        out["finished"] = sup.run(timeout_s=60)
    finally:
        sup.stop()
    out["ppo"] = _ppo_result(home / "launch" / "default-0.log")
    return out


def actor_restart(run: DemoRun, pool: str, endpoint: str, home: Path) -> dict[str, Any]:
    """A job of two env runners (``role: actor``: ``restart_scope`` worker) under the supervisor in ``pool``; once
    both report, actor 1 is killed -9: it restarts alone, actor 0 keeps its process and its env steps."""
    stop = home / "actors-stop"
    job = JobFile.model_validate(
        {
            "job": "demo-actors",
            "pool": pool,
            "snapshots": {"enabled": False},
            "restart": {"max_restarts": 1, "resume_timeout_s": 30},
            "groups": [
                {
                    "name": "actors",
                    "role": "actor",
                    "world_size": ACTORS,
                    "memory_gb": 1,
                    "env": {"DSEC_HEARTBEAT_INTERVAL": "0.5"},
                    # A pause after each step leaves the 2-core machine to the rest of the demo.
                    "command": [sys.executable, "-m", "dsec.demo.workload", "600", "--pause", "0.002",
                                "--stop-file", str(stop)],
                }
            ],
        }
    )  # fmt: skip
    launcher = LocalLauncher(log_dir=home / "launch-actors")
    recoveries: list[Recovery] = []
    token = run.client.create_token(pool)
    sup = Supervisor(job, launcher, client=run.client, endpoint=endpoint, pool_token=token, poll_s=0.02,
                     on_recovery=recoveries.append)  # fmt: skip

    def env_steps() -> dict[int, float]:
        ws = [w for w in run.client.workers(pool=pool) if w["state"] == "active" and w["group"] == "actors"]
        return {int(w["rank"]): float(w["metrics"].get("env_steps_total", 0)) for w in ws}

    out: dict[str, Any] = {}
    try:
        sup.start()
        _wait(sup, lambda: len(env_steps()) == ACTORS and min(env_steps().values()) > 0, 30)
        before, steps_before = launcher.pids("actors"), env_steps()
        t_kill = time.time()
        os.kill(before["actors-1"], signal.SIGKILL)
        _wait(sup, lambda: recoveries, 30)
        after = launcher.pids("actors")
        if recoveries:
            rec = recoveries[0]
            out["recovery"] = {**rec.timings(), "total_from_kill_s": round((rec.resumed_at or t_kill) - t_kill, 3)}
        out["replaced"] = after.get("actors-1") not in (None, before["actors-1"])
        out["others_kept"] = {w: after.get(w) == pid for w, pid in before.items() if w != "actors-1"}
        _wait(sup, lambda: env_steps().get(0, 0.0) > steps_before.get(0, 0.0), 10)
        out["actor0_steps"] = (steps_before.get(0), env_steps().get(0))
        out["move"] = _move_off_degraded(run, sup, launcher, recoveries, pool)
        stop.touch()
        out["finished"] = sup.run(timeout_s=30)
    finally:
        sup.stop()
    return out


def _move_off_degraded(
    run: DemoRun, sup: Supervisor, launcher: LocalLauncher, recoveries: list[Recovery], pool: str
) -> dict[str, Any]:
    """A spare device joins the pool, then actor 0's device is marked degraded (what the device-health judge does
    when every worker on a device is a fleet outlier; here by hand): the supervisor places the job again with actor
    1 pinned where it runs, and moves actor 0 alone to the spare."""
    spec = run.client.request("GET", f"/v1/pools/{pool}")
    devices = {d["id"]: d for d in run.client.devices()}
    like = devices[spec["devices"][0]]
    spare = f"{pool}-spare"
    run.client.request("PUT", f"/v1/devices/{spare}", json={"id": spare, "node": like["node"],
                                                            "memory_gb": like["memory_gb"], "pool": pool})  # fmt: skip
    kept = {k: v for k, v in spec.items() if k not in ("name", "devices")}
    run.client.put_pool(pool, **kept, devices=[*spec["devices"], spare])
    placed = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
    before, n = launcher.pids("actors"), len(recoveries)
    bad = devices[placed["actors-0"]]
    run.client.request("PUT", f"/v1/devices/{bad['id']}", json={**{k: bad[k] for k in ("id", "node", "memory_gb")},
                                                                "pool": pool, "health": "degraded"})  # fmt: skip
    _wait(sup, lambda: len(recoveries) > n and recoveries[-1].resumed_at is not None, 30)
    after = launcher.pids("actors")
    rec = recoveries[-1] if len(recoveries) > n else None
    return {
        "bad": bad["id"],
        "spare": spare,
        "recovery": rec.timings() if rec else None,
        "devices": dict(rec.devices) if rec else {},
        "moved": after.get("actors-0") not in (None, before["actors-0"]),
        "kept": after.get("actors-1") == before["actors-1"],
        "record": {a["worker"]: a["device"] for a in run.client.placement("demo-actors")["assignments"]},
        "before": placed,
    }


def actor_moved(run: DemoRun, a: dict[str, Any]) -> bool:
    m = a.get("move") or {}
    rec = m.get("recovery") or {}
    if not rec:
        run.notes.append("move off a degraded device: no recovery recorded for actor 0")
        return False
    run.notes.append(
        f"{m['bad']} marked degraded: actor 0 alone moved to {m['devices'].get('actors-0')} (mode {rec.get('mode')}, "
        f"reason {rec.get('reason')}), actor 1 kept its process and {m['record'].get('actors-1')}"
    )
    return (
        rec.get("mode") == "worker"
        and rec.get("reason") == "degraded-device"
        and m["devices"] == {"actors-0": m["spare"]}
        and bool(m.get("moved"))
        and bool(m.get("kept"))
        and m["record"] == {**m["before"], "actors-0": m["spare"]}
    )


def actor_restarted(run: DemoRun, a: dict[str, Any]) -> bool:
    rec = a.get("recovery") or {}
    kept = a.get("others_kept") or {}
    b, b2 = a.get("actor0_steps") or (None, None)
    if not rec:
        run.notes.append("actor restart: no recovery recorded for the killed actor")
        return False
    run.notes.append(
        f"kill -9 of env runner {rec['worker']}: detected in {rec['detect_s'] * 1e3:.0f} ms, restarted alone (mode "
        f"{rec.get('mode')}, {rec.get('healthy_ranks_restarted')} others restarted), registered again "
        f"{rec.get('total_from_kill_s', float('nan')):.1f} s after the kill; actor 0 kept its process and stepped on "
        f"({b} -> {b2} env steps)"
    )
    grew = b is not None and b2 is not None and b2 > b
    back = rec.get("total_from_kill_s", 0.0) > 0  # the new process registered (not the killed one's registration)
    return (
        rec.get("mode") == "worker" and bool(a.get("replaced")) and bool(kept) and all(kept.values()) and grew and back
    )


def _recovery_job(pool: str, world: int, script: str, snapshot_dir: str, stop: Path, journal: Path) -> JobFile:
    """The PPO learners as one healing group ``default`` (the names the first run's snapshots carry), training until
    ``stop`` exists."""
    return JobFile.model_validate(
        {
            "job": "demo-ppo",
            "pool": pool,
            # The interval adapts to the group's failure history (a heal rolls nothing back, so it only grows).
            "snapshots": {"dir": snapshot_dir, "interval_s": 1, "cadence": "failure_history"},
            "restart": {"max_restarts": 2, "resume_timeout_s": 60, "admit_timeout_s": 60},
            "groups": [
                {
                    "name": "default",
                    "world_size": world,
                    "memory_gb": 1,
                    "heal": True,
                    # Each process's op journal: what a failed admission is read from (heal_story).
                    "env": {"DSEC_HEAL_JOURNAL": str(journal), "PYTHONFAULTHANDLER": "1"},
                    "command": [sys.executable, script, "--seed", "1", "--max-seconds", "60", "--log-every", "0",
                                "--target-return", "100000", "--stop-file", str(stop)],
                },
            ],
        }
    )  # fmt: skip


def _ppo_result(log: Path) -> dict[str, Any]:
    """The PPO script's last JSON line in rank 0's log ({} when there is none)."""
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")] if log.exists() else []
    return json.loads(lines[-1]) if lines else {}


def recovered(run: DemoRun, result: dict[str, Any]) -> bool:
    restores = result.get("restores", [])
    steps = sorted({d.get("agreed_step") for d in restores}, key=str)
    run.notes.append(
        f"restart from snapshots: {len(restores)} learners restored, all at one agreed step {steps}"
        if len(steps) == 1
        else f"restart from snapshots: the learners restored different steps {steps}"
    )
    cadence = result.get("cadence") or []
    run.notes.append(
        f"snapshot cadence from failure history: configured 1 s, {cadence[-1]['interval_s']:g} s after "
        f"{len(cadence)} snapshots of ~{cadence[-1]['total_ms'] or 0:.0f} ms and no rollback (the heal below rolls "
        "nothing back)"
        if cadence
        else "snapshot cadence from failure history: no snapshot reported its interval"
    )
    rec = result.get("recovery")
    if not rec:
        story = ", ".join(result.get("heal_story", [])) or "none"
        run.notes.append(f"healing: the supervisor did not report the replacement's admission (heal events: {story})")
        return False
    survivors = result.get("survivors", {})
    kept = all(s["same_process"] and s["steps_after"] > s["steps_before"] for s in survivors.values())
    diff = result.get("ppo", {}).get("replica_max_abs_diff")
    run.notes.append(
        f"kill -9 of learner rank {rec['worker']}: detected in {rec['detect_s'] * 1e3:.0f} ms; the group re-formed "
        f"without it in {rec.get('reconfigure_s', float('nan')) * 1e3:.0f} ms while "
        + ", ".join(
            f"rank {r} kept its process and trained on ({s['steps_before']} -> {s['steps_after']} steps)"
            for r, s in survivors.items()
        )
        + f"; its replacement joined {rec.get('rejoin_s', float('nan')):.1f} s after spawning, at the next PPO "
        f"update, with the live state from a peer; {rec['healthy_ranks_restarted']} healthy ranks restarted; "
        f"replicas at the end: max |difference| {diff}"
    )
    return len(steps) == 1 and rec.get("mode") == "heal" and kept and diff == 0.0 and bool(result.get("finished"))
