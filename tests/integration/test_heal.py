"""Healing in place with real processes: a DDP job (gloo on 127.0.0.1) under the supervisor and the local launcher,
against a real control plane. A rank is SIGKILLed: the survivors keep their processes and their step counters, the
group re-forms without it within a fraction of a second, a replacement is admitted at the next start of the
script's loop with the live state from a peer, and at the end every rank holds bit-identical parameters. Also: two
deaths at once, a death while a replacement waits, the control plane restarted during healing, a frozen rank
fenced out, and a script whose collectives never repeat falling back to a restart from the agreed snapshots."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, wait_for
from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor
from dsec.probe.epoch_setup import journal_tails

pytest.importorskip("torch")
# The tests' own waits (steps, then an admission, then a fallback) add up past the default 120 s: a wait that runs
# out must fail with its own message and the group's story (heal_story), not be cut by pytest-timeout first.
pytestmark = pytest.mark.timeout(400)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "heal_train.py"


def job_file(tmp_path: Path, world: int = 3, extra: tuple[str, ...] = (), **restart: Any) -> JobFile:
    return JobFile.model_validate(
        {
            "job": "heal",
            "pool": "pool-a",
            "snapshots": {"dir": str(tmp_path / "snaps"), "interval_s": 1},
            "restart": {"max_restarts": 4, "resume_timeout_s": 60, "admit_timeout_s": 60, **restart},
            "groups": [
                {
                    "name": "trainers",
                    "world_size": world,
                    "memory_gb": 1,
                    "heal": True,
                    "env": {"DSEC_HEARTBEAT_INTERVAL": "0.5", "OMP_NUM_THREADS": "1", "DSEC_HEAL_TIMEOUT_S": "20",
                            # one line per op, view and admission vote of each process, for heal_story
                            "DSEC_HEAL_JOURNAL": str(tmp_path / "journal"),
                            # a rank that dies of a signal prints its Python stack (one exited -11 at teardown)
                            "PYTHONFAULTHANDLER": "1"},
                    "command": [
                        sys.executable, str(FIXTURE), "--stop-file", str(tmp_path / "stop"),
                        "--out", str(tmp_path / "out.json"), *extra,
                    ],
                }
            ],
        }
    )  # fmt: skip


def with_devices(h: Harness) -> Harness:
    for i in range(6):
        h.admin.request("PUT", f"/v1/devices/gpu-{i}", json={"id": f"gpu-{i}", "node": "node-0", "memory_gb": 16})
    h.admin.put_pool("pool-a", devices=[f"gpu-{i}" for i in range(6)])
    return h


@pytest.fixture
def cp(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    return with_devices(server_factory(settings=make_settings(tmp_path / "home", heal_join_timeout_s=2.0), pools=True))


@pytest.fixture
def supervised(cp: Harness, tmp_path: Path) -> Iterator[Callable[..., tuple[Supervisor, LocalLauncher]]]:
    made: list[Supervisor] = []

    def make(job: JobFile, recoveries: list[Recovery]) -> tuple[Supervisor, LocalLauncher]:
        launcher = LocalLauncher(log_dir=tmp_path / "logs")
        sup = Supervisor(job, launcher, client=cp.admin, endpoint=cp.url, pool_token=cp.pool_tokens["pool-a"],
                         poll_s=0.02, on_recovery=recoveries.append)  # fmt: skip
        made.append(sup)
        return sup, launcher

    yield make
    for sup in made:
        sup.stop()


def supervise_until(
    sup: Supervisor, cond: Callable[[], Any], timeout: float, what: str, why: Callable[[], str] | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}" + (f"\n{why()}" if why else ""))
        sup.step()
        time.sleep(0.02)


def heal_story(admin: Any, tmp_path: Path) -> str:
    """What a failed wait on healing shows: the group's heal events, each member's own heal log events, and the
    last lines of each worker's log that are not step lines (an intermittent failure leaves nothing else)."""
    lines = ["heal events:"]
    for e in admin.all_events(types=["heal", "log"]):
        d = e["data"]
        if e["type"] == "heal" or d.get("kind") == "heal":
            keep = ("what", "epoch", "rank", "members", "joiners", "dead", "reason", "completed", "why", "worker")
            lines.append(
                f"  {e['ts']:.3f} {e['type']} {e.get('worker_id') or ''} "
                + json.dumps({k: d[k] for k in keep if k in d})[:300]
            )
    for log in sorted((tmp_path / "logs").glob("*.log")):
        text = log.read_text(errors="replace").splitlines()
        steps = [ln for ln in text if ln.startswith('{"rank"')]
        other = [ln for ln in text if not ln.startswith('{"rank"')]
        lines.append(f"{log.name}: {len(steps)} step lines, last {steps[-1] if steps else None}")
        lines.extend(f"  {ln[:300]}" for ln in other[-15:])
    for name, kept in journal_tails(tmp_path / "journal", 12):
        lines.append(f"{name}: the last lines besides issues:")
        lines.extend(f"  {ln[:300]}" for ln in kept)
    return "\n".join(lines)


def step_lines(tmp_path: Path, worker: str) -> list[dict[str, Any]]:
    path = tmp_path / "logs" / f"{worker}.log"
    if not path.exists():
        return []
    # Read while the ranks still write: a last line without its newline is a write in progress, not a step yet.
    done = path.read_text().rpartition("\n")[0]
    return [json.loads(ln) for ln in done.splitlines() if ln.startswith('{"rank"')]


def steps_of(tmp_path: Path, worker: str) -> list[dict[str, Any]]:
    return [ln for ln in step_lines(tmp_path, worker) if "step" in ln and "t" in ln]


def finish(sup: Supervisor, tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "stop").touch()
    assert sup.run(timeout_s=90), sup.failed
    return dict(json.loads((tmp_path / "out.json").read_text()))


def test_a_killed_rank_is_replaced_while_its_peers_keep_training(
    cp: Harness, supervised: Callable[..., Any], tmp_path: Path
) -> None:
    recoveries: list[Recovery] = []
    # Rank 2 (a survivor) also dies by SIGSEGV after its script's end: its training is complete, so that exit must
    # neither heal nor restart the group (it once did, from a real teardown crash).
    sup, launcher = supervised(job_file(tmp_path, extra=("--segv-after-end", "2")), recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    pids = launcher.pids("trainers")
    t_kill = time.time()
    os.kill(pids["trainers-1"], signal.SIGKILL)
    (rec,) = supervise_until(
        sup, lambda: recoveries, 90, "the replacement's admission", lambda: heal_story(cp.admin, tmp_path)
    )
    assert rec.mode == "heal" and rec.worker == "trainers-1" and rec.code == -signal.SIGKILL
    timings = rec.timings()
    assert timings["healthy_ranks_restarted"] == 0 and 0 <= timings["reconfigure_s"] < 5, timings
    assert rec.resumed_at is not None and rec.resumed_at > rec.spawned_at
    # The survivors are the same processes; their step counters never reset, and they kept stepping.
    now = launcher.pids("trainers")
    assert now["trainers-0"] == pids["trainers-0"] and now["trainers-2"] == pids["trainers-2"]
    assert now["trainers-1"] != pids["trainers-1"]
    for w in ("trainers-0", "trainers-2"):
        counts = [ln["step"] for ln in steps_of(tmp_path, w)]
        assert counts == list(range(1, len(counts) + 1)), f"{w}'s step counter restarted"
        after = [ln["t"] for ln in steps_of(tmp_path, w) if ln["t"] > t_kill]
        assert after and after[0] < rec.resumed_at, f"{w} waited for the replacement"
    out = finish(sup, tmp_path)
    assert out["max_param_diff"] == 0.0, out
    assert sup.died_after_end == {"trainers-2": -signal.SIGSEGV} and not sup.failed
    recovery_events = cp.admin.all_events(types=["recovery"])
    # One recovery: the heal; rank 2's death after its end is none.
    assert len(recovery_events) == 1, [e["data"] for e in recovery_events[1:]] + [heal_story(cp.admin, tmp_path)]
    (ev,) = recovery_events
    assert ev["data"]["mode"] == "heal" and ev["data"]["devices"] == {"trainers-1": rec.devices["trainers-1"]}
    heals = [e["data"] for e in cp.admin.all_events(types=["heal"]) if e["data"]["what"] == "formed"]
    assert [h["reason"] for h in heals] == ["start", "failure", "admission"], heals
    assert heals[1]["members"] == [0, 2] and heals[2]["joiners"] == [1]
    # Replicas are compared right after every heal: the checks ran and found no drift.
    ranks = {w["rank"]: w for w in cp.admin.workers(pool="pool-a") if w["state"] != "lost"}
    assert all(w["metrics"].get("replica_drift_total", 0) == 0 for w in ranks.values())
    assert not [e for e in cp.admin.all_events(types=["anomaly"]) if e["data"].get("kind") == "replica_drift"]


def test_two_deaths_at_once_and_settings_kept_in_the_scripts_own_variables(
    cp: Harness, supervised: Callable[..., Any], tmp_path: Path
) -> None:
    # --lr-from-step: each rank computes its learning rate from its own update counter, so a replacement would
    # apply a different one; the group keeps its oldest member's settings (and says so).
    recoveries: list[Recovery] = []
    sup, launcher = supervised(job_file(tmp_path, extra=("--lr-from-step",)), recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    pids = launcher.pids("trainers")
    os.kill(pids["trainers-1"], signal.SIGKILL)
    os.kill(pids["trainers-2"], signal.SIGKILL)
    supervise_until(
        sup, lambda: len(recoveries) >= 2, 120, "both replacements' admission", lambda: heal_story(cp.admin, tmp_path)
    )
    assert launcher.pids("trainers")["trainers-0"] == pids["trainers-0"]
    # Three more updates: each replacement's script sets its learning rate from its own (restarted) counter.
    n = len(steps_of(tmp_path, "trainers-0"))
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= n + 24, 60, "three more updates")
    out = finish(sup, tmp_path)
    assert out["max_param_diff"] == 0.0, out
    aligned = [e for e in cp.admin.all_events(types=["anomaly"]) if e["data"].get("aligned_to") is not None]
    # The two replacements outnumber the survivor, yet they take its settings (the oldest member's), not it theirs.
    ranks = {w["id"]: w["rank"] for w in cp.admin.workers(pool="pool-a")}
    assert aligned and {ranks[e["worker_id"]] for e in aligned} == {1, 2}, aligned
    assert all(e["data"]["aligned_to"] == 0 and e["data"]["keys"] == ["lr"] for e in aligned)


@pytest.mark.slow  # ~12 s; the killed-rank and two-deaths tests cover admission in the default run
def test_a_death_while_a_replacement_waits(cp: Harness, supervised: Callable[..., Any], tmp_path: Path) -> None:
    recoveries: list[Recovery] = []
    # Rank 2 (a survivor) also dies by SIGSEGV after its script's end: its training is complete, so that exit must
    # neither heal nor restart the group (it once did, from a real teardown crash).
    sup, launcher = supervised(job_file(tmp_path, extra=("--segv-after-end", "2")), recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    pids = launcher.pids("trainers")
    os.kill(pids["trainers-1"], signal.SIGKILL)
    supervise_until(sup, lambda: "trainers-1" in sup._healing, 30, "the first replacement to start")
    os.kill(pids["trainers-2"], signal.SIGKILL)  # a second death before the first replacement is in
    supervise_until(
        sup, lambda: len(recoveries) >= 2, 120, "both replacements' admission", lambda: heal_story(cp.admin, tmp_path)
    )
    assert {r.worker for r in recoveries} == {"trainers-1", "trainers-2"}
    assert launcher.pids("trainers")["trainers-0"] == pids["trainers-0"]
    assert finish(sup, tmp_path)["max_param_diff"] == 0.0


@pytest.mark.slow  # ~11 s; a degraded device's move: test_launch_local.py, in the default run
def test_a_rank_on_a_degraded_device_is_healed_onto_another(
    cp: Harness, supervised: Callable[..., Any], tmp_path: Path
) -> None:
    """A device marked degraded under a rank of a healing group: that rank alone is stopped and healed in place on
    a spare device (the job placed again with its peers pinned); its peers keep their processes and step counters,
    nothing rolls back, and the move uses no restart (``max_restarts: 0``)."""
    recoveries: list[Recovery] = []
    sup, launcher = supervised(job_file(tmp_path, max_restarts=0), recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    placed = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
    pids = launcher.pids("trainers")
    bad = placed["trainers-1"]
    cp.admin.request("PUT", f"/v1/devices/{bad}", json={"id": bad, "node": "node-0", "memory_gb": 16,
                                                        "pool": "pool-a", "health": "degraded"})  # fmt: skip
    (rec,) = supervise_until(
        sup, lambda: recoveries, 90, "the moved rank's admission", lambda: heal_story(cp.admin, tmp_path)
    )
    assert (rec.mode, rec.worker, rec.reason) == ("heal", "trainers-1", "degraded-device"), rec
    assert rec.devices["trainers-1"] not in placed.values()  # a spare device, not the degraded one
    now = launcher.pids("trainers")
    assert now["trainers-1"] != pids["trainers-1"]
    assert {w: now[w] for w in ("trainers-0", "trainers-2")} == {w: pids[w] for w in ("trainers-0", "trainers-2")}
    for w in ("trainers-0", "trainers-2"):
        counts = [ln["step"] for ln in steps_of(tmp_path, w)]
        assert counts == list(range(1, len(counts) + 1)), f"{w}'s step counter restarted"
    record = {a["worker"]: a["device"] for a in cp.admin.placement("heal")["assignments"]}
    assert record == {**placed, "trainers-1": rec.devices["trainers-1"]}
    assert not cp.admin.all_events(types=["restore"])  # nothing restored from snapshots: nothing rolled back
    assert finish(sup, tmp_path)["max_param_diff"] == 0.0


def test_the_control_plane_restarted_during_healing(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    from dsec.client import Client

    settings = make_settings(tmp_path / "home", heal_join_timeout_s=2.0)
    first = with_devices(server_factory(settings=settings, pools=True))
    job = job_file(tmp_path)
    recoveries: list[Recovery] = []
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    with Client(first.url, token=first.admin_token) as admin:
        sup = Supervisor(job, launcher, client=admin, endpoint=first.url, pool_token=first.pool_tokens["pool-a"],
                         poll_s=0.02, on_recovery=recoveries.append)  # fmt: skip
        try:
            sup.start()
            supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps")
            pids = launcher.pids("trainers")
            port = first.port
            first.close()  # the control plane goes away ...
            os.kill(pids["trainers-1"], signal.SIGKILL)  # ... and a rank dies while it is away
            t0 = time.time()
            supervise_until(sup, lambda: "trainers-1" in sup._healing, 30, "the replacement to start")
            while time.time() - t0 < 1.5:
                sup.step()
                time.sleep(0.05)
            server_factory(settings=settings, port=port)  # back, on the same database
            (rec,) = supervise_until(
                sup, lambda: recoveries, 120, "the replacement's admission", lambda: heal_story(admin, tmp_path)
            )
            assert rec.mode == "heal" and launcher.pids("trainers")["trainers-0"] == pids["trainers-0"]
            assert finish(sup, tmp_path)["max_param_diff"] == 0.0
            epochs = [e["data"]["epoch"] for e in admin.all_events(types=["heal"]) if e["data"]["what"] == "formed"]
            assert epochs == sorted(set(epochs)), "epoch numbers never repeat across the restart"
        finally:
            sup.stop()


def test_a_frozen_rank_is_fenced_out_and_replaced(cp: Harness, supervised: Callable[..., Any], tmp_path: Path) -> None:
    job = job_file(tmp_path)
    job.groups[0].env["DSEC_HEAL_TIMEOUT_S"] = "3"  # collectives give up on a silent peer after 3 s
    recoveries: list[Recovery] = []
    sup, launcher = supervised(job, recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    pids = launcher.pids("trainers")
    os.kill(pids["trainers-1"], signal.SIGSTOP)  # alive, silent: no exit for the supervisor to see
    try:
        formed = supervise_until(
            sup,
            lambda: [e for e in cp.admin.all_events(types=["heal"]) if e["data"].get("reason") == "failure"],
            60,
            "the survivors' epoch without the frozen rank",
        )
        assert formed[0]["data"]["members"] == [0, 2]
    finally:
        os.kill(pids["trainers-1"], signal.SIGCONT)
    # Back from its freeze, it cannot rejoin the old epoch: fenced, it exits, and is replaced.
    (rec,) = supervise_until(
        sup, lambda: recoveries, 120, "the frozen rank's replacement", lambda: heal_story(cp.admin, tmp_path)
    )
    assert rec.worker == "trainers-1" and rec.code not in (0, None)
    fenced = [e["data"] for e in cp.admin.all_events(types=["heal"]) if e["data"]["what"] == "fenced"]
    assert fenced and fenced[0]["rank"] == 1
    assert launcher.pids("trainers")["trainers-0"] == pids["trainers-0"]
    assert finish(sup, tmp_path)["max_param_diff"] == 0.0


def test_without_a_repeating_loop_the_group_falls_back_to_its_agreed_snapshots(
    cp: Harness, supervised: Callable[..., Any], tmp_path: Path
) -> None:
    recoveries: list[Recovery] = []
    sup, launcher = supervised(job_file(tmp_path, extra=("--aperiodic",), admit_timeout_s=6), recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    t0 = time.time()
    supervise_until(sup, lambda: [e for e in cp.admin.all_events(types=["snapshot"], since=t0)
                                  if e["data"].get("status") == "ok"], 60, "a group snapshot")  # fmt: skip
    os.kill(launcher.pids("trainers")["trainers-1"], signal.SIGKILL)
    (rec,) = supervise_until(sup, lambda: recoveries, 120, "the fallback restart")
    assert rec.mode == "restart" and rec.reason == "heal-timeout"
    restores = [e["data"] for e in cp.admin.all_events(types=["restore"]) if e["data"]["status"] == "ok"]
    assert len(restores) == 3 and len({d["agreed_step"] for d in restores}) == 1, restores
    assert finish(sup, tmp_path)["max_param_diff"] == 0.0


@pytest.mark.slow  # ~13 s; the refusal itself: tests/unit/probe (collectives_locked)
def test_a_healing_group_refuses_gradient_accumulation_and_still_heals(
    cp: Harness, supervised: Callable[..., Any], tmp_path: Path
) -> None:
    """The breaker's accumulation rung would change how many gradient syncs a loop makes: the group's sequence of
    collectives would lose its period and no replacement could be admitted (the group waited for its admission
    timeout, then restarted from its snapshots). A healing group answers the field as unappliable instead, and
    heals."""
    recoveries: list[Recovery] = []
    sup, launcher = supervised(job_file(tmp_path, admit_timeout_s=20), recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    ids = [w["id"] for w in cp.admin.workers(pool="pool-a") if w["state"] == "active"]
    assert len(ids) == 3
    for wid in ids:
        cp.admin.set_directive(wid, grad_accum_steps=2)

    def answered() -> list[dict[str, Any]]:
        views = [cp.admin.request("GET", f"/v1/workers/{wid}") for wid in ids]
        directives = [v["directive"] for v in views]
        if all("grad_accum_steps" in d["unappliable"] or d["in_sync"] for d in directives):
            return directives
        return []

    directives = supervise_until(sup, answered, 60, "every rank's answer to the accumulation directive")
    for d in directives:
        assert "heal" in d["unappliable"]["grad_accum_steps"]["reason"], d
    n = len(steps_of(tmp_path, "trainers-0"))
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= n + 100, 60, "100 more steps")
    os.kill(launcher.pids("trainers")["trainers-1"], signal.SIGKILL)
    (rec,) = supervise_until(
        sup, lambda: recoveries, 90, "the replacement's admission", lambda: heal_story(cp.admin, tmp_path)
    )
    assert rec.mode == "heal", heal_story(cp.admin, tmp_path)
    assert finish(sup, tmp_path)["max_param_diff"] == 0.0


def test_dsec_run_heal_zero_touch(cp: Harness, tmp_path: Path) -> None:
    """`dsec run --heal --nproc-per-node 3 -- python script.py`: the same healing without a job file."""
    import subprocess

    dsec = Path(sys.executable).with_name("dsec")
    cmd = [
        str(dsec), "run", "--endpoint", cp.url, "--sandbox-id", "pool-a", "--token", cp.pool_tokens["pool-a"],
        "--role", "learner", "--nproc-per-node", "3", "--heal", "--",
        sys.executable, str(FIXTURE), "--stop-file", str(tmp_path / "stop"), "--out", str(tmp_path / "out.json"),
    ]  # fmt: skip
    env = {**os.environ, "DSEC_HEARTBEAT_INTERVAL": "0.3", "OMP_NUM_THREADS": "1"}
    with (tmp_path / "run.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def rank1() -> dict[str, Any] | None:
            ws = [w for w in cp.admin.workers(pool="pool-a") if w["rank"] == 1 and w["metrics"].get("updates_total")]
            return ws[0] if ws and ws[0]["metrics"]["updates_total"] >= 100 else None

        victim = wait_for(rank1, timeout=120, what="rank 1 training")
        os.kill(int(victim["pid"]), signal.SIGKILL)
        wait_for(
            lambda: [e for e in cp.admin.all_events(types=["heal"]) if e["data"].get("reason") == "admission"],
            timeout=120,
            what="the replacement's admission",
        )
        (tmp_path / "stop").touch()
        assert proc.wait(timeout=90) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert json.loads((tmp_path / "out.json").read_text())["max_param_diff"] == 0.0
    assert "heal of default-1" in (tmp_path / "run.log").read_text()


@pytest.mark.slow  # ~36 s (collective timeouts run out on purpose); a rare path, in make test-slow
def test_ranks_whose_scripts_diverge_stop_instead_of_hanging(
    cp: Harness, supervised: Callable[..., Any], tmp_path: Path
) -> None:
    # Each rank stops after 90 of its *own* updates: after a replacement joins, the survivors leave the loop while
    # the replacement (its count started at zero) goes on — their collectives no longer pair. Without detection
    # they would wait for each other forever (one collective timeout after another); healing sees members at the
    # same point blocked in different collectives, stops them, and the group falls back to its agreed snapshots.
    # The limit applies once the gate file exists, opened after the replacement's admission: on a loaded machine the
    # survivors could otherwise reach it before the replacement has even started, and leave without diverging.
    gate = tmp_path / "gate"
    job = job_file(tmp_path, extra=("--local-limit", "90", "--local-limit-gate", str(gate)))
    job.groups[0].env["DSEC_HEAL_TIMEOUT_S"] = "3"
    recoveries: list[Recovery] = []
    sup, launcher = supervised(job, recoveries)
    sup.start()
    supervise_until(sup, lambda: len(steps_of(tmp_path, "trainers-0")) >= 100, 120, "100 steps on rank 0")
    os.kill(launcher.pids("trainers")["trainers-1"], signal.SIGKILL)
    supervise_until(
        sup,
        lambda: [e for e in cp.admin.all_events(types=["heal"]) if e["data"].get("reason") == "admission"],
        120,
        "the replacement's admission",
        lambda: heal_story(cp.admin, tmp_path),
    )
    gate.touch()
    supervise_until(sup, lambda: any(r.mode == "restart" for r in recoveries), 180, "the fallback restart")
    logs = [e["data"] for e in cp.admin.all_events(types=["log"]) if e["data"].get("kind") == "heal"]
    assert any(d["what"] == "diverged" for d in logs), [d["what"] for d in logs]
    assert sup.run(timeout_s=120), sup.failed
