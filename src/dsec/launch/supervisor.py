"""Supervision of a launched job: place it, start it, and restart a failed worker group from its newest snapshot.

A group is the unit of restart: when one rank of a DDP group dies, its peers are stuck in a collective (gloo has
no abort), so the whole group is killed and started again with ``DSEC_RESTORE=latest``; each worker's probe
restores the newest snapshot that verifies before training resumes. The recovery is timed in phases and recorded
as a ``recovery`` event:

- ``detect_s``: the dead process's last sign of life (previous poll) to the supervisor noticing the exit;
- ``stop_s``: killing the rest of the group;
- ``restart_s``: spawn to the restarted workers' restores beginning (interpreter, imports, process group, model);
- ``restore_s``: the slowest rank's restore (from its ``restore`` event);
- ``total_s``: exit noticed to training resumed (every rank restored), plus ``detect_s``.

A device the control plane marks *degraded* makes the supervisor move the groups placed on it: wait (bounded) for
the snapshot the control plane asked for, stop the group, place it again (degraded devices are excluded) and
restart it from the snapshot on its new devices.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.launch.base import Exit, Launcher, WorkerLaunch
from dsec.launch.jobfile import JobFile
from dsec.scheduler.inventory import synthesize
from dsec.scheduler.placement import job_to_dict, place

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Recovery:
    group: str
    worker: str
    code: int | None
    reason: str  # exit | degraded-device
    detected_at: float
    detect_s: float
    stopped_at: float = 0.0
    spawned_at: float = 0.0
    resumed_at: float | None = None
    restore_s: float | None = None
    restored: list[str] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)

    def timings(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group,
            "worker": self.worker,
            "exit_code": self.code,
            "reason": self.reason,
            "detect_s": round(self.detect_s, 4),
            "stop_s": round(self.stopped_at - self.detected_at, 4),
            "devices": self.devices,
        }
        if self.resumed_at is not None:
            out["restart_s"] = round(self.resumed_at - (self.restore_s or 0.0) - self.spawned_at, 4)
            out["restore_s"] = round(self.restore_s or 0.0, 4)
            out["total_s"] = round(self.resumed_at - self.detected_at + self.detect_s, 4)
            out["restored"] = self.restored
        return out


def place_job(job: JobFile, client: Any = None) -> dict[str, Any]:
    """Place a job file's workers: on the control plane's inventory (``client``: an admin Client), or offline on a
    synthetic one-node inventory with a device per worker. RuntimeError when some worker cannot be placed."""
    spec = job.spec()
    if client is not None:
        placement: dict[str, Any] = client.place(job_to_dict(spec))
    else:
        n = sum(len(g.workers) for g in spec.groups)
        placement = place(spec, synthesize(nodes=1, gpus_per_node=n, numa_per_node=1)).to_dict()
    if not placement["complete"]:
        raise RuntimeError(f"job {job.job} cannot be placed: {placement['unplaced']}")
    return placement


class Supervisor:
    def __init__(
        self,
        job: JobFile,
        launcher: Launcher,
        *,
        client: Any = None,  # dsec.client.Client with an admin token, or None (offline: local placement, no timing)
        endpoint: str | None = None,
        pool_token: str | None = None,
        poll_s: float = 0.05,
        device_check_s: float = 1.0,
        on_recovery: Callable[[Recovery], None] | None = None,
    ) -> None:
        self.job = job
        self.launcher = launcher
        self.client = client
        self.endpoint = endpoint
        self.pool_token = pool_token
        self.poll_s = poll_s
        self.device_check_s = device_check_s
        self.on_recovery = on_recovery
        self.placement: dict[str, Any] = {}
        self.restarts: dict[str, int] = {g.name: 0 for g in job.groups}
        self.done: set[str] = set()  # workers that finished with status 0
        self.failed: dict[str, str] = {}  # group -> why it was given up
        self.recoveries: list[Recovery] = []
        self._pending: dict[str, Recovery] = {}  # group -> recovery waiting for its restores
        self._last_poll = time.time()
        self._last_device_check = 0.0

    # -- placement and start ----------------------------------------------------------------------------------
    def _place(self) -> dict[str, Any]:
        return place_job(self.job, self.client)

    def _launches(self, group: str, restore: bool) -> list[WorkerLaunch]:
        g = next(x for x in self.job.groups if x.name == group)
        by_worker = {a["worker"]: a for a in self.placement["assignments"]}
        port = str(free_port())
        out = []
        for rank in range(g.world_size):
            name = f"{g.name}-{rank}"
            a = by_worker[name]
            # Rendezvous defaults for a group on this machine; a job spread over machines (Ray) sets MASTER_ADDR
            # and GLOO_SOCKET_IFNAME in its group's env, which win.
            env = {
                "MASTER_ADDR": "127.0.0.1",
                "GLOO_SOCKET_IFNAME": "lo",
                **g.env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(g.world_size),
                "MASTER_PORT": port,
                "DSEC_ROLE": g.role,
                "DSEC_GROUP": g.name,
                "DSEC_SNAPSHOT_DIR": str(self.job.snapshots.dir),
                "DSEC_SANDBOX_ID": self.job.pool,
                "DSEC_DEVICE": str(a["device"]),  # device health judges the devices workers report
            }
            if self.endpoint:
                env["DSEC_ENDPOINT"] = self.endpoint
            if self.pool_token:
                env["DSEC_TOKEN"] = self.pool_token
            if self.job.snapshots.interval_s is not None:
                env["DSEC_SNAPSHOT_INTERVAL_S"] = str(self.job.snapshots.interval_s)
            if restore:
                env["DSEC_RESTORE"] = "latest"
            device = str(a["device"])
            index = device.rsplit("gpu", 1)[-1]
            out.append(
                WorkerLaunch(
                    worker=name, group=g.name, role=g.role, rank=rank, world_size=g.world_size,
                    command=tuple(g.command), env=env, device=device, node=a["node"], cpus=tuple(a["cpus"]),
                    gpu_index=int(index) if index.isdigit() else None,
                )
            )  # fmt: skip
        return out

    def start(self, restore: bool = False) -> None:
        """Place the job and start every group (``restore``: from the newest snapshots, e.g. after a crash of the
        whole job)."""
        self.placement = self._place()
        for g in self.job.groups:
            self.launcher.start(self._launches(g.name, restore=restore))
        self._last_poll = time.time()

    # -- supervision loop -----------------------------------------------------------------------------------------
    def step(self) -> None:
        """One supervision pass (never blocks beyond stopping a failed group)."""
        now = time.time()
        previous, self._last_poll = self._last_poll, now
        for e in self.launcher.poll():
            self._on_exit(e, previous)
        if self.client is not None:
            self._check_resumed()
            if now - self._last_device_check >= self.device_check_s:
                self._last_device_check = now
                self._check_devices()

    def finished(self) -> bool:
        groups = {g.name for g in self.job.groups}
        live = groups - set(self.failed)
        total = {g.name: g.world_size for g in self.job.groups}
        return (
            all(sum(1 for w in self.done if w.rsplit("-", 1)[0] == g) >= total[g] for g in live) and not self._pending
        )

    def run(self, timeout_s: float | None = None) -> bool:
        """Supervise until every group finished (True) or gave up / ``timeout_s`` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.finished():
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.step()
            time.sleep(self.poll_s)
        return not self.failed

    def stop(self) -> None:
        self.launcher.stop()

    def _on_exit(self, e: Exit, previous: float) -> None:
        if e.code == 0:
            self.done.add(e.worker)
            return
        if e.group in self.failed:
            return
        self._restart(e.group, e.worker, e.code, "exit", e.at, max(0.0, e.at - previous))

    def _restart(
        self, group: str, worker: str, code: int | None, reason: str, detected_at: float, detect_s: float
    ) -> None:
        rec = Recovery(group, worker, code, reason, detected_at, detect_s)
        self.launcher.stop_group(group)
        rec.stopped_at = time.time()
        if self.restarts[group] >= self.job.restart.max_restarts:
            self.failed[group] = f"{worker} exited with {code}; {self.restarts[group]} restarts already"
            log.error("group %s given up: %s", group, self.failed[group])
            return
        self.restarts[group] += 1
        self.done = {w for w in self.done if not w.startswith(f"{group}-")}
        launches = self._launches(group, restore=True)
        rec.devices = {w.worker: str(w.device) for w in launches}
        self.launcher.start(launches)
        rec.spawned_at = time.time()
        if self.client is None:
            self._complete(rec)
        else:
            self._pending[group] = rec

    def _check_resumed(self) -> None:
        for group, rec in list(self._pending.items()):
            g = next(x for x in self.job.groups if x.name == group)
            events = self.client.all_events(types=["restore"], pool=self.job.pool, since=rec.spawned_at - 1.0)
            workers = {w["id"]: w for w in self.client.workers(pool=self.job.pool)}
            mine = [e for e in events if workers.get(e["worker_id"] or "", {}).get("group") == group]
            if len({e["worker_id"] for e in mine}) >= g.world_size:
                rec.resumed_at = max(float(e["ts"]) for e in mine)
                rec.restore_s = max(float(e["data"].get("restore_s") or 0.0) for e in mine)
                rec.restored = sorted(str(e["data"].get("id") or e["data"].get("status")) for e in mine)
                self._complete(rec)
            elif time.time() - rec.spawned_at > self.job.restart.resume_timeout_s:
                log.warning(
                    "group %s: restores not all reported within %.0f s", group, self.job.restart.resume_timeout_s
                )
                self._complete(rec)

    def _complete(self, rec: Recovery) -> None:
        self._pending.pop(rec.group, None)
        self.recoveries.append(rec)
        if self.client is not None:
            self.client.record_event("recovery", {"job": self.job.job, **rec.timings()}, pool=self.job.pool)
        if self.on_recovery is not None:
            self.on_recovery(rec)

    # -- degraded devices -----------------------------------------------------------------------------------------
    def _check_devices(self) -> None:
        health = {d["id"]: d["health"] for d in self.client.devices()}
        mine = {a["worker"]: a["device"] for a in self.placement.get("assignments", [])}
        for g in self.job.groups:
            if g.name in self._pending or g.name in self.failed:
                continue
            bad = sorted({d for w, d in mine.items() if w.startswith(f"{g.name}-") and health.get(d) == "degraded"})
            if bad:
                self._migrate(g.name, bad)

    def _migrate(self, group: str, bad: list[str]) -> None:
        """Move a group off degraded devices: wait (bounded) for the snapshot the control plane requested, then
        stop, re-place (the degraded devices are excluded now) and restart from that snapshot."""
        t0 = time.time()
        deadline = t0 + 10.0
        while time.time() < deadline:
            snaps = self.client.all_events(types=["snapshot"], pool=self.job.pool, since=t0 - 30.0)
            if any(any(str(r).startswith("degraded-") for r in e["data"].get("requests", [])) for e in snaps):
                break
            time.sleep(0.1)
        self.placement = self._place()
        log.info("group %s moves off degraded %s", group, ", ".join(bad))
        self._restart(group, f"{group}-*", None, "degraded-device", time.time(), 0.0)
