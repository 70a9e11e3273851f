"""``dsec demo``: the product's front door.

Starts an embedded control plane (real uvicorn on loopback, SQLite in a temporary DSEC_HOME, the
example cluster of 8 pools x 2 devices), launches real training processes that report to it, shows
a live status table, exercises the capabilities that exist, and ends with a summary.

Each capability is one ``Scene`` (what to do at which fraction of the run, and how to check it
worked); later capabilities add scenes instead of rewriting the demo.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from dsec.breaker import BreakerConfig
from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.judge import JudgeConfig
from dsec.control.server import ServerThread
from dsec.control.settings import Settings
from dsec.demo import integrations as integration_scenes
from dsec.demo import observe as observe_scenes
from dsec.demo import policies as policy_scenes
from dsec.demo import recovery as recovery_phase
from dsec.demo import simulation as simulation_scene
from dsec.demo import snapshots as snapshot_scenes
from dsec.render import events_table, pools_table, workers_table

POOL = "pool-0"
# Scenes are timed as fractions of this many seconds (or of --duration when shorter): PPO usually reaches its target
# in about 20 s here, and scenes that need running learners must play before that, whatever the --duration cap.
SCENE_HORIZON_S = 30.0
HEARTBEAT_S = 0.25


@dataclass
class Proc:
    name: str
    role: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class DemoRun:
    console: Console
    client: Client
    procs: list[Proc]
    notes: list[str] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def worker_ids(self, role: str | None = None) -> list[dict[str, Any]]:
        """Workers of the demo pool (optionally of one role), as the API lists them."""
        return [w for w in self.client.workers(pool=POOL) if role is None or w["role"] == role]


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


def _kill_actor(run: DemoRun) -> bool:
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
    its target return and stop well before ``duration_s``."""
    return f"sync_delay_ms=150,rank=0,after_s=4,for_s={max(3.0, 0.1 * duration_s):g}"


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
    Scene("liveness: a worker killed -9 becomes 'lost'", 0.3, _kill_actor, _actor_lost),
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


def _spawn(name: str, role: str, command: list[str], env: dict[str, str], logdir: Path) -> Proc:
    """``command`` under `dsec run`: the probe is injected into every Python process it starts."""
    log = logdir / f"{name}.log"
    dsec = [sys.executable, "-m", "dsec.cli", "run", "--role", role, "--"]
    with log.open("wb") as fh:
        # A session of its own: killing the group reaches the launcher and every process it started.
        popen = subprocess.Popen(
            [*dsec, *command], env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, role, popen, log)


def _ppo_result(proc: Proc) -> dict[str, Any]:
    lines = [ln for ln in proc.log.read_text().splitlines() if ln.startswith("{")]
    try:
        return dict(json.loads(lines[-1])) if lines else {}
    except ValueError:
        return {}


def _summary(run: DemoRun, scenes_ok: dict[str, bool], elapsed: float) -> tuple[Table, dict[str, Any]]:
    """The summary table, and the same facts as data (``--summary-json``: what tests read, not the rendering)."""
    table = Table(title="DSec demo summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows: dict[str, str] = {}

    def add(key: str, value: str) -> None:
        table.add_row(key, value)
        if key and key not in scenes_ok:  # scenes and notes go into the data as such
            rows[key] = value

    ws = run.client.workers()
    evs = run.client.all_events()
    st = run.client.status()
    add("wall time", f"{elapsed:.1f} s")
    add("workers", ", ".join(f"{c} {s}" for s, c in sorted(Counter(w["state"] for w in ws).items())))
    add("heartbeats", str(st["heartbeats"]))
    add("events", ", ".join(f"{ty}={n}" for ty, n in sorted(Counter(e["type"] for e in evs).items())))
    learners = sorted((w for w in ws if w["role"] == "learner"), key=lambda w: w["rank"])
    add(
        "learner updates / env steps (probe)",
        ", ".join(
            f"rank {w['rank']}: {int(m.get('updates_total', 0))} / {int(m.get('env_steps_total', 0))}"
            for w in learners
            for m in (w["metrics"],)
        ),
    )
    add(
        "learner grad syncs, p99 sync ms",
        ", ".join(
            f"rank {w['rank']}: {int(w['metrics'].get('sync_ops_total', 0))}, "
            f"{w['metrics'].get('sync_latency_ms_p99', float('nan')):.2f}"
            for w in learners
        ),
    )
    ppo = run.state.get("ppo", {})
    if ppo:
        add(
            "PPO (examples/ppo_cartpole_ddp.py)",
            f"average return {ppo.get('avg_return', float('nan')):.1f} after {ppo.get('env_steps')} env steps, "
            f"{ppo.get('updates')} updates, {ppo.get('seconds', 0):.1f} s"
            + (" — reached 475" if ppo.get("reached") else ""),
        )
    for key, value in snapshot_scenes.summary_rows(run):
        add(key, value)
    if "simulation" in run.state:
        for key, value in simulation_scene.summary_rows(run.state["simulation"]):
            add(key, value)
    if "cost" in run.state:
        for key, value in observe_scenes.cost_rows(run.state["cost"]):
            add(key, value)
    metrics_text = run.state.get("metrics_text", "")
    for name in HEADLINE_METRICS:
        line = next((ln for ln in metrics_text.splitlines() if ln.startswith(f'{name}{{pool="{POOL}"}}')), None)
        add(f"{name} (mid-run)", line.split(" ", 1)[1] if line else "missing")
    for title, ok in scenes_ok.items():
        add(title, "[green]ok" if ok else "[red]FAILED")
    for note in run.notes:
        add("", note)
    data = {
        "scenes": scenes_ok,
        "rows": rows,
        "notes": list(run.notes),
        "workers": dict(Counter(w["state"] for w in ws)),
        "events": dict(Counter(e["type"] for e in evs)),
    }
    return table, data


def run_demo(
    console: Console,
    workers: int = 2,
    duration_s: float = 75.0,
    keep_home: bool = False,
    summary_json: Path | None = None,
) -> int:
    home = Path(tempfile.mkdtemp(prefix="dsec-demo-"))
    start = time.time()
    console.rule("[bold]DSec demo")
    console.print(f"DSEC_HOME={home}  (SQLite store, embedded control plane on 127.0.0.1)")
    cluster = resources.files("dsec") / "data" / "cluster.yaml"
    admin = "dsa_demo_" + os.urandom(8).hex()
    # Production waits 30 s of calm before stepping a worker down; the demo shows a whole cycle in seconds.
    judge = JudgeConfig(breaker=BreakerConfig(window_s=1.0, min_samples=3, recovery_s=1.0, max_recovery_s=8.0))
    settings = Settings.from_env(
        home=home,
        admin_token=admin,
        cluster_file=Path(str(cluster)),
        lost_after_beats=3,
        reconcile_interval_s=0.2,
        judge=judge,
        alert_log=False,  # alerts are shown from the event log, not printed over the live table
        policy_interval_s=1.0,  # rules are evaluated every second (15 s in production)
        webhook_allow_private=True,  # the demo's agent runtime listens on 127.0.0.1 (refused by default)
    )
    app = create_app(settings)
    procs: list[Proc] = []
    code = 1
    with ServerThread(app) as server, Client(server.url, token=admin) as client:
        pool_token = client.create_token(POOL, label="demo")
        console.print(f"control plane {server.url}: {len(client.pools())} pools from the example cluster file")
        view_token = client.create_token(kind="read", label="demo dashboard")
        console.print(f"dashboard {server.url}/#token={view_token}  (read-only token; reachable while the demo runs)")
        env = {
            **os.environ,
            "DSEC_ENDPOINT": server.url,
            "DSEC_SANDBOX_ID": POOL,
            "DSEC_TOKEN": pool_token,
            "DSEC_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        snapshot_dir = home / "snapshots"
        env.pop("DSEC_HOME", None)
        ppo = [
            sys.executable,
            str(resources.files("dsec") / "data" / "ppo_cartpole_ddp.py"),
            "--world-size",
            str(workers),
            "--seed",
            "1",
            "--max-seconds",
            str(duration_s),
            "--log-every",
            "0",
        ]
        chaos = chaos_for_learners(duration_s)
        learner_env = {**env, "DSEC_CHAOS": chaos, "DSEC_SNAPSHOT_DIR": str(snapshot_dir)}
        procs.append(_spawn("learners", "learner", ppo, learner_env, home))
        # The actor outlives the learners: the demo kills it (the liveness scene), whatever the machine's speed.
        actor_s = str(duration_s + 120)
        actor = [sys.executable, "-m", "dsec.demo.workload", actor_s]
        procs.append(_spawn("actor", "actor", actor, {**env, "DSEC_CHAOS": CHAOS_ACTOR}, home))
        console.print(
            f"started `dsec run -- python examples/ppo_cartpole_ddp.py --world-size {workers}` (PPO, DDP over gloo, "
            f"no dsec import) and one actor process; the probe reports every {HEARTBEAT_S} s"
        )
        run = DemoRun(console, client, procs)
        run.state["chaos_learners"] = chaos
        run.state["pool_token"] = pool_token
        run.state["endpoint"] = server.url
        pending = list(SCENES)
        try:
            # Wait for every process to register (import torch takes a few seconds per process).
            deadline = time.time() + 60
            while len(run.worker_ids()) < workers + 1 and time.time() < deadline:
                time.sleep(0.2)
            t0 = time.time()
            total = duration_s + 5
            cursor, recent = 0, list[dict[str, Any]]()
            with Live(console=console, refresh_per_second=4, transient=False) as live:
                while any(p.popen.poll() is None for p in procs if p.role == "learner"):
                    frac = (time.time() - t0) / min(duration_s, SCENE_HORIZON_S)
                    for scene in [s for s in pending if frac >= s.at]:
                        if scene.act(run):
                            pending.remove(scene)
                    s = client.status()
                    mine = [w for w in s["workers"] if w["pool"] == POOL]
                    page = client.events(pool=POOL, cursor=cursor, limit=1000)
                    recent = (recent + page["items"])[-8:]
                    cursor = recent[-1]["id"] if recent else cursor
                    live.update(
                        Group(
                            workers_table(mine, now=s["server_time"], title=f"Workers in {POOL}", wide=True),
                            events_table(recent, title="Latest events"),
                        )
                    )
                    if time.time() - t0 > total + 60:
                        console.print("[red]learners did not finish in time; stopping them")
                        break
                    time.sleep(0.25)
            # PPO may reach its target before the later scenes' time: play them now (those that need
            # running learners then fail their check, visibly).
            for scene in pending:
                scene.act(run)
            learners_ok = all(p.popen.wait(timeout=30) == 0 for p in procs if p.role == "learner")
            # Give the control plane a beat to notice the last deregistrations.
            time.sleep(2 * HEARTBEAT_S)
            scenes_ok = {s.title: s.check(run) for s in SCENES}
            # The learners again, now under DSec's supervisor (local launcher): restored from the first run's
            # snapshots at one agreed step, then one rank killed -9 and healed in place (no chaos).
            console.print(
                "restarting the learners under the supervisor from their snapshots (one agreed step), then killing "
                "one rank (-9): its peer keeps training, a replacement joins"
            )
            result = recovery_phase.supervised_recovery(
                run, {**learner_env, "DSEC_SNAPSHOT_DIR": str(snapshot_dir)}, POOL, pool_token, server.url, ppo, home
            )
            run.state["ppo"] = _ppo_result(procs[0])
            keeps_learning = snapshot_scenes.keeps_learning(run, run.state["ppo"], result["ppo"])
            restore_title = "restart from snapshots: learners restored (verified), PPO resumes from its trained policy"
            scenes_ok[restore_title] = snapshot_scenes.restored(run) and keeps_learning
            scenes_ok["healing: a rank killed -9 -> replaced in place, its peer never stopped, replicas identical"] = (
                recovery_phase.recovered(run, result)
            )
            scenes_ok["training processes finished cleanly"] = learners_ok
            console.print(
                f"simulating {simulation_scene.SCENARIO} for {simulation_scene.HOURS:g} hours: baseline vs DSec's "
                "own decision code on one fault trace"
            )
            run.state["simulation"] = simulation_scene.simulate_cluster(home / "sim-report", settings.plots)
            scenes_ok["simulator: 128 agents, baseline vs DSec's modules on one fault trace (dsec simulate)"] = (
                simulation_scene.ran(run.state["simulation"])
            )
            console.print(pools_table(client.status(), wide=True))
            console.print(f"`dsec top --once --pool {POOL}` with the read-only token (the live view, one frame):")
            top = observe_scenes.top_frame(server.url, view_token, POOL)
            console.print(top.get("text") or f"[red]{top.get('error')}", highlight=False, markup="text" not in top)
            scenes_ok["dsec top: one frame with a read-only token, 100 columns, the lost worker first"] = (
                observe_scenes.top_ok(top)
            )
            run.state["cost"] = observe_scenes.cost_report(client, POOL, start, time.time())
            scenes_ok["cost accounting: the demo's device time split into useful/degraded/recovering/idle"] = (
                observe_scenes.cost_ok(run.state["cost"])
            )
            table, data = _summary(run, scenes_ok, time.time() - start)
            console.print(table)
            code = 0 if all(scenes_ok.values()) else 1
            if summary_json is not None:
                summary_json.write_text(json.dumps({"exit_code": code, **data}, indent=1))
            if not learners_ok:
                for p in procs:
                    console.print(f"[dim]--- {p.name} log (tail) ---\n{p.log.read_text()[-2000:]}")
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
    if keep_home:
        console.print(f"state kept in {home}")
    else:
        shutil.rmtree(home, ignore_errors=True)
    console.rule("[bold green]demo finished" if code == 0 else "[bold red]demo finished with failures")
    return code
